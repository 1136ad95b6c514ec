//! Bare-metal workflows: starting one when a bare-metal node enters a state that runs one
//! (the operators' provision moves, `recover`, and a workflow's own finishing move, so that
//! inspection leads into commissioning), `abortWorkflow`, and what the Workflow controller
//! needs: its work list, the execution of one step (BMC calls outside any transaction, looks
//! at the node and its inventory, the command a step runs on the node's daemon) and the one
//! transaction that records a pass (the workflow row under its `version`, the commands its
//! steps queued, the node's move, the next workflow, the events).
//!
//! A step that runs a command (`burn-in`, `record-firmware`, `wipe-disks`) builds it when
//! it executes but queues it in the transaction that records the step's handle (the
//! command's id): a pass that is dropped (an abort won) queues nothing, and a controller that
//! restarts finds the handle and polls that command instead of queueing another.
//!
//! The step machine itself is `bc_core::workflow` and pure; here is only its IO. A node
//! enrolled without a BMC runs no workflow: its moves stay what an operator types.

use bc_core::Actor;
use bc_core::axes::{Connectivity, Power, Trust};
use bc_core::bare_metal::{DEPLOY_DRIVER_KEY, PowerAction};
use bc_core::command::{Command, CommandKind, CommandStatus, NewCommand};
use bc_core::event::EventType;
use bc_core::ids::{CommandId, NodeId};
use bc_core::node::NodeRecord;
use bc_core::provision::ProvisionMove;
use bc_core::view::NodeDetail;
use bc_core::workflow::{
    self, Effect, Identifiers, Input, StepKind, StepResult, StepStatus, Workflow, WorkflowKind,
};
use std::collections::BTreeMap;

use super::Services;
use super::bare_metal::BareMetalNode;
use super::nodes::not_found;
use super::store::{
    WriteTxn, bare_metal, catalog, commands, events, inventory, nodes, placement, workflows,
};
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

/// What one execution of a step found, and the command it built to be queued with the
/// step's handle when the pass is recorded.
#[derive(Debug, Clone)]
pub struct Executed {
    pub result: StepResult,
    pub command: Option<Command>,
}

impl From<StepResult> for Executed {
    fn from(result: StepResult) -> Self {
        Executed {
            result,
            command: None,
        }
    }
}

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
        txn.lock_node(id).await?;
        let running = match nodes::load(&*txn, id).await? {
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
    /// events of what changed between them. A workflow that ends (whatever the way: success,
    /// failure, an abort, its node gone) cancels, in the same transaction, the commands its
    /// steps queued that have not ended (a burn-in still queued when an operator aborts,
    /// an earlier attempt's command that never ran), so none runs on the machine later;
    /// the step it ended at logs each.
    async fn save_workflow_in(
        &self,
        txn: &WriteTxn,
        node: &NodeRecord,
        before: &Workflow,
        mut after: Workflow,
        actor: &Actor,
        now: chrono::DateTime<chrono::Utc>,
    ) -> ApiResult<bool> {
        if before.is_running() && !after.is_running() {
            let cancelled = self
                .cancel_open_commands_in(
                    txn,
                    &node.id,
                    &Actor::Controller(WORKFLOW_ACTOR.into()),
                    before.created_at,
                    actor,
                    now,
                )
                .await?;
            for (command, was) in cancelled {
                after.note(
                    now,
                    format!(
                        "cancelled {} {}, which was still {was}: the workflow ended",
                        command.kind, command.id
                    ),
                );
            }
        }
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
        txn.lock_node(id).await?;
        let running = match nodes::load(&*txn, id).await? {
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
        mut queued: Vec<Command>,
    ) -> ApiResult<Recorded> {
        let actor = Actor::Controller(WORKFLOW_ACTOR.into());
        let now = self.clock.now();
        let txn = self.store.write().await?;
        txn.lock_node(&before.node_id).await?;
        let Some(node) = nodes::load(&*txn, &before.node_id).await? else {
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
            queued.clear();
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
        // A power step the BMC carried out makes the BMC due for a poll at once, as an
        // operator's power action does, so the `power` axis follows the workflow within a
        // tick instead of a poll interval (the node row is locked; its BMC row comes next).
        let powered = before.steps.iter().zip(&after.steps).any(|(was, is)| {
            matches!(is.kind, StepKind::PowerOn | StepKind::PowerOff)
                && was.status != is.status
                && is.status == StepStatus::Succeeded
        });
        if !self
            .save_workflow_in(&txn, current, before, after, &actor, now)
            .await?
        {
            return Ok(Recorded::Dropped);
        }
        if powered {
            bare_metal::poll_at(&*txn, &node.id, now).await?;
        }
        // The commands the pass's steps built, queued with the handles that name them
        // (lock order: the node is locked; command rows are new).
        if !queued.is_empty() {
            commands::insert(&*txn, &queued).await?;
            for command in &queued {
                events::append_command(&txn, command, None, &actor, now);
                metrics::counter!("bc_commands_sent_total", "kind" => command.kind.to_string())
                    .increment(1);
            }
        }
        // A finishing move into a state that runs a workflow (inspection's `commission`)
        // starts that one, after this one stopped running (one running row per node).
        if let Some((after_node, changes)) = &moved
            && !changes.is_empty()
            && after_node.provision_state != before.kind.state()
        {
            self.start_workflow_in(&txn, after_node, &actor, now)
                .await?;
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
    ) -> Executed {
        match self.try_execute_step(w, kind, handle).await {
            Ok(executed) => executed,
            Err(err) => StepResult::Failed {
                message: err.message(),
                retry: true,
            }
            .into(),
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
    ) -> ApiResult<Executed> {
        let read = self.store.read().await?;
        let node = nodes::load(&read, &w.node_id)
            .await?
            .ok_or_else(|| not_found(&w.node_id))?;
        if node.deleted_at.is_some() || node.provision_state != w.kind.state() {
            // Recorded as an end that leaves the node alone (`record_workflow`).
            return Ok(StepResult::Failed {
                message: format!("the node left {}", w.kind.state()),
                retry: false,
            }
            .into());
        }
        if let Some(command) = kind.command() {
            return self
                .command_step(&read, w, &node, kind, command, handle)
                .await;
        }
        Ok(match kind {
            StepKind::BootNetworkOnce => match self
                .workflow_driver(&read, &node)
                .await?
                .boot_once(BootTarget::Pxe)
                .await
            {
                Ok(()) => StepResult::Done(format!(
                    "the BMC boots the machine from the network once, at its next boot ({})",
                    network_boot_purpose(w.kind)
                )),
                Err(err) => bmc_failed(&err),
            },
            StepKind::BootDeployImage => {
                let driver = self.workflow_driver(&read, &node).await?;
                self.boot_deploy_image(&*driver, &node).await
            }
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
                    let joined = format!(
                        "the machine's daemon joined as this node (identity generation {}) and holds a session",
                        node.identity_generation
                    );
                    if w.kind.ejects_deploy_image() && node.drivers.contains_key(DEPLOY_DRIVER_KEY)
                    {
                        let ejected = self.eject_deploy_image(&read, &node).await;
                        StepResult::Done(format!("{joined}; {ejected}"))
                    } else {
                        StepResult::Done(joined)
                    }
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
            StepKind::BurnIn | StepKind::RecordFirmware | StepKind::WipeDisks => {
                return Err(ApiError::internal(anyhow::anyhow!(
                    "the step {kind} runs a command and is executed as one"
                )));
            }
        }
        .into())
    }

    /// `boot-deploy-image`: the image `drivers.deploy` names, as virtual media where the BMC
    /// has it (booted from once), else a one-time network boot; no image named: a network
    /// boot, the boot server choosing the image. The log says which, by the image's name
    /// (its address may carry a token and is not logged).
    async fn boot_deploy_image(&self, driver: &dyn PowerDriver, node: &NodeRecord) -> StepResult {
        let Some(name) = node.drivers.get(DEPLOY_DRIVER_KEY) else {
            return match driver.boot_once(BootTarget::Pxe).await {
                Ok(()) => StepResult::Done(
                    "no deploy image is named (drivers.deploy): the machine boots its deploy from the network once".into(),
                ),
                Err(err) => bmc_failed(&err),
            };
        };
        let Some(address) = self.bare_metal.config.images.get(name) else {
            return StepResult::Failed {
                message: format!(
                    "the node's drivers.deploy names the image `{name}`, which bare_metal.images does not list"
                ),
                retry: false,
            };
        };
        let (target, message) = match driver.insert_media(address).await {
            Ok(true) => (
                BootTarget::Cd,
                format!(
                    "the image `{name}` is inserted as the BMC's virtual CD; the machine boots from it once"
                ),
            ),
            Ok(false) => (
                BootTarget::Pxe,
                format!(
                    "the BMC has no virtual media: the machine boots the image `{name}` from the network once"
                ),
            ),
            Err(err) => return bmc_failed(&err),
        };
        match driver.boot_once(target).await {
            Ok(()) => StepResult::Done(message),
            Err(err) => bmc_failed(&err),
        }
    }

    /// Ejects the deploy image from the BMC's virtual CD once the installed system runs,
    /// and says how it went, for the step's log. Never a failure: the system is deployed
    /// either way, and an image left inserted is for an operator to eject.
    async fn eject_deploy_image(
        &self,
        read: &sea_orm::DatabaseTransaction,
        node: &NodeRecord,
    ) -> String {
        let ejected = match self.workflow_driver(read, node).await {
            Ok(driver) => driver.eject_media().await.map_err(|err| err.to_string()),
            Err(err) => Err(err.message()),
        };
        match ejected {
            Ok(true) => "the deploy image was ejected from the BMC's virtual CD".to_owned(),
            Ok(false) => "the BMC's virtual CD held no image to eject".to_owned(),
            Err(why) => {
                tracing::warn!(node = %node.id, error = %why, "the deploy image could not be ejected");
                format!(
                    "the deploy image could not be ejected from the BMC's virtual CD ({why}); it stays inserted until an operator ejects it"
                )
            }
        }
    }

    /// A step that runs `kind` on the node's daemon. Without a handle: builds the command
    /// (queued when the pass is recorded, with its id as the handle). With one: polls that
    /// command, the step ending with it.
    async fn command_step(
        &self,
        read: &sea_orm::DatabaseTransaction,
        w: &Workflow,
        node: &NodeRecord,
        step: StepKind,
        kind: CommandKind,
        handle: Option<&str>,
    ) -> ApiResult<Executed> {
        let Some(handle) = handle else {
            return self.build_step_command(read, node, step, kind).await;
        };
        let id = CommandId::parse(handle).map_err(|_| {
            ApiError::internal(anyhow::anyhow!(
                "workflow {}: the handle `{handle}` of {step} is no command id",
                w.id
            ))
        })?;
        let Some(command) = commands::load(read, &id, false).await? else {
            return Ok(StepResult::Failed {
                message: format!("{kind} {id} is gone"),
                retry: true,
            }
            .into());
        };
        let result = match command.status {
            CommandStatus::Succeeded => {
                StepResult::Done(self.command_succeeded(read, node, step, &command).await?)
            }
            CommandStatus::Failed
            | CommandStatus::TimedOut
            | CommandStatus::Cancelled
            | CommandStatus::Expired => StepResult::Failed {
                message: format!(
                    "{kind} {id} {}: {}",
                    command.status,
                    command_error(&command)
                ),
                retry: false,
            },
            status => StepResult::Waiting(if node.connectivity == Connectivity::Connected {
                format!("{kind} {id} is {status}")
            } else {
                format!(
                    "{kind} {id} is {status}; the node's daemon is {}",
                    node.connectivity
                )
            }),
        };
        Ok(result.into())
    }

    /// The command a command step runs, built (not yet queued), or the step's end when there
    /// is nothing to run.
    async fn build_step_command(
        &self,
        read: &sea_orm::DatabaseTransaction,
        node: &NodeRecord,
        step: StepKind,
        kind: CommandKind,
    ) -> ApiResult<Executed> {
        let (params, timeout, force, what) = match step {
            StepKind::BurnIn => {
                let pool = match &node.pool_id {
                    Some(id) => catalog::pool(read, id).await?,
                    None => None,
                };
                let (policy, profile) = pool
                    .map(|p| (p.acceptance, p.hardware_profile))
                    .unwrap_or_default();
                let level = match policy.diagnostic_level() {
                    Some(level) if profile.expects_gpus() => level,
                    _ => {
                        return Ok(StepResult::Done(
                            "no burn-in: the pool's acceptance runs no GPU diagnostic, or its machines have no GPUs".into(),
                        )
                        .into());
                    }
                };
                (
                    serde_json::json!({ "level": level }),
                    Some(workflow::BURN_IN_COMMAND_TIMEOUT),
                    false,
                    format!("{kind} level {level} (the pool's acceptance level)"),
                )
            }
            StepKind::RecordFirmware => (
                serde_json::json!({ "sections": workflow::FIRMWARE_SECTIONS }),
                None,
                false,
                format!(
                    "{kind} of {} (the sections with firmware facts)",
                    workflow::FIRMWARE_SECTIONS.join(", ")
                ),
            ),
            _ => {
                // A wipe is destructive. The node is out of service (releasing or retiring:
                // the placer books only adopted or deployed nodes), so the workflow sends it
                // with `force`, as the decision of the operator's release or retire; but
                // never to a tenant-controlled machine, and not while work is still booked.
                if node.trust == Trust::TenantControlled {
                    return Ok(StepResult::Failed {
                        message: format!(
                            "{kind} is destructive and the node is tenant-controlled: the platform never sends it destructive commands"
                        ),
                        retry: false,
                    }
                    .into());
                }
                let allocations = placement::active_on_nodes(read, std::slice::from_ref(&node.id))
                    .await?
                    .len();
                if allocations > 0 {
                    return Ok(StepResult::Waiting(format!(
                        "{kind} waits: the node still holds {allocations} allocation(s)"
                    ))
                    .into());
                }
                (serde_json::Value::Null, None, true, kind.to_string())
            }
        };
        let command = Command::new(
            NewCommand {
                kind,
                params,
                timeout,
                not_before: None,
                ttl: None,
                force,
            },
            node.id.clone(),
            node.owner_tenant_id.clone(),
            Actor::Controller(WORKFLOW_ACTOR.into()),
            self.clock.now(),
        )?;
        Ok(Executed {
            result: StepResult::Started {
                handle: command.id.to_string(),
                message: format!("queued {what} as {}", command.id),
            },
            command: Some(command),
        })
    }

    /// What a command step's successful command found, for its log.
    async fn command_succeeded(
        &self,
        read: &sea_orm::DatabaseTransaction,
        node: &NodeRecord,
        step: StepKind,
        command: &Command,
    ) -> ApiResult<String> {
        Ok(match step {
            StepKind::RecordFirmware => {
                let sections = inventory::sections(read, &node.id).await?;
                format!(
                    "{} {} reported; {}",
                    command.kind,
                    command.id,
                    workflow::firmware_facts(&sections)
                )
            }
            StepKind::WipeDisks => {
                let wiped: Vec<&str> = command
                    .result
                    .as_ref()
                    .and_then(|r| r.get("wiped"))
                    .and_then(serde_json::Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(serde_json::Value::as_str)
                    .collect();
                if wiped.is_empty() {
                    format!("{} {} succeeded", command.kind, command.id)
                } else {
                    format!(
                        "{} {} erased {}",
                        command.kind,
                        command.id,
                        wiped.join(", ")
                    )
                }
            }
            _ => format!("{} {} passed", command.kind, command.id),
        })
    }
}

/// What a network boot is for, in each workflow that makes one.
fn network_boot_purpose(kind: WorkflowKind) -> &'static str {
    match kind {
        WorkflowKind::Inspect => "the inspection ramdisk",
        WorkflowKind::Rescue => "the rescue ramdisk",
        WorkflowKind::Release | WorkflowKind::Retire => "the ramdisk that wipes the disks",
        WorkflowKind::Commission | WorkflowKind::Deploy => "the deploy",
    }
}

/// The most of a failed command's output a step's log and the workflow's reason carry.
const COMMAND_ERROR_CHARS: usize = 500;

/// Why a command ended without success, in a line: its error, else its output (the
/// diagnostic's verdict and failures) joined and shortened.
fn command_error(command: &Command) -> String {
    let text = command.error.clone().unwrap_or_else(|| {
        command
            .output
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join("; ")
    });
    if text.is_empty() {
        return "no reason given".to_owned();
    }
    match text.char_indices().nth(COMMAND_ERROR_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
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
