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
use bc_core::command::{Command, CommandKind, NewCommand};
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_core::provision::ProvisionMove;

use super::{Applied, apply};
use crate::error::ApiError;
use crate::service::Services;

/// Nodes looked at per pass at most; the rest wait for the next tick.
const MAX_PER_TICK: u64 = 2_000;

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

    async fn acceptance(&mut self, report: &mut LifecycleReport) -> Result<(), ApiError> {
        let candidates = self
            .services
            .acceptance_candidates(&self.actor, MAX_PER_TICK)
            .await?;
        // Each candidate's newest diagnostic, for the whole list in one query: while a fleet
        // comes up, thousands of nodes wait on theirs, and a query per node per tick kept
        // the database busy with answers that had not changed.
        let ids: Vec<NodeId> = candidates.iter().map(|c| c.node.id.clone()).collect();
        let mut diagnostics = self
            .services
            .newest_commands_by(&ids, CommandKind::DiagNvml, &self.actor)
            .await?;
        for candidate in candidates {
            let node = &candidate.node;
            let diagnostic = self
                .current_diagnostic(node, diagnostics.remove(&node.id))
                .await?;
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
            match step {
                AcceptanceStep::Wait => {}
                AcceptanceStep::QueueDiagnostic { level } => {
                    let new = NewCommand {
                        kind: CommandKind::DiagNvml,
                        params: serde_json::json!({ "level": level }),
                        timeout: None,
                        not_before: None,
                        ttl: None,
                        force: false,
                    };
                    self.services
                        .queue_command_as(&self.actor, node, new)
                        .await?;
                    report.checks_queued += 1;
                }
                AcceptanceStep::Adopt(why) => {
                    let outcome = apply(
                        &self.services,
                        &self.actor,
                        &node.id,
                        node.version,
                        &cause,
                        |n, _, _| n.apply_move(ProvisionMove::Adopt, Some(&why)),
                    )
                    .await;
                    if outcome == Applied::Changed {
                        report.adopted += 1;
                    }
                }
                AcceptanceStep::Fail(why) => {
                    let outcome = apply(
                        &self.services,
                        &self.actor,
                        &node.id,
                        node.version,
                        &cause,
                        |n, _, _| n.apply_move(ProvisionMove::Fail, Some(&why)),
                    )
                    .await;
                    if outcome == Applied::Changed {
                        report.failed += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// The newest `diag.nvml` acceptance queued for the node in its current life, given the
    /// newest of all (`newest`): a finished one from before the node's last provision move (a
    /// failed acceptance, then `recover`) judged the node in its previous life, so the node
    /// gets a new one rather than failing again on old evidence. Only a finished check costs
    /// a look at the log, and is acted on at once (the node is adopted, failed, or
    /// given a new check).
    async fn current_diagnostic(
        &self,
        node: &NodeRecord,
        newest: Option<Command>,
    ) -> Result<Option<Command>, ApiError> {
        Ok(match newest {
            Some(check) if check.status.is_final() => {
                let stale = self
                    .services
                    .queued_before_last_provision_move(&node.id, &check.id)
                    .await?;
                (!stale).then_some(check)
            }
            other => other,
        })
    }

    async fn node_spec(&mut self, report: &mut LifecycleReport) -> Result<(), ApiError> {
        let states = [ProvisionState::Adopted, ProvisionState::Deployed];
        let waiting = self
            .services
            .nodes_awaiting_first_spec(&states, MAX_PER_TICK)
            .await?;
        let actor = Actor::Controller("node-spec".into());
        for (id, version) in waiting {
            let outcome = apply(
                &self.services,
                &actor,
                &id,
                version,
                "node-spec:initial",
                |n, _, _| {
                    Ok(if n.generation == 0 {
                        n.bump_generation("first spec after acceptance")
                    } else {
                        Vec::new()
                    })
                },
            )
            .await;
            if outcome == Applied::Changed {
                report.specs_written += 1;
            }
        }
        Ok(())
    }
}
