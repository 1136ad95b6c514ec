//! Bare metal in the API: enrolment by BMC (`enrollBareMetalNode`), power actions
//! (`powerNode`) and the operators' bare-metal view of a node (`bareMetalNode`).
//!
//! *Decision:* the bare-metal view is a query of its own rather than a field of
//! `NodeDetail`, so `NodeDetail` stays exactly the seed's view (no `power`) for everyone,
//! and the one place that shows power and the BMC checks the operator role. Resolvers parse,
//! call one service function, and wrap the result; the rules live in
//! `service::bare_metal`, `bmc` and `bc_core::bare_metal`.

use async_graphql::{Context, Enum, ID, InputObject, Object, SimpleObject};
use bc_core::ids::{NodeId, PoolId, SiteId};
use chrono::{DateTime, Utc};

use super::input_limits::{Field, MAX_IDENTIFIERS, Text, VERSION, Validate, Validated};
use super::inputs::MachineIdentifierInput;
use super::types::NodeDetail;
use super::{parse_id, principal, services};
use crate::credentials::BmcCredentials;
use crate::error::ApiError;
use crate::service::bare_metal::{BareMetalNode as DomainBareMetalNode, BmcStatus, NewBmc};
use bc_core::workflow::{LogLine, Step, Workflow};

type Checked = Result<(), ApiError>;

/// A machine's power as last read through its BMC.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::axes::Power")]
pub enum Power {
    /// The BMC reports the machine on (or powering on).
    On,
    /// The BMC reports the machine off (or powering off).
    Off,
    /// Not known: never read, no BMC, or the BMC does not answer (`BmcUnreachable`).
    Unknown,
}

/// Which power driver a node's pool binds (`drivers.power`).
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::bare_metal::PowerDriverKind")]
pub enum PowerDriver {
    /// DMTF Redfish over HTTPS.
    Redfish,
    /// No BMC: power is not managed.
    None,
}

/// What `powerNode` asks of the machine.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::bare_metal::PowerAction")]
pub enum PowerAction {
    /// Power on (Redfish `On`).
    On,
    /// Power off at once (Redfish `ForceOff`). Needs `force` on a node with allocations.
    Off,
    /// Off and on again (Redfish `PowerCycle`, or `ForceRestart` where the BMC lacks it). Needs
    /// `force` on a node with allocations.
    Cycle,
}

/// How the control plane checks a BMC's TLS certificate.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::bare_metal::BmcTlsVerification")]
pub enum BmcTlsVerification {
    /// Against the platform's trusted roots.
    Verify,
    /// Against the CA certificate given at enrolment.
    CustomCa,
    /// Not checked (labs only).
    Off,
}

/// How to reach a machine's BMC over Redfish. The credentials are stored encrypted and are
/// never returned or logged.
#[derive(InputObject)]
pub struct BmcInput {
    /// The Redfish service: `https://host[:port]`, nothing more (`http://` only where the
    /// server allows it, for tests).
    pub address: String,
    /// The `ComputerSystem`'s id under `/redfish/v1/Systems`, for a BMC that serves several
    /// systems. Omit it when the BMC serves one, or to pick the system whose UUID is the
    /// machine's `system-uuid` identifier.
    pub system_id: Option<String>,
    /// The BMC user.
    pub username: String,
    /// The BMC user's password.
    pub password: String,
    /// Check the BMC's certificate (against `caCertificate`, or the platform's roots).
    /// `false` accepts any certificate: labs only.
    #[graphql(default = true)]
    pub verify_tls: bool,
    /// A CA certificate (PEM) to check the BMC's certificate against, for BMCs with
    /// certificates of their own making.
    pub ca_certificate: Option<String>,
}

impl Validate for BmcInput {
    fn validate(&self, at: &Field) -> Checked {
        let BmcInput {
            address,
            system_id,
            username,
            password,
            verify_tls: _,
            ca_certificate,
        } = self;
        at.at("address").text(address, Text::BmcAddress)?;
        at.at("systemId")
            .text_opt(system_id.as_deref(), Text::BmcSystemId)?;
        at.at("username").text(username, Text::BmcUsername)?;
        at.at("password").text(password, Text::BmcPassword)?;
        at.at("caCertificate")
            .text_opt(ca_certificate.as_deref(), Text::CaCertificate)
    }
}

/// What `enrollBareMetalNode` needs: the machine, where it goes, its BMC and its identifiers.
#[derive(InputObject)]
pub struct EnrollBareMetalNodeInput {
    /// The machine's hostname.
    pub hostname: String,
    /// The site the machine is in.
    pub site_id: ID,
    /// The pool it joins; its drivers must bind `power` to `redfish`.
    pub pool_id: ID,
    /// The machine's BMC.
    pub bmc: BmcInput,
    /// The machine's identifiers, at least two kinds (its system UUID and a MAC, say), as
    /// for `enrollNode`: the daemon that later boots on the machine is recognised as this
    /// node by them.
    #[graphql(default)]
    pub identifiers: Vec<MachineIdentifierInput>,
}

impl Validate for EnrollBareMetalNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let EnrollBareMetalNodeInput {
            hostname,
            site_id,
            pool_id,
            bmc,
            identifiers,
        } = self;
        at.at("hostname").text(hostname, Text::Hostname)?;
        at.at("siteId").id(site_id)?;
        at.at("poolId").id(pool_id)?;
        at.at("bmc").object(bmc)?;
        at.at("identifiers")
            .list(identifiers, MAX_IDENTIFIERS, |at, i| at.object(i))
    }
}

/// What `powerNode` needs: the node, the version read, the action, and whether to force it.
#[derive(InputObject)]
pub struct PowerNodeInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// What to do.
    pub action: PowerAction,
    /// Turn off (or cycle) a node that holds active allocations, losing their work. Needs
    /// the admin role.
    #[graphql(default)]
    pub force: bool,
}

impl Validate for PowerNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let PowerNodeInput {
            id,
            version,
            action: _,
            force: _,
        } = self;
        at.at("id").id(id)?;
        at.at("version").int(*version, VERSION)
    }
}

/// A node's BMC as the control plane sees it. Never its credentials.
#[derive(SimpleObject)]
pub struct Bmc {
    /// The Redfish service's address.
    pub address: String,
    /// The system's id, if one was given at enrolment.
    pub system_id: Option<String>,
    /// The `ComputerSystem`'s path, once found from the service root.
    pub system_path: Option<String>,
    /// How its certificate is checked.
    pub tls_verification: BmcTlsVerification,
    /// Whether the last poll got an answer; null before the first poll.
    pub reachable: Option<bool>,
    /// Why the last poll failed, if it did.
    pub last_error: Option<String>,
    /// Failed polls in a row (`BmcUnreachable` is set after
    /// `bare_metal.unreachable_after_failures`).
    pub consecutive_failures: i64,
    /// When the Power controller last polled it.
    pub last_polled_at: Option<DateTime<Utc>>,
    /// When it polls next (at once after a power action).
    pub next_poll_at: DateTime<Utc>,
}

impl From<BmcStatus> for Bmc {
    fn from(s: BmcStatus) -> Self {
        Bmc {
            address: s.address,
            system_id: s.system_id,
            system_path: s.system_path,
            tls_verification: s.tls_verification.into(),
            reachable: s.reachable,
            last_error: s.last_error,
            consecutive_failures: s.consecutive_failures,
            last_polled_at: s.last_polled_at,
            next_poll_at: s.next_poll_at,
        }
    }
}

/// The operators' bare-metal view of a node.
pub struct BareMetalNode(DomainBareMetalNode);

/// The operators' bare-metal view of a node: its power and its BMC, which `NodeDetail`
/// leaves out.
#[Object]
impl BareMetalNode {
    /// The node (the same view as `node(id)`).
    async fn node(&self) -> NodeDetail {
        NodeDetail::from(self.0.node.clone())
    }

    /// The `power` axis: as the Power controller last read it through the BMC.
    async fn power(&self) -> Power {
        self.0.power.into()
    }

    /// The power driver the node's pool binds.
    async fn power_driver(&self) -> PowerDriver {
        self.0.power_driver.into()
    }

    /// Whether the BMC answers: false while `BmcUnreachable` is true, null before the first
    /// poll or without a BMC.
    async fn bmc_reachable(&self) -> Option<bool> {
        self.0
            .bmc
            .as_ref()
            .and_then(|b| b.reachable.map(|r| r && !b.unreachable_condition))
    }

    /// The node's BMC; null for a node enrolled without one.
    async fn bmc(&self) -> Option<Bmc> {
        self.0.bmc.clone().map(Bmc::from)
    }

    /// The node's latest bare-metal workflow (the running one, if any); null if it never
    /// ran one.
    async fn workflow(&self) -> Option<BareMetalWorkflow> {
        self.0.workflows.first().cloned().map(BareMetalWorkflow)
    }

    /// The node's newest bare-metal workflows (at most 10), newest first: a failed one
    /// stays beside the one `recover` started over.
    async fn workflows(&self) -> Vec<BareMetalWorkflow> {
        self.0
            .workflows
            .iter()
            .cloned()
            .map(BareMetalWorkflow)
            .collect()
    }
}

/// What a bare-metal workflow does to its node.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::workflow::WorkflowKind")]
pub enum WorkflowKind {
    /// `inspecting`: boot the network once, wait for the ramdisk daemon, check its
    /// identifiers against the enrolment; success moves the node to `commissioning`.
    Inspect,
    /// `commissioning`: burn the GPUs in (`diag.nvml` at the pool's acceptance level),
    /// record the firmware facts, power off; success moves the node to `ready`.
    Commission,
    /// `deploying`: boot the deploy image (virtual media, else the network), power on, wait
    /// for the installed system's daemon; success moves the node to `deployed`.
    Deploy,
    /// `releasing`: boot the ramdisk, wipe the disks, power off; success moves the node to
    /// `ready`.
    Release,
    /// `rescue`: boot the rescue ramdisk from the network, power on, wait for its daemon;
    /// success leaves the node in `rescue` (`UNRESCUE` leaves it).
    Rescue,
    /// `retiring`: boot the ramdisk, wipe the disks, power off; success bumps
    /// `identityGeneration` and moves the node to `retired`.
    Retire,
}

/// Where a bare-metal workflow is.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::workflow::WorkflowStatus")]
pub enum WorkflowStatus {
    /// Under way.
    Running,
    /// Every step succeeded; the node made the workflow's finishing move.
    Succeeded,
    /// A step failed; the node is `failed` with maintenance on.
    Failed,
    /// An operator aborted it; the node is `failed` with maintenance on.
    Aborted,
}

/// One step of a bare-metal workflow.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::workflow::StepKind")]
pub enum WorkflowStepKind {
    /// Set the BMC's one-time boot override to the network.
    BootNetworkOnce,
    /// Insert the deploy image (`drivers.deploy`) as the BMC's virtual CD and boot from it
    /// once, else boot from the network once; the log says which.
    BootDeployImage,
    /// Power the machine on (restart it if on) and wait until the BMC reports it on.
    PowerOn,
    /// Wait for the machine's daemon to join as this node with a new identity generation.
    AwaitDaemon,
    /// Compare the identifiers the daemon reports with the enrolment's.
    CheckIdentifiers,
    /// Run `diag.nvml` at the pool's acceptance level and wait for it to pass.
    BurnIn,
    /// Run an `inventory.refresh` of the sections with firmware facts and log them.
    RecordFirmware,
    /// Run `disk.wipe` and wait for it to succeed.
    WipeDisks,
    /// Power the machine off and wait until the BMC reports it off.
    PowerOff,
}

/// Where a step of a bare-metal workflow is.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::workflow::StepStatus")]
pub enum WorkflowStepStatus {
    /// Not reached yet.
    Pending,
    /// Under way.
    Running,
    /// Done.
    Succeeded,
    /// Its last attempt failed or timed out.
    Failed,
    /// Aborted by an operator while it ran.
    Aborted,
}

/// A bare-metal workflow: steps run one after another on one node, persisted so that it
/// resumes after a restart.
pub struct BareMetalWorkflow(Workflow);

/// A bare-metal workflow: steps run one after another on one node, persisted so that it
/// resumes after a restart.
#[Object]
impl BareMetalWorkflow {
    /// The workflow's id (`wf_…`).
    async fn id(&self) -> ID {
        ID(self.0.id.to_string())
    }
    /// What it does.
    async fn kind(&self) -> WorkflowKind {
        self.0.kind.into()
    }
    /// Where it is.
    async fn status(&self) -> WorkflowStatus {
        self.0.status.into()
    }
    /// Why it failed or was aborted.
    async fn reason(&self) -> Option<&str> {
        self.0.reason.as_deref()
    }
    /// Who started it (the actor of the move that entered its state).
    async fn started_by(&self) -> &str {
        &self.0.started_by
    }
    /// The index of the step under way (or the last one reached, once it ended).
    async fn current_step(&self) -> i64 {
        i64::try_from(self.0.current).unwrap_or(i64::MAX)
    }
    /// Its steps, in order.
    async fn steps(&self) -> Vec<WorkflowStep> {
        self.0.steps.iter().cloned().map(WorkflowStep).collect()
    }
    /// When it started.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When it last changed.
    async fn updated_at(&self) -> DateTime<Utc> {
        self.0.updated_at
    }
    /// When it ended.
    async fn finished_at(&self) -> Option<DateTime<Utc>> {
        self.0.finished_at
    }
}

/// One step of a bare-metal workflow.
pub struct WorkflowStep(Step);

/// One step of a bare-metal workflow: its status, attempts, timing and log.
#[Object]
impl WorkflowStep {
    /// What the step does.
    async fn kind(&self) -> WorkflowStepKind {
        self.0.kind.into()
    }
    /// Where it is.
    async fn status(&self) -> WorkflowStepStatus {
        self.0.status.into()
    }
    /// Attempts begun.
    async fn attempts(&self) -> i64 {
        i64::from(self.0.attempts)
    }
    /// The attempts it gets.
    async fn max_attempts(&self) -> i64 {
        i64::from(self.0.kind.max_attempts())
    }
    /// How long one attempt may take, in seconds.
    async fn timeout_seconds(&self) -> i64 {
        self.0.kind.timeout().num_seconds()
    }
    /// When it started.
    async fn started_at(&self) -> Option<DateTime<Utc>> {
        self.0.started_at
    }
    /// When it ended.
    async fn finished_at(&self) -> Option<DateTime<Utc>> {
        self.0.finished_at
    }
    /// When its current attempt times out.
    async fn deadline(&self) -> Option<DateTime<Utc>> {
        self.0.deadline
    }
    /// The command its current attempt queued on the node's daemon (`BURN_IN`,
    /// `RECORD_FIRMWARE`, `WIPE_DISKS`), once queued; see `command(id:)`.
    async fn command_id(&self) -> Option<ID> {
        self.0
            .kind
            .command()
            .and(self.0.handle.as_ref())
            .map(|h| ID(h.clone()))
    }
    /// What it did and saw, oldest first (the last 50 lines).
    async fn log(&self) -> Vec<WorkflowLogLine> {
        self.0.log.iter().cloned().map(WorkflowLogLine).collect()
    }
}

/// A line of a workflow step's log.
pub struct WorkflowLogLine(LogLine);

/// A line of a workflow step's log.
#[Object]
impl WorkflowLogLine {
    /// When it was written.
    async fn at(&self) -> DateTime<Utc> {
        self.0.at
    }
    /// What happened.
    async fn message(&self) -> &str {
        &self.0.message
    }
}

/// What `abortWorkflow` needs: the node, the version read, and why.
#[derive(InputObject)]
pub struct AbortWorkflowInput {
    /// The node whose running workflow to abort.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// Why you abort it; kept as the workflow's and the failure's reason.
    pub reason: String,
}

impl Validate for AbortWorkflowInput {
    fn validate(&self, at: &Field) -> Checked {
        let AbortWorkflowInput {
            id,
            version,
            reason,
        } = self;
        at.at("id").id(id)?;
        at.at("version").int(*version, VERSION)?;
        at.at("reason").text(reason, Text::Reason)
    }
}

/// What `abortWorkflow` answers.
#[derive(SimpleObject)]
pub struct AbortWorkflowPayload {
    /// The node's bare-metal view: `failed`, maintenance on, the workflow `ABORTED`.
    pub bare_metal_node: BareMetalNode,
}

/// What `enrollBareMetalNode` answers.
#[derive(SimpleObject)]
pub struct EnrollBareMetalNodePayload {
    /// The new node, `ENROLLING`, and its BMC.
    pub bare_metal_node: BareMetalNode,
}

/// What `powerNode` answers.
#[derive(SimpleObject)]
pub struct PowerNodePayload {
    /// The node's bare-metal view after the BMC accepted the action. `power` changes when
    /// the Power controller next reads the BMC (at once, then after the BMC acted).
    pub bare_metal_node: BareMetalNode,
}

impl BareMetalMutation {
    async fn abort(
        ctx: &Context<'_>,
        input: AbortWorkflowInput,
    ) -> async_graphql::Result<AbortWorkflowPayload> {
        let id = parse_id(&input.id, NodeId::parse)?;
        let node = services(ctx)?
            .abort_workflow(principal(ctx)?, &id, input.version, &input.reason)
            .await?;
        Ok(AbortWorkflowPayload {
            bare_metal_node: BareMetalNode(node),
        })
    }
}

/// Bare-metal queries, merged into `Query`.
#[derive(Default)]
pub struct BareMetalQuery;

#[Object]
impl BareMetalQuery {
    /// A node's bare-metal view: power, power driver and BMC. Operators only.
    async fn bare_metal_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node's id (`node_…`).")] id: ID,
    ) -> async_graphql::Result<BareMetalNode> {
        let id = parse_id(&id, NodeId::parse)?;
        Ok(BareMetalNode(
            services(ctx)?.bare_metal_node(principal(ctx)?, &id).await?,
        ))
    }
}

/// Bare-metal mutations, merged into `Mutation`.
#[derive(Default)]
pub struct BareMetalMutation;

#[Object]
impl BareMetalMutation {
    /// `metal.enroll` by BMC: registers a bare-metal machine with its BMC; it starts
    /// `ENROLLING`, and the Power controller starts reading its power. Admins only.
    async fn enroll_bare_metal_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The machine's hostname, site, pool, BMC and identifiers.")]
        input: Validated<EnrollBareMetalNodeInput>,
    ) -> async_graphql::Result<EnrollBareMetalNodePayload> {
        let input = input.check("input")?;
        let site = parse_id(&input.site_id, SiteId::parse)?;
        let pool = parse_id(&input.pool_id, PoolId::parse)?;
        let identifiers: Vec<(String, String)> = input
            .identifiers
            .iter()
            .map(|i| (i.name.clone(), i.value.clone()))
            .collect();
        let bmc = NewBmc {
            address: input.bmc.address,
            system_id: input.bmc.system_id,
            credentials: BmcCredentials {
                username: input.bmc.username,
                password: input.bmc.password,
            },
            verify_tls: input.bmc.verify_tls,
            ca_pem: input.bmc.ca_certificate,
        };
        let node = services(ctx)?
            .enroll_bare_metal_node(
                principal(ctx)?,
                &input.hostname,
                &site,
                &pool,
                &identifiers,
                bmc,
            )
            .await?;
        Ok(EnrollBareMetalNodePayload {
            bare_metal_node: BareMetalNode(node),
        })
    }

    /// Powers a node on, off or through a cycle through its BMC. Takes the `version` read;
    /// turning off or cycling a node with active allocations needs `force` (admins).
    async fn power_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, the action and `force`.")]
        input: Validated<PowerNodeInput>,
    ) -> async_graphql::Result<PowerNodePayload> {
        let input = input.check("input")?;
        let id = parse_id(&input.id, NodeId::parse)?;
        let node = services(ctx)?
            .power_node(
                principal(ctx)?,
                &id,
                input.version,
                input.action.into(),
                input.force,
            )
            .await?;
        Ok(PowerNodePayload {
            bare_metal_node: BareMetalNode(node),
        })
    }

    /// Aborts the node's running bare-metal workflow: the workflow ends `ABORTED` and the
    /// node `failed` (with `failedFrom` and maintenance on), in one transaction; `recover`
    /// starts the workflow over. Takes the node's `version`.
    async fn abort_workflow(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, and why.")] input: Validated<
            AbortWorkflowInput,
        >,
    ) -> async_graphql::Result<AbortWorkflowPayload> {
        BareMetalMutation::abort(ctx, input.check("input")?).await
    }
}
