//! The fleet as the dashboard knows it: every visible node's row, kept current by one
//! `nodeChanges` subscription for as long as the operator is signed in. Pages read it; only
//! the subscription writes it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use leptos::prelude::*;

use crate::gql::{FleetChanges, fleet_changes, wire};
use crate::live::{LiveHandle, LiveState, follow};
use crate::model::{Row, seed_spelling};

/// How often received changes are applied to the table. Changes arrive one message per node
/// (a 10,000-node snapshot is 10,000 messages); applying them in batches re-sorts the table
/// ten times a second at most instead of once per message, and keeps every change well
/// within the second an operator expects to wait.
const FLUSH_EVERY: Duration = Duration::from_millis(100);

#[derive(Clone, Copy)]
pub struct FleetStore {
    rows: StoredValue<HashMap<String, Arc<Row>>>,
    pending: StoredValue<Vec<Row>>,
    /// Bumped each time a batch of changes has been applied.
    pub revision: RwSignal<u64>,
    /// The revision the last batch produced and the ids it changed, so a view can move just
    /// those rows; `None` after a change that is not a batch (sign-out forgets every row).
    last_batch: StoredValue<Option<(u64, Vec<String>)>>,
    pub state: RwSignal<LiveState>,
    feed: StoredValue<Option<LiveHandle>>,
}

impl FleetStore {
    pub fn new() -> FleetStore {
        let store = FleetStore {
            rows: StoredValue::new(HashMap::new()),
            pending: StoredValue::new(Vec::new()),
            revision: RwSignal::new(0),
            last_batch: StoredValue::new(None),
            state: RwSignal::new(LiveState::Connecting),
            feed: StoredValue::new(None),
        };
        let interval_ms = u32::try_from(FLUSH_EVERY.as_millis()).unwrap_or(100);
        // The store lives as long as the page, so its timer does too.
        gloo_timers::callback::Interval::new(interval_ms, move || store.flush()).forget();
        store
    }

    /// Starts following the fleet (after sign-in); a running feed is replaced.
    pub fn start(self) {
        self.stop();
        let pending = self.pending;
        let handle = follow::<FleetChanges>(
            |after| fleet_changes::Variables { after },
            |data| Some(data.node_changes.cursor.clone()),
            move |data| pending.update_value(|p| p.push(row_from_feed(data.node_changes.node))),
            self.state,
        );
        self.feed.set_value(Some(handle));
    }

    /// Stops the feed and forgets every row (sign-out).
    pub fn stop(self) {
        if let Some(feed) = self.feed.get_value() {
            feed.stop();
        }
        self.feed.set_value(None);
        self.pending.update_value(Vec::clear);
        self.rows.update_value(HashMap::clear);
        self.last_batch.set_value(None);
        self.revision.update(|r| *r += 1);
    }

    fn flush(self) {
        let batch = self
            .pending
            .try_update_value(std::mem::take)
            .unwrap_or_default();
        if batch.is_empty() {
            return;
        }
        let mut changed = Vec::with_capacity(batch.len());
        self.rows.update_value(|rows| {
            for row in batch {
                // A change can overtake nothing: the feed is ordered, but a snapshot page and
                // a change of the same node may both be in one batch, and the later one wins.
                let newer = rows
                    .get(&row.id)
                    .is_none_or(|old| old.version <= row.version);
                if newer {
                    changed.push(row.id.clone());
                    rows.insert(row.id.clone(), Arc::new(row));
                }
            }
        });
        let revision = self.revision.get_untracked() + 1;
        self.last_batch.set_value(Some((revision, changed)));
        self.revision.set(revision);
    }

    /// Reads the rows (track `revision` to be told when they change).
    pub fn with_rows<R>(&self, f: impl FnOnce(&HashMap<String, Arc<Row>>) -> R) -> R {
        self.rows.with_value(f)
    }

    /// The ids the batch that produced `revision` changed, if that is the newest batch.
    pub fn changed_in(&self, revision: u64) -> Option<Vec<String>> {
        self.last_batch.with_value(|last| match last {
            Some((r, ids)) if *r == revision => Some(ids.clone()),
            _ => None,
        })
    }

    pub fn row(&self, id: &str) -> Option<Arc<Row>> {
        self.rows.with_value(|rows| rows.get(id).cloned())
    }
}

pub fn row_from_feed(node: fleet_changes::FleetRow) -> Row {
    Row {
        id: node.id,
        hostname: node.hostname,
        site_id: node.site_id,
        pool_id: node.pool_id,
        role: seed_spelling(&wire(&node.role)),
        trust: seed_spelling(&wire(&node.trust)),
        version: node.version,
        provision_state: seed_spelling(&wire(&node.provision_state)),
        maintenance: node.maintenance,
        cordoned: node.cordoned,
        connectivity: seed_spelling(&wire(&node.connectivity)),
        conditions: node
            .conditions
            .into_iter()
            .filter(|c| matches!(c.status, fleet_changes::ConditionStatus::TRUE))
            .map(|c| c.type_)
            .collect(),
        reasons: node.no_schedule_reasons,
        gpus: node.gpu_count,
        schedulable: node.schedulability.schedulable,
        bucket: seed_spelling(&wire(&node.schedulability.bucket)),
    }
}

/// The same row from a one-node read (a conflict on a node the feed has not caught up with).
pub fn row_from_read(node: crate::gql::node_row_by_id::FleetRow) -> Row {
    row_from_fragment(&node)
}

/// The row of any generated type that selects the FleetRow fragment's fields. `graphql_client`
/// generates the fragment once per operation, so this goes through JSON rather than copy the
/// mapping field by field. The fields are the fragment's, so it cannot fail unless the
/// operations change; if it does, the console says so and the row stays empty.
pub fn row_from_fragment(node: &impl serde::Serialize) -> Row {
    match serde_json::to_value(node).and_then(serde_json::from_value::<fleet_changes::FleetRow>) {
        Ok(row) => row_from_feed(row),
        Err(err) => {
            leptos::logging::error!("a node does not read as a fleet row: {err}");
            Row::default()
        }
    }
}
