//! Health remediation: a pool's policy ([`RemediationPolicy`]) says, per condition, which
//! ladder of steps to climb (`gpu.reset` → verify; still failing → `node.reboot` → verify;
//! still failing → give up), how many tries each step gets and how long to wait after a
//! failed try. The Remediation controller (server) persists every try as a
//! [`RemediationAttempt`] and asks [`plan`] what to do next; this module is the pure part.
//!
//! # The rules
//!
//! - A try is: the step's action (`gpu.reset` or `node.reboot`), then a verification
//!   (`diag.nvml` at the step's level, with an `inventory.refresh` of `gpus` for fresh
//!   evidence). It succeeds when the condition's own proof completes
//!   ([`crate::clear`]): the action succeeded and the diagnostic after it passed. Anything
//!   else fails the try.
//! - A failed try is followed, after the step's backoff, by the next try of the step, or the
//!   first try of the next step when the step's tries are used up. When the last step's tries
//!   are used up, remediation gives up: maintenance on and `GpuNeedsPerson` (the seed's rule).
//! - Work first: a try acts only on a node that holds no allocation (it waits until they are
//!   released, as Kubernetes' node-problem remediation waits for a drain; an operator who is
//!   in a hurry drains the node with a deadline), that is connected, in service (`adopted`
//!   or `deployed`, not in maintenance) and not tenant-controlled. The condition being
//!   remediated is NoSchedule, so no new work lands meanwhile: together that is what a
//!   cordon guarantees, which is why the destructive action needs no operator's cordon
//!   ([`crate::command::check_remediation_safety`]).
//! - A run ends without a verdict (cancelled) when the condition clears otherwise (by hand,
//!   by an operator's own commands) or the node leaves service.
//!
//! # Defaults ([`RemediationPolicy::default`])
//!
//! | condition | ladder |
//! | --- | --- |
//! | `GpuNeedsReset` | `gpu.reset` (2 tries, 30 s apart) → `node.reboot` (1 try) → give up; each verified by `diag.nvml` level 1 |
//! | `GpuNeedsReboot` | `node.reboot` (2 tries, 120 s apart) → give up; verified by `diag.nvml` level 1 |
//!
//! `GpuNeedsPerson` is not remediated (a person must act); `GpuCountMismatch` clears with
//! its evidence.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

use crate::axes::axis_enum;
use crate::clear::{self, ClearRule, GPU_NEEDS_REBOOT, GPU_NEEDS_RESET};
use crate::command::{Command, CommandKind, CommandStatus};
use crate::error::DomainError;
use crate::ids::{CommandId, NodeId, RemediationId};

/// Steps in one ladder at most.
pub const MAX_STEPS: usize = 4;
/// Tries of one step at most.
pub const MAX_ATTEMPTS: u32 = 5;
/// The longest backoff after a failed try (a day).
pub const MAX_BACKOFF_SECS: u32 = 86_400;

/// One rung of a ladder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RemediationStep {
    /// `gpu.reset` or `node.reboot`: a command the condition's proof accepts as its first step.
    pub action: CommandKind,
    /// Tries of this step before the next (1 to [`MAX_ATTEMPTS`]).
    pub attempts: u32,
    /// How long after a failed try of this step the next try starts (0 to
    /// [`MAX_BACKOFF_SECS`]).
    pub backoff_secs: u32,
    /// The `diag.nvml` level that verifies it (1 to 3).
    pub verify_level: u8,
}

/// The ladder for one condition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RemediationRule {
    pub condition: String,
    pub steps: Vec<RemediationStep>,
}

/// A pool's remediation policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RemediationPolicy {
    /// Off: the controller leaves the pool's nodes alone (conditions still clear on proof).
    pub enabled: bool,
    pub rules: Vec<RemediationRule>,
}

impl Default for RemediationPolicy {
    fn default() -> Self {
        let step = |action, attempts, backoff_secs| RemediationStep {
            action,
            attempts,
            backoff_secs,
            verify_level: clear::VERIFY_DIAG_LEVEL,
        };
        RemediationPolicy {
            enabled: true,
            rules: vec![
                RemediationRule {
                    condition: GPU_NEEDS_RESET.to_owned(),
                    steps: vec![
                        step(CommandKind::GpuReset, 2, 30),
                        step(CommandKind::NodeReboot, 1, 120),
                    ],
                },
                RemediationRule {
                    condition: GPU_NEEDS_REBOOT.to_owned(),
                    steps: vec![step(CommandKind::NodeReboot, 2, 120)],
                },
            ],
        }
    }
}

impl RemediationPolicy {
    /// The ladder for `condition`, if the policy is on and has one.
    pub fn rule_for(&self, condition: &str) -> Option<&RemediationRule> {
        self.enabled
            .then(|| self.rules.iter().find(|r| r.condition == condition))
            .flatten()
    }

    /// Every rule of the policy is one the domain can run: a condition that clears on a
    /// proof of commands, at most one rule per condition, 1 to [`MAX_STEPS`] steps whose
    /// action is a first step of that proof, sane tries, backoff and level.
    pub fn validate(&self) -> Result<(), DomainError> {
        let bad = |why: String| Err(DomainError::BadInput(why));
        for (i, rule) in self.rules.iter().enumerate() {
            if self.rules[..i]
                .iter()
                .any(|r| r.condition == rule.condition)
            {
                return bad(format!(
                    "remediation has two rules for `{}`",
                    rule.condition
                ));
            }
            let proof = ClearRule::for_condition(&rule.condition);
            let Some(first) = proof.steps().first() else {
                return bad(format!(
                    "`{}` is not remediable: it does not clear on a proof of commands ({})",
                    rule.condition,
                    proof.describe()
                ));
            };
            if rule.steps.is_empty() || rule.steps.len() > MAX_STEPS {
                return bad(format!(
                    "the rule for `{}` has {} steps; it takes 1 to {MAX_STEPS}",
                    rule.condition,
                    rule.steps.len()
                ));
            }
            for step in &rule.steps {
                if !first.kinds.contains(&step.action) {
                    let kinds: Vec<&str> = first.kinds.iter().map(|k| k.as_static_str()).collect();
                    return bad(format!(
                        "`{}` cannot be remediated by {}: its proof starts with {}",
                        rule.condition,
                        step.action,
                        kinds.join(" or ")
                    ));
                }
                if !(1..=MAX_ATTEMPTS).contains(&step.attempts) {
                    return bad(format!("a step takes 1 to {MAX_ATTEMPTS} attempts"));
                }
                if step.backoff_secs > MAX_BACKOFF_SECS {
                    return bad(format!(
                        "a step's backoff is at most {MAX_BACKOFF_SECS} seconds"
                    ));
                }
                if !(clear::VERIFY_DIAG_LEVEL..=3).contains(&step.verify_level) {
                    return bad("a step's verifyLevel is 1, 2 or 3".into());
                }
            }
        }
        Ok(())
    }
}

axis_enum!(
    /// Where one remediation try is.
    AttemptStatus {
        /// Due at `nextAttemptAt`; waits for it, for allocations to be released, or for the
        /// node to connect.
        Waiting = "waiting",
        /// Its action command is queued or running.
        Acting = "acting",
        /// Its action succeeded; the verification is queued or running.
        Verifying = "verifying",
        /// Verified: the condition cleared.
        Succeeded = "succeeded",
        /// It failed; a later try follows.
        Failed = "failed",
        /// It failed and it was the ladder's last: remediation gave up.
        GaveUp = "gave_up",
        /// Ended without a verdict.
        Cancelled = "cancelled",
    }
);

impl AttemptStatus {
    /// Still under way (the controller looks at it every tick).
    pub fn is_open(self) -> bool {
        matches!(
            self,
            AttemptStatus::Waiting | AttemptStatus::Acting | AttemptStatus::Verifying
        )
    }
}

/// One try of one step of a node's remediation, as persisted (a restart resumes from it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemediationAttempt {
    pub id: RemediationId,
    /// The first try of the run this one belongs to (a run: from the first try to success,
    /// giving up or cancellation).
    pub run_id: RemediationId,
    pub node_id: NodeId,
    pub condition: String,
    /// The policy's ladder when the run started: a policy changed meanwhile does not change a
    /// run under way.
    pub ladder: Vec<RemediationStep>,
    /// Index into `ladder`.
    pub step: u32,
    /// 1-based try of that step.
    pub attempt: u32,
    pub status: AttemptStatus,
    pub action_command_id: Option<CommandId>,
    pub refresh_command_id: Option<CommandId>,
    pub verify_command_id: Option<CommandId>,
    /// When this try may act.
    pub next_attempt_at: DateTime<Utc>,
    /// Why it waits, failed or ended, in words.
    pub note: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl RemediationAttempt {
    /// The first try of a run, due now.
    pub fn first(
        node_id: NodeId,
        condition: &str,
        ladder: Vec<RemediationStep>,
        now: DateTime<Utc>,
    ) -> RemediationAttempt {
        let id = RemediationId::generate();
        RemediationAttempt {
            run_id: id.clone(),
            id,
            node_id,
            condition: condition.to_owned(),
            ladder,
            step: 0,
            attempt: 1,
            status: AttemptStatus::Waiting,
            action_command_id: None,
            refresh_command_id: None,
            verify_command_id: None,
            next_attempt_at: now,
            note: None,
            created_at: now,
            updated_at: now,
            finished_at: None,
        }
    }

    /// The next try of the same run: `step`/`attempt`, due at `at`.
    pub fn next(&self, step: u32, attempt: u32, at: DateTime<Utc>, now: DateTime<Utc>) -> Self {
        RemediationAttempt {
            id: RemediationId::generate(),
            run_id: self.run_id.clone(),
            node_id: self.node_id.clone(),
            condition: self.condition.clone(),
            ladder: self.ladder.clone(),
            step,
            attempt,
            status: AttemptStatus::Waiting,
            action_command_id: None,
            refresh_command_id: None,
            verify_command_id: None,
            next_attempt_at: at,
            note: None,
            created_at: now,
            updated_at: now,
            finished_at: None,
        }
    }

    /// This try's step (a step beyond the ladder is a corrupt attempt: `None`).
    pub fn current(&self) -> Option<&RemediationStep> {
        self.ladder.get(self.step as usize)
    }

    /// Ends it (or moves it on) with `status` and a note.
    pub fn set_status(&mut self, status: AttemptStatus, note: Option<String>, now: DateTime<Utc>) {
        self.status = status;
        if note.is_some() {
            self.note = note;
        }
        self.updated_at = now;
        if !status.is_open() {
            self.finished_at = Some(now);
        }
    }
}

/// What the controller knows about the node when it looks at a try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeFacts {
    /// The condition being remediated is still `true`.
    pub condition_true: bool,
    /// `adopted` or `deployed`, not in maintenance, not deleted.
    pub in_service: bool,
    pub tenant_controlled: bool,
    pub connected: bool,
    /// Active allocations on the node.
    pub allocations: u64,
}

/// What to do with a try now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Nothing yet (why).
    Wait(String),
    /// Queue the step's action.
    Act,
    /// The action succeeded: queue the verification.
    Verify,
    /// Verified and the condition cleared.
    Succeed,
    /// This try failed (why); the next try is `step`/`attempt`, due at `at`.
    Retry {
        why: String,
        step: u32,
        attempt: u32,
        at: DateTime<Utc>,
    },
    /// This try failed and the ladder is used up (why).
    GiveUp(String),
    /// The run ends without a verdict (why).
    Cancel(String),
}

/// The decision for `attempt` (open) given the node and its commands (see the module
/// documentation).
pub fn plan(
    attempt: &RemediationAttempt,
    node: &NodeFacts,
    action: Option<&Command>,
    verify: Option<&Command>,
    now: DateTime<Utc>,
) -> Plan {
    if !node.condition_true {
        let verified =
            attempt.status == AttemptStatus::Verifying && verify.is_some_and(clear::diag_passed);
        return if verified {
            Plan::Succeed
        } else {
            Plan::Cancel(format!(
                "{} cleared otherwise (by hand, or by other commands)",
                attempt.condition
            ))
        };
    }
    if node.tenant_controlled {
        return Plan::Cancel(
            "the node is tenant-controlled: the platform never sends it destructive commands"
                .into(),
        );
    }
    if !node.in_service {
        return Plan::Cancel(
            "the node left service (maintenance, or not adopted or deployed)".into(),
        );
    }
    let Some(step) = attempt.current() else {
        return Plan::Cancel("the attempt's step is not in its ladder".into());
    };
    match attempt.status {
        AttemptStatus::Waiting => {
            if now < attempt.next_attempt_at {
                Plan::Wait(format!(
                    "backing off until {}",
                    attempt.next_attempt_at.to_rfc3339()
                ))
            } else if node.allocations > 0 {
                Plan::Wait(format!(
                    "waiting for the node's {} allocation(s) to be released (drain it to hurry)",
                    node.allocations
                ))
            } else if !node.connected {
                Plan::Wait("waiting for the node to connect".into())
            } else {
                Plan::Act
            }
        }
        AttemptStatus::Acting => match action {
            Some(c) if !c.status.is_final() => Plan::Wait(format!("{} is {}", c.kind, c.status)),
            Some(c) if c.status == CommandStatus::Succeeded => Plan::Verify,
            Some(c) => after_failure(attempt, ended(c), now),
            None => after_failure(attempt, format!("{} was never queued", step.action), now),
        },
        AttemptStatus::Verifying => match verify {
            Some(c) if !c.status.is_final() => Plan::Wait(format!("{} is {}", c.kind, c.status)),
            Some(c) if clear::diag_passed(c) => after_failure(
                attempt,
                format!(
                    "{} {} passed but {} still holds (its evidence came back, or the proof restarted)",
                    c.kind, c.id, attempt.condition
                ),
                now,
            ),
            Some(c) => after_failure(attempt, ended(c), now),
            None => after_failure(attempt, "the verification was never queued".into(), now),
        },
        _ => Plan::Wait("the attempt has ended".into()),
    }
}

fn ended(c: &Command) -> String {
    let passed = c
        .result
        .as_ref()
        .and_then(|r| r.get("passed"))
        .and_then(serde_json::Value::as_bool);
    let verdict = match (c.status, passed) {
        (CommandStatus::Succeeded, Some(false)) => "did not pass".to_owned(),
        (status, _) => status.to_string(),
    };
    let error = c
        .error
        .as_deref()
        .map_or(String::new(), |e| format!(": {e}"));
    format!("{} {} {verdict}{error}", c.kind, c.id)
}

/// After a failed try: the next try of the step, the next step, or giving up.
pub fn after_failure(attempt: &RemediationAttempt, why: String, now: DateTime<Utc>) -> Plan {
    let Some(step) = attempt.current() else {
        return Plan::GiveUp(why);
    };
    let at = now + Duration::seconds(i64::from(step.backoff_secs));
    if attempt.attempt < step.attempts {
        Plan::Retry {
            why,
            step: attempt.step,
            attempt: attempt.attempt + 1,
            at,
        }
    } else if (attempt.step as usize) + 1 < attempt.ladder.len() {
        Plan::Retry {
            why,
            step: attempt.step + 1,
            attempt: 1,
            at,
        }
    } else {
        let tried: Vec<String> = attempt
            .ladder
            .iter()
            .map(|s| format!("{} ×{}", s.action, s.attempts))
            .collect();
        Plan::GiveUp(format!("{why}; tried {}", tried.join(" then ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Actor;
    use crate::command::{NewCommand, Outcome};
    use crate::node::tests::t0;
    use proptest::prelude::*;

    fn facts() -> NodeFacts {
        NodeFacts {
            condition_true: true,
            in_service: true,
            tenant_controlled: false,
            connected: true,
            allocations: 0,
        }
    }

    fn ladder() -> Vec<RemediationStep> {
        RemediationPolicy::default()
            .rule_for(GPU_NEEDS_RESET)
            .expect("a default rule")
            .steps
            .clone()
    }

    fn finished(kind: CommandKind, ok: bool) -> Command {
        let mut c = Command::new(
            NewCommand {
                kind,
                params: serde_json::Value::Null,
                timeout: None,
                not_before: None,
                ttl: None,
                force: true,
            },
            NodeId::generate(),
            None,
            Actor::Controller("remediation".into()),
            t0(),
        )
        .expect("valid");
        c.dispatch(1, t0()).expect("dispatch");
        let outcome = if ok {
            Outcome::Succeeded
        } else {
            Outcome::Failed
        };
        let result = (kind == CommandKind::DiagNvml).then(|| serde_json::json!({ "passed": ok }));
        c.finish(outcome, None, "", result, t0()).expect("finish");
        c
    }

    #[test]
    fn the_default_policy_is_valid_and_bad_ones_are_refused() {
        let policy = RemediationPolicy::default();
        assert_eq!(policy.validate(), Ok(()));
        let mut reboot_by_reset = policy.clone();
        reboot_by_reset.rules[1].steps[0].action = CommandKind::GpuReset;
        assert!(
            reboot_by_reset.validate().is_err(),
            "a reset proves no reboot"
        );
        let mut person = policy.clone();
        person.rules[0].condition = clear::GPU_NEEDS_PERSON.into();
        assert!(
            person.validate().is_err(),
            "a person's condition is not remediable"
        );
        let mut twice = policy.clone();
        twice.rules[1].condition = GPU_NEEDS_RESET.into();
        assert!(twice.validate().is_err());
        let mut none = policy.clone();
        none.rules[0].steps.clear();
        assert!(none.validate().is_err());
        let mut many = policy.clone();
        many.rules[0].steps[0].attempts = 0;
        assert!(many.validate().is_err());
        let mut deep = policy;
        deep.rules[0].steps[0].verify_level = 4;
        assert!(deep.validate().is_err());
        let off = RemediationPolicy {
            enabled: false,
            ..RemediationPolicy::default()
        };
        assert_eq!(off.rule_for(GPU_NEEDS_RESET), None);
    }

    #[test]
    fn a_try_waits_for_backoff_allocations_and_a_session_then_acts_then_verifies() {
        let mut a = RemediationAttempt::first(NodeId::generate(), GPU_NEEDS_RESET, ladder(), t0());
        a.next_attempt_at = t0() + Duration::seconds(30);
        assert!(matches!(
            plan(&a, &facts(), None, None, t0()),
            Plan::Wait(_)
        ));
        let later = t0() + Duration::seconds(30);
        let busy = NodeFacts {
            allocations: 2,
            ..facts()
        };
        let Plan::Wait(why) = plan(&a, &busy, None, None, later) else {
            panic!("waits for the allocations")
        };
        assert!(why.contains("allocation"), "{why}");
        let away = NodeFacts {
            connected: false,
            ..facts()
        };
        assert!(matches!(plan(&a, &away, None, None, later), Plan::Wait(_)));
        assert_eq!(plan(&a, &facts(), None, None, later), Plan::Act);
        a.status = AttemptStatus::Acting;
        let reset = finished(CommandKind::GpuReset, true);
        assert_eq!(plan(&a, &facts(), Some(&reset), None, later), Plan::Verify);
        a.status = AttemptStatus::Verifying;
        let diag = finished(CommandKind::DiagNvml, true);
        let cleared = NodeFacts {
            condition_true: false,
            ..facts()
        };
        assert_eq!(
            plan(&a, &cleared, Some(&reset), Some(&diag), later),
            Plan::Succeed
        );
        // A diagnostic that passed while the condition still holds is no success.
        assert!(matches!(
            plan(&a, &facts(), Some(&reset), Some(&diag), later),
            Plan::Retry { .. }
        ));
        // Cleared by someone else before the verification: cancelled, not succeeded.
        a.status = AttemptStatus::Acting;
        assert!(matches!(
            plan(&a, &cleared, None, None, later),
            Plan::Cancel(_)
        ));
        let maintenance = NodeFacts {
            in_service: false,
            ..facts()
        };
        assert!(matches!(
            plan(&a, &maintenance, None, None, later),
            Plan::Cancel(_)
        ));
    }

    #[test]
    fn the_default_ladder_resets_twice_reboots_once_then_gives_up() {
        let mut a = RemediationAttempt::first(NodeId::generate(), GPU_NEEDS_RESET, ladder(), t0());
        let mut now = t0();
        let mut seen = Vec::new();
        loop {
            seen.push((a.current().map(|s| s.action), a.attempt));
            a.status = AttemptStatus::Verifying;
            let diag = finished(CommandKind::DiagNvml, false);
            match plan(&a, &facts(), None, Some(&diag), now) {
                Plan::Retry {
                    step, attempt, at, ..
                } => {
                    assert!(at >= now);
                    now = at;
                    a = a.next(step, attempt, at, now);
                }
                Plan::GiveUp(why) => {
                    assert!(
                        why.contains("tried gpu.reset ×2 then node.reboot ×1"),
                        "{why}"
                    );
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            seen,
            vec![
                (Some(CommandKind::GpuReset), 1),
                (Some(CommandKind::GpuReset), 2),
                (Some(CommandKind::NodeReboot), 1)
            ]
        );
        assert_eq!(now, t0() + Duration::seconds(30 + 30));
    }

    fn arb_ladder() -> impl Strategy<Value = Vec<RemediationStep>> {
        proptest::collection::vec(
            (
                proptest::sample::select(vec![CommandKind::GpuReset, CommandKind::NodeReboot]),
                1u32..=MAX_ATTEMPTS,
                0u32..1000,
            )
                .prop_map(|(action, attempts, backoff_secs)| RemediationStep {
                    action,
                    attempts,
                    backoff_secs,
                    verify_level: 1,
                }),
            1..=MAX_STEPS,
        )
    }

    proptest! {
        /// A run that always fails climbs the ladder rung by rung, each rung exactly its
        /// number of tries, each try after the one before plus its backoff, never acting on
        /// a node that holds allocations, and then gives up.
        #[test]
        fn a_failing_run_climbs_the_whole_ladder_then_gives_up(ladder in arb_ladder(), busy in 0u64..3) {
            let expected: u32 = ladder.iter().map(|s| s.attempts).sum();
            let mut a = RemediationAttempt::first(NodeId::generate(), GPU_NEEDS_RESET, ladder.clone(), t0());
            let mut now = t0();
            let mut tries = 0u32;
            loop {
                let held = NodeFacts { allocations: busy, ..facts() };
                let first = plan(&a, &held, None, None, now);
                if busy > 0 {
                    prop_assert!(matches!(first, Plan::Wait(_)), "acted with allocations held");
                }
                prop_assert_eq!(plan(&a, &facts(), None, None, now), Plan::Act);
                tries += 1;
                a.status = AttemptStatus::Acting;
                let failed = finished(a.current().map_or(CommandKind::GpuReset, |s| s.action), false);
                match plan(&a, &facts(), Some(&failed), None, now) {
                    Plan::Retry { step, attempt, at, .. } => {
                        let backoff = ladder[a.step as usize].backoff_secs;
                        prop_assert_eq!(at, now + Duration::seconds(i64::from(backoff)));
                        prop_assert!(step == a.step && attempt == a.attempt + 1 || step == a.step + 1 && attempt == 1);
                        now = at;
                        a = a.next(step, attempt, at, now);
                    }
                    Plan::GiveUp(_) => break,
                    other => prop_assert!(false, "unexpected {:?}", other),
                }
            }
            prop_assert_eq!(tries, expected);
        }
    }
}
