//! NodeLifecycle (acceptance) and NodeSpec: the seed's "Acceptance" and "Schedulable" steps.
//!
//! - Acceptance: an `adopting`, connected node that reported its `gpus` section gets the
//!   checks its pool lists (`bc_core::acceptance`: by default `diag.nvml` level 2, run as a
//!   command; `hardware-profile` reads the mismatch conditions). All passing makes it
//!   `adopted`; a failure makes it `failed` (`failedFrom: adopting`, maintenance on), and a
//!   diagnostic's result stays on the command for people to read. A check that times out,
//!   expires or is cancelled counts as a failure: acceptance never passes a node it could
//!   not check. A node reporting no GPUs fails in a GPU pool and skips the GPU checks in a
//!   CPU pool (expected GPU count 0).
//! - NodeSpec: an `adopted` or `deployed` node at generation 0 gets generation 1; the gateway
//!   sends it, the daemon converges and reports `observedGeneration`, and the node becomes
//!   schedulable when nothing else blocks it.

use bc_core::Actor;
use bc_core::acceptance::{self, AcceptanceStep};
use bc_core::axes::ProvisionState;
use bc_core::command::{CommandKind, NewCommand};
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_core::provision::ProvisionMove;
use chrono::{DateTime, Utc};

use super::{Applied, NODES_PER_TRANSACTION, apply_batch};
use crate::error::ApiError;
use crate::service::Services;
use crate::service::node_changes::NodeChangeRequest;

/// Nodes looked at per pass at most; the rest wait for the next pass. Acceptance looks at a
/// node twice (to queue its check, then to judge the result), so a pass moves half this many:
/// when passes ran only at the 5-second tick, 2,000 held a fleet's acceptance to 200 nodes a
/// second, the last 4,000 of 10,000 nodes taking 20 s while the server idled at 15 % of a
/// core. Issue 16 asks for 500 a second. A pass holds this many node records at once (a few
/// MB).
const MAX_PER_PASS: u64 = 5_000;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LifecycleReport {
    pub checks_queued: usize,
    pub adopted: usize,
    pub failed: usize,
    pub specs_written: usize,
}

pub struct LifecycleController {
    services: Services,
    actor: Actor,
}

/// A provision move acceptance decided for one node, waiting for its batch.
struct DecidedMove {
    node: NodeId,
    version: i64,
    cause: String,
    action: ProvisionMove,
    why: String,
}

impl LifecycleController {
    pub fn new(services: Services) -> Self {
        LifecycleController {
            services,
            actor: Actor::Controller("node-lifecycle".into()),
        }
    }

    pub async fn tick(&mut self) -> Result<LifecycleReport, ApiError> {
        let mut report = LifecycleReport::default();
        self.acceptance(&mut report).await?;
        self.node_spec(&mut report).await?;
        Ok(report)
    }

    /// Decides every candidate first (reads only), then writes the decisions in batches.
    async fn acceptance(&mut self, report: &mut LifecycleReport) -> Result<(), ApiError> {
        let candidates = self
            .services
            .acceptance_candidates(&self.actor, MAX_PER_PASS)
            .await?;
        // Each candidate's newest diagnostic, for the whole list in one query: while a fleet
        // comes up, thousands of nodes wait on theirs, and a query per node per tick kept
        // the database busy with answers that had not changed.
        let ids: Vec<NodeId> = candidates.iter().map(|c| c.node.id.clone()).collect();
        let mut diagnostics = self
            .services
            .newest_commands_by(&ids, CommandKind::DiagNvml, &self.actor)
            .await?;
        // A finished check from before the node's last provision move (a failed acceptance,
        // then `recover`) judged the node in its previous life: the node gets a new one
        // rather than failing again on old evidence.
        let finished: Vec<_> = diagnostics
            .iter()
            .filter(|(_, check)| check.status.is_final())
            .map(|(node, check)| (node.clone(), check.id.clone()))
            .collect();
        let stale = self
            .services
            .checks_queued_before_last_provision_move(&finished)
            .await?;
        let mut checks = Vec::new();
        let mut moves = Vec::new();
        for candidate in &candidates {
            let node = &candidate.node;
            let diagnostic = diagnostics
                .remove(&node.id)
                .filter(|check| !stale.contains(&check.id));
            let step = acceptance::decide(
                &candidate.policy,
                &candidate.profile,
                node,
                diagnostic.as_ref(),
            );
            let cause = match &diagnostic {
                Some(check) => format!("acceptance:{}", check.id),
                None => "acceptance".to_owned(),
            };
            let (action, why) = match step {
                AcceptanceStep::Wait => continue,
                AcceptanceStep::QueueDiagnostic { level } => {
                    let new = NewCommand {
                        kind: CommandKind::DiagNvml,
                        params: serde_json::json!({ "level": level }),
                        timeout: None,
                        not_before: None,
                        ttl: None,
                        force: false,
                    };
                    checks.push((node, new));
                    continue;
                }
                AcceptanceStep::Adopt(why) => (ProvisionMove::Adopt, why),
                AcceptanceStep::Fail(why) => (ProvisionMove::Fail, why),
            };
            moves.push(DecidedMove {
                node: node.id.clone(),
                version: node.version,
                cause,
                action,
                why,
            });
        }
        for batch in checks.chunks(NODES_PER_TRANSACTION) {
            let queued = self
                .services
                .queue_commands_as(&self.actor, batch.to_vec())
                .await?;
            report.checks_queued += queued.len();
        }
        for batch in moves.chunks_mut(NODES_PER_TRANSACTION) {
            let requests = batch
                .iter_mut()
                .map(|decided| {
                    let action = decided.action;
                    let why = std::mem::take(&mut decided.why);
                    NodeChangeRequest {
                        id: decided.node.clone(),
                        actor: self.actor.clone(),
                        expected_version: Some(decided.version),
                        cause: std::mem::take(&mut decided.cause),
                        change: move |n: &mut NodeRecord, _: &Actor, _: DateTime<Utc>| {
                            n.apply_move(action, Some(&why))
                        },
                    }
                })
                .collect();
            let outcomes = apply_batch(&self.services, &self.actor, requests).await;
            for (decided, outcome) in batch.iter().zip(outcomes) {
                match (decided.action, outcome) {
                    (ProvisionMove::Adopt, Applied::Changed) => report.adopted += 1,
                    (ProvisionMove::Fail, Applied::Changed) => report.failed += 1,
                    _ => {}
                }
            }
        }
        Ok(())
    }

    async fn node_spec(&mut self, report: &mut LifecycleReport) -> Result<(), ApiError> {
        let states = [ProvisionState::Adopted, ProvisionState::Deployed];
        let waiting = self
            .services
            .nodes_awaiting_first_spec(&states, MAX_PER_PASS)
            .await?;
        let actor = Actor::Controller("node-spec".into());
        for batch in waiting.chunks(NODES_PER_TRANSACTION) {
            let requests = batch
                .iter()
                .map(|(id, version)| NodeChangeRequest {
                    id: id.clone(),
                    actor: actor.clone(),
                    expected_version: Some(*version),
                    cause: "node-spec:initial".to_owned(),
                    change: |n: &mut NodeRecord, _: &Actor, _: DateTime<Utc>| {
                        Ok(if n.generation == 0 {
                            n.bump_generation("first spec after acceptance")
                        } else {
                            Vec::new()
                        })
                    },
                })
                .collect();
            let outcomes = apply_batch(&self.services, &actor, requests).await;
            report.specs_written += outcomes
                .into_iter()
                .filter(|outcome| *outcome == Applied::Changed)
                .count();
        }
        Ok(())
    }
}
