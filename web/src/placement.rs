//! Placement, the pure parts: a reservation as the dashboard holds it, how its shape and a
//! node's drain read, the create form's checks, keeping a live list current, and what a
//! release conflict shows. Unit-tested; the pages are in `reservations.rs` and
//! `allocations.rs`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::gql::create_reservation;
use crate::model::FactChange;

/// A reservation: the `ReservationFields` fragment. `graphql_client` generates the fragment
/// once per operation (list, read, create, release, live), so each is read into this one type
/// through JSON, the way `store::row_from_fragment` reads nodes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reservation {
    pub id: String,
    pub tenant_id: String,
    pub pool_id: String,
    pub gpus_per_node: i64,
    pub node_count: i64,
    pub gpu_model: Option<String>,
    pub selector: Vec<LabelRequirement>,
    pub tolerations: Vec<String>,
    /// `BIN_PACK` or `SPREAD`.
    pub policy: String,
    /// `PENDING`, `PLACED`, `RELEASED` or `FAILED`.
    pub state: String,
    pub reason: Option<String>,
    pub idempotency_key: Option<String>,
    pub expires_at: Option<String>,
    pub version: i64,
    pub created_by: String,
    pub created_at: String,
    pub updated_at: String,
    pub allocations: Vec<Allocation>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LabelRequirement {
    pub key: String,
    pub value: Option<String>,
}

/// One node's booked atoms, as a reservation lists them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocation {
    pub id: String,
    pub node_id: String,
    pub atoms: Vec<String>,
    pub active: bool,
    pub booked_at: String,
    pub released_at: Option<String>,
    pub release_reason: Option<String>,
}

/// The states a reservation moves through, in the order the state filter lists them.
pub const STATES: [&str; 4] = ["PENDING", "PLACED", "RELEASED", "FAILED"];

/// The placer's policies: wire name and what the form says of each.
pub const POLICIES: [(&str, &str); 2] = [
    ("BIN_PACK", "bin-pack (fullest node first)"),
    ("SPREAD", "spread (emptiest node first)"),
];

impl Reservation {
    /// The reservation in any generated type that selects the `ReservationFields` fragment.
    /// The fields are the fragment's, so this fails only if the operations change; then the
    /// console says so and the reservation is left out.
    pub fn of(fragment: &impl Serialize) -> Option<Reservation> {
        match serde_json::to_value(fragment).and_then(serde_json::from_value) {
            Ok(reservation) => Some(reservation),
            Err(err) => {
                leptos::logging::error!("a reservation does not read as one: {err}");
                None
            }
        }
    }

    /// "2 × 8 GPUs", with the model when one is asked for.
    pub fn shape(&self) -> String {
        let gpus = if self.gpus_per_node == 1 {
            "GPU"
        } else {
            "GPUs"
        };
        let shape = format!("{} × {} {gpus}", self.node_count, self.gpus_per_node);
        match &self.gpu_model {
            Some(model) => format!("{shape} ({model})"),
            None => shape,
        }
    }

    /// The nodes it holds atoms on now, in booking order.
    pub fn active_nodes(&self) -> Vec<&str> {
        self.allocations
            .iter()
            .filter(|a| a.active)
            .map(|a| a.node_id.as_str())
            .collect()
    }

    /// Whether it still holds or waits for GPUs, so releasing it means something.
    pub fn is_live(&self) -> bool {
        matches!(self.state.as_str(), "PENDING" | "PLACED")
    }
}

/// The reservations page's filters: one pool and one state, each optional (empty: any).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListFilter {
    pub pool: String,
    pub state: String,
}

impl ListFilter {
    pub fn matches(&self, r: &Reservation) -> bool {
        (self.pool.is_empty() || r.pool_id == self.pool)
            && (self.state.is_empty() || r.state == self.state)
    }
}

/// Applies one reservation as it is now (a live update, a create's or release's answer) to a
/// list shown under `filter`, newest first: a newer version replaces the one shown (an equal
/// one too, as the reason of a pending reservation changes without a new version); one that
/// no longer matches the filter leaves; a new one that matches comes in at its place.
/// Returns whether the list changed.
pub fn apply_update(list: &mut Vec<Reservation>, update: Reservation, filter: &ListFilter) -> bool {
    match list.iter().position(|r| r.id == update.id) {
        Some(i) if list[i].version > update.version => false,
        Some(i) if !filter.matches(&update) => {
            list.remove(i);
            true
        }
        Some(i) if list[i] == update => false,
        Some(i) => {
            list[i] = update;
            true
        }
        None if !filter.matches(&update) => false,
        None => {
            // Newest first, as the server pages them: by creation time, then id.
            let at = list
                .iter()
                .position(|r| (&r.created_at, &r.id) < (&update.created_at, &update.id))
                .unwrap_or(list.len());
            list.insert(at, update);
            true
        }
    }
}

/// What a release conflict shows: every fact of the reservation that differs between the one
/// the operator saw and the one stored now (the version, which always differs, left out).
/// `host` names a node.
pub fn reservation_changes(
    before: &Reservation,
    after: &Reservation,
    host: impl Fn(&str) -> String,
) -> Vec<FactChange> {
    let nodes = |r: &Reservation| {
        r.active_nodes()
            .into_iter()
            .map(&host)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let text = |o: &Option<String>| o.clone().unwrap_or_default();
    let facts: [(&'static str, String, String); 5] = [
        ("State", state_text(&before.state), state_text(&after.state)),
        ("Reason", text(&before.reason), text(&after.reason)),
        ("Nodes", nodes(before), nodes(after)),
        ("Shape", before.shape(), after.shape()),
        ("Expires", text(&before.expires_at), text(&after.expires_at)),
    ];
    facts
        .into_iter()
        .filter(|(_, b, a)| b != a)
        .map(|(fact, before, after)| FactChange {
            fact,
            before,
            after,
        })
        .collect()
}

/// A state as the page writes it: `placed`.
pub fn state_text(state: &str) -> String {
    crate::model::seed_spelling(state)
}

/// How a draining node is doing: "3 allocations left, deadline in 12 min", "1 allocation
/// left, no deadline", "deadline passed 2 min ago" … measured at `now`.
pub fn drain_progress(
    allocations_left: usize,
    deadline: Option<&str>,
    now: DateTime<Utc>,
) -> String {
    let left = match allocations_left {
        0 => "no allocations left".to_owned(),
        1 => "1 allocation left".to_owned(),
        n => format!("{n} allocations left"),
    };
    let deadline = match deadline.map(DateTime::parse_from_rfc3339) {
        None => "no deadline".to_owned(),
        Some(Err(_)) => "deadline unknown".to_owned(),
        Some(Ok(at)) => {
            let secs = (at.with_timezone(&Utc) - now).num_seconds();
            if secs >= 0 {
                format!("deadline in {}", duration_text(secs))
            } else {
                format!("deadline passed {} ago", duration_text(-secs))
            }
        }
    };
    format!("{left}, {deadline}")
}

/// `40 s`, `12 min`, `2 h 5 min`, `3 d 4 h`: whole units, rounded down.
pub fn duration_text(secs: i64) -> String {
    match secs {
        s if s < 60 => format!("{s} s"),
        s if s < 3_600 => format!("{} min", s / 60),
        s if s < 86_400 => match (s % 3_600) / 60 {
            0 => format!("{} h", s / 3_600),
            m => format!("{} h {m} min", s / 3_600),
        },
        s => match (s % 86_400) / 3_600 {
            0 => format!("{} d", s / 86_400),
            h => format!("{} d {h} h", s / 86_400),
        },
    }
}

/// The units an expiry is given in, with their length in seconds.
pub const EXPIRY_UNITS: [(&str, i64); 3] = [("minutes", 60), ("hours", 3_600), ("days", 86_400)];

/// What the create form's inputs say, before they are checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ReservationForm {
    pub tenant: String,
    pub pool: String,
    pub gpus_per_node: String,
    pub node_count: String,
    pub gpu_model: String,
    /// An index into [`POLICIES`].
    pub policy: usize,
    /// Taint keys, separated by commas or spaces.
    pub tolerations: String,
    /// `key` or `key=value`, separated by commas or line breaks.
    pub selector: String,
    /// Empty: it never expires.
    pub expires_in: String,
    /// An index into [`EXPIRY_UNITS`].
    pub expires_unit: usize,
    /// Sent with the create, so a retried submit of the same form (a timeout, a double click)
    /// returns the first reservation instead of booking a second.
    pub idempotency_key: String,
}

impl Default for ReservationForm {
    fn default() -> Self {
        ReservationForm {
            tenant: String::new(),
            pool: String::new(),
            gpus_per_node: "8".to_owned(),
            node_count: "1".to_owned(),
            gpu_model: String::new(),
            policy: 0,
            tolerations: String::new(),
            selector: String::new(),
            expires_in: String::new(),
            expires_unit: 1,
            idempotency_key: String::new(),
        }
    }
}

/// The server's bounds on a shape (`bc_core::placement`), checked here too so the form says
/// what is wrong before a round trip.
const MAX_GPUS_PER_NODE: i64 = 64;
const MAX_NODE_COUNT: i64 = 1024;

impl ReservationForm {
    /// Checks the inputs; `needs_tenant` for a platform principal, who must name the tenant.
    /// `now` dates the expiry. The error says what is wrong.
    pub fn check(
        &self,
        needs_tenant: bool,
        now: DateTime<Utc>,
    ) -> Result<create_reservation::CreateReservationInput, String> {
        use create_reservation::{LabelSelectorInput, PlacementPolicy};
        let tenant = self.tenant.trim();
        if needs_tenant && tenant.is_empty() {
            return Err("Choose the tenant the GPUs are for.".to_owned());
        }
        if self.pool.trim().is_empty() {
            return Err("Choose a pool.".to_owned());
        }
        let gpus_per_node = whole_number(&self.gpus_per_node, "GPUs per node", MAX_GPUS_PER_NODE)?;
        let node_count = whole_number(&self.node_count, "Node count", MAX_NODE_COUNT)?;
        let mut selector = Vec::new();
        for term in self
            .selector
            .split([',', '\n'])
            .map(str::trim)
            .filter(|t| !t.is_empty())
        {
            let (key, value) = match term.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim().to_owned())),
                None => (term, None),
            };
            if key.is_empty() {
                return Err(format!("`{term}` has no label key."));
            }
            selector.push(LabelSelectorInput {
                key: key.to_owned(),
                value,
            });
        }
        let tolerations: Vec<String> = self
            .tolerations
            .split([',', ' ', '\n'])
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect();
        let expires_at = match self.expires_in.trim() {
            "" => None,
            amount => {
                let amount: i64 = amount
                    .parse()
                    .ok()
                    .filter(|a| *a > 0)
                    .ok_or_else(|| "Expires in must be a whole number above 0.".to_owned())?;
                let unit = EXPIRY_UNITS.get(self.expires_unit).map_or(3_600, |u| u.1);
                let at = amount
                    .checked_mul(unit)
                    .and_then(chrono::Duration::try_seconds)
                    .and_then(|d| now.checked_add_signed(d))
                    .ok_or_else(|| "Expires in is too far away.".to_owned())?;
                Some(at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            }
        };
        let gpu_model = Some(self.gpu_model.trim().to_owned()).filter(|m| !m.is_empty());
        Ok(create_reservation::CreateReservationInput {
            tenant_id: Some(tenant.to_owned()).filter(|t| !t.is_empty()),
            pool_id: self.pool.trim().to_owned(),
            gpus_per_node,
            node_count,
            gpu_model,
            selector: (!selector.is_empty()).then_some(selector),
            tolerations: (!tolerations.is_empty()).then_some(tolerations),
            policy: if POLICIES.get(self.policy).is_some_and(|p| p.0 == "SPREAD") {
                PlacementPolicy::SPREAD
            } else {
                PlacementPolicy::BIN_PACK
            },
            idempotency_key: Some(self.idempotency_key.clone()).filter(|k| !k.is_empty()),
            expires_at,
        })
    }
}

fn whole_number(text: &str, what: &str, max: i64) -> Result<i64, String> {
    text.trim()
        .parse::<i64>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| format!("{what} must be a whole number from 1 to {max}."))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("a time")
            .with_timezone(&Utc)
    }

    fn reservation(id: &str, created_at: &str, state: &str, version: i64) -> Reservation {
        Reservation {
            id: id.to_owned(),
            pool_id: "pool_a".to_owned(),
            gpus_per_node: 8,
            node_count: 2,
            state: state.to_owned(),
            version,
            created_at: created_at.to_owned(),
            ..Reservation::default()
        }
    }

    #[test]
    fn a_generated_fragment_reads_as_a_reservation() {
        let fragment: crate::gql::reservations::ReservationFields =
            serde_json::from_value(serde_json::json!({
                "id": "rsv_1", "tenantId": "tnt_1", "poolId": "pool_a", "gpusPerNode": 8,
                "nodeCount": 2, "gpuModel": null, "selector": [{ "key": "rack", "value": null }],
                "tolerations": ["gpu-burn"], "policy": "SPREAD", "state": "PLACED",
                "reason": null, "idempotencyKey": "k", "expiresAt": null, "version": 2,
                "createdBy": "user:dev-admin", "createdAt": "2026-12-03T10:00:00Z",
                "updatedAt": "2026-12-03T10:00:01Z",
                "allocations": [
                    { "id": "alloc_1", "nodeId": "node_1", "atoms": ["gpu0/whole"], "active": true,
                      "bookedAt": "2026-12-03T10:00:01Z", "releasedAt": null, "releaseReason": null },
                    { "id": "alloc_0", "nodeId": "node_9", "atoms": ["gpu0/whole"], "active": false,
                      "bookedAt": "2026-12-03T09:00:00Z", "releasedAt": "2026-12-03T09:30:00Z",
                      "releaseReason": "evicted" }
                ]
            }))
            .expect("a fragment");
        let r = Reservation::of(&fragment).expect("a reservation");
        assert_eq!(r.policy, "SPREAD");
        assert_eq!(r.state, "PLACED");
        assert_eq!(r.selector[0].key, "rack");
        assert_eq!(r.active_nodes(), ["node_1"]);
        assert!(r.is_live());
        assert_eq!(r.shape(), "2 × 8 GPUs");
    }

    #[test]
    fn shapes_read_as_nodes_times_gpus() {
        let mut r = reservation("rsv_1", "t", "PENDING", 1);
        r.node_count = 1;
        r.gpus_per_node = 1;
        assert_eq!(r.shape(), "1 × 1 GPU");
        r.gpu_model = Some("H100".to_owned());
        assert_eq!(r.shape(), "1 × 1 GPU (H100)");
    }

    #[test]
    fn live_updates_keep_a_filtered_list_newest_first() {
        let pending = ListFilter {
            pool: String::new(),
            state: "PENDING".to_owned(),
        };
        let mut list = vec![
            reservation("rsv_c", "2026-12-03T10:03:00Z", "PENDING", 1),
            reservation("rsv_a", "2026-12-03T10:01:00Z", "PENDING", 1),
        ];
        // A new one in between, by creation time.
        assert!(apply_update(
            &mut list,
            reservation("rsv_b", "2026-12-03T10:02:00Z", "PENDING", 1),
            &pending
        ));
        let ids = |l: &[Reservation]| l.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&list), ["rsv_c", "rsv_b", "rsv_a"]);
        // An older version than the one shown changes nothing; the same one neither.
        assert!(!apply_update(
            &mut list,
            reservation("rsv_b", "2026-12-03T10:02:00Z", "PENDING", 0),
            &pending
        ));
        assert!(!apply_update(
            &mut list,
            reservation("rsv_b", "2026-12-03T10:02:00Z", "PENDING", 1),
            &pending
        ));
        // The same version with a new reason replaces it.
        let mut explained = reservation("rsv_b", "2026-12-03T10:02:00Z", "PENDING", 1);
        explained.reason = Some("1 of 2 nodes fit".to_owned());
        assert!(apply_update(&mut list, explained.clone(), &pending));
        assert_eq!(list[1], explained);
        // Placed: it no longer matches the filter and leaves.
        assert!(apply_update(
            &mut list,
            reservation("rsv_b", "2026-12-03T10:02:00Z", "PLACED", 2),
            &pending
        ));
        assert_eq!(ids(&list), ["rsv_c", "rsv_a"]);
        // One that never matched stays out.
        assert!(!apply_update(
            &mut list,
            reservation("rsv_d", "2026-12-03T10:04:00Z", "PLACED", 2),
            &pending
        ));
        // Without a filter the newest goes first.
        assert!(apply_update(
            &mut list,
            reservation("rsv_d", "2026-12-03T10:04:00Z", "PLACED", 2),
            &ListFilter::default()
        ));
        assert_eq!(ids(&list), ["rsv_d", "rsv_c", "rsv_a"]);
        // Another pool's stays out of a pool filter.
        let pool_b = ListFilter {
            pool: "pool_b".to_owned(),
            state: String::new(),
        };
        assert!(!apply_update(
            &mut list,
            reservation("rsv_e", "2026-12-03T10:05:00Z", "PLACED", 2),
            &pool_b
        ));
    }

    #[test]
    fn a_conflict_names_what_moved() {
        let before = reservation("rsv_1", "t", "PENDING", 1);
        let mut after = reservation("rsv_1", "t", "PLACED", 2);
        after.allocations = vec![
            Allocation {
                node_id: "node_1".to_owned(),
                active: true,
                ..Allocation::default()
            },
            Allocation {
                node_id: "node_2".to_owned(),
                active: true,
                ..Allocation::default()
            },
        ];
        let host = |id: &str| id.replace("node_", "gpu-");
        let changes = reservation_changes(&before, &after, host);
        let text: Vec<String> = changes
            .iter()
            .map(|c| format!("{}: {} → {}", c.fact, c.before, c.after))
            .collect();
        assert_eq!(text, ["State: pending → placed", "Nodes:  → gpu-1, gpu-2"]);
        assert!(reservation_changes(&before, &before, |id: &str| id.to_owned()).is_empty());
    }

    #[test]
    fn drain_progress_counts_allocations_and_time() {
        let now = at("2026-12-03T10:00:00Z");
        assert_eq!(
            drain_progress(3, Some("2026-12-03T10:12:30Z"), now),
            "3 allocations left, deadline in 12 min"
        );
        assert_eq!(
            drain_progress(1, None, now),
            "1 allocation left, no deadline"
        );
        assert_eq!(
            drain_progress(0, Some("2026-12-03T09:58:00Z"), now),
            "no allocations left, deadline passed 2 min ago"
        );
        assert_eq!(
            drain_progress(2, Some("2026-12-03T10:00:40Z"), now),
            "2 allocations left, deadline in 40 s"
        );
        assert_eq!(duration_text(2 * 3_600 + 5 * 60 + 7), "2 h 5 min");
        assert_eq!(duration_text(3 * 3_600), "3 h");
        assert_eq!(duration_text(3 * 86_400 + 4 * 3_600), "3 d 4 h");
        assert_eq!(duration_text(2 * 86_400), "2 d");
    }

    #[test]
    fn the_create_form_is_checked() {
        let now = at("2026-12-03T10:00:00Z");
        let form = ReservationForm {
            pool: "pool_a".to_owned(),
            ..ReservationForm::default()
        };
        let input = form.check(false, now).expect("the defaults are a request");
        assert_eq!((input.gpus_per_node, input.node_count), (8, 1));
        assert_eq!(input.tenant_id, None);
        assert_eq!(input.expires_at, None);
        assert!(input.selector.is_none() && input.tolerations.is_none());
        assert_eq!(
            form.check(true, now).expect_err("no tenant"),
            "Choose the tenant the GPUs are for."
        );

        let full = ReservationForm {
            tenant: "tnt_1".to_owned(),
            pool: "pool_a".to_owned(),
            gpus_per_node: " 4 ".to_owned(),
            node_count: "2".to_owned(),
            gpu_model: " H100 ".to_owned(),
            policy: 1,
            tolerations: "gpu-burn, maint".to_owned(),
            selector: "rack=r1\nfast".to_owned(),
            expires_in: "90".to_owned(),
            expires_unit: 0,
            idempotency_key: "web-1".to_owned(),
        };
        let input = full.check(true, now).expect("a full request");
        assert_eq!(input.tenant_id.as_deref(), Some("tnt_1"));
        assert_eq!(input.gpu_model.as_deref(), Some("H100"));
        assert!(matches!(
            input.policy,
            create_reservation::PlacementPolicy::SPREAD
        ));
        assert_eq!(
            input.tolerations,
            Some(vec!["gpu-burn".to_owned(), "maint".to_owned()])
        );
        let selector = input.selector.expect("a selector");
        assert_eq!(
            (selector[0].key.as_str(), selector[0].value.as_deref()),
            ("rack", Some("r1"))
        );
        assert_eq!(
            (selector[1].key.as_str(), selector[1].value.as_deref()),
            ("fast", None)
        );
        assert_eq!(input.expires_at.as_deref(), Some("2026-12-03T11:30:00Z"));
        assert_eq!(input.idempotency_key.as_deref(), Some("web-1"));

        let bad = |change: fn(&mut ReservationForm)| {
            let mut f = full.clone();
            change(&mut f);
            f.check(true, now).expect_err("refused")
        };
        assert_eq!(
            bad(|f| f.gpus_per_node = "65".to_owned()),
            "GPUs per node must be a whole number from 1 to 64."
        );
        assert_eq!(
            bad(|f| f.node_count = "0".to_owned()),
            "Node count must be a whole number from 1 to 1024."
        );
        assert_eq!(bad(|f| f.pool.clear()), "Choose a pool.");
        assert_eq!(
            bad(|f| f.selector = "=x".to_owned()),
            "`=x` has no label key."
        );
        assert_eq!(
            bad(|f| f.expires_in = "-1".to_owned()),
            "Expires in must be a whole number above 0."
        );
    }
}
