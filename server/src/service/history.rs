//! A node as it was: `nodeAsOf` (at a time or a version) and the node each event of the
//! live feed carries, rebuilt from the event log by `bc_core::history`'s fold.
//!
//! A rebuild reads the events of at most [`bc_core::history::SNAPSHOT_EVERY`] versions of
//! one node (one indexed range read) and folds them; a node's current version is read from its row, never folded.
//! A past `NodeDetail` has no session (sessions are not versioned: heartbeats never bump
//! `version`), and its schedulability explanation is computed for the rebuilt record.

use bc_core::event::RecordedEvent;
use bc_core::history::{self, HistoryError, Rebuild};
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_core::view::NodeDetail;
use chrono::{DateTime, Utc};
use sea_orm::ConnectionTrait;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::Services;
use super::nodes::not_found;
use super::store::{events, nodes};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};

/// Which past node `nodeAsOf` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsOf {
    /// The node as it was at this time: the version in force then.
    Time(DateTime<Utc>),
    /// The node at this version.
    Version(i64),
}

/// The node an event of the feed is about, as it was at that event.
#[derive(Debug, Clone)]
pub enum NodeAtEvent {
    /// The node as it was right after the event.
    Node(Arc<NodeDetail>),
    /// That version of the node cannot be rebuilt: it was written before events carried
    /// rebuild data. Never replaced by today's node.
    NotRecorded { version: i64 },
}

fn history_error(id: &NodeId, err: HistoryError) -> ApiError {
    match err {
        HistoryError::NotRecorded { version } => ApiError::HistoryNotRecorded {
            message: format!("node `{id}`: {err}"),
            version,
        },
        other => ApiError::internal(anyhow::anyhow!("node {id}: {other}")),
    }
}

/// One step per version, from the events of a version range (ordered by version): the
/// first event of each version that carries one.
fn steps_of(events: &[RecordedEvent]) -> ApiResult<Vec<(i64, Option<Rebuild>)>> {
    let mut by_version: BTreeMap<i64, Option<Rebuild>> = BTreeMap::new();
    for event in events {
        let Some(version) = event.node_version() else {
            continue;
        };
        let step = Rebuild::from_event_data(&event.data)
            .map_err(|e| ApiError::internal(anyhow::anyhow!("event {}: {e}", event.id)))?;
        let slot = by_version.entry(version).or_insert(None);
        if slot.is_none() {
            *slot = step;
        }
    }
    Ok(by_version.into_iter().collect())
}

impl Services {
    /// `nodeAsOf(id, at | version)`: the node as it was, rebuilt from its events. Tenant
    /// visibility is the one rule, on the node's owner; a deleted node's history stays
    /// readable. A version out of `1..=current` is `BAD_USER_INPUT`; a time before the node
    /// existed is `NOT_FOUND`; history written before rebuild data was recorded is
    /// `HISTORY_NOT_RECORDED`.
    pub async fn node_as_of(
        &self,
        principal: &Principal,
        id: &NodeId,
        as_of: AsOf,
    ) -> ApiResult<NodeDetail> {
        let read = self.store.read().await?;
        let current = nodes::load(&read, id)
            .await?
            .filter(|n| principal.can_see(n.owner_tenant_id.as_ref()))
            .ok_or_else(|| not_found(id))?;
        let version = match as_of {
            AsOf::Version(v) if v < 1 || v > current.version => {
                return Err(ApiError::BadUserInput(format!(
                    "node `{id}` has versions 1 to {}; there is no version {v}",
                    current.version
                )));
            }
            AsOf::Version(v) => v,
            AsOf::Time(at) if at < current.created_at => {
                return Err(ApiError::NotFound(format!(
                    "node `{id}` did not exist at {}; it was created at {}",
                    at.to_rfc3339(),
                    current.created_at.to_rfc3339()
                )));
            }
            AsOf::Time(at) => {
                match events::node_version_at(&read, id, events::LogPoint::At(at)).await? {
                    Some(v) => v,
                    // Created before `at` but no change recorded by then: a node written without
                    // events (before the log recorded versions), never guessed at.
                    None => {
                        return Err(history_error(id, HistoryError::NotRecorded { version: 1 }));
                    }
                }
            }
        };
        let record = if version == current.version {
            current
        } else {
            rebuild(&read, id, version).await?
        };
        Ok(self.views_of(&read, vec![record], false).await?.remove(0))
    }

    /// For each event of `batch` about a node, that node as it was right after the event
    /// (by position in `batch`): the live feed's enrichment. A node change carries its
    /// version; any other event about a node (a command, an allocation) is at the version in
    /// force at its place in the log. Nodes whose wanted version is their current one come
    /// from their rows (with their session); the others are folded, once per node for the
    /// whole batch.
    pub async fn nodes_at_events(
        &self,
        batch: &[RecordedEvent],
    ) -> ApiResult<Vec<Option<NodeAtEvent>>> {
        let mut ids: Vec<NodeId> = batch.iter().filter_map(|e| e.node_id.clone()).collect();
        ids.sort();
        ids.dedup();
        if ids.is_empty() {
            return Ok(vec![None; batch.len()]);
        }
        let current: HashMap<NodeId, Arc<NodeDetail>> = self
            .node_details_by_ids(&ids)
            .await?
            .into_iter()
            .map(|n| (n.record.id.clone(), Arc::new(n)))
            .collect();
        let read = self.store.read().await?;

        // The version each event is at: its own, else the newest before it in the batch,
        // else (the node changed later in the batch) one before that change, else the
        // log's answer for the batch's first event.
        let mut wanted: Vec<Option<(NodeId, i64)>> = vec![None; batch.len()];
        let mut last: HashMap<NodeId, i64> = HashMap::new();
        let mut pending: Vec<usize> = Vec::new();
        for (i, event) in batch.iter().enumerate() {
            let Some(id) = &event.node_id else { continue };
            if let Some(v) = event.node_version() {
                last.insert(id.clone(), v);
                wanted[i] = Some((id.clone(), v));
            } else if let Some(v) = last.get(id) {
                wanted[i] = Some((id.clone(), *v));
            } else {
                pending.push(i);
            }
        }
        let mut first_in_batch: HashMap<NodeId, i64> = HashMap::new();
        for event in batch {
            if let (Some(id), Some(v)) = (&event.node_id, event.node_version()) {
                first_in_batch.entry(id.clone()).or_insert(v);
            }
        }
        let mut asked: HashMap<NodeId, Option<i64>> = HashMap::new();
        for i in pending {
            let event = &batch[i];
            let Some(id) = event.node_id.clone() else {
                continue;
            };
            let version = match first_in_batch.get(&id) {
                Some(first) => Some(first - 1),
                None => match asked.get(&id) {
                    Some(v) => *v,
                    None => {
                        let v =
                            events::node_version_at(&read, &id, events::LogPoint::Seq(event.id.0))
                                .await?;
                        asked.insert(id.clone(), v);
                        v
                    }
                },
            };
            // No change recorded before it: only a node written without events (a fixture)
            // has none, and it was at version 1 then (its row if it still is, else the
            // rebuild answers that it was not recorded: never today's node).
            let version = version.filter(|v| *v >= 1).unwrap_or(1);
            wanted[i] = Some((id, version));
        }

        // Fold, per node, the versions that are not the current one.
        let mut to_fold: BTreeMap<NodeId, BTreeSet<i64>> = BTreeMap::new();
        for (id, v) in wanted.iter().flatten() {
            if current.get(id).is_none_or(|n| n.record.version != *v) {
                to_fold.entry(id.clone()).or_default().insert(*v);
            }
        }
        let mut folded: HashMap<(NodeId, i64), NodeAtEvent> = HashMap::new();
        for (id, versions) in to_fold {
            // One fold per snapshot segment: a segment that cannot be rebuilt (written before
            // rebuild data) does not keep a later one from being rebuilt.
            let mut segments: BTreeMap<i64, BTreeSet<i64>> = BTreeMap::new();
            for v in versions {
                segments
                    .entry(history::snapshot_base(v))
                    .or_default()
                    .insert(v);
            }
            for (base, versions) in segments {
                let Some(&high) = versions.last() else {
                    continue;
                };
                let events = events::of_node_versions(&read, &id, base, high).await?;
                let steps = steps_of(&events)?;
                let mut records = Vec::new();
                let result = history::fold_visiting(high, &steps, |v, doc| {
                    if versions.contains(&v) {
                        records.push(history::record_of(doc, v)?);
                    }
                    Ok(())
                });
                let failed = match result {
                    Ok(_) => None,
                    Err(HistoryError::NotRecorded { version }) => Some(version),
                    Err(other) => return Err(history_error(&id, other)),
                };
                let found: BTreeSet<i64> = records.iter().map(|r| r.version).collect();
                for detail in self.views_of(&read, records, false).await? {
                    folded.insert(
                        (id.clone(), detail.record.version),
                        NodeAtEvent::Node(Arc::new(detail)),
                    );
                }
                for v in versions.difference(&found) {
                    folded.insert(
                        (id.clone(), *v),
                        NodeAtEvent::NotRecorded {
                            version: failed.unwrap_or(*v),
                        },
                    );
                }
            }
        }
        Ok(wanted
            .into_iter()
            .map(|w| {
                let (id, v) = w?;
                match current.get(&id) {
                    Some(n) if n.record.version == v => Some(NodeAtEvent::Node(n.clone())),
                    _ => folded.get(&(id, v)).cloned(),
                }
            })
            .collect())
    }
}

/// The node at `version`, folded from the log: at most
/// [`bc_core::history::SNAPSHOT_EVERY`] versions' events.
async fn rebuild(conn: &impl ConnectionTrait, id: &NodeId, version: i64) -> ApiResult<NodeRecord> {
    let events =
        events::of_node_versions(conn, id, history::snapshot_base(version), version).await?;
    let steps = steps_of(&events)?;
    history::fold(version, &steps).map_err(|e| history_error(id, e))
}
