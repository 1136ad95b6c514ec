//! The command queue's use cases: send, cancel and read for people; dispatch, start, result
//! and session loss for the gateway; expiry and timeouts for the controller.

use bc_core::Actor;
use bc_core::command::{Command, CommandStatus, NewCommand, Outcome, check_safety};
use bc_core::ids::{CommandId, NodeId};
use chrono::{DateTime, Utc};
use std::collections::HashSet;

use super::NodeFilter;
use super::Services;
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
    /// controller that queues a check for each of a thousand nodes commits once.
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
        let queued = requests
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

    /// One command, whoever owns it (the gateway checks its own session's commands).
    pub async fn command_for_gateway(&self, id: &CommandId) -> ApiResult<Option<Command>> {
        Ok(commands::load(self.store.db(), id, false).await?)
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
            nodes::lock(&*txn, node).await?;
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

    /// For the session of `epoch`: in each lane with nothing dispatched or running, the
    /// oldest queued command that may run now is dispatched. Returns what to send.
    pub async fn dispatch_commands(&self, node_id: &NodeId, epoch: i64) -> ApiResult<Vec<Command>> {
        let gateway = Actor::Controller("gateway".into());
        // Most calls have nothing to do (a poke about another node's lane, a result with
        // nothing queued behind it): they find that out without the writer, which on SQLite
        // every session, controller and operator queues on.
        {
            let open = commands::of_node(self.store.db(), node_id, OPEN_STATUSES).await?;
            if !anything_to_dispatch(&open, epoch, self.clock.now()) {
                return Ok(Vec::new());
            }
        }
        let txn = self.store.write().await?;
        // Every command this may change is locked here, in id order, before any is written;
        // the events follow at commit (ARCHITECTURE.md, Invariants: lock order).
        let mut open = commands::of_node(&*txn, node_id, OPEN_STATUSES).await?;
        let now = self.clock.now();
        // Commands still marked dispatched to an older session lost it without the gateway
        // noticing (a crashed replica): they are redelivered (or failed) now, as if that
        // session had ended cleanly.
        for command in open.iter_mut() {
            if lost_with_older_session(command, epoch) {
                let from = command.session_lost(now)?;
                if commands::save(&*txn, from, command).await? {
                    events::append_command(&txn, command, Some(from), &gateway, now);
                }
            }
        }
        let mut busy = busy_lanes(&open);
        let mut sent = Vec::new();
        for mut command in open
            .into_iter()
            .filter(|c| c.status == CommandStatus::Queued)
        {
            if busy.contains(&command.lane) || !ready_to_send(&command, now) {
                continue;
            }
            let from = command.dispatch(epoch, now)?;
            if commands::save(&*txn, from, &command).await? {
                events::append_command(&txn, &command, Some(from), &gateway, now);
                busy.insert(command.lane);
                sent.push(command);
            }
        }
        txn.commit().await?;
        Ok(sent)
    }

    /// The daemon says it started `id`.
    pub async fn command_started(&self, node_id: &NodeId, id: &CommandId) -> ApiResult<Command> {
        let actor = Actor::Node(node_id.to_string());
        self.change_own_command(node_id, id, &actor, |c, now| c.start(now))
            .await
    }

    /// The daemon's result for `id`. If a cancel or timeout already ended the command, that
    /// state stands and the late result is refused (INVALID_STATE), which the gateway logs.
    pub async fn command_finished(
        &self,
        node_id: &NodeId,
        id: &CommandId,
        outcome: Outcome,
        exit_code: Option<i32>,
        output: &str,
        result: Option<serde_json::Value>,
    ) -> ApiResult<Command> {
        let actor = Actor::Node(node_id.to_string());
        let command = self
            .change_own_command(node_id, id, &actor, |c, now| {
                c.finish(outcome, exit_code, output, result, now)
            })
            .await?;
        metrics::counter!("bc_commands_finished_total", "kind" => command.kind.to_string(), "status" => command.status.to_string()).increment(1);
        Ok(command)
    }

    async fn change_own_command(
        &self,
        node_id: &NodeId,
        id: &CommandId,
        actor: &Actor,
        change: impl FnOnce(&mut Command, DateTime<Utc>) -> Result<CommandStatus, bc_core::DomainError>,
    ) -> ApiResult<Command> {
        let Some(owned) = commands::load(self.store.db(), id, false)
            .await?
            .filter(|c| &c.node_id == node_id)
        else {
            return Err(ApiError::BadUserInput(format!(
                "command `{id}` was not sent to this node"
            )));
        };
        let proving = may_prove(owned.kind).then_some(node_id);
        self.change_command_proving(id, proving, actor, None, change)
            .await
    }

    /// The session of `epoch` ended: its dispatched and running commands are queued again for
    /// the next session, or failed with the reason when resending is unsafe.
    pub async fn commands_session_lost(
        &self,
        node_id: &NodeId,
        epoch: i64,
    ) -> ApiResult<Vec<Command>> {
        let gateway = Actor::Controller("gateway".into());
        let txn = self.store.write().await?;
        // Locked up front in id order, as in `dispatch_commands`.
        let active = commands::of_node(
            &*txn,
            node_id,
            &[CommandStatus::Dispatched, CommandStatus::Running],
        )
        .await?;
        let now = self.clock.now();
        let mut changed = Vec::new();
        for mut command in active
            .into_iter()
            .filter(|c| c.session_epoch == Some(epoch))
        {
            let from = command.session_lost(now)?;
            if commands::save(&*txn, from, &command).await? {
                events::append_command(&txn, &command, Some(from), &gateway, now);
                changed.push(command);
            }
        }
        txn.commit().await?;
        Ok(changed)
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

/// Whether [`Services::dispatch_commands`] would change anything for a session of `epoch`
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
