//! Acceptance per pool: which checks the NodeLifecycle controller runs on an `adopting` node
//! before it becomes `adopted` ([`AcceptancePolicy`], set with `createPool` and `updatePool`),
//! and [`decide`], the pure decision for one node at one tick.
//!
//! # The rules
//!
//! - Acceptance looks at a node once it reported its `gpus` section (the Inventory controller
//!   has then compared it with the pool's hardware profile).
//! - A node that reports no GPUs in a pool that expects them
//!   ([`HardwareProfile::expects_gpus`]: every pool whose expected GPU count is not 0) fails
//!   at once, with that as its reason: a GPU machine whose driver did not load reports no GPUs,
//!   and nothing would ever change that while it waits.
//! - In a CPU pool (expected GPU count 0), checks that need GPUs are skipped on a machine
//!   without GPUs; the others run as for any node.
//! - The checks run in the pool's order; the first that fails fails the node (`failed`,
//!   `failedFrom: adopting`, maintenance on, the reason naming the check). When all pass (or
//!   the pool lists none), the node is adopted.
//! - A check that could not run to its end (timed out, expired, cancelled) fails like a
//!   failing one: acceptance never passes what it could not check.
//!
//! # The checks
//!
//! | check | what it asks | needs GPUs |
//! | --- | --- | --- |
//! | `hardware-profile` | none of `GpuCountMismatch`, `GpuModelMismatch`, `DriverVersionMismatch` is `true` | no |
//! | `gpu-diagnostic` (level 1–3) | a `diag.nvml` at that level passes | yes |
//!
//! The default is one `gpu-diagnostic` at level 2 (memory and PCIe, minutes not hours):
//! what acceptance always ran. A node whose hardware does not match its pool is still
//! adopted by default, and kept off work by the mismatch conditions (NoSchedule) until a
//! report or the pool's expectations agree; `hardware-profile` fails it instead.

use serde::{Deserialize, Serialize};

use crate::axes::{ConditionStatus, axis_enum};
use crate::catalog::HardwareProfile;
use crate::clear::{self, DRIVER_VERSION_MISMATCH, GPU_COUNT_MISMATCH, GPU_MODEL_MISMATCH};
use crate::command::{Command, CommandStatus};
use crate::error::DomainError;
use crate::event::EventType;
use crate::node::NodeRecord;

/// The `diag.nvml` level acceptance runs unless the pool says otherwise.
pub const DEFAULT_DIAG_LEVEL: u8 = 2;
/// The deepest `diag.nvml` level (DCGM's `-r 3`, about half an hour on an 8-GPU machine).
pub const MAX_DIAG_LEVEL: u8 = 3;

/// The conditions the `hardware-profile` check reads: the inventory's comparisons with the
/// pool's expectations.
pub const HARDWARE_MISMATCHES: &[&str] = &[
    GPU_COUNT_MISMATCH,
    GPU_MODEL_MISMATCH,
    DRIVER_VERSION_MISMATCH,
];

axis_enum!(
    /// What an acceptance check asks.
    AcceptanceCheckKind {
        /// The inventory matches the pool's hardware profile.
        HardwareProfile = "hardware-profile",
        /// A `diag.nvml` at the check's level passes.
        GpuDiagnostic = "gpu-diagnostic",
    }
);

impl AcceptanceCheckKind {
    /// Whether the check can only run on a machine with GPUs.
    pub fn needs_gpus(self) -> bool {
        matches!(self, AcceptanceCheckKind::GpuDiagnostic)
    }
}

/// One check of a pool's acceptance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AcceptanceCheck {
    pub kind: AcceptanceCheckKind,
    /// For `gpu-diagnostic`: the `diag.nvml` level (1 to [`MAX_DIAG_LEVEL`]); none otherwise.
    #[serde(default)]
    pub level: Option<u8>,
}

impl AcceptanceCheck {
    /// "diag.nvml level 2 passes", "the hardware matches the pool".
    pub fn describe(&self) -> String {
        match self.kind {
            AcceptanceCheckKind::HardwareProfile => {
                "the hardware matches the pool's profile".to_owned()
            }
            AcceptanceCheckKind::GpuDiagnostic => {
                format!(
                    "diag.nvml level {} passes",
                    self.level.unwrap_or(DEFAULT_DIAG_LEVEL)
                )
            }
        }
    }
}

/// Which checks acceptance runs on a pool's new nodes, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AcceptancePolicy {
    pub checks: Vec<AcceptanceCheck>,
}

impl Default for AcceptancePolicy {
    fn default() -> Self {
        AcceptancePolicy {
            checks: vec![AcceptanceCheck {
                kind: AcceptanceCheckKind::GpuDiagnostic,
                level: Some(DEFAULT_DIAG_LEVEL),
            }],
        }
    }
}

impl AcceptancePolicy {
    /// Each check at most once; a level exactly where the check has one, within range.
    pub fn validate(&self) -> Result<(), DomainError> {
        for (i, check) in self.checks.iter().enumerate() {
            if self.checks[..i].iter().any(|c| c.kind == check.kind) {
                return Err(DomainError::BadInput(format!(
                    "acceptance lists the check `{}` twice",
                    check.kind
                )));
            }
            match (check.kind, check.level) {
                (AcceptanceCheckKind::GpuDiagnostic, Some(level))
                    if (1..=MAX_DIAG_LEVEL).contains(&level) => {}
                (AcceptanceCheckKind::GpuDiagnostic, level) => {
                    return Err(DomainError::BadInput(format!(
                        "the acceptance check `gpu-diagnostic` needs a level from 1 to \
                         {MAX_DIAG_LEVEL}, not {}",
                        level.map_or("none".to_owned(), |l| l.to_string())
                    )));
                }
                (AcceptanceCheckKind::HardwareProfile, None) => {}
                (AcceptanceCheckKind::HardwareProfile, Some(_)) => {
                    return Err(DomainError::BadInput(
                        "the acceptance check `hardware-profile` takes no level".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The `diag.nvml` level the policy asks for, if it runs one.
    pub fn diagnostic_level(&self) -> Option<u8> {
        self.checks
            .iter()
            .find(|c| c.kind == AcceptanceCheckKind::GpuDiagnostic)
            .map(|c| c.level.unwrap_or(DEFAULT_DIAG_LEVEL))
    }
}

/// What acceptance does with a node now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcceptanceStep {
    /// Queue a `diag.nvml` at this level (none of this life is usable).
    QueueDiagnostic { level: u8 },
    /// A check is still running.
    Wait,
    /// Every check passed: adopt, with this reason.
    Adopt(String),
    /// A check failed: fail the node, with this reason.
    Fail(String),
}

/// What acceptance does with `node` (an `adopting` node that reported its `gpus` section),
/// given its pool's policy and profile and the newest `diag.nvml` acceptance queued for it
/// since its last provision move (older ones judged a previous life).
pub fn decide(
    policy: &AcceptancePolicy,
    profile: &HardwareProfile,
    node: &NodeRecord,
    diagnostic: Option<&Command>,
) -> AcceptanceStep {
    let no_gpus = node.gpu_count == 0;
    if no_gpus && profile.expects_gpus() {
        let expected = match (profile.gpu_count, &profile.gpu_model) {
            (Some(count), Some(model)) => format!("{count} {model} GPUs"),
            (Some(count), None) => format!("{count} GPUs"),
            (None, Some(model)) => format!("{model} GPUs"),
            (None, None) => "GPUs".to_owned(),
        };
        return AcceptanceStep::Fail(format!(
            "acceptance failed: the machine reports no GPUs and its pool expects {expected} \
             (a CPU pool expects 0 GPUs)"
        ));
    }
    let mut passed = Vec::new();
    for check in &policy.checks {
        if no_gpus && check.kind.needs_gpus() {
            continue;
        }
        match check.kind {
            AcceptanceCheckKind::HardwareProfile => {
                let mismatches: Vec<String> = node
                    .conditions
                    .iter()
                    .filter(|c| {
                        HARDWARE_MISMATCHES.contains(&c.kind.as_str())
                            && c.status == ConditionStatus::True
                    })
                    .map(|c| format!("{}: {}", c.kind, c.message))
                    .collect();
                if !mismatches.is_empty() {
                    return AcceptanceStep::Fail(format!(
                        "acceptance failed: the hardware does not match the pool ({})",
                        mismatches.join("; ")
                    ));
                }
            }
            AcceptanceCheckKind::GpuDiagnostic => {
                let level = check.level.unwrap_or(DEFAULT_DIAG_LEVEL);
                let Some(command) = diagnostic else {
                    return AcceptanceStep::QueueDiagnostic { level };
                };
                if !command.status.is_final() {
                    return AcceptanceStep::Wait;
                }
                // A diagnostic shallower than the pool asks for now (its policy changed
                // after it was queued) proves too little: a new one runs at the level asked.
                if clear::diag_level(command) < u64::from(level) {
                    return AcceptanceStep::QueueDiagnostic { level };
                }
                if !clear::diag_passed(command) {
                    return AcceptanceStep::Fail(diagnostic_failure(command));
                }
            }
        }
        passed.push(check.describe());
    }
    AcceptanceStep::Adopt(if passed.is_empty() {
        "acceptance passed: the pool runs no check on this machine".to_owned()
    } else {
        format!("acceptance passed: {}", passed.join(", "))
    })
}

/// Whether an event may give acceptance or the first spec something to do now, so that the
/// controller loop runs their pass soon after it instead of at its next tick: the node's
/// inventory arrived (its GPU count, inventory labels or conditions changed), it connected, a
/// command ended (any command: a check's verdict among them), its provision state moved (`adopted`
/// wants its first spec, a recovered node is `adopting` again), or its pool's acceptance
/// policy changed (`pool.updated`). No other event can move a node through acceptance.
pub fn may_advance(event_type: EventType) -> bool {
    matches!(
        event_type,
        EventType::PoolUpdated
            | EventType::NodeGpuCountChanged
            | EventType::NodeInventoryLabelsChanged
            | EventType::NodeConditionChanged
            | EventType::NodeConnectivityChanged
            | EventType::NodeProvisionStateChanged
            | EventType::NodeRejoined
            | EventType::CommandSucceeded
            | EventType::CommandFailed
            | EventType::CommandTimedOut
            | EventType::CommandCancelled
            | EventType::CommandExpired
    )
}

/// Why a finished diagnostic fails acceptance, in a line.
fn diagnostic_failure(command: &Command) -> String {
    match (&command.error, &command.result, command.status) {
        (Some(error), _, status) => format!("acceptance {status}: {error}"),
        (None, Some(result), CommandStatus::Succeeded | CommandStatus::Failed) => {
            format!("acceptance failed: {}", summarise(result))
        }
        (None, _, status) => format!("acceptance {status}"),
    }
}

/// The failures of a diagnostic result, in a line.
fn summarise(result: &serde_json::Value) -> String {
    match result.get("failures").and_then(serde_json::Value::as_array) {
        Some(failures) if !failures.is_empty() => failures
            .iter()
            .map(|f| {
                f.get("message")
                    .and_then(serde_json::Value::as_str)
                    .map_or_else(|| f.to_string(), str::to_owned)
            })
            .collect::<Vec<_>>()
            .join("; "),
        _ => "the diagnostic did not pass".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::Actor;
    use crate::command::{CommandKind, Lane};
    use crate::ids::{CommandId, NodeId};
    use chrono::Utc;
    use serde_json::json;

    fn node(gpus: i32) -> NodeRecord {
        let mut n = crate::node::tests::node(crate::axes::ProvisionState::Adopting);
        n.gpu_count = gpus;
        n
    }

    fn diag(level: u64, status: CommandStatus, passed: bool) -> Command {
        let now = Utc::now();
        Command {
            id: CommandId::generate(),
            node_id: NodeId::generate(),
            tenant_id: None,
            kind: CommandKind::DiagNvml,
            lane: Lane::Gpu,
            params: json!({ "level": level }),
            status,
            force: false,
            not_before: now,
            timeout: chrono::Duration::minutes(15),
            expires_at: now,
            attempts: 1,
            session_epoch: Some(1),
            exit_code: Some(i32::from(!passed)),
            output: String::new(),
            result: status.is_final().then(|| {
                json!({ "passed": passed, "failures": if passed { json!([]) } else { json!([{"message": "GPU 3: memory test failed"}]) } })
            }),
            error: None,
            created_by: Actor::Controller("node-lifecycle".into()),
            created_at: now,
            dispatched_at: Some(now),
            started_at: Some(now),
            finished_at: status.is_final().then_some(now),
            updated_at: now,
        }
    }

    fn gpu_pool() -> HardwareProfile {
        HardwareProfile {
            gpu_count: Some(8),
            gpu_model: Some("NVIDIA H100 80GB HBM3".into()),
            driver_version: None,
        }
    }

    fn cpu_pool() -> HardwareProfile {
        HardwareProfile {
            gpu_count: Some(0),
            ..HardwareProfile::default()
        }
    }

    #[test]
    fn the_default_runs_a_level_2_diagnostic_and_adopts_on_a_pass() {
        let policy = AcceptancePolicy::default();
        let n = node(8);
        assert_eq!(
            decide(&policy, &gpu_pool(), &n, None),
            AcceptanceStep::QueueDiagnostic { level: 2 }
        );
        let running = diag(2, CommandStatus::Running, false);
        assert_eq!(
            decide(&policy, &gpu_pool(), &n, Some(&running)),
            AcceptanceStep::Wait
        );
        let passed = diag(2, CommandStatus::Succeeded, true);
        assert_eq!(
            decide(&policy, &gpu_pool(), &n, Some(&passed)),
            AcceptanceStep::Adopt("acceptance passed: diag.nvml level 2 passes".into())
        );
        let failed = diag(2, CommandStatus::Failed, false);
        assert_eq!(
            decide(&policy, &gpu_pool(), &n, Some(&failed)),
            AcceptanceStep::Fail("acceptance failed: GPU 3: memory test failed".into())
        );
        let mut timed_out = diag(2, CommandStatus::TimedOut, false);
        timed_out.error = Some("no result within 900 s".into());
        assert_eq!(
            decide(&policy, &gpu_pool(), &n, Some(&timed_out)),
            AcceptanceStep::Fail("acceptance timed_out: no result within 900 s".into())
        );
    }

    #[test]
    fn the_pool_chooses_the_level_and_a_shallower_pass_proves_too_little() {
        let policy = AcceptancePolicy {
            checks: vec![AcceptanceCheck {
                kind: AcceptanceCheckKind::GpuDiagnostic,
                level: Some(3),
            }],
        };
        let n = node(8);
        let shallow = diag(2, CommandStatus::Succeeded, true);
        assert_eq!(
            decide(&policy, &gpu_pool(), &n, Some(&shallow)),
            AcceptanceStep::QueueDiagnostic { level: 3 }
        );
        let deep = diag(3, CommandStatus::Succeeded, true);
        assert!(matches!(
            decide(&policy, &gpu_pool(), &n, Some(&deep)),
            AcceptanceStep::Adopt(_)
        ));
    }

    #[test]
    fn no_gpus_fails_in_a_gpu_pool_and_passes_in_a_cpu_pool() {
        let policy = AcceptancePolicy::default();
        let n = node(0);
        let AcceptanceStep::Fail(why) = decide(&policy, &gpu_pool(), &n, None) else {
            panic!("a GPU pool fails a machine without GPUs");
        };
        assert!(why.contains("reports no GPUs"), "{why}");
        assert!(why.contains("8 NVIDIA H100 80GB HBM3 GPUs"), "{why}");
        // A pool that says nothing about GPUs is a GPU pool.
        assert!(matches!(
            decide(&policy, &HardwareProfile::default(), &n, None),
            AcceptanceStep::Fail(_)
        ));
        assert_eq!(
            decide(&policy, &cpu_pool(), &n, None),
            AcceptanceStep::Adopt(
                "acceptance passed: the pool runs no check on this machine".into()
            )
        );
        // A CPU pool's checks that need no GPUs still run.
        let strict = AcceptancePolicy {
            checks: vec![
                AcceptanceCheck {
                    kind: AcceptanceCheckKind::HardwareProfile,
                    level: None,
                },
                AcceptanceCheck {
                    kind: AcceptanceCheckKind::GpuDiagnostic,
                    level: Some(1),
                },
            ],
        };
        assert_eq!(
            decide(&strict, &cpu_pool(), &n, None),
            AcceptanceStep::Adopt(
                "acceptance passed: the hardware matches the pool's profile".into()
            )
        );
    }

    #[test]
    fn the_hardware_profile_check_fails_on_a_mismatch_before_any_diagnostic() {
        let policy = AcceptancePolicy {
            checks: vec![
                AcceptanceCheck {
                    kind: AcceptanceCheckKind::HardwareProfile,
                    level: None,
                },
                AcceptanceCheck {
                    kind: AcceptanceCheckKind::GpuDiagnostic,
                    level: Some(1),
                },
            ],
        };
        let mut n = node(8);
        assert_eq!(
            decide(&policy, &gpu_pool(), &n, None),
            AcceptanceStep::QueueDiagnostic { level: 1 }
        );
        n.set_condition(
            DRIVER_VERSION_MISMATCH,
            ConditionStatus::True,
            "Expected535Got550.54.15",
            "the pool expects NVIDIA driver 535; this machine runs 550.54.15",
            true,
            &Actor::Controller("inventory".into()),
            Utc::now(),
        )
        .expect("a condition");
        let AcceptanceStep::Fail(why) = decide(&policy, &gpu_pool(), &n, None) else {
            panic!("a mismatch fails");
        };
        assert!(why.contains("DriverVersionMismatch"), "{why}");
        // Without the check, the mismatch does not stop acceptance (it keeps work off).
        assert_eq!(
            decide(&AcceptancePolicy::default(), &gpu_pool(), &n, None),
            AcceptanceStep::QueueDiagnostic { level: 2 }
        );
    }

    #[test]
    fn an_empty_policy_adopts_and_bad_policies_are_refused() {
        let none = AcceptancePolicy { checks: vec![] };
        assert!(none.validate().is_ok());
        assert!(matches!(
            decide(&none, &gpu_pool(), &node(8), None),
            AcceptanceStep::Adopt(_)
        ));
        let check = |kind, level| AcceptanceCheck { kind, level };
        for bad in [
            vec![check(AcceptanceCheckKind::GpuDiagnostic, None)],
            vec![check(AcceptanceCheckKind::GpuDiagnostic, Some(4))],
            vec![check(AcceptanceCheckKind::GpuDiagnostic, Some(0))],
            vec![check(AcceptanceCheckKind::HardwareProfile, Some(1))],
            vec![
                check(AcceptanceCheckKind::GpuDiagnostic, Some(1)),
                check(AcceptanceCheckKind::GpuDiagnostic, Some(2)),
            ],
        ] {
            assert!(
                AcceptancePolicy {
                    checks: bad.clone()
                }
                .validate()
                .is_err(),
                "{bad:?}"
            );
        }
        assert!(AcceptancePolicy::default().validate().is_ok());
        assert_eq!(AcceptancePolicy::default().diagnostic_level(), Some(2));
    }

    #[test]
    fn only_events_that_may_move_a_node_through_acceptance_wake_its_pass() {
        // A node's way through acceptance: it connects, reports its inventory, its check
        // ends, it is adopted.
        for wakes in [
            EventType::NodeConnectivityChanged,
            EventType::NodeGpuCountChanged,
            EventType::NodeInventoryLabelsChanged,
            EventType::CommandSucceeded,
            EventType::CommandTimedOut,
            EventType::NodeProvisionStateChanged,
            EventType::PoolUpdated,
        ] {
            assert!(may_advance(wakes), "{wakes}");
        }
        // A check under way, an operator's cordon, taint or label, a booking, or the first spec
        // (written by the pass itself) decide nothing.
        for quiet in [
            EventType::CommandQueued,
            EventType::CommandDispatched,
            EventType::CommandRunning,
            EventType::NodeCordoned,
            EventType::NodeTainted,
            EventType::NodeLabelSet,
            EventType::AllocationBooked,
            EventType::NodeSpecGeneration,
        ] {
            assert!(!may_advance(quiet), "{quiet}");
        }
    }
}
