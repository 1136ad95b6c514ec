//! The fleet table's data, as plain Rust: a row per node, the columns, filtering, sorting and
//! the comparison a `CONFLICT` shows. Nothing here touches the DOM or the network, so all of
//! it is unit-tested natively (`cargo test` in `web/`).

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// One node as the fleet table shows it. Enumerations are kept as the seed spells them
/// (`adopting`, `tenant-owned`), which is also what the filters match.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub id: String,
    pub hostname: String,
    pub site_id: String,
    pub pool_id: Option<String>,
    pub role: String,
    pub trust: String,
    pub version: i64,
    pub provision_state: String,
    pub maintenance: bool,
    pub cordoned: bool,
    pub connectivity: String,
    /// Conditions whose status is `true`, by type.
    pub conditions: Vec<String>,
    pub reasons: Vec<String>,
    pub gpus: i64,
    pub schedulable: bool,
    pub bucket: String,
}

/// An SDL enum value (`TENANT_OWNED`) as the seed writes it (`tenant-owned`).
pub fn seed_spelling(wire: &str) -> String {
    wire.to_ascii_lowercase().replace('_', "-")
}

/// The columns of the fleet table, in display order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Column {
    Hostname,
    ProvisionState,
    Maintenance,
    Cordoned,
    Connectivity,
    Conditions,
    Reasons,
    Schedulable,
    Role,
    Trust,
    Site,
    Pool,
    Gpus,
}

/// How a column is filtered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterKind {
    /// A case-insensitive substring (of any element, for lists).
    Text,
    /// One of a fixed set of values.
    Choice(&'static [&'static str]),
    /// Yes or no.
    Flag,
    /// One of the catalog's sites or pools, by id.
    CatalogId,
    /// At least this many.
    AtLeast,
}

const PROVISION_STATES: &[&str] = &[
    "adopting",
    "adopted",
    "enrolling",
    "inspecting",
    "commissioning",
    "ready",
    "deploying",
    "deployed",
    "releasing",
    "rescue",
    "failed",
    "retiring",
    "retired",
];
const CONNECTIVITY: &[&str] = &["connected", "disconnected", "unreachable", "lost"];
const ROLES: &[&str] = &["host", "dedicated", "site", "unassigned"];
const TRUST: &[&str] = &["platform", "tenant-owned", "tenant-controlled"];

impl Column {
    pub const ALL: [Column; 13] = [
        Column::Hostname,
        Column::ProvisionState,
        Column::Maintenance,
        Column::Cordoned,
        Column::Connectivity,
        Column::Conditions,
        Column::Reasons,
        Column::Schedulable,
        Column::Role,
        Column::Trust,
        Column::Site,
        Column::Pool,
        Column::Gpus,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Column::Hostname => "Hostname",
            Column::ProvisionState => "Provision state",
            Column::Maintenance => "Maintenance",
            Column::Cordoned => "Cordoned",
            Column::Connectivity => "Connectivity",
            Column::Conditions => "Conditions",
            Column::Reasons => "Reasons",
            Column::Schedulable => "Schedulable",
            Column::Role => "Role",
            Column::Trust => "Trust",
            Column::Site => "Site",
            Column::Pool => "Pool",
            Column::Gpus => "GPUs",
        }
    }

    /// A stable name for test selectors and the URL.
    pub fn key(self) -> &'static str {
        match self {
            Column::Hostname => "hostname",
            Column::ProvisionState => "provisionState",
            Column::Maintenance => "maintenance",
            Column::Cordoned => "cordoned",
            Column::Connectivity => "connectivity",
            Column::Conditions => "conditions",
            Column::Reasons => "reasons",
            Column::Schedulable => "schedulable",
            Column::Role => "role",
            Column::Trust => "trust",
            Column::Site => "site",
            Column::Pool => "pool",
            Column::Gpus => "gpus",
        }
    }

    pub fn filter_kind(self) -> FilterKind {
        match self {
            Column::Hostname | Column::Conditions | Column::Reasons => FilterKind::Text,
            Column::ProvisionState => FilterKind::Choice(PROVISION_STATES),
            Column::Connectivity => FilterKind::Choice(CONNECTIVITY),
            Column::Role => FilterKind::Choice(ROLES),
            Column::Trust => FilterKind::Choice(TRUST),
            Column::Maintenance | Column::Cordoned | Column::Schedulable => FilterKind::Flag,
            Column::Site | Column::Pool => FilterKind::CatalogId,
            Column::Gpus => FilterKind::AtLeast,
        }
    }

    /// The cell's text. Sites and pools show their names where the catalog knows them.
    pub fn text(self, row: &Row, names: &Names) -> String {
        let flag = |b: bool| if b { "yes" } else { "no" }.to_owned();
        match self {
            Column::Hostname => row.hostname.clone(),
            Column::ProvisionState => row.provision_state.clone(),
            Column::Maintenance => flag(row.maintenance),
            Column::Cordoned => flag(row.cordoned),
            Column::Connectivity => row.connectivity.clone(),
            Column::Conditions => row.conditions.join(", "),
            Column::Reasons => row.reasons.join(", "),
            Column::Schedulable => flag(row.schedulable),
            Column::Role => row.role.clone(),
            Column::Trust => row.trust.clone(),
            Column::Site => names.name(&row.site_id).to_owned(),
            Column::Pool => row
                .pool_id
                .as_deref()
                .map_or_else(String::new, |id| names.name(id).to_owned()),
            Column::Gpus => row.gpus.to_string(),
        }
    }

    /// Whether `row` passes this column's filter `value` (an empty value passes everything).
    pub fn admits(self, row: &Row, value: &str) -> bool {
        if value.is_empty() {
            return true;
        }
        let yes = value == "yes";
        match self {
            Column::Hostname => contains_folded(&row.hostname, value),
            Column::Conditions => row.conditions.iter().any(|c| contains_folded(c, value)),
            Column::Reasons => row.reasons.iter().any(|r| contains_folded(r, value)),
            Column::ProvisionState => row.provision_state == value,
            Column::Connectivity => row.connectivity == value,
            Column::Role => row.role == value,
            Column::Trust => row.trust == value,
            Column::Maintenance => row.maintenance == yes,
            Column::Cordoned => row.cordoned == yes,
            Column::Schedulable => row.schedulable == yes,
            Column::Site => row.site_id == value,
            Column::Pool => row.pool_id.as_deref() == Some(value),
            // A value that is not a number filters nothing out rather than everything.
            Column::Gpus => value.trim().parse::<i64>().is_ok_and(|min| row.gpus >= min),
        }
    }

    fn compare(self, a: &Row, b: &Row, names: &Names) -> Ordering {
        match self {
            Column::Gpus => a.gpus.cmp(&b.gpus),
            Column::Maintenance => a.maintenance.cmp(&b.maintenance),
            Column::Cordoned => a.cordoned.cmp(&b.cordoned),
            Column::Schedulable => a.schedulable.cmp(&b.schedulable),
            Column::Conditions => a.conditions.len().cmp(&b.conditions.len()),
            Column::Reasons => a.reasons.len().cmp(&b.reasons.len()),
            Column::Hostname => natural(&a.hostname, &b.hostname),
            // Comparing freshly built strings is fine for these: they are short and the
            // catalog lookups are hash hits.
            other => other.text(a, names).cmp(&other.text(b, names)),
        }
    }
}

fn contains_folded(haystack: &str, needle: &str) -> bool {
    haystack
        .to_ascii_lowercase()
        .contains(&needle.trim().to_ascii_lowercase())
}

/// Hostnames compared so that `gpu-2` sorts before `gpu-10`: runs of digits compare as
/// numbers, everything else as text.
pub fn natural(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let da = a.iter().take_while(|c| c.is_ascii_digit()).count();
                let db = b.iter().take_while(|c| c.is_ascii_digit()).count();
                let (na, nb) = (trim_zeros(&a[..da]), trim_zeros(&b[..db]));
                let by_number = na.len().cmp(&nb.len()).then_with(|| na.cmp(nb));
                if by_number != Ordering::Equal {
                    return by_number;
                }
                a = &a[da..];
                b = &b[db..];
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                a = &a[1..];
                b = &b[1..];
            }
        }
    }
}

fn trim_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|&&c| c == b'0').count();
    &digits[zeros.min(digits.len().saturating_sub(1))..]
}

/// Names of sites and pools by id, from the catalog.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Names(pub HashMap<String, String>);

impl Names {
    /// The name, or the id itself while the catalog does not know it.
    pub fn name<'a>(&'a self, id: &'a str) -> &'a str {
        self.0.get(id).map_or(id, String::as_str)
    }
}

/// The table's filters: a value per column (absent or empty: no filter).
pub type Filters = BTreeMap<Column, String>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sort {
    pub column: Column,
    pub descending: bool,
}

impl Default for Sort {
    fn default() -> Self {
        Sort {
            column: Column::Hostname,
            descending: false,
        }
    }
}

impl Sort {
    /// Clicking a column's header: sort by it, or flip the direction if it already sorts.
    pub fn toggled(self, column: Column) -> Sort {
        if self.column == column {
            Sort {
                column,
                descending: !self.descending,
            }
        } else {
            Sort {
                column,
                descending: false,
            }
        }
    }
}

/// The rows that pass every filter, in sort order. Ties fall back to the hostname and then
/// the id, so the order is total and rows do not jump between equal neighbours on updates.
pub fn visible_rows<'a>(
    rows: impl Iterator<Item = &'a Arc<Row>>,
    filters: &Filters,
    sort: Sort,
    names: &Names,
) -> Vec<Arc<Row>> {
    let active = active_filters(filters);
    let mut out: Vec<Arc<Row>> = rows.filter(|row| admitted(row, &active)).cloned().collect();
    out.sort_by(|a, b| order(a, b, sort, names));
    out
}

/// The filters that constrain anything, as (column, value).
fn active_filters(filters: &Filters) -> Vec<(Column, &str)> {
    filters
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(c, v)| (*c, v.as_str()))
        .collect()
}

fn admitted(row: &Row, active: &[(Column, &str)]) -> bool {
    active.iter().all(|(c, v)| c.admits(row, v))
}

/// The table's total order: the sort column, then the hostname, then the id.
fn order(a: &Row, b: &Row, sort: Sort, names: &Names) -> Ordering {
    let primary = sort.column.compare(a, b, names);
    let primary = if sort.descending {
        primary.reverse()
    } else {
        primary
    };
    primary
        .then_with(|| natural(&a.hostname, &b.hostname))
        .then_with(|| a.id.cmp(&b.id))
}

/// Brings `visible` (the output of `visible_rows` for these filters and sort) up to date
/// after the nodes `changed` (id, and the row now stored, or `None` when it is gone), with
/// the same result as `visible_rows` over all rows would give.
///
/// This is what keeps a live 10,000-node table smooth: re-sorting every row for each batch of
/// a handful of changes costs a frame's budget many times over (natural order compares
/// strings), while moving only the changed rows costs a scan and a binary search each.
pub fn apply_changes<'a>(
    visible: &mut Vec<Arc<Row>>,
    changed: impl IntoIterator<Item = (&'a str, Option<&'a Arc<Row>>)>,
    filters: &Filters,
    sort: Sort,
    names: &Names,
) {
    let active = active_filters(filters);
    for (id, now) in changed {
        if let Some(at) = visible.iter().position(|r| r.id == id) {
            visible.remove(at);
        }
        if let Some(row) = now.filter(|row| admitted(row, &active)) {
            let at = visible.partition_point(|r| order(r, row, sort, names) == Ordering::Less);
            visible.insert(at, row.clone());
        }
    }
}

/// One fact of a node that differs between what the operator saw and what is stored now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FactChange {
    pub fact: &'static str,
    pub before: String,
    pub after: String,
}

/// What changed on a node between two reads of it: every column that differs. The version
/// is left out (it always differs in a conflict and says nothing by itself).
pub fn what_changed(before: &Row, after: &Row, names: &Names) -> Vec<FactChange> {
    Column::ALL
        .iter()
        .filter_map(|&column| {
            let (b, a) = (column.text(before, names), column.text(after, names));
            (b != a).then(|| FactChange {
                fact: column.title(),
                before: b,
                after: a,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(hostname: &str) -> Row {
        Row {
            id: format!("node_{hostname}"),
            hostname: hostname.to_owned(),
            site_id: "site_a".into(),
            pool_id: Some("pool_a".into()),
            role: "host".into(),
            trust: "platform".into(),
            version: 1,
            provision_state: "adopted".into(),
            connectivity: "connected".into(),
            gpus: 8,
            schedulable: true,
            bucket: "schedulable".into(),
            ..Row::default()
        }
    }

    fn names() -> Names {
        Names(HashMap::from([
            ("site_a".to_owned(), "fra1".to_owned()),
            ("pool_a".to_owned(), "h100".to_owned()),
        ]))
    }

    #[test]
    fn applying_changes_gives_what_recomputing_gives() {
        let names = Names::default();
        let rows: HashMap<String, Arc<Row>> = ["n10", "n2", "n1", "n3", "n20"]
            .iter()
            .map(|h| (format!("node_{h}"), Arc::new(row(h))))
            .collect();
        for (filters, sort) in [
            (Filters::new(), Sort::default()),
            (
                Filters::new(),
                Sort {
                    column: Column::Cordoned,
                    descending: true,
                },
            ),
            (
                Filters::from([(Column::Cordoned, "no".to_owned())]),
                Sort {
                    column: Column::Hostname,
                    descending: true,
                },
            ),
        ] {
            let mut visible = visible_rows(rows.values(), &filters, sort, &names);
            // One node is cordoned, one leaves, one joins.
            let mut cordoned = (*rows["node_n2"]).clone();
            cordoned.cordoned = true;
            cordoned.version += 1;
            let mut after = rows.clone();
            after.insert(cordoned.id.clone(), Arc::new(cordoned));
            after.remove("node_n3");
            after.insert("node_n15".into(), Arc::new(row("n15")));
            let changed = ["node_n2", "node_n3", "node_n15"];
            apply_changes(
                &mut visible,
                changed.iter().map(|id| (*id, after.get(*id))),
                &filters,
                sort,
                &names,
            );
            let ids = |v: &[Arc<Row>]| v.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
            assert_eq!(
                ids(&visible),
                ids(&visible_rows(after.values(), &filters, sort, &names)),
                "{filters:?} {sort:?}"
            );
        }
    }

    #[test]
    fn seed_spelling_of_sdl_values() {
        assert_eq!(seed_spelling("TENANT_CONTROLLED"), "tenant-controlled");
        assert_eq!(seed_spelling("ADOPTING"), "adopting");
    }

    #[test]
    fn every_column_filters_as_its_kind_says() {
        let mut r = row("gpu-007");
        r.cordoned = true;
        r.conditions = vec!["GpuCountMismatch".into()];
        r.reasons = vec!["taint:gpu-burn".into(), "draining".into()];
        // (column, filter value, admitted?)
        let cases: &[(Column, &str, bool)] = &[
            (Column::Hostname, "", true),
            (Column::Hostname, "GPU-00", true),
            (Column::Hostname, "gpu-1", false),
            (Column::ProvisionState, "adopted", true),
            (Column::ProvisionState, "adopting", false),
            (Column::Maintenance, "no", true),
            (Column::Maintenance, "yes", false),
            (Column::Cordoned, "yes", true),
            (Column::Cordoned, "no", false),
            (Column::Connectivity, "connected", true),
            (Column::Connectivity, "lost", false),
            (Column::Conditions, "countmis", true),
            (Column::Conditions, "xid", false),
            (Column::Reasons, "drain", true),
            (Column::Reasons, "unreachable", false),
            (Column::Schedulable, "yes", true),
            (Column::Role, "host", true),
            (Column::Role, "site", false),
            (Column::Trust, "platform", true),
            (Column::Trust, "tenant-owned", false),
            (Column::Site, "site_a", true),
            (Column::Site, "site_b", false),
            (Column::Pool, "pool_a", true),
            (Column::Pool, "pool_b", false),
            (Column::Gpus, "8", true),
            (Column::Gpus, "9", false),
            (Column::Gpus, "many", false),
        ];
        for &(column, value, admitted) in cases {
            assert_eq!(column.admits(&r, value), admitted, "{column:?} {value:?}");
        }
    }

    #[test]
    fn filters_combine_and_sorting_is_total() {
        let mut rows: Vec<Arc<Row>> = ["gpu-10", "gpu-2", "gpu-1", "cpu-1"]
            .iter()
            .map(|h| Arc::new(row(h)))
            .collect();
        Arc::make_mut(&mut rows[1]).cordoned = true;
        let names = names();

        let all = visible_rows(rows.iter(), &Filters::new(), Sort::default(), &names);
        let hosts: Vec<&str> = all.iter().map(|r| r.hostname.as_str()).collect();
        assert_eq!(hosts, ["cpu-1", "gpu-1", "gpu-2", "gpu-10"]);

        let desc = Sort::default().toggled(Column::Hostname);
        assert!(desc.descending);
        let hosts: Vec<String> = visible_rows(rows.iter(), &Filters::new(), desc, &names)
            .iter()
            .map(|r| r.hostname.clone())
            .collect();
        assert_eq!(hosts, ["gpu-10", "gpu-2", "gpu-1", "cpu-1"]);

        let filters = Filters::from([
            (Column::Hostname, "gpu".to_owned()),
            (Column::Cordoned, "no".to_owned()),
        ]);
        let hosts: Vec<String> = visible_rows(rows.iter(), &filters, Sort::default(), &names)
            .iter()
            .map(|r| r.hostname.clone())
            .collect();
        assert_eq!(hosts, ["gpu-1", "gpu-10"]);

        // Cordoned first when sorting by it descending; ties stay in hostname order.
        let by_cordon = Sort::default()
            .toggled(Column::Cordoned)
            .toggled(Column::Cordoned);
        let hosts: Vec<String> = visible_rows(rows.iter(), &Filters::new(), by_cordon, &names)
            .iter()
            .map(|r| r.hostname.clone())
            .collect();
        assert_eq!(hosts, ["gpu-2", "cpu-1", "gpu-1", "gpu-10"]);
    }

    #[test]
    fn natural_order_compares_digit_runs_as_numbers() {
        assert_eq!(natural("gpu-2", "gpu-10"), Ordering::Less);
        assert_eq!(natural("gpu-010", "gpu-10"), Ordering::Equal);
        assert_eq!(natural("a", "a1"), Ordering::Less);
        assert_eq!(natural("b1", "a9"), Ordering::Greater);
    }

    #[test]
    fn catalog_names_show_and_unknown_ids_show_as_ids() {
        let r = row("gpu-1");
        assert_eq!(Column::Site.text(&r, &names()), "fra1");
        assert_eq!(Column::Pool.text(&r, &Names::default()), "pool_a");
    }

    #[test]
    fn what_changed_lists_each_differing_fact() {
        let before = row("gpu-1");
        let mut after = before.clone();
        after.version = 7;
        assert!(what_changed(&before, &after, &names()).is_empty());
        after.cordoned = true;
        after.reasons = vec!["taint:burn".into()];
        assert_eq!(
            what_changed(&before, &after, &names()),
            vec![
                FactChange {
                    fact: "Cordoned",
                    before: "no".into(),
                    after: "yes".into()
                },
                FactChange {
                    fact: "Reasons",
                    before: String::new(),
                    after: "taint:burn".into()
                },
            ]
        );
    }
}
