//! Sessions and heartbeats: what the gateway calls as a daemon says hello, heartbeats,
//! converges its spec and goes away. The session row holds the epoch and `lastSeen`, so
//! heartbeats never bump the node's `version`.

use bc_core::Actor;
use bc_core::axes::Connectivity;
use bc_core::ids::NodeId;
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;

use super::Services;
use super::store::{inventory, nodes, sessions};
use crate::error::{ApiError, ApiResult};
use crate::pki::NodeIdentity;

/// A session the gateway opened.
pub struct OpenedSession {
    pub epoch: i64,
    pub want_sections: Vec<String>,
    pub spec_generation: i64,
}

impl Services {
    /// The gateway accepted `hello`: in one transaction, a new session epoch, `connected`,
    /// and the observed generation the daemon reported.
    pub async fn open_session(
        &self,
        identity: &NodeIdentity,
        gateway_id: &str,
        inventory_hashes: &BTreeMap<String, String>,
        observed_generation: i64,
    ) -> ApiResult<OpenedSession> {
        // The gateway checked the certificate before the upgrade ([`Services::check_identity`]);
        // a revocation since then is caught below, in the transaction, by the visibility
        // check on the identity generation.
        let gateway = Actor::Controller("gateway".into());
        let txn = self.store.write().await?;
        let generation = identity.identity_generation;
        // The node row before its session row (ARCHITECTURE.md, Invariants: lock order).
        // Two hellos of one node also take their epochs one after the other this way.
        nodes::lock(&*txn, &identity.node_id).await?;
        let epoch = sessions::open(&*txn, &identity.node_id, gateway_id, self.clock.now()).await?;
        let cause = format!("session:{epoch}");
        let (node, changes) = self
            .change_node_in(
                &txn,
                &gateway,
                &identity.node_id,
                None,
                &|n| n.identity_generation == generation,
                &cause,
                |n, by, now| {
                    let mut changes = n.set_connectivity(Connectivity::Connected, by, now);
                    changes.extend(n.report_observed_generation(observed_generation)?);
                    Ok(changes)
                },
            )
            .await
            .map_err(|e| match e {
                ApiError::NotFound(_) => {
                    ApiError::Forbidden("the node's identity was replaced".into())
                }
                other => other,
            })?;
        let stored = inventory::hashes(&*txn, &identity.node_id).await?;
        txn.commit().await?;
        self.after_node_commit(&node, &changes);
        let want_sections = inventory_hashes
            .iter()
            .filter(|(section, hash)| stored.get(*section) != Some(*hash))
            .map(|(section, _)| section.clone())
            .collect();
        Ok(OpenedSession {
            epoch,
            want_sections,
            spec_generation: node.generation,
        })
    }

    /// The session of `epoch` ended: if it was still the current one, the node becomes
    /// `disconnected` in the same transaction.
    pub async fn close_session(&self, node_id: &NodeId, epoch: i64) -> ApiResult<()> {
        let gateway = Actor::Controller("gateway".into());
        let txn = self.store.write().await?;
        let now = self.clock.now();
        // The node row before its session row (ARCHITECTURE.md, Invariants: lock order).
        nodes::lock(&*txn, node_id).await?;
        // Still the node's latest session: its end disconnects the node, even when the row
        // was already closed (a revoked identity closes it in the revoking transaction).
        let closed = sessions::close(&*txn, node_id, epoch, now).await?;
        if closed || sessions::current_epoch(&*txn, node_id).await? == Some(epoch) {
            let cause = format!("session:{epoch}");
            let result = self
                .change_node_in(
                    &txn,
                    &gateway,
                    node_id,
                    None,
                    &|_| true,
                    &cause,
                    |n, by, now| {
                        // Only a connected node becomes disconnected: if Liveness already
                        // marked it unreachable or lost, the session's end is old news, and
                        // moving it would restart the lost timer.
                        Ok(match n.connectivity {
                            Connectivity::Connected => {
                                n.set_connectivity(Connectivity::Disconnected, by, now)
                            }
                            _ => Vec::new(),
                        })
                    },
                )
                .await;
            match result {
                Ok(_) | Err(ApiError::NotFound(_)) => {}
                Err(other) => return Err(other),
            }
        }
        txn.commit().await?;
        Ok(())
    }

    /// The node's current spec generation (what the gateway sends as `spec`).
    pub async fn spec_generation(&self, node_id: &NodeId) -> ApiResult<i64> {
        Ok(nodes::generation_and_pool(self.store.db(), node_id)
            .await?
            .map_or(0, |(generation, _)| generation))
    }

    /// The daemon converged spec `generation`: the node's `observedGeneration`.
    pub async fn report_converged(&self, node_id: &NodeId, generation: i64) -> ApiResult<()> {
        let actor = Actor::Node(node_id.to_string());
        self.apply_node_change(
            &actor,
            node_id,
            None,
            &|_| true,
            "daemon:converged",
            |n, _, _| n.report_observed_generation(generation),
        )
        .await?;
        Ok(())
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
