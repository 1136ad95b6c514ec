//! The command queue's use cases: send, cancel and read for people; dispatch, start, result
//! and session loss for the gateway; expiry and timeouts for the controller.

use bc_core::Actor;
use bc_core::command::{Command, CommandStatus, NewCommand, Outcome, check_safety};
use bc_core::ids::{CommandId, NodeId};
use bc_core::node::NodeRecord;
use chrono::{DateTime, Utc};
use std::collections::{HashMap, HashSet};

use super::NodeFilter;
use super::Services;
use super::node_changes::NodeChangeRequest;
use super::store::commands::{self, CommandFilter};
use super::store::{WriteTxn, events, nodes};
use crate::auth::{Principal, Role};
use crate::error::{ApiError, ApiResult};

/// The actor of the changes a command's end makes to its node's conditions (proof steps).
pub const PROOF_ACTOR: &str = "health";

/// Whether an ended command of `kind` may advance or restart a condition's proof (it is named
/// by some clear rule), so its end is taken to its node's conditions.
fn may_prove(kind: bc_core::command::CommandKind) -> bool {
    use bc_core::command::CommandKind;
    matches!(
        kind,
        CommandKind::GpuReset | CommandKind::NodeReboot | CommandKind::DiagNvml
    )
}

/// The most nodes one `sendCommand` may target.
pub const MAX_COMMAND_TARGETS: u64 = 10_000;
/// Commands read per page of a `commandUpdates` snapshot.
const IN_FLIGHT_PAGE: u64 = 500;

fn not_found(id: &CommandId) -> ApiError {
    ApiError::NotFound(format!("command `{id}` does not exist"))
}

impl Services {
    /// Sends one command to every node `filter` selects (what the principal may see). All or
    /// nothing: if any target refuses it (safety rules), nothing is queued and the error names
    /// the node.
    pub async fn send_command(
        &self,
        principal: &Principal,
        mut filter: NodeFilter,
        new: NewCommand,
    ) -> ApiResult<Vec<Command>> {
        principal.require(Role::Operator)?;
        filter.owner = principal.tenant.clone();
        filter.include_deleted = false;
        let txn = self.store.write().await?;
        // Locked, so the safety checks below hold until the commands are queued and each
        // target is read whole (ARCHITECTURE.md, Invariants: lock order, node rows first).
        let targets = nodes::list_locked(&*txn, &filter, MAX_COMMAND_TARGETS + 1).await?;
        if targets.is_empty() {
            return Err(ApiError::NotFound(
                "no node matches the command's targets".into(),
            ));
        }
        if targets.len() as u64 > MAX_COMMAND_TARGETS {
            return Err(ApiError::BadUserInput(format!(
                "a command may target at most {MAX_COMMAND_TARGETS} nodes at once"
            )));
        }
        let now = self.clock.now();
        let actor = principal.actor();
        let mut queued = Vec::with_capacity(targets.len());
        for node in &targets {
            check_safety(
                new.kind,
                node.trust,
                node.cordoned(),
                principal.tenant.is_none(),
                new.force,
                principal.role >= Role::Admin,
            )
            .map_err(|err| match ApiError::from(err) {
                ApiError::BadUserInput(m) => {
                    ApiError::BadUserInput(format!("node `{}`: {m}", node.id))
                }
                ApiError::Forbidden(m) => ApiError::Forbidden(format!("node `{}`: {m}", node.id)),
                other => other,
            })?;
            queued.push(Command::new(
                new.clone(),
                node.id.clone(),
                node.owner_tenant_id.clone(),
                actor.clone(),
                now,
            )?);
        }
        commands::insert(&*txn, &queued).await?;
        for command in &queued {
            events::append_command(&txn, command, None, &actor, now);
        }
        txn.commit().await?;
        metrics::counter!("bc_commands_sent_total", "kind" => new.kind.to_string())
            .increment(queued.len() as u64);
        Ok(queued)
    }

    /// Queues a command as a controller (acceptance), without a person's checks. Only
    /// non-destructive kinds: controllers never interrupt work on their own.
    pub async fn queue_command_as(
        &self,
        actor: &Actor,
        node: &bc_core::node::NodeRecord,
        new: NewCommand,
    ) -> ApiResult<Command> {
        let mut queued = self.queue_commands_as(actor, vec![(node, new)]).await?;
        queued
            .pop()
            .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("queueing one command queued none")))
    }

    /// [`Services::queue_command_as`] for many nodes in one transaction, all or nothing: a
    /// controller that queues a check for each of a thousand nodes commits once. The commands
    /// come back in node id order, the order they are inserted in: each insert takes a
    /// `KEY SHARE` lock on its node's row (lock order, step 2, in node id order).
    pub async fn queue_commands_as(
        &self,
        actor: &Actor,
        requests: Vec<(&bc_core::node::NodeRecord, NewCommand)>,
    ) -> ApiResult<Vec<Command>> {
        if let Some((_, new)) = requests.iter().find(|(_, new)| new.kind.destructive()) {
            return Err(ApiError::Forbidden(format!(
                "controllers do not send destructive commands ({})",
                new.kind
            )));
        }
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.clock.now();
        let mut queued = requests
            .into_iter()
            .map(|(node, new)| {
                Command::new(
                    new,
                    node.id.clone(),
                    node.owner_tenant_id.clone(),
                    actor.clone(),
                    now,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        queued.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        let txn = self.store.write().await?;
        commands::insert(&*txn, &queued).await?;
        for command in &queued {
            events::append_command(&txn, command, None, actor, now);
        }
        txn.commit().await?;
        Ok(queued)
    }

    /// Cancels a command that has not ended.
    pub async fn cancel_command(
        &self,
        principal: &Principal,
        id: &CommandId,
    ) -> ApiResult<Command> {
        principal.require(Role::Operator)?;
        let actor = principal.actor();
        self.change_command(id, &actor, Some(principal), |c, now| c.cancel(&actor, now))
            .await
    }

    /// Cancels, in the caller's transaction, the commands of `node` that `queued_by` queued
    /// at or after `since` and that have not ended: what a bare-metal workflow that ends
    /// leaves behind. It is `cancelCommand`'s cancellation (the command's own `cancel`, the
    /// compare-and-set save, its event, which the gateway holding the node's session turns
    /// into a cancel for the daemon), made by `by`; each with the status it had. The caller
    /// has locked the node; the command rows are locked here, in id order (lock order,
    /// step 6).
    pub(super) async fn cancel_open_commands_in(
        &self,
        txn: &WriteTxn,
        node: &NodeId,
        queued_by: &Actor,
        since: DateTime<Utc>,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> ApiResult<Vec<(Command, CommandStatus)>> {
        let open: Vec<CommandStatus> = CommandStatus::ALL
            .iter()
            .copied()
            .filter(|s| !s.is_final())
            .collect();
        let mut cancelled = Vec::new();
        for mut command in commands::of_node(&**txn, node, &open).await? {
            if command.created_by != *queued_by || command.created_at < since {
                continue;
            }
            let from = command.cancel(by, now)?;
            if commands::save(&**txn, from, &command).await? {
                events::append_command(txn, &command, Some(from), by, now);
                cancelled.push((command, from));
            }
        }
        Ok(cancelled)
    }

    pub async fn command(&self, principal: &Principal, id: &CommandId) -> ApiResult<Command> {
        commands::load(self.store.db(), id, false)
            .await?
            .filter(|c| principal.can_see(c.tenant_id.as_ref()))
            .ok_or_else(|| not_found(id))
    }

    /// Commands, newest first.
    pub async fn commands(
        &self,
        principal: &Principal,
        mut filter: CommandFilter,
        before: Option<&str>,
        first: u64,
    ) -> ApiResult<(Vec<Command>, bool)> {
        filter.tenant = principal.tenant.clone();
        let mut list = commands::list(self.store.db(), &filter, before, first + 1).await?;
        let more = list.len() as u64 > first;
        list.truncate(first as usize);
        Ok((list, more))
    }

    /// The current state of the commands a `commandUpdates` subscription follows: the one
    /// command named (whatever its status), else every command still in flight (queued,
    /// dispatched or running) of the node named, or of every node visible, oldest first.
    pub async fn commands_in_flight(
        &self,
        principal: &Principal,
        node: Option<&NodeId>,
        command: Option<&CommandId>,
    ) -> ApiResult<Vec<Command>> {
        if let Some(id) = command {
            let command = self.command(principal, id).await?;
            return Ok(node
                .is_none_or(|n| &command.node_id == n)
                .then_some(command)
                .into_iter()
                .collect());
        }
        let filter = CommandFilter {
            node_ids: node.into_iter().cloned().collect(),
            statuses: CommandStatus::ALL
                .iter()
                .copied()
                .filter(|s| !s.is_final())
                .collect(),
            kinds: Vec::new(),
            tenant: principal.tenant.clone(),
        };
        let mut all = Vec::new();
        let mut before: Option<String> = None;
        loop {
            let page = commands::list(
                self.store.db(),
                &filter,
                before.as_deref(),
                IN_FLIGHT_PAGE + 1,
            )
            .await?;
            let more = page.len() as u64 > IN_FLIGHT_PAGE;
            all.extend(page.into_iter().take(IN_FLIGHT_PAGE as usize));
            before = all.last().map(|c: &Command| c.id.to_string());
            if !more {
                break;
            }
        }
        all.reverse();
        Ok(all)
    }

    /// How many commands `filter` matches, of those the principal may see.
    pub async fn count_commands(
        &self,
        principal: &Principal,
        mut filter: CommandFilter,
    ) -> ApiResult<u64> {
        filter.tenant = principal.tenant.clone();
        Ok(commands::count(self.store.db(), &filter).await?)
    }

    /// Loads, changes and saves one command with its event, in one transaction. The row is
    /// locked as it is read (`FOR UPDATE`; SQLite has one writer), so a racing change waits
    /// and then meets the winner's status, which the domain judges (`INVALID_STATE` about the
    /// command). The save is a compare-and-set on the status all the same, the second guard:
    /// should it ever miss, the command is read again and the refusal names its real status.
    async fn change_command(
        &self,
        id: &CommandId,
        actor: &Actor,
        visible_to: Option<&Principal>,
        change: impl FnOnce(&mut Command, DateTime<Utc>) -> Result<CommandStatus, bc_core::DomainError>,
    ) -> ApiResult<Command> {
        self.change_command_proving(id, None, actor, visible_to, change)
            .await
    }

    /// [`Services::change_command`], and, when `proving` names the command's node and the
    /// command is one a clear rule may name (`gpu.reset`, `node.reboot`, `diag.nvml`), the
    /// node's conditions take its end into account in the same transaction
    /// ([`bc_core::node::NodeRecord::observe_command`], through
    /// [`Services::change_node_in`]): a step of a proof satisfied, a condition proven and
    /// cleared, or a proof restarted by a failed verification, each with its event. The node
    /// row is locked before the command's (ARCHITECTURE.md, Invariants: lock order).
    async fn change_command_proving(
        &self,
        id: &CommandId,
        proving: Option<&NodeId>,
        actor: &Actor,
        visible_to: Option<&Principal>,
        change: impl FnOnce(&mut Command, DateTime<Utc>) -> Result<CommandStatus, bc_core::DomainError>,
    ) -> ApiResult<Command> {
        let txn = self.store.write().await?;
        if let Some(node) = proving {
            txn.lock_node(node).await?;
        }
        let mut command = commands::load(&*txn, id, true)
            .await?
            .filter(|c| visible_to.is_none_or(|p| p.can_see(c.tenant_id.as_ref())))
            .ok_or_else(|| not_found(id))?;
        let now = self.clock.now();
        let from = change(&mut command, now)?;
        if !commands::save(&*txn, from, &command).await? {
            let current = commands::load(&*txn, id, true)
                .await?
                .ok_or_else(|| not_found(id))?;
            return Err(current.refusal(command.status).into());
        }
        events::append_command(&txn, &command, Some(from), actor, now);
        if proving == Some(&command.node_id) && command.status.is_final() {
            let health = Actor::Controller(PROOF_ACTOR.into());
            let everyone = |_: &bc_core::node::NodeRecord| true;
            let proved = self
                .change_node_in(
                    &txn,
                    &health,
                    &command.node_id,
                    None,
                    &everyone,
                    &format!("proof:{}", command.id),
                    |n, by, now| n.observe_command(&command, by, now),
                )
                .await;
            match proved {
                // A deleted node has nothing left to prove.
                Ok(_) | Err(ApiError::NotFound(_)) => {}
                Err(err) => return Err(err),
            }
        }
        txn.commit().await?;
        Ok(command)
    }

    /// What sessions send next, many sessions at once, each answered in the order asked
    /// ([`Dispatch`]): `cancel` for each command in flight that ended here (cancelled, timed
    /// out) or is gone, `spec` when the node's generation moved past the one sent, and, in
    /// each lane with nothing dispatched or running, the oldest queued command that may run
    /// now, dispatched to the session's epoch. Commands still marked dispatched to an older
    /// session lost it without the gateway noticing (a crashed replica): they are
    /// redelivered (or failed) now, as if that session had ended cleanly.
    ///
    /// Two reads for the whole batch find out what to do without the writer, which on SQLite
    /// every session, controller and operator queues on; most looks (a result with nothing
    /// queued behind it) end there. The sessions that have something to dispatch share one
    /// transaction. A node asked for twice is decided the second time on what the first
    /// dispatched.
    pub async fn dispatch_many(&self, looks: &[DispatchLook]) -> ApiResult<Vec<Dispatch>> {
        let gateway = Actor::Controller("gateway".into());
        let node_ids: Vec<NodeId> = looks.iter().map(|l| l.node_id.clone()).collect();
        let generations = nodes::generation_and_pool_of_each(self.store.db(), &node_ids).await?;
        let open = commands::of_nodes(self.store.db(), &node_ids, OPEN_STATUSES, false).await?;
        let now = self.clock.now();
        let mut answers: Vec<Dispatch> = looks
            .iter()
            .map(|look| {
                let open = open.get(&look.node_id).map_or(&[][..], Vec::as_slice);
                let generation = generations.get(&look.node_id).map_or(0, |(g, _)| *g);
                Dispatch {
                    stop: look
                        .in_flight
                        .iter()
                        .filter(|id| !open.iter().any(|c| &c.id == *id))
                        .cloned()
                        .collect(),
                    spec: (generation > look.spec_sent).then_some(generation),
                    send: Vec::new(),
                }
            })
            .collect();
        let to_dispatch: Vec<NodeId> = looks
            .iter()
            .filter(|look| {
                let open = open.get(&look.node_id).map_or(&[][..], Vec::as_slice);
                anything_to_dispatch(open, look.epoch, now)
            })
            .map(|look| look.node_id.clone())
            .collect();
        if to_dispatch.is_empty() {
            return Ok(answers);
        }
        let txn = self.store.write().await?;
        // Every command this may change is locked here, in id order, before any is written;
        // the events follow at commit (ARCHITECTURE.md, Invariants: lock order).
        let mut open = commands::of_nodes(&*txn, &to_dispatch, OPEN_STATUSES, true).await?;
        let now = self.clock.now();
        let mut changed: Vec<CommandChange> = Vec::new();
        for (look, answer) in looks.iter().zip(answers.iter_mut()) {
            // Only the nodes with something to dispatch were read again, locked.
            let Some(open) = open.get_mut(&look.node_id) else {
                continue;
            };
            for command in open.iter_mut() {
                if lost_with_older_session(command, look.epoch) {
                    let from = command.session_lost(now)?;
                    changed.push(CommandChange::new(from, command, &gateway));
                }
            }
            let mut busy = busy_lanes(open);
            for command in open
                .iter_mut()
                .filter(|c| c.status == CommandStatus::Queued)
            {
                if busy.contains(&command.lane) || !ready_to_send(command, now) {
                    continue;
                }
                let from = command.dispatch(look.epoch, now)?;
                busy.insert(command.lane);
                changed.push(CommandChange::new(from, command, &gateway));
                answer.send.push(command.clone());
            }
        }
        self.write_command_changes(&txn, &changed, now).await?;
        txn.commit().await?;
        Ok(answers)
    }

    /// Daemons' reports of their commands (`command.started`, `command.result`), many per
    /// transaction, each answered in the order given: the command as it now is, or why the
    /// report was refused (it names a command not sent to this node: `BAD_USER_INPUT`; a
    /// cancel or timeout that ended the command first: `INVALID_STATE`, and that state
    /// stands), and the rest are written. The end of a `gpu.reset`, `node.reboot` or
    /// `diag.nvml` is taken to its node's conditions in the same transaction
    /// ([`bc_core::node::NodeRecord::observe_command`], through
    /// [`Services::change_nodes_in`]): a step of a proof satisfied, a condition proven and
    /// cleared, or a proof restarted by a failed verification, each with its event.
    pub async fn report_commands(
        &self,
        reports: &[CommandReport],
    ) -> ApiResult<Vec<ApiResult<Command>>> {
        // Which command each report names, read without the writer: its node says whether
        // the report is this daemon's to make, and its kind whether its end goes to the
        // node's conditions, so whether the node is locked first.
        let ids: Vec<CommandId> = reports.iter().map(|r| r.id.clone()).collect();
        let named = commands::load_many(self.store.db(), &ids, false).await?;
        let mut answers: Vec<Option<ApiResult<Command>>> = reports
            .iter()
            .map(|r| {
                let owned = named.get(&r.id).is_some_and(|c| c.node_id == r.node_id);
                (!owned).then(|| {
                    Err(ApiError::BadUserInput(format!(
                        "command `{}` was not sent to this node",
                        r.id
                    )))
                })
            })
            .collect();
        if answers.iter().all(Option::is_some) {
            return Ok(answers.into_iter().flatten().collect());
        }
        // A result's node, when the result may prove one of its conditions.
        let proving: Vec<NodeId> = reports
            .iter()
            .zip(&answers)
            .filter(|(r, refused)| {
                refused.is_none()
                    && matches!(r.progress, CommandProgress::Finished { .. })
                    && named.get(&r.id).is_some_and(|c| may_prove(c.kind))
            })
            .map(|(r, _)| r.node_id.clone())
            .collect();
        let txn = self.store.write().await?;
        // Node rows before command rows (ARCHITECTURE.md, Invariants: lock order).
        txn.lock_nodes(&proving).await?;
        let mut locked = commands::load_many(&*txn, &ids, true).await?;
        let now = self.clock.now();
        let mut changed: Vec<CommandChange> = Vec::new();
        for (report, answer) in reports.iter().zip(answers.iter_mut()) {
            if answer.is_some() {
                continue;
            }
            let Some(command) = locked.get_mut(&report.id) else {
                *answer = Some(Err(not_found(&report.id)));
                continue;
            };
            // Decided on a copy: a refused report leaves the command as it was.
            let mut next = command.clone();
            match report.progress.clone().apply(&mut next, now) {
                Ok(from) => {
                    *command = next.clone();
                    let daemon = Actor::Node(report.node_id.to_string());
                    changed.push(CommandChange::new(from, &next, &daemon));
                    *answer = Some(Ok(next));
                }
                Err(refused) => *answer = Some(Err(refused.into())),
            }
        }
        self.write_command_changes(&txn, &changed, now).await?;
        let health = Actor::Controller(PROOF_ACTOR.into());
        let proofs = changed
            .iter()
            .map(|change| &change.command)
            .filter(|c| may_prove(c.kind) && c.status.is_final())
            .map(|command| NodeChangeRequest {
                id: command.node_id.clone(),
                actor: health.clone(),
                expected_version: None,
                cause: format!("proof:{}", command.id),
                change: move |n: &mut NodeRecord, by: &Actor, now| {
                    n.observe_command(command, by, now)
                },
            })
            .collect();
        let everyone = |_: &NodeRecord| true;
        for (_, proved) in self.change_nodes_in(&txn, &everyone, proofs).await? {
            match proved {
                // A deleted node has nothing left to prove.
                Ok(_) | Err(ApiError::NotFound(_)) => {}
                Err(err) => return Err(err),
            }
        }
        txn.commit().await?;
        for command in changed
            .iter()
            .map(|change| &change.command)
            .filter(|c| c.status.is_final())
        {
            metrics::counter!("bc_commands_finished_total", "kind" => command.kind.to_string(), "status" => command.status.to_string()).increment(1);
        }
        Ok(answers
            .into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| {
                    Err(ApiError::Internal(anyhow::anyhow!(
                        "a command report went unanswered"
                    )))
                })
            })
            .collect())
    }

    /// The commands that sessions which ended had in flight, each `(node, epoch)` with each
    /// node once, in `txn` ([`Services::end_sessions`]): queued again for the node's next
    /// session, or failed with the reason when resending is unsafe
    /// ([`Command::session_lost`]). A command dispatched to another session of the node (a
    /// newer one) is left alone; each change's event names `by`. Answers each end with the
    /// commands it changed. The caller has locked the nodes and their session rows; the
    /// commands are locked here, after them (ARCHITECTURE.md, Invariants: lock order).
    pub(super) async fn lose_sessions_commands_in(
        &self,
        txn: &WriteTxn,
        ended: &[(NodeId, i64)],
        by: &Actor,
        now: DateTime<Utc>,
    ) -> ApiResult<Vec<Vec<Command>>> {
        let ids: Vec<NodeId> = ended.iter().map(|(id, _)| id.clone()).collect();
        let in_flight = &[CommandStatus::Dispatched, CommandStatus::Running];
        let mut in_flight = commands::of_nodes(&**txn, &ids, in_flight, true).await?;
        let mut changed: Vec<CommandChange> = Vec::new();
        let mut lost: Vec<Vec<Command>> = Vec::with_capacity(ended.len());
        for (node_id, epoch) in ended {
            let mut of_session = Vec::new();
            for mut command in in_flight.remove(node_id).unwrap_or_default() {
                if command.session_epoch == Some(*epoch) {
                    let from = command.session_lost(now)?;
                    changed.push(CommandChange::new(from, &command, by));
                    of_session.push(command);
                }
            }
            lost.push(of_session);
        }
        self.write_command_changes(txn, &changed, now).await?;
        Ok(lost)
    }

    /// Writes the commands changed in `txn`, in the order changed, with one event per change:
    /// every command's last state once, in one batched write ([`commands::save_many`]; the
    /// caller read them locked).
    async fn write_command_changes(
        &self,
        txn: &WriteTxn,
        changed: &[CommandChange],
        now: DateTime<Utc>,
    ) -> ApiResult<()> {
        let mut last: HashMap<&CommandId, &Command> = HashMap::new();
        for change in changed {
            last.insert(&change.command.id, &change.command);
        }
        let mut rows: Vec<&Command> = last.into_values().collect();
        rows.sort_by(|a, b| a.id.cmp(&b.id));
        commands::save_many(&**txn, &rows).await?;
        for change in changed {
            events::append_command(txn, &change.command, Some(change.from), &change.by, now);
        }
        Ok(())
    }

    /// The controller's pass: queued commands past their expiry expire; dispatched or running
    /// ones past their deadline time out. Returns the commands it ended.
    pub async fn end_overdue_commands(&self, limit: u64) -> ApiResult<Vec<Command>> {
        let controller = Actor::Controller("commands".into());
        let now = self.clock.now();
        let candidates = commands::overdue_candidates(self.store.db(), now, limit).await?;
        let mut ended = Vec::new();
        for candidate in candidates {
            if candidate.overdue(now).is_none() {
                continue;
            }
            // Judged again on the locked row: the candidate was read without a lock, and the
            // command may have moved on since (dispatched, requeued, finished).
            // A verification that timed out fails its proof: the node's conditions see it.
            let proving = may_prove(candidate.kind).then_some(&candidate.node_id);
            let result = self
                .change_command_proving(
                    &candidate.id,
                    proving,
                    &controller,
                    None,
                    Command::end_overdue,
                )
                .await;
            match result {
                Ok(command) => ended.push(command),
                // Another writer moved it first: nothing to do.
                Err(ApiError::InvalidState { .. } | ApiError::NotFound(_)) => {}
                Err(other) => return Err(other),
            }
        }
        Ok(ended)
    }

    /// How many commands are in each status, for `/metrics`.
    pub async fn command_queue_depths(&self) -> ApiResult<Vec<(CommandStatus, u64)>> {
        Ok(commands::depths(self.store.db()).await?)
    }
}

/// One session's look at its node ([`Services::dispatch_many`]): the session's epoch, the
/// commands it sent that have not ended as far as it knows, and the spec generation it sent
/// last.
#[derive(Debug, Clone)]
pub struct DispatchLook {
    pub node_id: NodeId,
    pub epoch: i64,
    pub in_flight: Vec<CommandId>,
    pub spec_sent: i64,
}

/// What a session sends after a look, in this order: `cancel` for each of `stop`, `spec` at
/// `spec`, then each of `send`.
#[derive(Debug, Clone, Default)]
pub struct Dispatch {
    /// Commands in flight that ended here (cancelled, timed out) or are gone.
    pub stop: Vec<CommandId>,
    /// The node's spec generation, when it moved past the one the session sent.
    pub spec: Option<i64>,
    /// Commands dispatched to the session, one per lane that was free.
    pub send: Vec<Command>,
}

/// A daemon's report of one of its commands ([`Services::report_commands`]).
#[derive(Debug, Clone)]
pub struct CommandReport {
    pub node_id: NodeId,
    pub id: CommandId,
    pub progress: CommandProgress,
}

/// How far a daemon says a command got.
#[derive(Debug, Clone)]
pub enum CommandProgress {
    /// `command.started`.
    Started,
    /// `command.result`.
    Finished {
        outcome: Outcome,
        exit_code: Option<i32>,
        output: String,
        result: Option<serde_json::Value>,
    },
}

impl CommandProgress {
    /// The command's transition for this report; the status it left, or why it may not.
    fn apply(
        self,
        command: &mut Command,
        now: DateTime<Utc>,
    ) -> Result<CommandStatus, bc_core::DomainError> {
        match self {
            CommandProgress::Started => command.start(now),
            CommandProgress::Finished {
                outcome,
                exit_code,
                output,
                result,
            } => command.finish(outcome, exit_code, &output, result, now),
        }
    }
}

/// A command changed in a transaction: the status it left, the command as it now is, and
/// who changed it (the event's actor).
struct CommandChange {
    from: CommandStatus,
    command: Command,
    by: Actor,
}

impl CommandChange {
    fn new(from: CommandStatus, command: &Command, by: &Actor) -> CommandChange {
        CommandChange {
            from,
            command: command.clone(),
            by: by.clone(),
        }
    }
}

/// The statuses of a command a session may still have to deal with.
const OPEN_STATUSES: &[CommandStatus] = &[
    CommandStatus::Queued,
    CommandStatus::Dispatched,
    CommandStatus::Running,
];

/// The lanes in which a command is dispatched or running.
fn busy_lanes(open: &[Command]) -> HashSet<bc_core::command::Lane> {
    open.iter()
        .filter(|c| c.status != CommandStatus::Queued && !c.status.is_final())
        .map(|c| c.lane)
        .collect()
}

/// Whether a queued command may be sent at `now`: past its `notBefore`, not expired.
fn ready_to_send(command: &Command, now: DateTime<Utc>) -> bool {
    command.not_before <= now && command.expires_at > now
}

/// Whether a command was sent to a session older than `epoch` and not finished: that
/// session is gone, so the command is redelivered or failed.
fn lost_with_older_session(command: &Command, epoch: i64) -> bool {
    command.status != CommandStatus::Queued && command.session_epoch.is_some_and(|e| e < epoch)
}

/// Whether [`Services::dispatch_many`] would change anything for a session of `epoch`
/// given a node's open commands: one dispatched to an older session (to redeliver or fail),
/// or a queued one that may be sent in a free lane. When this says no, the dispatch writes
/// nothing, so it need not take the writer.
fn anything_to_dispatch(open: &[Command], epoch: i64, now: DateTime<Utc>) -> bool {
    let busy = busy_lanes(open);
    open.iter().any(|c| lost_with_older_session(c, epoch))
        || open.iter().any(|c| {
            c.status == CommandStatus::Queued && !busy.contains(&c.lane) && ready_to_send(c, now)
        })
}
