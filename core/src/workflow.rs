//! Bare-metal workflows as step machines, the way OpenStack Ironic runs its provision steps:
//! a workflow is a fixed list of steps for one node, each with a status, timestamps,
//! attempts, a deadline and a log, and the whole of it is a value that storage keeps.
//!
//! [`advance`] is the machine: a pure function from (workflow, input, now) to the next
//! workflow and the effects the caller must perform. It never does IO. The Workflow controller
//! in the server feeds it a [`Input::Tick`] on each pass, performs the [`Effect::Execute`] it
//! asks for (a BMC call, a command queued to the node's daemon, a look at the node), feeds
//! the [`StepResult`] back as [`Input::Outcome`], and writes the workflow and the node change
//! of an ending ([`Effect::Succeed`], [`Effect::Fail`]) in one transaction. Because every
//! decision is in the persisted value, a controller that restarts resumes from the step it
//! was at: a step that was running is executed again, so each step's execution is written to
//! be safe to repeat (asking a BMC to power on a machine that is on, looking at a node again,
//! polling the command whose id the step keeps as its handle instead of queueing another).
//!
//! Which workflow runs is decided by the provision state alone ([`WorkflowKind::for_state`]):
//! entering `inspecting`, `commissioning`, `deploying`, `releasing`, `rescue` or `retiring`
//! (by the operator's move, by a workflow's finishing move, or by `recover` back to one of
//! them) starts that state's workflow, and its success makes the state's finishing move, if
//! it has one. A failure or an abort fails the node (`failedFrom`, maintenance on).

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

use crate::axes::{Connectivity, ProvisionState, axis_enum};
use crate::command::{CommandKind, DISK_WIPE_TIMEOUT};
use crate::error::DomainError;
use crate::event::Change;
use crate::ids::{NodeId, WorkflowId};
use crate::node::NodeRecord;
use crate::provision::ProvisionMove;

axis_enum!(
    /// What a workflow does to its node. Each runs while the node is in one provision state.
    WorkflowKind {
        /// `inspecting`: network-boot the machine once, wait for its ramdisk daemon to join,
        /// and check what it reports against the enrolment. Success makes `commission`.
        Inspect = "inspect",
        /// `commissioning`: the ramdisk daemon (still running from the inspection) burns the
        /// GPUs in with `diag.nvml` at the pool's acceptance level, reports the firmware
        /// facts, and the machine is powered off. Success makes `provide` (`ready`).
        Commission = "commission",
        /// `deploying`: boot the deploy image (virtual media where the BMC has it, else the
        /// network once), power on, and wait for the installed system's daemon to join; then
        /// the image is ejected from the virtual media, as Ironic does, so that the machine
        /// never boots the installer again. Success makes `finish-deploy` (`deployed`).
        Deploy = "deploy",
        /// `releasing`: boot the ramdisk, wipe the disks, power off. Success makes
        /// `finish-release` (`ready`).
        Release = "release",
        /// `rescue`: boot the rescue ramdisk from the network once, power on, and wait for
        /// its daemon. Success leaves the node in `rescue` (the operator's `unrescue` leaves).
        Rescue = "rescue",
        /// `retiring`: boot the ramdisk, wipe the disks, power off. Success bumps
        /// `identityGeneration` and makes `finish-retire` (`retired`).
        Retire = "retire",
    }
);

axis_enum!(
    /// One step of a workflow.
    StepKind {
        /// Sets the BMC's one-time boot override to the network (Redfish `Pxe`).
        BootNetworkOnce = "boot-network-once",
        /// Boots the deploy image at the next boot: inserted as virtual media with a
        /// one-time boot from it where the BMC offers virtual media and the image has an
        /// address, else a one-time network boot. The log says which.
        BootDeployImage = "boot-deploy-image",
        /// Powers the machine on (restarts it when it is on already, so the one-time boot
        /// applies) and waits until the BMC reports it on.
        PowerOn = "power-on",
        /// Waits for the machine's daemon to join as this node with a newer identity
        /// generation than the workflow started with, and to hold a session. In a deploy
        /// that named an image, it then ejects the image from the BMC's virtual CD
        /// ([`WorkflowKind::ejects_deploy_image`]); a failed eject is logged, not fatal: the
        /// installed system runs, and the image only waits to be ejected by hand.
        AwaitDaemon = "await-daemon",
        /// Compares the identifiers the daemon's inventory reports with the enrolment's.
        CheckIdentifiers = "check-identifiers",
        /// Queues `diag.nvml` at the pool's acceptance level and waits for it to pass.
        BurnIn = "burn-in",
        /// Queues an `inventory.refresh` of the sections that carry firmware facts (BIOS,
        /// GPU VBIOS, driver) and records what they report in the step's log.
        RecordFirmware = "record-firmware",
        /// Queues `disk.wipe` and waits for it to succeed.
        WipeDisks = "wipe-disks",
        /// Powers the machine off and waits until the BMC reports it off.
        PowerOff = "power-off",
    }
);

axis_enum!(
    /// Where a step is.
    StepStatus {
        /// Not reached yet.
        Pending = "pending",
        /// Under way: executed (at least once) within its current attempt.
        Running = "running",
        Succeeded = "succeeded",
        /// Its last attempt failed or timed out: the workflow failed with it.
        Failed = "failed",
        /// An operator aborted the workflow while this step ran.
        Aborted = "aborted",
    }
);

axis_enum!(
    /// Where a workflow is. Only `running` workflows are advanced; one node has at most one.
    WorkflowStatus {
        Running = "running",
        Succeeded = "succeeded",
        Failed = "failed",
        Aborted = "aborted",
    }
);

/// A BMC request is accepted in a second and the power follows within seconds (the Redfish
/// emulator takes 1 to 11 s; real BMCs up to a minute for a forced power change). Two
/// minutes per attempt leaves room for a slow BMC without hiding a dead one for long.
pub const BMC_STEP_TIMEOUT: Duration = Duration::minutes(2);
/// A GPU server's firmware takes up to 10 minutes to POST with its memory training, and a
/// network boot and the ramdisk's start a few more: 30 minutes before a daemon that never
/// came is a failure.
pub const AWAIT_DAEMON_TIMEOUT: Duration = Duration::minutes(30);
/// The daemon reports its inventory right after its session opens; 5 minutes is generous
/// for the sections that carry the identifiers to arrive.
pub const CHECK_IDENTIFIERS_TIMEOUT: Duration = Duration::minutes(5);
/// BMCs fail transiently (a busy management controller answers 503, a reset of its web
/// server drops a request): three attempts of a BMC step before the workflow fails.
pub const BMC_STEP_ATTEMPTS: u32 = 3;
/// How long a command a step queued may wait for its lane and the daemon's session before it
/// runs: seconds on a healthy machine; ten minutes leaves room for a daemon that reconnects.
pub const COMMAND_DISPATCH_ALLOWANCE: Duration = Duration::minutes(10);
/// The burn-in's `diag.nvml` may run this long. DCGM's deepest level (3) takes about half an
/// hour on an 8-GPU machine; 45 minutes ends a hung diagnostic without cutting a slow one.
pub const BURN_IN_COMMAND_TIMEOUT: Duration = Duration::minutes(45);
/// The burn-in step: its diagnostic's timeout and the wait to dispatch it.
pub const BURN_IN_TIMEOUT: Duration = BURN_IN_COMMAND_TIMEOUT
    .checked_add(&COMMAND_DISPATCH_ALLOWANCE)
    .expect("in range");
/// The firmware facts come from an `inventory.refresh`, which runs within a minute (its
/// command timeout); five minutes covers its dispatch as well.
pub const RECORD_FIRMWARE_TIMEOUT: Duration = Duration::minutes(5);
/// The wipe step: the `disk.wipe`'s timeout and the wait to dispatch it.
pub const WIPE_DISKS_TIMEOUT: Duration = DISK_WIPE_TIMEOUT
    .checked_add(&COMMAND_DISPATCH_ALLOWANCE)
    .expect("in range");
/// Steps that run a command get two attempts: a command that ran and failed fails the
/// workflow at once (a failing diagnostic is not retried), but a step that timed out
/// waiting for a daemon that came back late, or that could not queue its command (the
/// database was away), queues it once more.
pub const COMMAND_STEP_ATTEMPTS: u32 = 2;
/// The most log lines a step keeps: the oldest are dropped first. A step that waits logs only
/// when what it waits on changes, so this bounds a step that flaps, not one that waits.
pub const MAX_LOG_LINES: usize = 50;

/// The inventory sections that carry firmware facts: the BIOS (`system`), each GPU's VBIOS
/// (`gpus`) and the GPU driver (`drivers`).
pub const FIRMWARE_SECTIONS: &[&str] = &["system", "gpus", "drivers"];

impl WorkflowKind {
    /// The provision state the workflow runs in.
    pub fn state(self) -> ProvisionState {
        match self {
            WorkflowKind::Inspect => ProvisionState::Inspecting,
            WorkflowKind::Commission => ProvisionState::Commissioning,
            WorkflowKind::Deploy => ProvisionState::Deploying,
            WorkflowKind::Release => ProvisionState::Releasing,
            WorkflowKind::Rescue => ProvisionState::Rescue,
            WorkflowKind::Retire => ProvisionState::Retiring,
        }
    }

    /// The workflow a node entering `state` runs, if it has one.
    pub fn for_state(state: ProvisionState) -> Option<WorkflowKind> {
        WorkflowKind::ALL
            .iter()
            .copied()
            .find(|k| k.state() == state)
    }

    /// Its steps, in order.
    ///
    /// Release and retire always boot the ramdisk before they wipe, even when the deployed
    /// system's daemon is connected: a system cannot honestly erase the disks it runs from,
    /// and a deployed system may be a tenant's, whose daemon the platform does not trust with
    /// its own teardown. The ramdisk joins with a new identity generation, which also ends
    /// every certificate the deployed system held, as Ironic's cleaning and MAAS's erasure
    /// boot their own ramdisks.
    pub fn steps(self) -> &'static [StepKind] {
        match self {
            WorkflowKind::Inspect => &[
                StepKind::BootNetworkOnce,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
                StepKind::CheckIdentifiers,
            ],
            WorkflowKind::Commission => &[
                StepKind::BurnIn,
                StepKind::RecordFirmware,
                StepKind::PowerOff,
            ],
            WorkflowKind::Deploy => &[
                StepKind::BootDeployImage,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
            ],
            WorkflowKind::Rescue => &[
                StepKind::BootNetworkOnce,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
            ],
            WorkflowKind::Release | WorkflowKind::Retire => &[
                StepKind::BootNetworkOnce,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
                StepKind::WipeDisks,
                StepKind::PowerOff,
            ],
        }
    }

    /// Whether the wait for the daemon ends by ejecting the deploy image from the BMC's
    /// virtual CD: in a deploy, once the installed system's daemon has joined, the image has
    /// done its work, and left inserted it would be booted again by a later one-time CD boot
    /// or found by the installed system as a stray disc.
    pub fn ejects_deploy_image(self) -> bool {
        self == WorkflowKind::Deploy
    }

    /// The move its success makes: none for `rescue`, whose success is the machine running
    /// the rescue ramdisk in the state it already is in.
    pub fn finishing_move(self) -> Option<ProvisionMove> {
        match self {
            WorkflowKind::Inspect => Some(ProvisionMove::Commission),
            WorkflowKind::Commission => Some(ProvisionMove::Provide),
            WorkflowKind::Deploy => Some(ProvisionMove::FinishDeploy),
            WorkflowKind::Release => Some(ProvisionMove::FinishRelease),
            WorkflowKind::Rescue => None,
            WorkflowKind::Retire => Some(ProvisionMove::FinishRetire),
        }
    }
}

impl StepKind {
    /// How long one attempt may take.
    pub fn timeout(self) -> Duration {
        match self {
            StepKind::BootNetworkOnce
            | StepKind::BootDeployImage
            | StepKind::PowerOn
            | StepKind::PowerOff => BMC_STEP_TIMEOUT,
            StepKind::AwaitDaemon => AWAIT_DAEMON_TIMEOUT,
            StepKind::CheckIdentifiers => CHECK_IDENTIFIERS_TIMEOUT,
            StepKind::BurnIn => BURN_IN_TIMEOUT,
            StepKind::RecordFirmware => RECORD_FIRMWARE_TIMEOUT,
            StepKind::WipeDisks => WIPE_DISKS_TIMEOUT,
        }
    }

    /// How many attempts it gets. Waiting again for a daemon that did not come, or comparing
    /// the same identifiers again, would change nothing: those get one.
    pub fn max_attempts(self) -> u32 {
        match self {
            StepKind::BootNetworkOnce
            | StepKind::BootDeployImage
            | StepKind::PowerOn
            | StepKind::PowerOff => BMC_STEP_ATTEMPTS,
            StepKind::AwaitDaemon | StepKind::CheckIdentifiers => 1,
            StepKind::BurnIn | StepKind::RecordFirmware | StepKind::WipeDisks => {
                COMMAND_STEP_ATTEMPTS
            }
        }
    }

    /// The command the step runs on the node's daemon, if it runs one.
    pub fn command(self) -> Option<CommandKind> {
        match self {
            StepKind::BurnIn => Some(CommandKind::DiagNvml),
            StepKind::RecordFirmware => Some(CommandKind::InventoryRefresh),
            StepKind::WipeDisks => Some(CommandKind::DiskWipe),
            _ => None,
        }
    }
}

/// One line of a step's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    pub at: DateTime<Utc>,
    pub message: String,
}

/// One step of a workflow, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub kind: StepKind,
    pub status: StepStatus,
    /// Attempts begun (0 while pending).
    pub attempts: u32,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// When the current attempt times out.
    pub deadline: Option<DateTime<Utc>>,
    /// What the current attempt started and now waits on (a power request the BMC
    /// accepted, the id of the command it queued): kept so that a controller that restarts
    /// polls it instead of starting it again, and kept once the step is done.
    pub handle: Option<String>,
    pub log: Vec<LogLine>,
}

impl Step {
    fn new(kind: StepKind) -> Step {
        Step {
            kind,
            status: StepStatus::Pending,
            attempts: 0,
            started_at: None,
            finished_at: None,
            deadline: None,
            handle: None,
            log: Vec::new(),
        }
    }

    fn note(&mut self, at: DateTime<Utc>, message: impl Into<String>) {
        self.log.push(LogLine {
            at,
            message: message.into(),
        });
        if self.log.len() > MAX_LOG_LINES {
            let extra = self.log.len() - MAX_LOG_LINES;
            self.log.drain(..extra);
        }
    }
}

/// A workflow, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workflow {
    pub id: WorkflowId,
    pub node_id: NodeId,
    pub kind: WorkflowKind,
    pub status: WorkflowStatus,
    /// The index of the step under way (or the last one reached, once ended).
    pub current: usize,
    pub steps: Vec<Step>,
    /// Why it failed or was aborted.
    pub reason: Option<String>,
    /// Who started it (the actor of the move that entered its state).
    pub started_by: String,
    /// The node's `identityGeneration` when it started: a daemon that joins during the
    /// workflow has a newer one.
    pub identity_generation: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Optimistic concurrency between the controller and an operator's abort.
    pub version: i64,
}

impl Workflow {
    /// A new workflow of `kind` for `node`, all steps pending.
    pub fn new(
        kind: WorkflowKind,
        node: &NodeRecord,
        started_by: &str,
        now: DateTime<Utc>,
    ) -> Workflow {
        Workflow {
            id: WorkflowId::generate(),
            node_id: node.id.clone(),
            kind,
            status: WorkflowStatus::Running,
            current: 0,
            steps: kind.steps().iter().copied().map(Step::new).collect(),
            reason: None,
            started_by: started_by.to_owned(),
            identity_generation: node.identity_generation,
            created_at: now,
            updated_at: now,
            finished_at: None,
            version: 1,
        }
    }

    pub fn is_running(&self) -> bool {
        self.status == WorkflowStatus::Running
    }

    /// Adds a line to the log of the step it is at (or ended at): what its caller did
    /// around a step, such as cancelling a command when the workflow ended.
    pub fn note(&mut self, at: DateTime<Utc>, message: impl Into<String>) {
        if let Some(step) = self.steps.get_mut(self.current) {
            step.note(at, message);
        }
    }

    /// The step under way, if the workflow runs.
    pub fn current_step(&self) -> Option<&Step> {
        self.is_running()
            .then(|| self.steps.get(self.current))
            .flatten()
    }
}

/// What happened, for [`advance`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A controller pass: start the current step, or check its deadline and ask for it to be
    /// executed again (a poll).
    Tick,
    /// What executing a step found. Ignored unless it is for the current step and attempt.
    Outcome {
        step: usize,
        attempt: u32,
        result: StepResult,
    },
    /// An operator's `abortWorkflow` (or a `fail` move while the workflow runs).
    Abort { by: String, reason: String },
}

/// What one execution of a step found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepResult {
    /// The step is done.
    Done(String),
    /// The step started something to wait on (a power request the BMC accepted); the next
    /// executions poll it.
    Started { handle: String, message: String },
    /// Not yet: what it waits on (logged when it changes).
    Waiting(String),
    /// This attempt failed. `retry`: another attempt may succeed (a BMC that did not
    /// answer); otherwise the workflow fails at once (identifiers that contradict).
    Failed { message: String, retry: bool },
}

/// What the caller must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Execute step `step` (attempt `attempt`), polling `handle` if it has one.
    Execute {
        step: usize,
        attempt: u32,
        kind: StepKind,
        handle: Option<String>,
    },
    /// The workflow succeeded: make its finishing move ([`finish_node`]).
    Succeed,
    /// The workflow failed or was aborted: fail the node with this reason.
    Fail { reason: String },
}

/// The next workflow and the effects to perform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advanced {
    pub workflow: Workflow,
    pub effects: Vec<Effect>,
}

impl Advanced {
    /// The step execution asked for, if any.
    pub fn execute(&self) -> Option<(usize, u32, StepKind, Option<String>)> {
        self.effects.iter().find_map(|e| match e {
            Effect::Execute {
                step,
                attempt,
                kind,
                handle,
            } => Some((*step, *attempt, *kind, handle.clone())),
            _ => None,
        })
    }

    /// The ending asked for, if any.
    pub fn ending(&self) -> Option<Effect> {
        self.effects
            .iter()
            .find(|e| matches!(e, Effect::Succeed | Effect::Fail { .. }))
            .cloned()
    }
}

/// The step machine. Pure: the same workflow, input and time give the same answer. A
/// workflow that has ended ignores every input.
pub fn advance(workflow: &Workflow, input: Input, now: DateTime<Utc>) -> Advanced {
    let mut w = workflow.clone();
    let mut effects = Vec::new();
    if w.is_running() && w.current < w.steps.len() {
        match input {
            Input::Tick => drive(&mut w, now, &mut effects),
            Input::Outcome {
                step,
                attempt,
                result,
            } => {
                let current = &w.steps[w.current];
                if step == w.current
                    && current.status == StepStatus::Running
                    && current.attempts == attempt
                {
                    outcome(&mut w, result, now, &mut effects);
                }
            }
            Input::Abort { by, reason } => {
                let step = &mut w.steps[w.current];
                if matches!(step.status, StepStatus::Running | StepStatus::Pending) {
                    step.status = StepStatus::Aborted;
                    step.finished_at = Some(now);
                    step.note(now, format!("aborted by {by}: {reason}"));
                }
                let why = format!("{} aborted by {by}: {reason}", w.kind);
                end(&mut w, WorkflowStatus::Aborted, Some(why.clone()), now);
                effects.push(Effect::Fail { reason: why });
            }
        }
    }
    if w != *workflow {
        w.updated_at = now;
    }
    Advanced {
        workflow: w,
        effects,
    }
}

/// Starts the current step, or times it out, or asks for it to be polled.
fn drive(w: &mut Workflow, now: DateTime<Utc>, effects: &mut Vec<Effect>) {
    let index = w.current;
    let step = &mut w.steps[index];
    match step.status {
        StepStatus::Pending => {
            step.status = StepStatus::Running;
            step.started_at = Some(now);
            begin_attempt(step, now, effects, index);
        }
        StepStatus::Running => match step.deadline {
            Some(deadline) if now >= deadline => {
                let message = format!(
                    "attempt {} timed out after {} s",
                    step.attempts,
                    step.kind.timeout().num_seconds()
                );
                retry_or_fail(w, message, true, now, effects, true);
            }
            _ => effects.push(Effect::Execute {
                step: index,
                attempt: step.attempts,
                kind: step.kind,
                handle: step.handle.clone(),
            }),
        },
        StepStatus::Succeeded | StepStatus::Failed | StepStatus::Aborted => {}
    }
}

fn begin_attempt(step: &mut Step, now: DateTime<Utc>, effects: &mut Vec<Effect>, index: usize) {
    step.attempts += 1;
    step.deadline = Some(now + step.kind.timeout());
    step.handle = None;
    step.note(
        now,
        format!("attempt {} of {}", step.attempts, step.kind.max_attempts()),
    );
    effects.push(Effect::Execute {
        step: index,
        attempt: step.attempts,
        kind: step.kind,
        handle: None,
    });
}

fn outcome(w: &mut Workflow, result: StepResult, now: DateTime<Utc>, effects: &mut Vec<Effect>) {
    let index = w.current;
    let step = &mut w.steps[index];
    match result {
        StepResult::Done(message) => {
            // The handle stays: what the step waited on (the command it ran) is part of its
            // record.
            step.status = StepStatus::Succeeded;
            step.finished_at = Some(now);
            step.note(now, message);
            if index + 1 == w.steps.len() {
                end(w, WorkflowStatus::Succeeded, None, now);
                effects.push(Effect::Succeed);
            } else {
                // The next step starts at once: a workflow moves as fast as its steps.
                w.current = index + 1;
                drive(w, now, effects);
            }
        }
        StepResult::Started { handle, message } => {
            step.handle = Some(handle);
            step.note(now, message);
        }
        StepResult::Waiting(message) => {
            if step.log.last().map(|l| l.message.as_str()) != Some(message.as_str()) {
                step.note(now, message);
            }
        }
        StepResult::Failed { message, retry } => {
            retry_or_fail(w, message, retry, now, effects, false);
        }
    }
}

/// A failed attempt: another one if the step has attempts left and the failure is worth
/// retrying, else the workflow fails. A failure's retry waits for the next tick (so a BMC
/// that refuses is not asked again in the same breath); a timeout's starts at once, since
/// the attempt has already waited its whole timeout.
fn retry_or_fail(
    w: &mut Workflow,
    message: String,
    retry: bool,
    now: DateTime<Utc>,
    effects: &mut Vec<Effect>,
    at_once: bool,
) {
    let index = w.current;
    let step = &mut w.steps[index];
    step.note(now, message.clone());
    if retry && step.attempts < step.kind.max_attempts() {
        if at_once {
            begin_attempt(step, now, effects, index);
        } else {
            // The next tick executes the new attempt afresh.
            step.attempts += 1;
            step.deadline = Some(now + step.kind.timeout());
            step.handle = None;
            step.note(
                now,
                format!("attempt {} of {}", step.attempts, step.kind.max_attempts()),
            );
        }
        return;
    }
    step.status = StepStatus::Failed;
    step.finished_at = Some(now);
    let why = format!("{} failed at {}: {message}", w.kind, step.kind);
    end(w, WorkflowStatus::Failed, Some(why.clone()), now);
    effects.push(Effect::Fail { reason: why });
}

fn end(w: &mut Workflow, status: WorkflowStatus, reason: Option<String>, now: DateTime<Utc>) {
    w.status = status;
    w.reason = reason;
    w.finished_at = Some(now);
}

/// The node transition of a workflow's success: its finishing move (none for `rescue`), and
/// for `retire` a new identity generation (the machine's certificates never work again).
pub fn finish_node(
    kind: WorkflowKind,
    workflow: &WorkflowId,
    node: &mut NodeRecord,
) -> Result<Vec<Change>, DomainError> {
    let Some(finishing) = kind.finishing_move() else {
        return Ok(Vec::new());
    };
    let why = format!("workflow {workflow} succeeded");
    let mut changes = node.apply_move(finishing, Some(why.as_str()))?;
    if kind == WorkflowKind::Retire {
        changes.extend(node.bump_identity_generation("retired: its workflow wiped the identity"));
    }
    Ok(changes)
}

/// The firmware facts an inventory reports, in a sentence for the commission's log: the
/// BIOS (`system.biosVendor`, `biosVersion`), each distinct GPU VBIOS with how many GPUs
/// carry it (`gpus.devices[].vbiosVersion`), and the GPU driver (`gpus.driverVersion`, else
/// `drivers.nvidia`). What a section does not report is said to be unreported.
pub fn firmware_facts(sections: &BTreeMap<String, serde_json::Value>) -> String {
    let text =
        |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_str).map(str::to_owned);
    let system = sections.get("system");
    let bios = match (
        text(system.and_then(|s| s.get("biosVendor"))),
        text(system.and_then(|s| s.get("biosVersion"))),
    ) {
        (Some(vendor), Some(version)) => format!("BIOS {version} ({vendor})"),
        (None, Some(version)) => format!("BIOS {version}"),
        _ => "BIOS unreported".to_owned(),
    };
    let gpus = sections.get("gpus");
    let mut vbios: BTreeMap<String, usize> = BTreeMap::new();
    for device in gpus
        .and_then(|g| g.get("devices"))
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
    {
        let version = text(device.get("vbiosVersion")).unwrap_or_else(|| "unreported".to_owned());
        *vbios.entry(version).or_default() += 1;
    }
    let vbios = if vbios.is_empty() {
        "no GPU VBIOS reported".to_owned()
    } else {
        vbios
            .iter()
            .map(|(version, count)| format!("GPU VBIOS {version} on {count} GPU(s)"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let driver = text(gpus.and_then(|g| g.get("driverVersion")))
        .or_else(|| text(sections.get("drivers").and_then(|d| d.get("nvidia"))))
        .map_or_else(
            || "GPU driver unreported".to_owned(),
            |v| format!("GPU driver {v}"),
        );
    format!("firmware: {bios}; {vbios}; {driver}")
}

/// Whether the machine's daemon has joined as `node` since a workflow that started at
/// identity generation `started_at` (a join in place bumps it) and holds a session.
pub fn daemon_joined(started_at: i64, node: &NodeRecord) -> bool {
    node.identity_generation > started_at && node.connectivity == Connectivity::Connected
}

/// Identifiers by kind, normalised ([`crate::hardware::HardwareKey::identifiers`]).
pub type Identifiers = BTreeMap<String, BTreeSet<String>>;

/// Compares what a machine reported with what it was enrolled with. A kind both name
/// contradicts when they share no value (a MAC list agrees when one MAC is shared: the BMC
/// sees fewer interfaces than the daemon). `Ok` names the kinds that agree; `Err` names
/// every contradiction, with both sides, for the failed workflow's reason.
pub fn check_identifiers(enrolled: &Identifiers, reported: &Identifiers) -> Result<String, String> {
    let mut agreeing = Vec::new();
    let mut contradictions = Vec::new();
    for (kind, values) in enrolled {
        let Some(seen) = reported.get(kind) else {
            continue;
        };
        if values.is_disjoint(seen) {
            contradictions.push(format!(
                "{kind} was enrolled as {} but the machine reports {}",
                join(values),
                join(seen)
            ));
        } else {
            agreeing.push(kind.as_str());
        }
    }
    if !contradictions.is_empty() {
        return Err(format!(
            "the machine's identifiers contradict its enrolment: {}",
            contradictions.join("; ")
        ));
    }
    if agreeing.is_empty() {
        return Err("the machine reports none of the identifiers it was enrolled with".to_owned());
    }
    Ok(format!(
        "the machine's identifiers match its enrolment ({})",
        agreeing.join(", ")
    ))
}

fn join(values: &BTreeSet<String>) -> String {
    values.iter().cloned().collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::tests::{node, t0};
    use proptest::prelude::*;

    fn inspect() -> Workflow {
        Workflow::new(
            WorkflowKind::Inspect,
            &node(ProvisionState::Inspecting),
            "user:op",
            t0(),
        )
    }

    fn done(w: &Workflow, message: &str, at: DateTime<Utc>) -> Advanced {
        let step = w.current;
        let attempt = w.steps[step].attempts;
        advance(
            w,
            Input::Outcome {
                step,
                attempt,
                result: StepResult::Done(message.into()),
            },
            at,
        )
    }

    #[test]
    fn a_tick_starts_the_first_step_and_each_success_starts_the_next() {
        let w = inspect();
        let a = advance(&w, Input::Tick, t0());
        assert_eq!(a.execute(), Some((0, 1, StepKind::BootNetworkOnce, None)));
        assert_eq!(a.workflow.steps[0].status, StepStatus::Running);
        assert_eq!(a.workflow.steps[0].deadline, Some(t0() + BMC_STEP_TIMEOUT));
        let b = done(&a.workflow, "boot override set", t0());
        assert_eq!(b.workflow.steps[0].status, StepStatus::Succeeded);
        assert_eq!(b.execute(), Some((1, 1, StepKind::PowerOn, None)));
        let mut w = b.workflow;
        for _ in 1..w.steps.len() {
            let next = done(&w, "ok", t0());
            w = next.workflow;
            if w.status == WorkflowStatus::Succeeded {
                assert_eq!(next.effects, vec![Effect::Succeed]);
            }
        }
        assert_eq!(w.status, WorkflowStatus::Succeeded);
        assert!(w.steps.iter().all(|s| s.status == StepStatus::Succeeded));
        assert_eq!(
            advance(&w, Input::Tick, t0()).effects,
            vec![],
            "ended: inert"
        );
    }

    #[test]
    fn a_started_step_is_polled_with_its_handle_and_waits_log_once() {
        let a = advance(&inspect(), Input::Tick, t0());
        let b = done(&a.workflow, "set", t0());
        let c = advance(
            &b.workflow,
            Input::Outcome {
                step: 1,
                attempt: 1,
                result: StepResult::Started {
                    handle: "on-requested".into(),
                    message: "asked".into(),
                },
            },
            t0(),
        );
        let d = advance(&c.workflow, Input::Tick, t0() + Duration::seconds(10));
        assert_eq!(
            d.execute(),
            Some((1, 1, StepKind::PowerOn, Some("on-requested".into())))
        );
        let waiting = |w: &Workflow| {
            advance(
                w,
                Input::Outcome {
                    step: 1,
                    attempt: 1,
                    result: StepResult::Waiting("still off".into()),
                },
                t0() + Duration::seconds(20),
            )
            .workflow
        };
        let once = waiting(&d.workflow);
        let twice = waiting(&once);
        assert_eq!(once.steps[1].log.len(), twice.steps[1].log.len());
    }

    #[test]
    fn a_failed_attempt_retries_on_the_next_tick_then_fails_the_workflow() {
        let mut w = advance(
            &Workflow::new(
                WorkflowKind::Release,
                &node(ProvisionState::Releasing),
                "user:op",
                t0(),
            ),
            Input::Tick,
            t0(),
        )
        .workflow;
        for attempt in 1..=BMC_STEP_ATTEMPTS {
            let a = advance(
                &w,
                Input::Outcome {
                    step: 0,
                    attempt,
                    result: StepResult::Failed {
                        message: "the BMC did not answer".into(),
                        retry: true,
                    },
                },
                t0(),
            );
            let ending = a.ending();
            w = a.workflow;
            if attempt < BMC_STEP_ATTEMPTS {
                assert!(ending.is_none(), "the retry waits for the tick");
                assert_eq!(w.steps[0].attempts, attempt + 1);
                let tick = advance(&w, Input::Tick, t0());
                assert_eq!(
                    tick.execute(),
                    Some((0, attempt + 1, StepKind::BootNetworkOnce, None))
                );
                w = tick.workflow;
            } else {
                assert_eq!(w.status, WorkflowStatus::Failed);
                assert!(
                    matches!(ending, Some(Effect::Fail { reason }) if reason.contains("boot-network-once") && reason.contains("did not answer"))
                );
            }
        }
    }

    #[test]
    fn a_contradiction_fails_at_once_and_stale_outcomes_are_ignored() {
        let mut w = advance(&inspect(), Input::Tick, t0()).workflow;
        for _ in 0..2 {
            w = done(&w, "ok", t0()).workflow;
        }
        assert_eq!(w.current, 2);
        let stale = advance(
            &w,
            Input::Outcome {
                step: 0,
                attempt: 1,
                result: StepResult::Failed {
                    message: "late".into(),
                    retry: false,
                },
            },
            t0(),
        );
        assert_eq!(
            stale.workflow, w,
            "an outcome for another step changes nothing"
        );
        let failed = advance(
            &w,
            Input::Outcome {
                step: 2,
                attempt: 1,
                result: StepResult::Failed {
                    message: "serial contradicts".into(),
                    retry: false,
                },
            },
            t0(),
        );
        assert_eq!(failed.workflow.status, WorkflowStatus::Failed);
        assert_eq!(failed.workflow.steps[2].status, StepStatus::Failed);
        assert_eq!(failed.workflow.steps[3].status, StepStatus::Pending);
    }

    #[test]
    fn deadlines_come_from_the_clock_and_a_timeout_starts_the_next_attempt_at_once() {
        let a = advance(&inspect(), Input::Tick, t0());
        let before = advance(
            &a.workflow,
            Input::Tick,
            t0() + BMC_STEP_TIMEOUT - Duration::seconds(1),
        );
        assert_eq!(
            before.execute(),
            Some((0, 1, StepKind::BootNetworkOnce, None))
        );
        let after = advance(&a.workflow, Input::Tick, t0() + BMC_STEP_TIMEOUT);
        assert_eq!(
            after.execute(),
            Some((0, 2, StepKind::BootNetworkOnce, None))
        );
        assert!(
            after.workflow.steps[0]
                .log
                .iter()
                .any(|l| l.message.contains("timed out"))
        );
        // The daemon's wait has one attempt: its timeout fails the workflow.
        let mut w = a.workflow;
        for _ in 0..2 {
            w = done(&w, "ok", t0()).workflow;
        }
        let late = advance(&w, Input::Tick, t0() + AWAIT_DAEMON_TIMEOUT);
        assert_eq!(late.workflow.status, WorkflowStatus::Failed);
        assert!(
            matches!(late.ending(), Some(Effect::Fail { reason }) if reason.contains("await-daemon"))
        );
    }

    #[test]
    fn an_abort_ends_the_running_step_and_fails_the_node() {
        let a = advance(&inspect(), Input::Tick, t0());
        let b = advance(
            &a.workflow,
            Input::Abort {
                by: "user:op".into(),
                reason: "wrong rack".into(),
            },
            t0() + Duration::seconds(5),
        );
        assert_eq!(b.workflow.status, WorkflowStatus::Aborted);
        assert_eq!(b.workflow.steps[0].status, StepStatus::Aborted);
        assert_eq!(b.workflow.finished_at, Some(t0() + Duration::seconds(5)));
        assert!(
            matches!(b.ending(), Some(Effect::Fail { reason }) if reason.contains("wrong rack"))
        );
        let again = advance(
            &b.workflow,
            Input::Abort {
                by: "x".into(),
                reason: "y".into(),
            },
            t0(),
        );
        assert!(again.effects.is_empty());
    }

    /// Each workflow: its state, its steps, and where its success leaves the node.
    const KINDS: &[(WorkflowKind, ProvisionState, &[StepKind], ProvisionState)] = &[
        (
            WorkflowKind::Inspect,
            ProvisionState::Inspecting,
            &[
                StepKind::BootNetworkOnce,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
                StepKind::CheckIdentifiers,
            ],
            ProvisionState::Commissioning,
        ),
        (
            WorkflowKind::Commission,
            ProvisionState::Commissioning,
            &[
                StepKind::BurnIn,
                StepKind::RecordFirmware,
                StepKind::PowerOff,
            ],
            ProvisionState::Ready,
        ),
        (
            WorkflowKind::Deploy,
            ProvisionState::Deploying,
            &[
                StepKind::BootDeployImage,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
            ],
            ProvisionState::Deployed,
        ),
        (
            WorkflowKind::Release,
            ProvisionState::Releasing,
            &[
                StepKind::BootNetworkOnce,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
                StepKind::WipeDisks,
                StepKind::PowerOff,
            ],
            ProvisionState::Ready,
        ),
        (
            WorkflowKind::Rescue,
            ProvisionState::Rescue,
            &[
                StepKind::BootNetworkOnce,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
            ],
            ProvisionState::Rescue,
        ),
        (
            WorkflowKind::Retire,
            ProvisionState::Retiring,
            &[
                StepKind::BootNetworkOnce,
                StepKind::PowerOn,
                StepKind::AwaitDaemon,
                StepKind::WipeDisks,
                StepKind::PowerOff,
            ],
            ProvisionState::Retired,
        ),
    ];

    #[test]
    fn each_workflow_runs_its_steps_and_its_success_makes_its_finishing_move() {
        assert_eq!(KINDS.len(), WorkflowKind::ALL.len(), "every kind is listed");
        let id = WorkflowId::generate();
        for &(kind, state, steps, finished) in KINDS {
            assert_eq!(kind.state(), state, "{kind}");
            assert_eq!(WorkflowKind::for_state(state), Some(kind), "{kind}");
            assert_eq!(kind.steps(), steps, "{kind}");
            assert!(
                crate::provision::WORKFLOW_STATES.contains(&state),
                "{kind}'s state can fail"
            );
            // Every step succeeding, one after the other, ends in one `Succeed`.
            let mut w = advance(
                &Workflow::new(kind, &node(state), "user:op", t0()),
                Input::Tick,
                t0(),
            )
            .workflow;
            let mut endings = Vec::new();
            while w.is_running() {
                let next = done(&w, "ok", t0());
                endings.extend(next.ending());
                w = next.workflow;
            }
            assert_eq!(endings, vec![Effect::Succeed], "{kind}");
            let mut n = node(state);
            let before = n.identity_generation;
            let changes = finish_node(kind, &id, &mut n).expect("legal");
            assert_eq!(n.provision_state, finished, "{kind}");
            assert_eq!(
                n.identity_generation,
                before + i64::from(kind == WorkflowKind::Retire),
                "{kind}: only retire replaces the identity"
            );
            assert_eq!(
                changes.is_empty(),
                kind.finishing_move().is_none(),
                "{kind}: rescue alone has no finishing move"
            );
        }
        assert_eq!(WorkflowKind::for_state(ProvisionState::Ready), None);
        assert_eq!(WorkflowKind::for_state(ProvisionState::Deployed), None);
    }

    #[test]
    fn only_a_deploy_ejects_its_image_and_a_note_lands_on_the_step_reached() {
        for kind in WorkflowKind::ALL {
            assert_eq!(
                kind.ejects_deploy_image(),
                *kind == WorkflowKind::Deploy,
                "{kind}"
            );
        }
        let mut w = advance(&inspect(), Input::Tick, t0()).workflow;
        w = done(&w, "ok", t0()).workflow;
        let aborted = advance(
            &w,
            Input::Abort {
                by: "user:op".into(),
                reason: "wrong rack".into(),
            },
            t0(),
        );
        let mut ended = aborted.workflow;
        let lines = ended.steps[1].log.len();
        ended.note(t0(), "cancelled cmd_1");
        assert_eq!(ended.steps[1].log.len(), lines + 1, "the step it ended at");
        assert_eq!(
            ended.steps[1].log.last().map(|l| l.message.as_str()),
            Some("cancelled cmd_1")
        );
        assert!(
            ended.steps[0]
                .log
                .iter()
                .all(|l| l.message != "cancelled cmd_1")
        );
    }

    #[test]
    fn a_command_step_keeps_its_command_fails_with_it_and_queues_again_after_a_timeout() {
        for kind in [
            StepKind::BurnIn,
            StepKind::RecordFirmware,
            StepKind::WipeDisks,
        ] {
            assert!(kind.command().is_some(), "{kind}");
            let workflow = match kind {
                StepKind::WipeDisks => WorkflowKind::Release,
                _ => WorkflowKind::Commission,
            };
            let mut w = advance(
                &Workflow::new(workflow, &node(workflow.state()), "user:op", t0()),
                Input::Tick,
                t0(),
            )
            .workflow;
            while w.steps[w.current].kind != kind {
                w = done(&w, "ok", t0()).workflow;
            }
            let step = w.current;
            assert_eq!(
                w.steps[step].deadline,
                Some(t0() + kind.timeout()),
                "{kind}"
            );
            let started = advance(
                &w,
                Input::Outcome {
                    step,
                    attempt: 1,
                    result: StepResult::Started {
                        handle: "cmd_1".into(),
                        message: "queued".into(),
                    },
                },
                t0(),
            )
            .workflow;
            // A restarted controller polls the command the step queued.
            let poll = advance(&started, Input::Tick, t0() + Duration::seconds(30));
            assert_eq!(
                poll.execute(),
                Some((step, 1, kind, Some("cmd_1".into()))),
                "{kind}"
            );
            // The command failed: the workflow fails with its error, without a retry.
            let failed = advance(
                &started,
                Input::Outcome {
                    step,
                    attempt: 1,
                    result: StepResult::Failed {
                        message: "diag.nvml cmd_1 failed: GPU 3 memory".into(),
                        retry: false,
                    },
                },
                t0(),
            );
            assert!(
                matches!(failed.ending(), Some(Effect::Fail { reason }) if reason.contains(kind.as_static_str()) && reason.contains("GPU 3 memory")),
                "{kind}"
            );
            // A timeout starts the second attempt at once, without the old handle (a new
            // command is queued); the second timeout fails the workflow.
            let second = advance(&started, Input::Tick, t0() + kind.timeout());
            assert_eq!(second.execute(), Some((step, 2, kind, None)), "{kind}");
            let last = advance(
                &second.workflow,
                Input::Tick,
                t0() + kind.timeout() + kind.timeout(),
            );
            assert_eq!(last.workflow.status, WorkflowStatus::Failed, "{kind}");
        }
        assert_eq!(StepKind::PowerOff.command(), None);
        assert_eq!(StepKind::WipeDisks.command(), Some(CommandKind::DiskWipe));
        assert!(StepKind::WipeDisks.timeout() > DISK_WIPE_TIMEOUT);
        assert!(StepKind::BurnIn.timeout() > BURN_IN_COMMAND_TIMEOUT);
    }

    #[test]
    fn firmware_facts_name_the_bios_each_vbios_and_the_driver() {
        let sections = BTreeMap::from([
            (
                "system".to_owned(),
                serde_json::json!({ "biosVendor": "AMI", "biosVersion": "2.1" }),
            ),
            (
                "gpus".to_owned(),
                serde_json::json!({ "driverVersion": "550.54.15", "devices": [
                    { "vbiosVersion": "96.00.99.00.01" },
                    { "vbiosVersion": "96.00.99.00.01" },
                    { "vbiosVersion": "96.00.74.00.0B" },
                ] }),
            ),
        ]);
        assert_eq!(
            firmware_facts(&sections),
            "firmware: BIOS 2.1 (AMI); GPU VBIOS 96.00.74.00.0B on 1 GPU(s), GPU VBIOS 96.00.99.00.01 on 2 GPU(s); GPU driver 550.54.15"
        );
        assert_eq!(
            firmware_facts(&BTreeMap::new()),
            "firmware: BIOS unreported; no GPU VBIOS reported; GPU driver unreported"
        );
    }

    #[test]
    fn identifiers_agree_only_without_contradiction() {
        let ids = |pairs: &[(&str, &str)]| {
            let mut out = Identifiers::new();
            for (k, v) in pairs {
                out.entry((*k).to_owned())
                    .or_default()
                    .insert((*v).to_owned());
            }
            out
        };
        let enrolled = ids(&[
            ("system-uuid", "u1"),
            ("system-serial", "s1"),
            ("mac", "aa"),
        ]);
        assert!(
            check_identifiers(
                &enrolled,
                &ids(&[("system-uuid", "u1"), ("mac", "aa"), ("mac", "bb")])
            )
            .is_ok()
        );
        let err = check_identifiers(
            &enrolled,
            &ids(&[("system-uuid", "u1"), ("system-serial", "s2")]),
        )
        .expect_err("contradicts");
        assert!(
            err.contains("system-serial was enrolled as s1 but the machine reports s2"),
            "{err}"
        );
        assert!(check_identifiers(&enrolled, &ids(&[("board-serial", "b")])).is_err());
    }

    /// What an arbitrary input looks like.
    fn input() -> impl Strategy<Value = Input> {
        let result = prop_oneof![
            Just(StepResult::Done("ok".into())),
            Just(StepResult::Waiting("not yet".into())),
            Just(StepResult::Started {
                handle: "h".into(),
                message: "asked".into()
            }),
            any::<bool>().prop_map(|retry| StepResult::Failed {
                message: "no".into(),
                retry
            }),
        ];
        prop_oneof![
            4 => Just(Input::Tick),
            6 => (0usize..5, 1u32..4, result).prop_map(|(step, attempt, result)| Input::Outcome { step, attempt, result }),
            1 => Just(Input::Abort { by: "user:op".into(), reason: "stop".into() }),
        ]
    }

    proptest! {
        /// Whatever happens, in whatever order, with time moving forward: an ended workflow
        /// never moves again, exactly one ending is ever asked for and only when the
        /// workflow ends, the steps before the current one succeeded and those after are
        /// pending, attempts stay within the step's limit, and logs stay bounded.
        #[test]
        fn the_machine_keeps_its_invariants(kind in prop::sample::select(WorkflowKind::ALL), inputs in prop::collection::vec((input(), 0i64..400), 1..80)) {
            let mut w = Workflow::new(kind, &node(kind.state()), "user:op", t0());
            let mut now = t0();
            let mut endings = 0;
            for (input, seconds) in inputs {
                now += Duration::seconds(seconds);
                let was_running = w.is_running();
                let a = advance(&w, input, now);
                let ending = a.ending();
                if !was_running {
                    prop_assert_eq!(&a.workflow, &w);
                    prop_assert!(a.effects.is_empty());
                }
                if ending.is_some() {
                    endings += 1;
                    prop_assert!(was_running && !a.workflow.is_running());
                    prop_assert_eq!(matches!(ending, Some(Effect::Succeed)), a.workflow.status == WorkflowStatus::Succeeded);
                } else {
                    prop_assert_eq!(was_running, a.workflow.is_running());
                }
                w = a.workflow;
                for (i, step) in w.steps.iter().enumerate() {
                    prop_assert!(step.attempts <= step.kind.max_attempts());
                    prop_assert!(step.log.len() <= MAX_LOG_LINES);
                    if i < w.current {
                        prop_assert_eq!(step.status, StepStatus::Succeeded);
                    }
                    if i > w.current {
                        prop_assert_eq!(step.status, StepStatus::Pending);
                    }
                }
            }
            prop_assert!(endings <= 1);
        }
    }
}
