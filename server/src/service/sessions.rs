//! Sessions and heartbeats: what the gateway calls as a daemon says hello, heartbeats,
//! converges its spec and goes away. The session row holds the epoch and `lastSeen`, so
//! heartbeats never bump the node's `version`.

use anyhow::anyhow;
use bc_core::Actor;
use bc_core::axes::Connectivity;
use bc_core::command::Command;
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use chrono::{DateTime, Utc};
use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::Services;
use super::node_changes::NodeChangeRequest;
use super::store::{inventory, sessions};
use crate::error::{ApiError, ApiResult};
use crate::pki::NodeIdentity;

/// A session the gateway opened.
pub struct OpenedSession {
    pub epoch: i64,
    pub want_sections: Vec<String>,
    pub spec_generation: i64,
}

/// A daemon's `hello`, as the gateway hands it to [`Services::open_sessions`].
#[derive(Debug, Clone)]
pub struct Hello {
    pub identity: NodeIdentity,
    pub inventory_hashes: BTreeMap<String, String>,
    pub observed_generation: i64,
}

impl Services {
    /// The gateway accepted these `hello`s, each of a different node: in one transaction,
    /// each node's next session epoch, `connected`, and the observed generation its daemon
    /// reported. Each hello is answered in the order given; one refused (its node is gone or
    /// its identity was replaced since the gateway checked the certificate) opens nothing.
    ///
    /// A fleet coming up says hello a hundred times a second, and on SQLite every statement
    /// is a round trip to the one writer that everything else waits on, so the statements
    /// are per batch, not per node: the epochs, the nodes (loaded and written together,
    /// [`Services::change_nodes_in`]), the session rows and the stored inventory hashes.
    pub async fn open_sessions(
        &self,
        gateway_id: &str,
        hellos: &[Hello],
    ) -> ApiResult<Vec<ApiResult<OpenedSession>>> {
        let ids: Vec<NodeId> = hellos.iter().map(|h| h.identity.node_id.clone()).collect();
        if ids.iter().collect::<BTreeSet<_>>().len() != ids.len() {
            return Err(ApiError::Internal(anyhow!(
                "a batch of hellos named a node twice"
            )));
        }
        let gateway = Actor::Controller("gateway".into());
        let txn = self.store.write().await?;
        // The node rows before their session rows (ARCHITECTURE.md, Invariants: lock order).
        txn.lock_nodes(&ids).await?;
        let epochs = sessions::next_epochs(&*txn, &ids).await?;
        // The gateway checked each certificate before the upgrade
        // ([`Services::check_identities`]); a revocation since then is caught here, by the
        // visibility check on the identity generation.
        let generations: HashMap<&NodeId, i64> = hellos
            .iter()
            .map(|h| (&h.identity.node_id, h.identity.identity_generation))
            .collect();
        let same_identity = |n: &NodeRecord| generations.get(&n.id) == Some(&n.identity_generation);
        let requests = hellos
            .iter()
            .map(|hello| {
                let observed_generation = hello.observed_generation;
                NodeChangeRequest {
                    id: hello.identity.node_id.clone(),
                    actor: gateway.clone(),
                    expected_version: None,
                    cause: format!("session:{}", epochs[&hello.identity.node_id]),
                    change: move |n: &mut NodeRecord, by: &Actor, now| {
                        let mut changes = n.set_connectivity(Connectivity::Connected, by, now);
                        changes.extend(n.report_observed_generation(observed_generation)?);
                        Ok(changes)
                    },
                }
            })
            .collect();
        let outcomes = self.change_nodes_in(&txn, &same_identity, requests).await?;
        let opened: Vec<(NodeId, i64)> = outcomes
            .iter()
            .filter(|(_, outcome)| outcome.is_ok())
            .map(|(id, _)| (id.clone(), epochs[id]))
            .collect();
        sessions::open_many(&*txn, &opened, gateway_id, self.clock.now()).await?;
        let opened_ids: Vec<NodeId> = opened.into_iter().map(|(id, _)| id).collect();
        let mut stored = inventory::hashes_of(&*txn, &opened_ids).await?;
        txn.commit().await?;
        Ok(outcomes
            .into_iter()
            .zip(hellos)
            .map(|((id, outcome), hello)| {
                let (node, changes) = outcome.map_err(|e| match e {
                    ApiError::NotFound(_) => {
                        ApiError::Forbidden("the node's identity was replaced".into())
                    }
                    other => other,
                })?;
                self.after_node_commit(&node, &changes);
                let stored = stored.remove(&id).unwrap_or_default();
                let want_sections = hello
                    .inventory_hashes
                    .iter()
                    .filter(|(section, hash)| stored.get(*section) != Some(*hash))
                    .map(|(section, _)| section.clone())
                    .collect();
                Ok(OpenedSession {
                    epoch: epochs[&id],
                    want_sections,
                    spec_generation: node.generation,
                })
            })
            .collect())
    }

    /// Sessions that ended (their daemons left, or the gateway closed them), recorded
    /// together in one transaction, each `(node, epoch)` as if alone. The commands the
    /// session had in flight are queued again for the next session, or failed with the
    /// reason when resending is unsafe ([`Services::lose_sessions_commands_in`]); and if it
    /// was still the node's latest session, its row is closed (unless a revoke closed it
    /// first) and a connected node becomes `disconnected` (one that Liveness already marked
    /// unreachable or lost stays so: the session's end is old news, and moving it would
    /// restart the lost timer). Answers each end with the commands it requeued or failed.
    ///
    /// A network blip that drops every daemon at once ends thousands of sessions in a
    /// second; one transaction each made every ending session wait for a pooled connection,
    /// holding its future (about 20 KB) meanwhile.
    pub async fn end_sessions(&self, ended: &[(NodeId, i64)]) -> ApiResult<Vec<Vec<Command>>> {
        let ids: Vec<NodeId> = ended.iter().map(|(id, _)| id.clone()).collect();
        // A node's commands and disconnect are decided once per batch (`Batches` holds each
        // node once).
        if ids.iter().collect::<BTreeSet<_>>().len() != ids.len() {
            return Err(ApiError::Internal(anyhow!(
                "a batch of session ends named a node twice"
            )));
        }
        let gateway = Actor::Controller("gateway".into());
        let txn = self.store.write().await?;
        let now = self.clock.now();
        // Lock order (ARCHITECTURE.md, Invariants): node rows, session rows, command rows.
        txn.lock_nodes(&ids).await?;
        let latest = sessions::close_many(&*txn, ended, now).await?;
        let lost = self
            .lose_sessions_commands_in(&txn, ended, &gateway, now)
            .await?;
        let disconnects = ended
            .iter()
            .filter(|(node_id, _)| latest.contains(node_id))
            .map(|(node_id, epoch)| NodeChangeRequest {
                id: node_id.clone(),
                actor: gateway.clone(),
                expected_version: None,
                cause: format!("session:{epoch}"),
                change: |n: &mut NodeRecord, by: &Actor, now: DateTime<Utc>| {
                    Ok(match n.connectivity {
                        Connectivity::Connected => {
                            n.set_connectivity(Connectivity::Disconnected, by, now)
                        }
                        _ => Vec::new(),
                    })
                },
            })
            .collect();
        for (_, outcome) in self.change_nodes_in(&txn, &|_| true, disconnects).await? {
            match outcome {
                // Deleted meanwhile: nothing to disconnect.
                Ok(_) | Err(ApiError::NotFound(_)) => {}
                Err(other) => return Err(other),
            }
        }
        txn.commit().await?;
        Ok(lost)
    }

    /// Daemons converged their specs, each `(node, generation)`: the nodes'
    /// `observedGeneration`, in one transaction ([`Services::change_nodes_in`]). Each report
    /// is answered in the order given; one the domain refuses (a generation the node never
    /// had) is answered with its error, and the rest are written.
    pub async fn report_converged_many(
        &self,
        reports: &[(NodeId, i64)],
    ) -> ApiResult<Vec<ApiResult<()>>> {
        let requests = reports
            .iter()
            .map(|&(ref node_id, generation)| NodeChangeRequest {
                actor: Actor::Node(node_id.to_string()),
                id: node_id.clone(),
                expected_version: None,
                cause: "daemon:converged".to_owned(),
                change: move |n: &mut NodeRecord, _: &Actor, _| {
                    n.report_observed_generation(generation)
                },
            })
            .collect();
        let outcomes = self.apply_node_changes(requests).await?;
        Ok(outcomes
            .into_iter()
            .map(|(_, outcome)| outcome.map(|_| ()))
            .collect())
    }

    /// Records a batch of heartbeats in one transaction; returns the (node, epoch) pairs
    /// whose session is no longer current, so the gateway can end them.
    pub async fn record_heartbeats(
        &self,
        beats: &[(NodeId, i64, DateTime<Utc>)],
    ) -> ApiResult<Vec<(NodeId, i64)>> {
        let txn = self.store.write().await?;
        let stale = sessions::record_heartbeats(&*txn, beats).await?;
        txn.commit().await?;
        Ok(stale)
    }
}
