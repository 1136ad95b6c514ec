//! GraphQL input types, each with its [`Validate`]: which limit of `limits.rs` each field
//! has (SECURITY.md, "Input limits", is the table).

use async_graphql::{ID, InputObject, MaybeUndefined};

use super::input_limits::{
    ACCEPTANCE_DIAG_LEVEL, COMMAND_TIMEOUT_SECONDS, COMMAND_TTL_SECONDS, EXPECTED_GPU_COUNT, Field,
    JOIN_TOKEN_LIFETIME_SECONDS, JOIN_TOKEN_USES, MAX_ACCEPTANCE_CHECKS, MAX_COMMAND_NODE_IDS,
    MAX_DRIVERS, MAX_FILTER_VALUES, MAX_IDENTIFIERS, MAX_LABELS_PER_CHANGE, MAX_REMEDIATION_RULES,
    REMEDIATION_ATTEMPTS, REMEDIATION_BACKOFF_SECONDS, REMEDIATION_VERIFY_LEVEL, Text, Timestamp,
    VERSION, Validate,
};
use super::types::{
    CapacityBucket, Connectivity, NodeRole, PoolAgent, PoolKind, ProvisionMove, ProvisionState,
    SiteKind, TaintEffect, Trust,
};

/// A label selector term: the key present, or present with this value.
#[derive(InputObject, Clone)]
pub struct LabelSelectorInput {
    /// The label key the node must carry.
    pub key: String,
    /// The value the label must have; omit to match any value.
    pub value: Option<String>,
}

/// Which nodes to list. Values within one field are alternatives ("any of"); fields and
/// label selectors must all hold.
#[derive(InputObject, Default, Clone)]
pub struct NodeFilterInput {
    /// Nodes in any of these provision states.
    pub provision_state: Option<Vec<ProvisionState>>,
    /// Nodes with any of these connectivities.
    pub connectivity: Option<Vec<Connectivity>>,
    /// Only nodes in maintenance (`true`) or only nodes not in it (`false`).
    pub maintenance: Option<bool>,
    /// Only cordoned nodes (`true`) or only uncordoned ones (`false`).
    pub cordoned: Option<bool>,
    /// Nodes with any of these roles.
    pub role: Option<Vec<NodeRole>>,
    /// Nodes with any of these trusts.
    pub trust: Option<Vec<Trust>>,
    /// Nodes in any of these sites.
    pub site_id: Option<Vec<ID>>,
    /// Nodes in any of these pools.
    pub pool_id: Option<Vec<ID>>,
    /// Nodes matching every one of these label selectors.
    pub labels: Option<Vec<LabelSelectorInput>>,
    /// Nodes carrying any of these `noScheduleReasons` (e.g. `taint:gpu-burn`, `unreachable`).
    pub reason: Option<Vec<String>>,
    /// Nodes in any of these capacity buckets.
    pub bucket: Option<Vec<CapacityBucket>>,
    /// Only schedulable nodes (`true`) or only nodes that are not (`false`).
    pub schedulable: Option<bool>,
    /// Nodes whose hostname contains this text.
    pub hostname: Option<String>,
    /// Nodes whose open session is held by any of these gateway replicas (`session.gatewayId`):
    /// the sessions a replica would drop if it stopped. Not in subscriptions: a session moves
    /// to another gateway without changing the node, so a subscription could not follow it.
    pub gateway_id: Option<Vec<String>>,
}

/// What `cordonNode` needs: the node, the version read, and why.
#[derive(InputObject)]
pub struct CordonNodeInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// Why the node is taken out of service, kept with the cordon and its event.
    pub reason: String,
}

/// Declares the input of a node mutation that needs the node and the `version` read, and
/// its [`Validate`]; with `reason`, also why the change is made (kept with its event).
macro_rules! node_input {
    ($(#[doc = $doc:literal])+ $name:ident { id, version }) => {
        $(#[doc = $doc])+
        #[derive(InputObject)]
        pub struct $name {
            /// The node's id.
            pub id: ID,
            /// The `version` of the node you read; a node that changed since is `CONFLICT`.
            pub version: i64,
        }

        impl Validate for $name {
            fn validate(&self, at: &Field) -> Checked {
                let $name { id, version } = self;
                node_and_version(at, id, *version)
            }
        }
    };
    ($(#[doc = $doc:literal])+ $name:ident { id, version, reason }) => {
        $(#[doc = $doc])+
        #[derive(InputObject)]
        pub struct $name {
            /// The node's id.
            pub id: ID,
            /// The `version` of the node you read; a node that changed since is `CONFLICT`.
            pub version: i64,
            /// Why, kept with the change's event.
            pub reason: String,
        }

        impl Validate for $name {
            fn validate(&self, at: &Field) -> Checked {
                let $name { id, version, reason } = self;
                node_and_version(at, id, *version)?;
                at.at("reason").text(reason, Text::Reason)
            }
        }
    };
}

node_input!(
    /// What `uncordonNode` needs: the node and the version read.
    UncordonNodeInput { id, version }
);
node_input!(
    /// What `adoptNode` needs: the node and the version read.
    AdoptNodeInput { id, version }
);
node_input!(
    /// What `deleteNode` needs: the node and the version read.
    DeleteNodeInput { id, version }
);
node_input!(
    /// What `retireNode` needs: the node, the version read, and why it is retired.
    RetireNodeInput { id, version, reason }
);
node_input!(
    /// What `revokeNodeIdentity` needs: the node, the version read, and why its identity is
    /// revoked (a stolen key, a re-install).
    RevokeNodeIdentityInput { id, version, reason }
);

/// What `clearNodeCondition` needs: the node, the version read, the condition, and the
/// operator's own reason.
#[derive(InputObject)]
pub struct ClearNodeConditionInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// The type of the `TRUE` condition to clear, e.g. `GpuNeedsReset`.
    #[graphql(name = "type")]
    pub kind: String,
    /// Why you clear it by hand (what you checked or fixed); kept on the condition and in its
    /// event, with you as the actor. Required: a blank reason is refused.
    pub reason: String,
}

/// What `drainNode` needs: the node, the version read, why, and how long to wait.
#[derive(InputObject)]
pub struct DrainNodeInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// Why the node is drained, kept with the cordon and its events.
    pub reason: String,
    /// When `draining` leaves `noScheduleReasons` even if allocations remain.
    pub deadline: Option<Timestamp>,
}

/// What `taintNode` needs: the node, the version read, and the taint.
#[derive(InputObject)]
pub struct TaintNodeInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// The taint's key (`[prefix/]name`); a taint with the same key is replaced.
    pub key: String,
    /// The taint's value; empty by default.
    #[graphql(default)]
    pub value: String,
    /// What the taint does; `NO_SCHEDULE` (keeps new work off the node) by default.
    #[graphql(default_with = "TaintEffect::NoSchedule")]
    pub effect: TaintEffect,
}

/// What `untaintNode` needs: the node, the version read, and the taint's key.
#[derive(InputObject)]
pub struct UntaintNodeInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// The key of the taint to remove.
    pub key: String,
}

/// A key-value pair to set: a node's label or a pool's driver binding.
#[derive(InputObject)]
pub struct LabelInput {
    /// The key, `[prefix/]name` (e.g. `example.com/rack`).
    pub key: String,
    /// The value; may be empty.
    pub value: String,
}

/// What `labelNode` needs: the node, the version read, labels to set and keys to remove.
#[derive(InputObject)]
pub struct LabelNodeInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// Labels to add or overwrite; each key at most once.
    #[graphql(default)]
    pub set: Vec<LabelInput>,
    /// Keys of labels to remove; a key the node does not carry is ignored.
    #[graphql(default)]
    pub remove: Vec<String>,
}

/// What `transitionNode` needs: the node, the version read, and the move.
#[derive(InputObject)]
pub struct TransitionNodeInput {
    /// The node's id.
    pub id: ID,
    /// The `version` of the node you read; a node that changed since is `CONFLICT`.
    pub version: i64,
    /// The move of `provisionStateTable` to make.
    #[graphql(name = "move")]
    pub action: ProvisionMove,
    /// Kept with the event; for `FAIL`, also the maintenance reason.
    pub reason: Option<String>,
}

/// What `enrollNode` needs: the machine's hostname and where it goes.
#[derive(InputObject)]
pub struct EnrollNodeInput {
    /// The machine's hostname.
    pub hostname: String,
    /// The site the machine is in.
    pub site_id: ID,
    /// The pool it joins, which decides its role; omit for an unassigned machine.
    pub pool_id: Option<ID>,
    /// The machine's identifiers as its BMC reports them, at least two kinds (its system
    /// UUID and a MAC, say). The daemon that later boots on the machine and reports them is
    /// recognised as this node instead of joining as a new one.
    #[graphql(default)]
    pub identifiers: Vec<MachineIdentifierInput>,
}

/// One identifier of a machine.
#[derive(InputObject)]
pub struct MachineIdentifierInput {
    /// `system-uuid`, `system-serial`, `board-serial`, `chassis-serial`, `tpm-ek`, or `mac`
    /// (also `mac:<interface>`); a machine's several MACs may each be named `mac`.
    pub name: String,
    /// The identifier as the BMC reports it (normalised the way the daemon's inventory is).
    pub value: String,
}

/// What `createTenant` needs.
#[derive(InputObject)]
pub struct CreateTenantInput {
    /// A unique name for the tenant.
    pub name: String,
}

/// What `createSite` needs.
#[derive(InputObject)]
pub struct CreateSiteInput {
    /// A unique name for the site, e.g. `fra1`.
    pub name: String,
    /// The platform's site or a tenant's own.
    pub kind: SiteKind,
    /// Required for a `CUSTOM` site, refused for a `PLATFORM` one.
    pub owner_tenant_id: Option<ID>,
}

/// What `createPool` needs.
#[derive(InputObject)]
pub struct CreatePoolInput {
    /// The site the pool is in.
    pub site_id: ID,
    /// A name for the pool, unique within its site, e.g. `h100`.
    pub name: String,
    /// What kind of machines it holds, which decides their role.
    pub kind: PoolKind,
    /// Whether its machines run the daemon; `BCD` by default.
    #[graphql(default_with = "PoolAgent::Bcd")]
    pub agent: PoolAgent,
    /// The tenant that owns the pool; on a tenant's site, that tenant (the default there).
    pub owner_tenant_id: Option<ID>,
    /// GPUs each machine should have; a node reporting another count gets
    /// `GpuCountMismatch`.
    pub expected_gpu_count: Option<i32>,
    /// The GPU model each GPU should be (compared as labels spell it, ignoring case); a node
    /// with another gets `GpuModelMismatch`.
    pub expected_gpu_model: Option<String>,
    /// The NVIDIA driver the machines should run: a version (`550.54.15`) or a prefix of whole
    /// parts (`550`); a node running another gets `DriverVersionMismatch`.
    pub expected_driver_version: Option<String>,
    /// Driver bindings (`power`, `boot`, `deploy`, …) the pool's nodes inherit.
    #[graphql(default)]
    pub drivers: Vec<LabelInput>,
    /// The pool's health remediation policy; omit for the defaults (`GpuNeedsReset`:
    /// `gpu.reset` twice 30 s apart, then `node.reboot` once, then give up; `GpuNeedsReboot`:
    /// `node.reboot` twice 120 s apart, then give up; each try verified by `diag.nvml` level 1).
    pub remediation: Option<RemediationPolicyInput>,
    /// The checks acceptance runs on the pool's new nodes; omit for the default (one
    /// `GPU_DIAGNOSTIC` at level 2).
    pub acceptance: Option<AcceptancePolicyInput>,
}

/// What `updatePool` needs: the pool, and what to change (omitted fields stay as they are;
/// an expectation set to `null` is removed).
#[derive(InputObject)]
pub struct UpdatePoolInput {
    /// The pool's id.
    pub id: ID,
    /// A new health remediation policy, replacing the pool's whole policy. Runs under way
    /// keep the ladder they started with.
    pub remediation: Option<RemediationPolicyInput>,
    /// New acceptance checks, replacing the pool's; nodes in acceptance are judged by them
    /// from the next pass.
    pub acceptance: Option<AcceptancePolicyInput>,
    /// GPUs each machine should have (`0`: a CPU pool); `null` removes the expectation. Every
    /// node of the pool is compared again at once.
    pub expected_gpu_count: MaybeUndefined<i32>,
    /// The GPU model each GPU should be; `null` removes the expectation.
    pub expected_gpu_model: MaybeUndefined<String>,
    /// The NVIDIA driver the machines should run (`550.54.15`, or a prefix of whole parts
    /// such as `550`); `null` removes the expectation.
    pub expected_driver_version: MaybeUndefined<String>,
}

/// A pool's acceptance: the checks an `ADOPTING` node must pass, in order, to become
/// `ADOPTED`.
#[derive(InputObject)]
pub struct AcceptancePolicyInput {
    /// The checks, each kind at most once; empty adopts a node once it reported its GPUs.
    pub checks: Vec<AcceptanceCheckInput>,
}

/// One acceptance check.
#[derive(InputObject)]
pub struct AcceptanceCheckInput {
    /// What the check asks.
    pub check: super::types::AcceptanceCheckKind,
    /// For `GPU_DIAGNOSTIC`: the `diag.nvml` level (1 to 3; default 2). None for the others.
    pub level: Option<i32>,
}

impl AcceptancePolicyInput {
    /// The domain's policy (checked by the domain's own `validate` where it is used).
    pub fn policy(&self) -> bc_core::acceptance::AcceptancePolicy {
        use bc_core::acceptance::{AcceptanceCheck, AcceptanceCheckKind, DEFAULT_DIAG_LEVEL};
        bc_core::acceptance::AcceptancePolicy {
            checks: self
                .checks
                .iter()
                .map(|c| {
                    let kind = AcceptanceCheckKind::from(c.check);
                    let level = match (kind, c.level) {
                        (AcceptanceCheckKind::GpuDiagnostic, None) => Some(DEFAULT_DIAG_LEVEL),
                        (_, level) => level.map(|l| u8::try_from(l).unwrap_or(0)),
                    };
                    AcceptanceCheck { kind, level }
                })
                .collect(),
        }
    }
}

/// A pool's health remediation policy.
#[derive(InputObject)]
pub struct RemediationPolicyInput {
    /// Off: the controller leaves the pool's nodes alone (conditions still clear on proof).
    /// On by default.
    #[graphql(default = true)]
    pub enabled: bool,
    /// One ladder per remediated condition; omit for the default ladders.
    pub rules: Option<Vec<RemediationRuleInput>>,
}

/// The ladder for one condition.
#[derive(InputObject)]
pub struct RemediationRuleInput {
    /// The condition to remediate: `GpuNeedsReset` or `GpuNeedsReboot` (a condition that
    /// clears on a proof of commands).
    pub condition: String,
    /// The steps, climbed in order while tries fail (1 to 4).
    pub steps: Vec<RemediationStepInput>,
}

/// One step of a ladder.
#[derive(InputObject)]
pub struct RemediationStepInput {
    /// The action: `GPU_RESET` (for `GpuNeedsReset`) or `NODE_REBOOT` (for either).
    pub action: super::types::CommandKind,
    /// Tries of this step before the next step (1 to 5; default 1).
    #[graphql(default = 1)]
    pub attempts: i32,
    /// Seconds after a failed try of this step before the next try (0 to 86400; default 60).
    #[graphql(default = 60)]
    pub backoff_seconds: i32,
    /// The `diag.nvml` level that verifies each try (1 to 3; default 1).
    #[graphql(default = 1)]
    pub verify_level: i32,
}

impl RemediationPolicyInput {
    /// The domain's policy (checked by the domain's own `validate` where it is used).
    pub fn policy(&self) -> bc_core::remediation::RemediationPolicy {
        let default = bc_core::remediation::RemediationPolicy::default();
        let rules = match &self.rules {
            None => default.rules,
            Some(rules) => rules
                .iter()
                .map(|r| bc_core::remediation::RemediationRule {
                    condition: r.condition.clone(),
                    steps: r
                        .steps
                        .iter()
                        .map(|s| bc_core::remediation::RemediationStep {
                            action: s.action.into(),
                            attempts: u32::try_from(s.attempts).unwrap_or(0),
                            backoff_secs: u32::try_from(s.backoff_seconds).unwrap_or(u32::MAX),
                            verify_level: u8::try_from(s.verify_level).unwrap_or(0),
                        })
                        .collect(),
                })
                .collect(),
        };
        bc_core::remediation::RemediationPolicy {
            enabled: self.enabled,
            rules,
        }
    }
}

/// What `createJoinToken` needs: where joining nodes land and how often the token works.
#[derive(InputObject)]
pub struct CreateJoinTokenInput {
    /// The site joining nodes land in.
    pub site_id: ID,
    /// Nodes joining with this token land in this pool (which decides their role).
    pub pool_id: Option<ID>,
    /// Default 86400 (a day); at most a year.
    pub expires_in_seconds: Option<i64>,
    /// Default 1 (single-use).
    pub max_uses: Option<i64>,
    /// What the token is for, for the admins who see it later.
    #[graphql(default)]
    pub description: String,
}

/// A command for one node or many.
#[derive(InputObject)]
pub struct SendCommandInput {
    /// Target these nodes (at most 10,000)…
    pub node_ids: Option<Vec<ID>>,
    /// …or every node this filter matches (at most 10,000).
    pub filter: Option<NodeFilterInput>,
    /// What the command does.
    pub kind: super::types::CommandKind,
    /// The kind's parameters (for `DIAG_NVML`: `{level: 1..3}`).
    pub params: Option<async_graphql::Json<serde_json::Value>>,
    /// Default: the kind's own (diag.nvml 15 min, node.reboot 20 min, …).
    pub timeout_seconds: Option<i64>,
    /// Not dispatched before this time.
    pub not_before: Option<Timestamp>,
    /// Expires if still queued this long after it could first run (default 3600).
    pub expires_in_seconds: Option<i64>,
    /// Send a destructive command to an uncordoned node (admins only).
    #[graphql(default)]
    pub force: bool,
}

/// What `cancelCommand` needs.
#[derive(InputObject)]
pub struct CancelCommandInput {
    /// The command to cancel (`cmd_…`).
    pub id: ID,
}

/// What `revokeJoinToken` needs.
#[derive(InputObject)]
pub struct RevokeJoinTokenInput {
    /// The token to revoke (`jt_…`).
    pub id: ID,
}

/// Which commands to list.
#[derive(InputObject, Default)]
pub struct CommandFilterInput {
    /// Commands of any of these nodes.
    pub node_id: Option<Vec<ID>>,
    /// Commands in any of these statuses.
    pub status: Option<Vec<super::types::CommandStatus>>,
    /// Commands of any of these kinds.
    pub kind: Option<Vec<super::types::CommandKind>>,
}

type Checked = Result<(), crate::error::ApiError>;

/// A node and the `version` the caller read, the start of every node mutation.
fn node_and_version(at: &Field, id: &ID, version: i64) -> Checked {
    at.at("id").id(id)?;
    at.at("version").int(version, VERSION)
}

impl Validate for LabelSelectorInput {
    fn validate(&self, at: &Field) -> Checked {
        let LabelSelectorInput { key, value } = self;
        at.at("key").text(key, Text::LabelKeyFilter)?;
        at.at("value")
            .text_opt(value.as_deref(), Text::LabelValueFilter)
    }
}

impl Validate for NodeFilterInput {
    fn validate(&self, at: &Field) -> Checked {
        let NodeFilterInput {
            provision_state,
            connectivity,
            maintenance: _,
            cordoned: _,
            role,
            trust,
            site_id,
            pool_id,
            labels,
            reason,
            bucket,
            schedulable: _,
            hostname,
            gateway_id,
        } = self;
        let max = MAX_FILTER_VALUES;
        at.at("provisionState")
            .bounded(provision_state.as_deref(), max)?;
        at.at("connectivity")
            .bounded(connectivity.as_deref(), max)?;
        at.at("role").bounded(role.as_deref(), max)?;
        at.at("trust").bounded(trust.as_deref(), max)?;
        at.at("bucket").bounded(bucket.as_deref(), max)?;
        at.at("siteId")
            .list_opt(site_id.as_deref(), max, Field::id)?;
        at.at("poolId")
            .list_opt(pool_id.as_deref(), max, Field::id)?;
        at.at("labels")
            .list_opt(labels.as_deref(), max, |at, l| at.object(l))?;
        at.at("reason").list_opt(reason.as_deref(), max, |at, r| {
            at.text(r, Text::ReasonFilter)
        })?;
        at.at("hostname")
            .text_opt(hostname.as_deref(), Text::HostnameFilter)?;
        at.at("gatewayId")
            .list_opt(gateway_id.as_deref(), max, |at, g| {
                at.text(g, Text::GatewayId)
            })
    }
}

impl Validate for CordonNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let CordonNodeInput {
            id,
            version,
            reason,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("reason").text(reason, Text::Reason)
    }
}

impl Validate for ClearNodeConditionInput {
    fn validate(&self, at: &Field) -> Checked {
        let ClearNodeConditionInput {
            id,
            version,
            kind,
            reason,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("type").text(kind, Text::ConditionType)?;
        at.at("reason").text(reason, Text::Reason)
    }
}

impl Validate for UpdatePoolInput {
    fn validate(&self, at: &Field) -> Checked {
        let UpdatePoolInput {
            id,
            remediation,
            acceptance,
            expected_gpu_count,
            expected_gpu_model,
            expected_driver_version,
        } = self;
        at.at("id").id(id)?;
        remediation
            .as_ref()
            .map_or(Ok(()), |r| at.at("remediation").object(r))?;
        acceptance
            .as_ref()
            .map_or(Ok(()), |a| at.at("acceptance").object(a))?;
        at.at("expectedGpuCount").int_opt(
            expected_gpu_count.value().copied().map(i64::from),
            EXPECTED_GPU_COUNT,
        )?;
        at.at("expectedGpuModel").text_opt(
            expected_gpu_model.value().map(String::as_str),
            Text::GpuModel,
        )?;
        at.at("expectedDriverVersion").text_opt(
            expected_driver_version.value().map(String::as_str),
            Text::DriverVersion,
        )
    }
}

impl Validate for AcceptancePolicyInput {
    fn validate(&self, at: &Field) -> Checked {
        let AcceptancePolicyInput { checks } = self;
        at.at("checks")
            .list(checks, MAX_ACCEPTANCE_CHECKS, |at, c| at.object(c))
    }
}

impl Validate for AcceptanceCheckInput {
    fn validate(&self, at: &Field) -> Checked {
        let AcceptanceCheckInput { check: _, level } = self;
        at.at("level")
            .int_opt(level.map(i64::from), ACCEPTANCE_DIAG_LEVEL)
    }
}

impl Validate for RemediationPolicyInput {
    fn validate(&self, at: &Field) -> Checked {
        let RemediationPolicyInput { enabled: _, rules } = self;
        at.at("rules")
            .list_opt(rules.as_deref(), MAX_REMEDIATION_RULES, |at, r| {
                at.object(r)
            })
    }
}

impl Validate for RemediationRuleInput {
    fn validate(&self, at: &Field) -> Checked {
        let RemediationRuleInput { condition, steps } = self;
        at.at("condition").text(condition, Text::ConditionType)?;
        at.at("steps")
            .list(steps, bc_core::remediation::MAX_STEPS, |at, s| at.object(s))
    }
}

impl Validate for RemediationStepInput {
    fn validate(&self, at: &Field) -> Checked {
        let RemediationStepInput {
            action: _,
            attempts,
            backoff_seconds,
            verify_level,
        } = self;
        at.at("attempts")
            .int(i64::from(*attempts), REMEDIATION_ATTEMPTS)?;
        at.at("backoffSeconds")
            .int(i64::from(*backoff_seconds), REMEDIATION_BACKOFF_SECONDS)?;
        at.at("verifyLevel")
            .int(i64::from(*verify_level), REMEDIATION_VERIFY_LEVEL)
    }
}

impl Validate for DrainNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let DrainNodeInput {
            id,
            version,
            reason,
            deadline,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("reason").text(reason, Text::Reason)?;
        at.at("deadline").time(deadline.as_ref())
    }
}

impl Validate for TaintNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let TaintNodeInput {
            id,
            version,
            key,
            value,
            effect: _,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("key").text(key, Text::LabelKey)?;
        at.at("value").text(value, Text::LabelValue)
    }
}

impl Validate for UntaintNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let UntaintNodeInput { id, version, key } = self;
        node_and_version(at, id, *version)?;
        at.at("key").text(key, Text::LabelKey)
    }
}

impl Validate for LabelInput {
    fn validate(&self, at: &Field) -> Checked {
        let LabelInput { key, value } = self;
        at.at("key").text(key, Text::LabelKey)?;
        at.at("value").text(value, Text::LabelValue)
    }
}

impl Validate for LabelNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let LabelNodeInput {
            id,
            version,
            set,
            remove,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("set")
            .list(set, MAX_LABELS_PER_CHANGE, |at, l| at.object(l))?;
        at.at("remove")
            .list(remove, MAX_LABELS_PER_CHANGE, |at, k| {
                at.text(k, Text::LabelKey)
            })
    }
}

impl Validate for TransitionNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let TransitionNodeInput {
            id,
            version,
            action: _,
            reason,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("reason").text_opt(reason.as_deref(), Text::Reason)
    }
}

impl Validate for EnrollNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let EnrollNodeInput {
            hostname,
            site_id,
            pool_id,
            identifiers,
        } = self;
        at.at("hostname").text(hostname, Text::Hostname)?;
        at.at("siteId").id(site_id)?;
        pool_id.as_ref().map_or(Ok(()), |p| at.at("poolId").id(p))?;
        at.at("identifiers")
            .list(identifiers, MAX_IDENTIFIERS, |at, i| at.object(i))
    }
}

impl Validate for MachineIdentifierInput {
    fn validate(&self, at: &Field) -> Checked {
        let MachineIdentifierInput { name, value } = self;
        at.at("name").text(name, Text::IdentifierName)?;
        at.at("value").text(value, Text::IdentifierValue)
    }
}

impl Validate for CreateTenantInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreateTenantInput { name } = self;
        at.at("name").text(name, Text::Name)
    }
}

impl Validate for CancelCommandInput {
    fn validate(&self, at: &Field) -> Checked {
        let CancelCommandInput { id } = self;
        at.at("id").id(id)
    }
}

impl Validate for RevokeJoinTokenInput {
    fn validate(&self, at: &Field) -> Checked {
        let RevokeJoinTokenInput { id } = self;
        at.at("id").id(id)
    }
}

impl Validate for CreateSiteInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreateSiteInput {
            name,
            kind: _,
            owner_tenant_id,
        } = self;
        at.at("name").text(name, Text::Name)?;
        owner_tenant_id
            .as_ref()
            .map_or(Ok(()), |t| at.at("ownerTenantId").id(t))
    }
}

impl Validate for CreatePoolInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreatePoolInput {
            site_id,
            name,
            kind: _,
            agent: _,
            owner_tenant_id,
            expected_gpu_count,
            expected_gpu_model,
            expected_driver_version,
            drivers,
            remediation,
            acceptance,
        } = self;
        remediation
            .as_ref()
            .map_or(Ok(()), |r| at.at("remediation").object(r))?;
        acceptance
            .as_ref()
            .map_or(Ok(()), |a| at.at("acceptance").object(a))?;
        at.at("expectedDriverVersion")
            .text_opt(expected_driver_version.as_deref(), Text::DriverVersion)?;
        at.at("siteId").id(site_id)?;
        at.at("name").text(name, Text::Name)?;
        owner_tenant_id
            .as_ref()
            .map_or(Ok(()), |t| at.at("ownerTenantId").id(t))?;
        at.at("expectedGpuCount")
            .int_opt(expected_gpu_count.map(i64::from), EXPECTED_GPU_COUNT)?;
        at.at("expectedGpuModel")
            .text_opt(expected_gpu_model.as_deref(), Text::GpuModel)?;
        at.at("drivers")
            .list(drivers, MAX_DRIVERS, |at, d| at.object(d))
    }
}

impl Validate for CreateJoinTokenInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreateJoinTokenInput {
            site_id,
            pool_id,
            expires_in_seconds,
            max_uses,
            description,
        } = self;
        at.at("siteId").id(site_id)?;
        pool_id.as_ref().map_or(Ok(()), |p| at.at("poolId").id(p))?;
        at.at("expiresInSeconds")
            .int_opt(*expires_in_seconds, JOIN_TOKEN_LIFETIME_SECONDS)?;
        at.at("maxUses").int_opt(*max_uses, JOIN_TOKEN_USES)?;
        at.at("description").text(description, Text::Description)
    }
}

impl Validate for SendCommandInput {
    fn validate(&self, at: &Field) -> Checked {
        let SendCommandInput {
            node_ids,
            filter,
            kind: _,
            params,
            timeout_seconds,
            not_before,
            expires_in_seconds,
            force: _,
        } = self;
        at.at("nodeIds")
            .list_opt(node_ids.as_deref(), MAX_COMMAND_NODE_IDS, Field::id)?;
        filter
            .as_ref()
            .map_or(Ok(()), |f| at.at("filter").object(f))?;
        params
            .as_ref()
            .map_or(Ok(()), |p| at.at("params").json(&p.0))?;
        at.at("timeoutSeconds")
            .int_opt(*timeout_seconds, COMMAND_TIMEOUT_SECONDS)?;
        at.at("notBefore").time(not_before.as_ref())?;
        at.at("expiresInSeconds")
            .int_opt(*expires_in_seconds, COMMAND_TTL_SECONDS)
    }
}

impl Validate for CommandFilterInput {
    fn validate(&self, at: &Field) -> Checked {
        let CommandFilterInput {
            node_id,
            status,
            kind,
        } = self;
        at.at("nodeId")
            .list_opt(node_id.as_deref(), MAX_FILTER_VALUES, Field::id)?;
        at.at("status")
            .bounded(status.as_deref(), MAX_FILTER_VALUES)?;
        at.at("kind").bounded(kind.as_deref(), MAX_FILTER_VALUES)
    }
}

/// Which events of the log to list or follow. Every field narrows (all must hold); an empty
/// or absent list matches everything.
#[derive(InputObject, Default)]
pub struct EventFilterInput {
    /// Only events about any of these nodes (`node_…`).
    pub node_ids: Option<Vec<ID>>,
    /// Only events of any of these types.
    pub types: Option<Vec<super::types::EventType>>,
    /// Only events by any of these actors, spelled as `Event.actor` is: `user:<subject>`,
    /// `controller:<name>`, `node:<id>` or `system`.
    pub actors: Option<Vec<String>>,
    /// Only events at or after this time.
    pub since: Option<Timestamp>,
    /// Only events before this time (not at it); at or after `since`.
    pub until: Option<Timestamp>,
}

impl Validate for EventFilterInput {
    fn validate(&self, at: &Field) -> Checked {
        let EventFilterInput {
            node_ids,
            types,
            actors,
            since,
            until,
        } = self;
        at.at("nodeIds")
            .list_opt(node_ids.as_deref(), MAX_FILTER_VALUES, Field::id)?;
        at.at("types")
            .bounded(types.as_deref(), super::input_limits::MAX_EVENT_TYPES)?;
        at.at("actors")
            .list_opt(actors.as_deref(), MAX_FILTER_VALUES, |at, a| {
                at.text(a, Text::Actor)?;
                bc_core::Actor::parse(a).map(|_| ()).ok_or_else(|| {
                    at.refuse("is not an actor (`user:<subject>`, `controller:<name>`, `node:<id>` or `system`)")
                })
            })?;
        at.at("since").time(since.as_ref())?;
        at.at("until").time(until.as_ref())
    }
}
