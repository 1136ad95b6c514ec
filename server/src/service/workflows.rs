//! Bare-metal workflows: starting one when a bare-metal node enters a state that runs one
//! (the operators' provision moves, `recover`), `abortWorkflow`, and what the Workflow
//! controller needs: its work list, the execution of one step (BMC calls outside any
//! transaction, looks at the node and its inventory) and the one transaction that records a
//! pass (the workflow row under its `version`, the node's move, the events).
//!
//! The step machine itself is `bc_core::workflow` and pure; here is only its IO. A node
//! enrolled without a BMC runs no workflow: its moves stay what an operator types.

use bc_core::Actor;
use bc_core::axes::Power;
use bc_core::bare_metal::PowerAction;
use bc_core::event::EventType;
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_core::provision::ProvisionMove;
use bc_core::view::NodeDetail;
use bc_core::workflow::{
    self, Effect, Identifiers, Input, StepKind, StepResult, Workflow, WorkflowKind,
};
use std::collections::BTreeMap;

use super::Services;
use super::bare_metal::BareMetalNode;
use super::nodes::not_found;
use super::store::{WriteTxn, bare_metal, events, inventory, nodes, workflows};
use crate::auth::{Principal, Role};
use crate::bmc::{BmcError, BootTarget, PowerDriver};
use crate::error::{ApiError, ApiResult};

/// The Workflow controller's name: events say `controller:workflow`.
pub const WORKFLOW_ACTOR: &str = "workflow";

/// How many nodes that joined during an inspection one look compares with the enrolment
/// (a daemon that booted on the wrong machine joins as a node of its own). A site rarely
/// sees more joins than this in one inspection; the newest beyond it are seen on later
/// looks as the list moves on.
const STRAY_SCAN_LIMIT: u64 = 50;

/// What [`Services::record_workflow`] did with a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The pass changed nothing (a step still waits on the same thing): nothing written.
    Unchanged,
    /// The workflow was written and still runs.
    Saved,
    /// The workflow was written and ended (the node moved with it, unless it left).
    Ended,
    /// The workflow changed since the pass read it (an abort won), or its node is gone:
    /// nothing written.
    Dropped,
}

/// How many workflows the bare-metal view lists for a node (newest first).
pub const WORKFLOWS_SHOWN: u64 = 10;

impl Services {
    /// A provision move by an operator (`transitionNode`, `adoptNode`, `retireNode`), in one
    /// transaction with what it means for bare-metal workflows: while a workflow runs, only
    /// `fail` is allowed, and it aborts the workflow; a bare-metal node (one with a BMC)
    /// entering a state that runs a workflow starts it.
    pub async fn move_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        action: ProvisionMove,
        reason: Option<&str>,
    ) -> ApiResult<NodeDetail> {
        p.require(Role::Operator)?;
        let visible = |n: &NodeRecord| p.can_see(n.owner_tenant_id.as_ref());
        let actor = p.actor();
        let cause = format!("provision:{action}");
        let txn = self.store.write().await?;
        // Lock order: the node first, then its workflow row.
        let running = match nodes::load(&*txn, id, true).await? {
            Some(n) if n.deleted_at.is_none() && visible(&n) => {
                workflows::running_for(&*txn, id).await?
            }
            _ => return Err(not_found(id)),
        };
        if let Some(w) = &running
            && action != ProvisionMove::Fail
        {
            return Err(ApiError::BadUserInput(format!(
                "node `{id}` runs the {} workflow `{}` (at its step {}): wait for it to end, or abortWorkflow first",
                w.kind,
                w.id,
                w.steps
                    .get(w.current)
                    .map_or("-", |s| s.kind.as_static_str())
            )));
        }
        let (after, changes) = self
            .change_node_in(
                &txn,
                &actor,
                id,
                Some(version),
                &visible,
                &cause,
                |n, _, _| n.apply_move(action, reason),
            )
            .await?;
        let now = self.clock.now();
        if let Some(w) = running {
            // A `fail` typed while the workflow runs is an abort of it.
            let aborted = workflow::advance(
                &w,
                Input::Abort {
                    by: actor.to_string(),
                    reason: reason.unwrap_or("failed by an operator").to_owned(),
                },
                now,
            )
            .workflow;
            self.save_workflow_in(&txn, &after, &w, aborted, &actor, now)
                .await?;
        }
        if !changes.is_empty() {
            self.start_workflow_in(&txn, &after, &actor, now).await?;
        }
        txn.commit().await?;
        self.after_node_commit(&after, &changes);
        self.detail_of(self.store.db(), vec![after])
            .await?
            .pop()
            .ok_or_else(|| not_found(id))
    }

    /// Starts the workflow of `node`'s provision state, if the state has one and the node
    /// has a BMC. The node is locked by the caller.
    async fn start_workflow_in(
        &self,
        txn: &WriteTxn,
        node: &NodeRecord,
        actor: &Actor,
        now: chrono::DateTime<chrono::Utc>,
    ) -> ApiResult<Option<Workflow>> {
        let Some(kind) = WorkflowKind::for_state(node.provision_state) else {
            return Ok(None);
        };
        if bare_metal::load(&**txn, &node.id).await?.is_none() {
            return Ok(None);
        }
        let w = Workflow::new(kind, node, &actor.to_string(), now);
        workflows::insert(&**txn, &w).await?;
        events::append_node_action(
            txn,
            node,
            EventType::WorkflowStarted,
            actor,
            Some(w.id.as_str()),
            serde_json::json!({ "workflow": w.id, "kind": kind, "steps": kind.steps() }),
            now,
        );
        tracing::info!(node = %node.id, workflow = %w.id, %kind, "a bare-metal workflow started");
        Ok(Some(w))
    }

    /// Writes `after` over `before` (which must still be stored at its version) and the
    /// events of what changed between them.
    async fn save_workflow_in(
        &self,
        txn: &WriteTxn,
        node: &NodeRecord,
        before: &Workflow,
        mut after: Workflow,
        actor: &Actor,
        now: chrono::DateTime<chrono::Utc>,
    ) -> ApiResult<bool> {
        after.version = before.version + 1;
        if !workflows::save(&**txn, &after, before.version).await? {
            return Ok(false);
        }
        for (i, (was, is)) in before.steps.iter().zip(&after.steps).enumerate() {
            if was.status != is.status {
                events::append_node_action(
                    txn,
                    node,
                    EventType::WorkflowStepChanged,
                    actor,
                    Some(after.id.as_str()),
                    serde_json::json!({
                        "workflow": after.id, "step": i, "kind": is.kind,
                        "from": was.status, "to": is.status, "attempts": is.attempts,
                        "log": is.log.last().map(|l| l.message.clone()),
                    }),
                    now,
                );
            }
        }
        if before.status != after.status {
            events::append_node_action(
                txn,
                node,
                EventType::WorkflowFinished,
                actor,
                Some(after.id.as_str()),
                serde_json::json!({
                    "workflow": after.id, "kind": after.kind, "status": after.status,
                    "reason": after.reason,
                }),
                now,
            );
        }
        Ok(true)
    }

    /// `abortWorkflow`: ends the node's running workflow, and fails the node with the
    /// reason (`failedFrom`, maintenance on), in one transaction. The node must still be at
    /// `version`.
    pub async fn abort_workflow(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        reason: &str,
    ) -> ApiResult<BareMetalNode> {
        p.require(Role::Operator)?;
        let reason = reason.trim();
        if reason.is_empty() {
            return Err(ApiError::BadUserInput("a reason is required".into()));
        }
        let visible = |n: &NodeRecord| p.can_see(n.owner_tenant_id.as_ref());
        let actor = p.actor();
        let txn = self.store.write().await?;
        let running = match nodes::load(&*txn, id, true).await? {
            Some(n) if n.deleted_at.is_none() && visible(&n) => {
                n.expect_version(version)?;
                workflows::running_for(&*txn, id).await?
            }
            _ => return Err(not_found(id)),
        };
        let Some(w) = running else {
            return Err(ApiError::BadUserInput(format!(
                "node `{id}` runs no workflow"
            )));
        };
        let now = self.clock.now();
        let advanced = workflow::advance(
            &w,
            Input::Abort {
                by: actor.to_string(),
                reason: reason.to_owned(),
            },
            now,
        );
        let why = match advanced.ending() {
            Some(Effect::Fail { reason }) => reason,
            _ => {
                return Err(ApiError::internal(anyhow::anyhow!(
                    "aborting workflow {} asked for no failure",
                    w.id
                )));
            }
        };
        let (after, changes) = self
            .change_node_in(
                &txn,
                &actor,
                id,
                Some(version),
                &visible,
                &format!("workflow:{}", w.id),
                |n, _, _| n.apply_move(ProvisionMove::Fail, Some(why.as_str())),
            )
            .await?;
        self.save_workflow_in(&txn, &after, &w, advanced.workflow, &actor, now)
            .await?;
        txn.commit().await?;
        self.after_node_commit(&after, &changes);
        tracing::info!(node = %id, workflow = %w.id, actor = %actor, "a workflow was aborted");
        self.bare_metal_node(p, id).await
    }

    /// The Workflow controller's work list: running workflows, the least recently advanced
    /// first, at most `limit`.
    pub async fn running_workflows(&self, limit: u64) -> ApiResult<Vec<Workflow>> {
        Ok(workflows::running(self.store.db(), limit).await?)
    }

    /// A node's newest workflows (the bare-metal view's).
    pub(super) async fn workflows_of(
        &self,
        conn: &impl sea_orm::ConnectionTrait,
        id: &NodeId,
    ) -> ApiResult<Vec<Workflow>> {
        Ok(workflows::of_node(conn, id, WORKFLOWS_SHOWN).await?)
    }

    /// Records what a pass of the Workflow controller made of `before`, in one
    /// transaction: the node locked, the workflow written where it is still at its
    /// version (`false` when it is not: an abort came first, and the pass is dropped), the
    /// node's move for an ending, and the events. A workflow whose node has left its state
    /// (deleted, or moved by a path that does not go through workflows) ends as aborted and
    /// leaves the node alone.
    pub async fn record_workflow(
        &self,
        before: &Workflow,
        mut after: Workflow,
        mut ending: Option<Effect>,
    ) -> ApiResult<Recorded> {
        let actor = Actor::Controller(WORKFLOW_ACTOR.into());
        let now = self.clock.now();
        let txn = self.store.write().await?;
        let Some(node) = nodes::load(&*txn, &before.node_id, true).await? else {
            return Ok(Recorded::Dropped);
        };
        if node.deleted_at.is_some() || node.provision_state != before.kind.state() {
            let why = if node.deleted_at.is_some() {
                "the node was deleted".to_owned()
            } else {
                format!(
                    "the node is {} now, not {}",
                    node.provision_state,
                    before.kind.state()
                )
            };
            after = workflow::advance(
                before,
                Input::Abort {
                    by: actor.to_string(),
                    reason: why,
                },
                now,
            )
            .workflow;
            ending = None;
        }
        if after == *before {
            return Ok(Recorded::Unchanged);
        }
        let cause = format!("workflow:{}", before.id);
        let everyone = |_: &NodeRecord| true;
        let kind = before.kind;
        let workflow_id = before.id.clone();
        let moved = match ending {
            Some(Effect::Succeed) => Some(
                self.change_node_in(
                    &txn,
                    &actor,
                    &node.id,
                    None,
                    &everyone,
                    &cause,
                    move |n, _, _| workflow::finish_node(kind, &workflow_id, n),
                )
                .await?,
            ),
            Some(Effect::Fail { reason }) => Some(
                self.change_node_in(
                    &txn,
                    &actor,
                    &node.id,
                    None,
                    &everyone,
                    &cause,
                    move |n, _, _| n.apply_move(ProvisionMove::Fail, Some(reason.as_str())),
                )
                .await?,
            ),
            _ => None,
        };
        let current = moved.as_ref().map_or(&node, |(after, _)| after);
        let ended = !after.is_running();
        if !self
            .save_workflow_in(&txn, current, before, after, &actor, now)
            .await?
        {
            return Ok(Recorded::Dropped);
        }
        txn.commit().await?;
        if let Some((after, changes)) = &moved {
            self.after_node_commit(after, changes);
        }
        Ok(if ended {
            Recorded::Ended
        } else {
            Recorded::Saved
        })
    }

    /// Executes one step of `w` once (the Workflow controller's effect), outside any
    /// transaction: BMC calls wait on the BMC. Anything that goes wrong on the way (the
    /// BMC, the database) is a failed attempt, retried while the step has attempts left.
    pub async fn execute_workflow_step(
        &self,
        w: &Workflow,
        kind: StepKind,
        handle: Option<&str>,
    ) -> StepResult {
        match self.try_execute_step(w, kind, handle).await {
            Ok(result) => result,
            Err(err) => StepResult::Failed {
                message: err.message(),
                retry: true,
            },
        }
    }

    /// The node's power driver, with its credentials opened.
    async fn workflow_driver(
        &self,
        read: &sea_orm::DatabaseTransaction,
        node: &NodeRecord,
    ) -> ApiResult<Box<dyn PowerDriver>> {
        let stored = bare_metal::load(read, &node.id).await?;
        let uuid = bare_metal::system_uuid(read, &node.id).await?;
        self.power_driver(node, stored.as_ref(), uuid)
    }

    async fn try_execute_step(
        &self,
        w: &Workflow,
        kind: StepKind,
        handle: Option<&str>,
    ) -> ApiResult<StepResult> {
        let read = self.store.read().await?;
        let node = nodes::load(&read, &w.node_id, false)
            .await?
            .ok_or_else(|| not_found(&w.node_id))?;
        if node.deleted_at.is_some() || node.provision_state != w.kind.state() {
            // Recorded as an end that leaves the node alone (`record_workflow`).
            return Ok(StepResult::Failed {
                message: format!("the node left {}", w.kind.state()),
                retry: false,
            });
        }
        Ok(match kind {
            StepKind::BootNetworkOnce => match self
                .workflow_driver(&read, &node)
                .await?
                .boot_once(BootTarget::Pxe)
                .await
            {
                Ok(()) => StepResult::Done(
                    "the BMC boots the machine from the network once, at its next boot".into(),
                ),
                Err(err) => bmc_failed(&err),
            },
            StepKind::PowerOn | StepKind::PowerOff => {
                let wanted = if kind == StepKind::PowerOn {
                    Power::On
                } else {
                    Power::Off
                };
                power_step(&*self.workflow_driver(&read, &node).await?, wanted, handle).await
            }
            StepKind::AwaitDaemon => {
                if workflow::daemon_joined(w.identity_generation, &node) {
                    StepResult::Done(format!(
                        "the machine's daemon joined as this node (identity generation {}) and holds a session",
                        node.identity_generation
                    ))
                } else {
                    let enrolled = workflows::enrolled_identifiers(&read, &node.id).await?;
                    let strays = workflows::identity_sections_of_nodes_since(
                        &read,
                        &node.site_id,
                        &node.id,
                        w.created_at,
                        STRAY_SCAN_LIMIT,
                    )
                    .await?;
                    let contradiction = strays.iter().find_map(|(other, sections)| {
                        let reported = reported_identifiers(sections);
                        let shares = enrolled
                            .iter()
                            .any(|(k, v)| reported.get(k).is_some_and(|r| !r.is_disjoint(v)));
                        match workflow::check_identifiers(&enrolled, &reported) {
                            Err(why) if shares => Some(format!(
                                "a daemon joined as node `{other}` from a machine that shares identifiers with this enrolment, and {why}"
                            )),
                            _ => None,
                        }
                    });
                    match contradiction {
                        Some(message) => StepResult::Failed {
                            message,
                            retry: false,
                        },
                        None => StepResult::Waiting(format!(
                            "waiting for the machine's daemon to join as this node (identity generation above {})",
                            w.identity_generation
                        )),
                    }
                }
            }
            StepKind::CheckIdentifiers => {
                let sections = inventory::sections(&read, &node.id).await?;
                if !sections.contains_key("system") {
                    StepResult::Waiting("waiting for the daemon's system inventory".into())
                } else {
                    let enrolled = workflows::enrolled_identifiers(&read, &node.id).await?;
                    match workflow::check_identifiers(&enrolled, &reported_identifiers(&sections)) {
                        Ok(message) => StepResult::Done(message),
                        Err(message) => StepResult::Failed {
                            message,
                            retry: false,
                        },
                    }
                }
            }
        })
    }
}

/// The identifiers an inventory reports, normalised as an enrolment's are.
fn reported_identifiers(sections: &BTreeMap<String, serde_json::Value>) -> Identifiers {
    let raw = bc_core::health::identifiers(sections.get("system"), sections.get("network"));
    bc_core::hardware::hardware_key(&raw).identifiers
}

fn bmc_failed(err: &BmcError) -> StepResult {
    StepResult::Failed {
        message: err.to_string(),
        retry: true,
    }
}

/// Powers the machine to `want` and waits until the BMC reports it so. First execution:
/// asks (powering on a machine that is on restarts it, so that a one-time boot override
/// applies); later ones (`handle` set): read the power.
async fn power_step(driver: &dyn PowerDriver, want: Power, handle: Option<&str>) -> StepResult {
    let now = match driver.power_state().await {
        Ok(power) => power,
        Err(err) => return bmc_failed(&err),
    };
    if handle.is_some() {
        return if now == want {
            StepResult::Done(format!("the BMC reports the machine {want}"))
        } else {
            StepResult::Waiting(format!("the BMC reports the machine {now}"))
        };
    }
    let (action, handle, message) = match (want, now) {
        (Power::Off, Power::Off) => return StepResult::Done("the machine was off already".into()),
        (Power::Off, _) => (
            PowerAction::Off,
            "off-requested",
            "asked the BMC to power the machine off",
        ),
        (_, Power::On) => (
            PowerAction::Cycle,
            "restart-requested",
            "the machine was on: asked the BMC to restart it, so that it boots as set",
        ),
        _ => (
            PowerAction::On,
            "on-requested",
            "asked the BMC to power the machine on",
        ),
    };
    match driver.power(action).await {
        Ok(()) => StepResult::Started {
            handle: handle.into(),
            message: message.into(),
        },
        Err(err) => bmc_failed(&err),
    }
}
