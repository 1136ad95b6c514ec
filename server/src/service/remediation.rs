//! Health remediation's use cases: the Remediation controller's work list, one step of a
//! node's remediation ([`Services::advance_remediation`]) and the attempts the API shows.
//!
//! The decisions are `bc_core::remediation::plan`'s; this module reads what it needs with the
//! node row locked, writes what it decided (commands, the attempt rows, the node) and the
//! events, in one transaction. Every attempt is a row, so a restarted server resumes a
//! remediation where it was: an attempt `acting` waits for its command, one `waiting` for its
//! time.

use anyhow::anyhow;
use bc_core::Actor;
use bc_core::axes::{ConditionStatus, Connectivity, ProvisionState, Trust};
use bc_core::clear::{GPU_NEEDS_REBOOT, GPU_NEEDS_RESET};
use bc_core::command::{Command, CommandKind, NewCommand, check_remediation_safety};
use bc_core::ids::{CommandId, NodeId, PoolId};
use bc_core::node::NodeRecord;
use bc_core::reason::ReasonKey;
use bc_core::remediation::{
    AttemptStatus, NodeFacts, Plan, RemediationAttempt, RemediationPolicy, plan,
};
use bc_core::view::NodeDetail;
use std::collections::{BTreeSet, HashMap};

use super::Services;
use super::store::node_filter::NodeFilter;
use super::store::nodes::ChildSets;
use super::store::{WriteTxn, catalog, commands, events, nodes, placement, remediation};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};

/// The controller's name: events and commands say `controller:remediation`.
pub const ACTOR: &str = "remediation";
/// The conditions remediation works on, in the order a node's run picks them when it has
/// several: a reboot resets the GPUs too, so it may prove both.
pub const REMEDIABLE: [&str; 2] = [GPU_NEEDS_REBOOT, GPU_NEEDS_RESET];
/// The attempts a node's page shows at most.
pub const MAX_LISTED_ATTEMPTS: u64 = 50;

/// What one [`Services::advance_remediation`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advanced {
    /// Nothing to do for the node.
    Nothing,
    /// The try waits (backoff, allocations, a session, a command still running).
    Waiting,
    /// The try's action was queued.
    Acted,
    /// The verification was queued.
    Verifying,
    /// The condition was proven and cleared.
    Succeeded,
    /// The try failed; the next one waits for its backoff.
    Retrying,
    /// Remediation gave up: maintenance on, `GpuNeedsPerson`.
    GaveUp,
    /// The run ended without a verdict.
    Cancelled,
}

fn condition_true(node: &NodeRecord, kind: &str) -> bool {
    node.conditions
        .iter()
        .any(|c| c.kind == kind && c.status == ConditionStatus::True)
}

/// In service: remediation may work on it.
fn in_service(node: &NodeRecord) -> bool {
    node.deleted_at.is_none()
        && !node.maintenance
        && matches!(
            node.provision_state,
            ProvisionState::Adopted | ProvisionState::Deployed
        )
}

impl Services {
    /// The Remediation controller's work list, at most `limit` of each kind: nodes with a
    /// remediation under way, and nodes in service carrying a condition their pool's policy
    /// remediates with none under way. Both are indexed reads, so a healthy fleet costs two
    /// small queries per tick.
    pub async fn remediation_work(&self, limit: u64) -> ApiResult<Vec<NodeId>> {
        let db = self.store.db();
        let mut ids: BTreeSet<NodeId> = remediation::open_nodes(db, limit).await?;
        let filter = NodeFilter {
            reasons: REMEDIABLE.iter().map(|c| (*c).to_owned()).collect(),
            provision_states: vec![ProvisionState::Adopted, ProvisionState::Deployed],
            maintenance: Some(false),
            ..NodeFilter::default()
        };
        let candidates = {
            let read = self.store.read().await?;
            nodes::list(&read, &filter, None, limit, ChildSets::ALL).await?
        };
        let mut policies: HashMap<PoolId, Option<RemediationPolicy>> = HashMap::new();
        for node in candidates {
            let Some(pool_id) = &node.pool_id else {
                continue;
            };
            if node.trust == Trust::TenantControlled || ids.contains(&node.id) {
                continue;
            }
            if !policies.contains_key(pool_id) {
                let policy = catalog::pool(db, pool_id).await?.map(|p| p.remediation);
                policies.insert(pool_id.clone(), policy);
            }
            let remediated = policies
                .get(pool_id)
                .and_then(Option::as_ref)
                .is_some_and(|p| {
                    REMEDIABLE
                        .iter()
                        .any(|c| condition_true(&node, c) && p.rule_for(c).is_some())
                });
            if remediated {
                ids.insert(node.id);
            }
        }
        Ok(ids.into_iter().collect())
    }

    /// One step of a node's remediation, in one transaction with the node row locked: start
    /// a run (if the node needs one and its pool's policy has a ladder for it), then do what
    /// [`bc_core::remediation::plan`] says for the open try: wait, queue the action, queue
    /// the verification, record success, fail the try and schedule the next, give up
    /// (maintenance on and `GpuNeedsPerson`, through [`Services::change_node_in`]) or cancel.
    pub async fn advance_remediation(&self, node_id: &NodeId) -> ApiResult<Advanced> {
        let actor = Actor::Controller(ACTOR.into());
        let txn = self.store.write().await?;
        // The node row first (ARCHITECTURE.md, Invariants: lock order); every writer of a
        // node's attempt rows holds it.
        txn.lock_node(node_id).await?;
        let Some(node) = nodes::load(&*txn, node_id).await? else {
            return Ok(Advanced::Nothing);
        };
        let now = self.clock.now();
        let attempt = match remediation::open_of_node(&*txn, node_id).await? {
            Some(open) => open,
            None => match self.start_run(&txn, &node, &actor).await? {
                Some(first) => first,
                None => return Ok(Advanced::Nothing),
            },
        };
        let allocations = placement::active_on_nodes(&*txn, std::slice::from_ref(node_id))
            .await?
            .len() as u64;
        let facts = NodeFacts {
            condition_true: condition_true(&node, &attempt.condition),
            in_service: in_service(&node),
            tenant_controlled: node.trust == Trust::TenantControlled,
            connected: node.connectivity == Connectivity::Connected,
            allocations,
        };
        let action = load_command(&txn, attempt.action_command_id.as_ref()).await?;
        let verify = load_command(&txn, attempt.verify_command_id.as_ref()).await?;
        let decided = plan(&attempt, &facts, action.as_ref(), verify.as_ref(), now);
        let outcome = self
            .carry_out(&txn, &node, attempt, decided, allocations, &actor)
            .await?;
        txn.commit().await?;
        Ok(outcome)
    }

    /// The first try of a run for the node, written with its event, if it needs one.
    async fn start_run(
        &self,
        txn: &WriteTxn,
        node: &NodeRecord,
        actor: &Actor,
    ) -> ApiResult<Option<RemediationAttempt>> {
        if !in_service(node) || node.trust == Trust::TenantControlled {
            return Ok(None);
        }
        let Some(pool_id) = &node.pool_id else {
            return Ok(None);
        };
        let Some(pool) = catalog::pool(&**txn, pool_id).await? else {
            return Ok(None);
        };
        let Some(rule) = REMEDIABLE
            .iter()
            .filter(|c| condition_true(node, c))
            .find_map(|c| pool.remediation.rule_for(c))
        else {
            return Ok(None);
        };
        let now = self.clock.now();
        let mut first =
            RemediationAttempt::first(node.id.clone(), &rule.condition, rule.steps.clone(), now);
        first.note = Some(format!("{} is true; remediation starts", rule.condition));
        remediation::insert(&**txn, &first).await?;
        events::append_remediation(txn, &first, node.owner_tenant_id.as_ref(), None, actor, now);
        Ok(Some(first))
    }

    /// Writes what `decided` says for `attempt`.
    async fn carry_out(
        &self,
        txn: &WriteTxn,
        node: &NodeRecord,
        mut attempt: RemediationAttempt,
        decided: Plan,
        allocations: u64,
        actor: &Actor,
    ) -> ApiResult<Advanced> {
        let now = self.clock.now();
        let before = attempt.status;
        let tenant = node.owner_tenant_id.as_ref();
        let outcome = match decided {
            Plan::Wait(why) => {
                if before == AttemptStatus::Waiting && attempt.note.as_deref() != Some(why.as_str())
                {
                    // Bookkeeping only (why it waits): no new status, no event.
                    attempt.note = Some(why);
                    attempt.updated_at = now;
                    save(txn, before, &attempt).await?;
                }
                return Ok(Advanced::Waiting);
            }
            Plan::Act => {
                let step = attempt.current().cloned().ok_or_else(|| {
                    anyhow!("remediation {}: no step {}", attempt.id, attempt.step)
                })?;
                let kept_off = node.has_reason(&ReasonKey::Condition(attempt.condition.clone()));
                check_remediation_safety(step.action, node.trust, allocations, kept_off)?;
                let command = queue(
                    txn,
                    node,
                    actor,
                    step.action,
                    serde_json::Value::Null,
                    !node.cordoned(),
                    now,
                )
                .await?;
                attempt.action_command_id = Some(command.id.clone());
                attempt.set_status(
                    AttemptStatus::Acting,
                    Some(format!(
                        "{} {} queued (step {}, try {} of {})",
                        step.action,
                        command.id,
                        attempt.step + 1,
                        attempt.attempt,
                        step.attempts
                    )),
                    now,
                );
                Advanced::Acted
            }
            Plan::Verify => {
                let level = attempt.current().map_or(1, |s| s.verify_level);
                // Fresh evidence beside the diagnostic: a report that still shows the fault
                // restarts the proof (bcd/v1 sends sections only when asked).
                let refresh = queue(
                    txn,
                    node,
                    actor,
                    CommandKind::InventoryRefresh,
                    serde_json::json!({ "sections": ["gpus"] }),
                    false,
                    now,
                )
                .await?;
                let verify = queue(
                    txn,
                    node,
                    actor,
                    CommandKind::DiagNvml,
                    serde_json::json!({ "level": level }),
                    false,
                    now,
                )
                .await?;
                attempt.refresh_command_id = Some(refresh.id);
                attempt.verify_command_id = Some(verify.id.clone());
                attempt.set_status(
                    AttemptStatus::Verifying,
                    Some(format!("diag.nvml level {level} {} queued", verify.id)),
                    now,
                );
                Advanced::Verifying
            }
            Plan::Succeed => {
                attempt.set_status(
                    AttemptStatus::Succeeded,
                    Some(format!("{} proven and cleared", attempt.condition)),
                    now,
                );
                Advanced::Succeeded
            }
            Plan::Retry {
                why,
                step,
                attempt: next_try,
                at,
            } => {
                attempt.set_status(AttemptStatus::Failed, Some(why.clone()), now);
                save(txn, before, &attempt).await?;
                events::append_remediation(txn, &attempt, tenant, Some(before), actor, now);
                let mut next = attempt.next(step, next_try, at, now);
                next.note = Some(format!("after: {why}"));
                remediation::insert(&**txn, &next).await?;
                events::append_remediation(txn, &next, tenant, None, actor, now);
                return Ok(Advanced::Retrying);
            }
            Plan::GiveUp(why) => {
                attempt.set_status(AttemptStatus::GaveUp, Some(why.clone()), now);
                save(txn, before, &attempt).await?;
                events::append_remediation(txn, &attempt, tenant, Some(before), actor, now);
                let everyone = |_: &NodeRecord| true;
                let condition = attempt.condition.clone();
                self.change_node_in(
                    txn,
                    actor,
                    &node.id,
                    None,
                    &everyone,
                    &format!("remediation:{}", attempt.id),
                    |n, by, now| n.give_up_remediation(&condition, &why, by, now),
                )
                .await?;
                return Ok(Advanced::GaveUp);
            }
            Plan::Cancel(why) => {
                attempt.set_status(AttemptStatus::Cancelled, Some(why), now);
                Advanced::Cancelled
            }
        };
        save(txn, before, &attempt).await?;
        events::append_remediation(txn, &attempt, tenant, Some(before), actor, now);
        Ok(outcome)
    }

    /// A node's remediation attempts, newest first (the last [`MAX_LISTED_ATTEMPTS`]), if
    /// the principal may see the node.
    pub async fn node_remediation_attempts(
        &self,
        principal: &Principal,
        node: &NodeDetail,
    ) -> ApiResult<Vec<RemediationAttempt>> {
        let node = &node.record;
        if !principal.can_see(node.owner_tenant_id.as_ref()) {
            return Err(ApiError::NotFound(format!(
                "node `{}` does not exist",
                node.id
            )));
        }
        Ok(remediation::of_node(self.store.db(), &node.id, MAX_LISTED_ATTEMPTS).await?)
    }
}

async fn save(
    txn: &WriteTxn,
    before: AttemptStatus,
    attempt: &RemediationAttempt,
) -> ApiResult<()> {
    if remediation::save(&**txn, before, attempt).await? {
        Ok(())
    } else {
        // Every writer holds the node's lock, so this is a bug, not a race.
        Err(anyhow!(
            "remediation attempt {} was not {before} any more",
            attempt.id
        )
        .into())
    }
}

async fn load_command(txn: &WriteTxn, id: Option<&CommandId>) -> ApiResult<Option<Command>> {
    match id {
        Some(id) => Ok(commands::load(&**txn, id, false).await?),
        None => Ok(None),
    }
}

/// Queues one command as the controller, with its event.
async fn queue(
    txn: &WriteTxn,
    node: &NodeRecord,
    actor: &Actor,
    kind: CommandKind,
    params: serde_json::Value,
    force: bool,
    now: chrono::DateTime<chrono::Utc>,
) -> ApiResult<Command> {
    let new = NewCommand {
        kind,
        params,
        timeout: None,
        not_before: None,
        ttl: None,
        force,
    };
    let command = Command::new(
        new,
        node.id.clone(),
        node.owner_tenant_id.clone(),
        actor.clone(),
        now,
    )?;
    commands::insert(&**txn, std::slice::from_ref(&command)).await?;
    events::append_command(txn, &command, None, actor, now);
    Ok(command)
}
