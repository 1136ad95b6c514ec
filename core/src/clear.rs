//! What clears a condition or a `noScheduleReasons` entry: a [`ClearRule`], declared once per
//! condition type ([`ClearRule::for_condition`]) and reason key ([`ClearRule::for_reason`]),
//! and the progress of a condition's proof ([`Proof`]).
//!
//! Some conditions clear when their evidence is gone (`GpuCountMismatch`: the next `gpus`
//! report with the right count). Others clear only on proof: a GPU that needed a reset is
//! trusted again only after a reset (or a reboot) **succeeded** on the node and a diagnostic
//! run **after it** passed, both after the condition was raised; a report that merely lacks
//! the XID records that the evidence is gone, nothing more. `GpuNeedsPerson` clears only by
//! hand. Any condition may be cleared by hand by an operator who gives a reason of their own
//! (`clearNodeCondition`), and the event says so.
//!
//! The proof's rules, applied by [`observe`] to every command that ends on the node:
//! - steps are satisfied in order; a command counts for the step awaited only if it was
//!   dispatched at or after the moment the previous step was satisfied (for the first step:
//!   when the condition was raised or its proof last restarted);
//! - a verification that fails (a `diag.nvml` that does not pass, a step's command that fails
//!   or times out) once a step is satisfied restarts the proof: everything must be done again;
//! - a report that shows the evidence again, after a step was satisfied or after the evidence
//!   was gone, restarts the proof too ([`evidence_seen`]): the fix did not hold.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::axes::axis_enum;
use crate::command::{Command, CommandKind, CommandStatus};
use crate::ids::CommandId;
use crate::reason::ReasonKey;

/// The condition a GPU reset (or a reboot, which resets too) recovers from.
pub const GPU_NEEDS_RESET: &str = "GpuNeedsReset";
/// The condition only a reboot recovers from.
pub const GPU_NEEDS_REBOOT: &str = "GpuNeedsReboot";
/// The condition a person must resolve (replace the GPU); also what remediation that gives
/// up sets.
pub const GPU_NEEDS_PERSON: &str = "GpuNeedsPerson";
/// The condition of a machine reporting another number of GPUs than its pool expects.
pub const GPU_COUNT_MISMATCH: &str = "GpuCountMismatch";
/// The condition of a machine whose GPUs are not the model its pool expects.
pub const GPU_MODEL_MISMATCH: &str = "GpuModelMismatch";
/// The condition of a machine running another NVIDIA driver than its pool expects.
pub const DRIVER_VERSION_MISMATCH: &str = "DriverVersionMismatch";
/// The lowest `diag.nvml` level that verifies a fix.
pub const VERIFY_DIAG_LEVEL: u8 = 1;

axis_enum!(
    /// The kind of a clear rule.
    ClearRuleKind {
        /// The next report without the evidence clears it.
        EvidenceGone = "evidence-gone",
        /// Commands that succeed on the node, in order, after the condition was raised.
        Commands = "commands",
        /// Only an operator, by hand, with a reason.
        Operator = "operator",
        /// An operator removes the taint.
        Untaint = "untaint",
        /// `uncordonNode`, or the drain ending.
        DrainEnds = "drain-ends",
        /// The daemon reconnects and heartbeats arrive.
        Heartbeats = "heartbeats",
    }
);

/// One step of a proof: a command of one of `kinds` that succeeds; for `diag.nvml`, one at
/// `min_level` or deeper whose result says it passed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProofStep {
    pub kinds: Vec<CommandKind>,
    /// For `diag.nvml`: the lowest level that counts.
    pub min_level: Option<u8>,
}

/// What an ended command says about a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It proves the step.
    Passed,
    /// It ran and failed (why).
    Failed(String),
    /// It says nothing (cancelled, expired, not yet ended, or a diagnostic too shallow).
    Inconclusive,
}

impl ProofStep {
    /// A command of one of `kinds` that succeeds.
    pub fn succeeds(kinds: &[CommandKind]) -> ProofStep {
        ProofStep {
            kinds: kinds.to_vec(),
            min_level: None,
        }
    }

    /// A `diag.nvml` at `level` or deeper that passes.
    pub fn diagnostic(level: u8) -> ProofStep {
        ProofStep {
            kinds: vec![CommandKind::DiagNvml],
            min_level: Some(level),
        }
    }

    /// "gpu.reset or node.reboot succeeds", "diag.nvml level 1 (or deeper) passes".
    pub fn describe(&self) -> String {
        let kinds = self
            .kinds
            .iter()
            .map(|k| k.as_static_str())
            .collect::<Vec<_>>()
            .join(" or ");
        match self.min_level {
            Some(level) => format!("{kinds} level {level} (or deeper) passes"),
            None => format!("{kinds} succeeds"),
        }
    }

    /// What `command` says about this step (a command of another kind says nothing).
    pub fn verdict(&self, command: &Command) -> Verdict {
        if !self.kinds.contains(&command.kind) || !command.status.is_final() {
            return Verdict::Inconclusive;
        }
        let failed = |what: &str| {
            let error = command
                .error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}"));
            Verdict::Failed(format!("{} {} {what}{error}", command.kind, command.id))
        };
        match command.status {
            CommandStatus::Succeeded => match self.min_level {
                None => Verdict::Passed,
                Some(min) if diag_level(command) < u64::from(min) => Verdict::Inconclusive,
                Some(_) if diag_passed(command) => Verdict::Passed,
                Some(_) => failed("did not pass"),
            },
            CommandStatus::Failed => failed("failed"),
            CommandStatus::TimedOut => failed("timed out"),
            _ => Verdict::Inconclusive,
        }
    }
}

/// The level a `diag.nvml` ran at (1 when it says none).
pub fn diag_level(command: &Command) -> u64 {
    command
        .params
        .get("level")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(1)
}

/// Whether a `diag.nvml` succeeded and its result says it passed (what acceptance requires).
pub fn diag_passed(command: &Command) -> bool {
    command.kind == CommandKind::DiagNvml
        && command.status == CommandStatus::Succeeded
        && command
            .result
            .as_ref()
            .and_then(|r| r.get("passed"))
            .and_then(serde_json::Value::as_bool)
            == Some(true)
}

/// What clears a condition or a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClearRule {
    /// The next report without the evidence clears it; `report` names the report.
    EvidenceGone { report: &'static str },
    /// These steps, in order, on the node, after the condition was raised.
    Commands(Vec<ProofStep>),
    /// Only an operator, by hand, with a reason of their own.
    Operator,
    /// An operator removes the taint with this key.
    Untaint(String),
    /// `uncordonNode`, or the drain ending.
    DrainEnds,
    /// The daemon reconnects and heartbeats arrive.
    Heartbeats,
}

impl ClearRule {
    /// The rule of a condition type: the one table of what clears what (health.rs's table
    /// says the same in words).
    pub fn for_condition(kind: &str) -> ClearRule {
        match kind {
            GPU_NEEDS_RESET => ClearRule::Commands(vec![
                // A reboot reloads the driver too, so it proves a reset as well.
                ProofStep::succeeds(&[CommandKind::GpuReset, CommandKind::NodeReboot]),
                ProofStep::diagnostic(VERIFY_DIAG_LEVEL),
            ]),
            GPU_NEEDS_REBOOT => ClearRule::Commands(vec![
                ProofStep::succeeds(&[CommandKind::NodeReboot]),
                ProofStep::diagnostic(VERIFY_DIAG_LEVEL),
            ]),
            GPU_NEEDS_PERSON => ClearRule::Operator,
            GPU_COUNT_MISMATCH | GPU_MODEL_MISMATCH => ClearRule::EvidenceGone { report: "gpus" },
            DRIVER_VERSION_MISMATCH => ClearRule::EvidenceGone {
                report: "gpus or drivers",
            },
            _ => ClearRule::EvidenceGone {
                report: "inventory or health",
            },
        }
    }

    /// The rule of a `noScheduleReasons` key.
    pub fn for_reason(key: &ReasonKey) -> ClearRule {
        match key {
            ReasonKey::Taint(key) => ClearRule::Untaint(key.clone()),
            ReasonKey::Draining => ClearRule::DrainEnds,
            ReasonKey::Unreachable => ClearRule::Heartbeats,
            ReasonKey::Condition(kind) => ClearRule::for_condition(kind),
        }
    }

    pub fn kind(&self) -> ClearRuleKind {
        match self {
            ClearRule::EvidenceGone { .. } => ClearRuleKind::EvidenceGone,
            ClearRule::Commands(_) => ClearRuleKind::Commands,
            ClearRule::Operator => ClearRuleKind::Operator,
            ClearRule::Untaint(_) => ClearRuleKind::Untaint,
            ClearRule::DrainEnds => ClearRuleKind::DrainEnds,
            ClearRule::Heartbeats => ClearRuleKind::Heartbeats,
        }
    }

    /// The steps of a proof (empty for the other rules).
    pub fn steps(&self) -> &[ProofStep] {
        match self {
            ClearRule::Commands(steps) => steps,
            _ => &[],
        }
    }

    /// Whether a report without the evidence clears it (otherwise it only records that the
    /// evidence is gone).
    pub fn clears_with_evidence(&self) -> bool {
        matches!(self, ClearRule::EvidenceGone { .. })
    }

    /// Whether an operator may clear it by hand (`clearNodeCondition`): every condition may;
    /// taints, drains and connectivity have their own mutations and owners.
    pub fn by_hand(&self) -> bool {
        matches!(
            self,
            ClearRule::EvidenceGone { .. } | ClearRule::Commands(_) | ClearRule::Operator
        )
    }

    /// The rule in a sentence: "clears when gpu.reset succeeds and then …".
    pub fn describe(&self) -> String {
        const BY_HAND: &str =
            "or by hand: an operator clears it with a reason (clearNodeCondition)";
        match self {
            ClearRule::EvidenceGone { report } => format!(
                "clears when a fresh {report} report no longer shows the evidence, {BY_HAND}"
            ),
            ClearRule::Commands(steps) => {
                let steps: Vec<String> = steps.iter().map(ProofStep::describe).collect();
                format!(
                    "clears when {}, each after the one before and after the condition was raised \
                     (a report without the evidence alone does not clear it), {BY_HAND}",
                    steps.join(" and then ")
                )
            }
            ClearRule::Operator => "clears only by hand: an operator who fixed the machine \
                                    (replaced the GPU) clears it with a reason (clearNodeCondition)"
                .to_owned(),
            ClearRule::Untaint(key) => {
                format!("clears when an operator removes the taint `{key}` (untaintNode)")
            }
            ClearRule::DrainEnds => "clears when the node is uncordoned (uncordonNode) or its \
                                     drain ends: its allocations released or the drain deadline passing"
                .to_owned(),
            ClearRule::Heartbeats => {
                "clears when the node's daemon reconnects to a gateway and sends heartbeats"
                    .to_owned()
            }
        }
    }
}

/// A step of a proof that is satisfied: by which command, when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SatisfiedStep {
    pub command_id: CommandId,
    pub kind: CommandKind,
    pub at: DateTime<Utc>,
}

/// The progress of a `true` condition towards being cleared, kept on the condition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Proof {
    /// Since when commands count: when the condition was raised, or the proof last restarted.
    pub since: DateTime<Utc>,
    /// The steps of its rule satisfied so far, in order.
    #[serde(default)]
    pub satisfied: Vec<SatisfiedStep>,
    /// A report stopped showing the evidence at this time (and none showed it since).
    #[serde(default)]
    pub evidence_gone_at: Option<DateTime<Utc>>,
    /// How often the proof started over.
    #[serde(default)]
    pub restarts: u32,
    /// Why it last started over.
    #[serde(default)]
    pub last_restart: Option<String>,
}

impl Proof {
    pub fn new(since: DateTime<Utc>) -> Proof {
        Proof {
            since,
            satisfied: Vec::new(),
            evidence_gone_at: None,
            restarts: 0,
            last_restart: None,
        }
    }

    /// Starts over: no step satisfied, commands count from `now`.
    pub fn restart(&mut self, why: String, now: DateTime<Utc>) {
        self.since = now;
        self.satisfied.clear();
        self.restarts += 1;
        self.last_restart = Some(why);
    }

    /// "1/2": steps satisfied of `of`.
    pub fn progress(&self, of: usize) -> String {
        format!("{}/{of}", self.satisfied.len())
    }
}

/// What an ended command did to a proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProofEffect {
    /// Nothing.
    None,
    /// Step `step` (0-based) is satisfied; `complete` when it was the last.
    Advanced { step: usize, complete: bool },
    /// The proof started over (why).
    Restarted(String),
}

/// Applies an ended command to a proof of `steps` (see the module documentation).
pub fn observe(
    steps: &[ProofStep],
    proof: &mut Proof,
    command: &Command,
    now: DateTime<Utc>,
) -> ProofEffect {
    let awaited = proof.satisfied.len();
    let Some(step) = steps.get(awaited) else {
        return ProofEffect::None;
    };
    if !step.kinds.contains(&command.kind) || !command.status.is_final() {
        return ProofEffect::None;
    }
    let anchor = proof.satisfied.last().map_or(proof.since, |s| s.at);
    let ran_at = command.dispatched_at.unwrap_or(command.created_at);
    if ran_at < anchor {
        // It ran before the condition was raised, or before the step it must follow.
        return ProofEffect::None;
    }
    match step.verdict(command) {
        Verdict::Passed => {
            proof.satisfied.push(SatisfiedStep {
                command_id: command.id.clone(),
                kind: command.kind,
                at: now,
            });
            ProofEffect::Advanced {
                step: awaited,
                complete: awaited + 1 == steps.len(),
            }
        }
        Verdict::Failed(why) if awaited > 0 => {
            let why = format!("verification failed: {why}");
            proof.restart(why.clone(), now);
            ProofEffect::Restarted(why)
        }
        Verdict::Failed(_) | Verdict::Inconclusive => ProofEffect::None,
    }
}

/// A report shows the evidence (again). After a step was satisfied, or after the evidence had
/// gone, the fix did not hold: the proof restarts (returns why). Otherwise nothing changes.
pub fn evidence_seen(proof: &mut Proof, now: DateTime<Utc>) -> Option<String> {
    if proof.satisfied.is_empty() && proof.evidence_gone_at.is_none() {
        return None;
    }
    proof.evidence_gone_at = None;
    let why = "a report shows the evidence again".to_owned();
    proof.restart(why.clone(), now);
    Some(why)
}

/// A report no longer shows the evidence: recorded (returns whether that is news), nothing
/// cleared.
pub fn evidence_gone(proof: &mut Proof, now: DateTime<Utc>) -> bool {
    if proof.evidence_gone_at.is_some() {
        return false;
    }
    proof.evidence_gone_at = Some(now);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Actor;
    use crate::command::{NewCommand, Outcome};
    use crate::ids::NodeId;
    use crate::node::tests::t0;
    use chrono::Duration;
    use proptest::prelude::*;

    fn command(kind: CommandKind, level: Option<u64>, at: DateTime<Utc>) -> Command {
        let params = level.map_or(serde_json::Value::Null, |l| serde_json::json!({"level": l}));
        let mut c = Command::new(
            NewCommand {
                kind,
                params,
                timeout: None,
                not_before: None,
                ttl: None,
                force: true,
            },
            NodeId::generate(),
            None,
            Actor::User("alice".into()),
            at,
        )
        .expect("valid");
        c.dispatch(1, at).expect("dispatch");
        c
    }

    fn ended(mut c: Command, ok: bool, at: DateTime<Utc>) -> Command {
        let result = (c.kind == CommandKind::DiagNvml).then(|| serde_json::json!({"passed": ok}));
        let outcome = if ok {
            Outcome::Succeeded
        } else {
            Outcome::Failed
        };
        c.finish(outcome, Some(i32::from(!ok)), "", result, at)
            .expect("finish");
        c
    }

    fn reset_rule() -> Vec<ProofStep> {
        ClearRule::for_condition(GPU_NEEDS_RESET).steps().to_vec()
    }

    #[test]
    fn the_rules_are_declared_once_and_read_as_sentences() {
        let reset = ClearRule::for_condition(GPU_NEEDS_RESET);
        assert_eq!(reset.kind(), ClearRuleKind::Commands);
        let sentence = reset.describe();
        assert!(
            sentence.starts_with(
                "clears when gpu.reset or node.reboot succeeds and then diag.nvml level 1 (or deeper) passes"
            ),
            "{sentence}"
        );
        assert_eq!(
            ClearRule::for_condition(GPU_NEEDS_PERSON),
            ClearRule::Operator
        );
        assert!(ClearRule::for_condition(GPU_COUNT_MISMATCH).clears_with_evidence());
        assert!(!ClearRule::for_condition(GPU_NEEDS_REBOOT).clears_with_evidence());
        assert_eq!(
            ClearRule::for_reason(&ReasonKey::Taint("burn".into())).kind(),
            ClearRuleKind::Untaint
        );
        assert!(!ClearRule::for_reason(&ReasonKey::Draining).by_hand());
        assert!(ClearRule::for_reason(&ReasonKey::Condition(GPU_NEEDS_RESET.into())).by_hand());
        assert!(
            ClearRule::for_reason(&ReasonKey::Unreachable)
                .describe()
                .contains("heartbeats")
        );
    }

    #[test]
    fn a_reset_then_a_passing_diagnostic_proves_a_reset_and_nothing_less_does() {
        let steps = reset_rule();
        let mut proof = Proof::new(t0());
        // A diagnostic before any reset proves nothing, pass or fail.
        let early = ended(command(CommandKind::DiagNvml, Some(1), t0()), true, t0());
        assert_eq!(observe(&steps, &mut proof, &early, t0()), ProofEffect::None);
        // A failed reset proves nothing and restarts nothing.
        let failed = ended(command(CommandKind::GpuReset, None, t0()), false, t0());
        assert_eq!(
            observe(&steps, &mut proof, &failed, t0()),
            ProofEffect::None
        );
        let t1 = t0() + Duration::seconds(10);
        let reset = ended(command(CommandKind::GpuReset, None, t1), true, t1);
        assert_eq!(
            observe(&steps, &mut proof, &reset, t1),
            ProofEffect::Advanced {
                step: 0,
                complete: false
            }
        );
        assert_eq!(proof.satisfied[0].command_id, reset.id);
        // A diagnostic dispatched before the reset ended does not verify it.
        let stale = ended(
            command(CommandKind::DiagNvml, Some(3), t0()),
            true,
            t1 + Duration::seconds(1),
        );
        assert_eq!(observe(&steps, &mut proof, &stale, t1), ProofEffect::None);
        let t2 = t1 + Duration::seconds(10);
        let diag = ended(command(CommandKind::DiagNvml, Some(1), t2), true, t2);
        assert_eq!(
            observe(&steps, &mut proof, &diag, t2),
            ProofEffect::Advanced {
                step: 1,
                complete: true
            }
        );
    }

    #[test]
    fn a_failed_verification_restarts_the_proof_and_a_reboot_counts_as_a_reset() {
        let steps = reset_rule();
        let mut proof = Proof::new(t0());
        let reboot = ended(command(CommandKind::NodeReboot, None, t0()), true, t0());
        assert!(matches!(
            observe(&steps, &mut proof, &reboot, t0()),
            ProofEffect::Advanced { step: 0, .. }
        ));
        let t1 = t0() + Duration::seconds(5);
        let diag = ended(command(CommandKind::DiagNvml, Some(1), t1), false, t1);
        assert!(matches!(
            observe(&steps, &mut proof, &diag, t1),
            ProofEffect::Restarted(_)
        ));
        assert!(proof.satisfied.is_empty());
        assert_eq!((proof.since, proof.restarts), (t1, 1));
        // A diagnostic deeper than needed counts; one that passes below the level does not.
        let reset = ended(command(CommandKind::GpuReset, None, t1), true, t1);
        observe(&steps, &mut proof, &reset, t1);
        let deep = ended(command(CommandKind::DiagNvml, Some(3), t1), true, t1);
        assert!(matches!(
            observe(&steps, &mut proof, &deep, t1),
            ProofEffect::Advanced { complete: true, .. }
        ));
        // A reset does not prove a reboot.
        let mut reboot_proof = Proof::new(t0());
        let reset = ended(command(CommandKind::GpuReset, None, t0()), true, t0());
        assert_eq!(
            observe(
                ClearRule::for_condition(GPU_NEEDS_REBOOT).steps(),
                &mut reboot_proof,
                &reset,
                t0()
            ),
            ProofEffect::None
        );
    }

    #[test]
    fn evidence_that_comes_back_restarts_and_evidence_gone_is_only_recorded() {
        let mut proof = Proof::new(t0());
        assert_eq!(evidence_seen(&mut proof, t0()), None);
        assert!(evidence_gone(&mut proof, t0()));
        assert!(!evidence_gone(&mut proof, t0()), "recorded once");
        assert!(evidence_seen(&mut proof, t0()).is_some());
        assert_eq!(proof.evidence_gone_at, None);
        assert_eq!(proof.restarts, 1);
    }

    proptest! {
        /// Whatever commands end in whatever order, a proof completes only when a reset (or
        /// reboot) succeeded and a passing diagnostic dispatched no earlier ran after it, with
        /// no failed verification between them.
        #[test]
        fn a_proof_completes_only_on_a_reset_followed_by_a_passing_diagnostic(
            script in proptest::collection::vec((0u8..4, any::<bool>()), 0..12)
        ) {
            let steps = reset_rule();
            let mut proof = Proof::new(t0());
            let mut reset_ok = false;
            let mut complete = false;
            for (i, (what, ok)) in script.into_iter().enumerate() {
                let at = t0() + Duration::seconds(i as i64);
                let kind = match what {
                    0 => CommandKind::GpuReset,
                    1 => CommandKind::NodeReboot,
                    2 => CommandKind::DiagNvml,
                    _ => CommandKind::LogsCollect,
                };
                let c = ended(command(kind, (kind == CommandKind::DiagNvml).then_some(1), at), ok, at);
                let effect = observe(&steps, &mut proof, &c, at);
                if complete { continue; }
                match kind {
                    CommandKind::GpuReset | CommandKind::NodeReboot if ok && !reset_ok => reset_ok = true,
                    CommandKind::DiagNvml if reset_ok && ok => complete = true,
                    CommandKind::DiagNvml if reset_ok => reset_ok = false,
                    _ => {}
                }
                prop_assert_eq!(matches!(effect, ProofEffect::Advanced { complete: true, .. }), complete && kind == CommandKind::DiagNvml);
                if complete { break; }
                prop_assert_eq!(proof.satisfied.len(), usize::from(reset_ok));
            }
        }
    }
}
