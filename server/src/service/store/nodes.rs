//! Node rows: load (with children), insert, save, list with filters, capacity.

use anyhow::anyhow;
use bc_core::Actor;
use bc_core::axes::{Connectivity, ProvisionState};
use bc_core::command::{CommandKind, CommandStatus};
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_entity::{
    command, node, node_condition, node_inventory_section, node_label, node_no_schedule_reason,
    node_taint,
};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query, SelectStatement};
use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, DbBackend, EntityTrait, FromQueryResult, QueryFilter,
    QueryOrder, QueryResult, QuerySelect, QueryTrait,
};
use std::collections::HashMap;

use super::batch_shapes::{one_of, runs_of};
use super::node_filter::NodeFilter;
use super::rows::{self, NodeChildren};

/// Reads one node ([`load_many`]). Deleted nodes are returned too; callers decide what a
/// deleted node means to them.
pub async fn load(conn: &impl ConnectionTrait, id: &NodeId) -> anyhow::Result<Option<NodeRecord>> {
    Ok(load_many(conn, std::slice::from_ref(id)).await?.remove(id))
}

/// Reads several nodes, keyed by id, in one statement per [`IDS_PER_STATEMENT`] nodes (each
/// row with its children, [`with_children`]); ids that name no node are left out. Deleted
/// nodes are returned too. A transaction that changes what it reads locks the rows first,
/// through [`super::WriteTxn::lock_nodes`] (in id order: the lock order of ARCHITECTURE.md's
/// Invariants), so this read, a statement of its own at READ COMMITTED, sees each node as its
/// last writer left it.
pub async fn load_many(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<HashMap<NodeId, NodeRecord>> {
    let mut sorted: Vec<String> = ids.iter().map(ToString::to_string).collect();
    sorted.sort();
    sorted.dedup();
    let mut loaded = HashMap::with_capacity(sorted.len());
    for chunk in sorted.chunks(IDS_PER_STATEMENT) {
        for record in read_by_ids(conn, chunk, ChildSets::ALL).await? {
            loaded.insert(record.id.clone(), record);
        }
    }
    Ok(loaded)
}

/// The class of the advisory locks on hardware keys: the first of the two-key form, whose
/// locks are apart from the event-order lock's one-key form (an arbitrary constant).
const HARDWARE_KEY_LOCK_CLASS: i32 = 0x6268_6b79;

/// Locks machines' hardware keys until the transaction ends (PostgreSQL), so that joins and
/// enrolments of one machine go one at a time: two at once (a daemon retrying a slow join, or
/// an operator enrolling the machine while its daemon joins) would both find no node holding
/// the key, both insert one, and the second would fail on the unique index of trusted keys;
/// with the lock, a join finds the first's node and takes it back, and an enrolment finds it
/// and is refused. An enrolment whose key differs from the joining daemon's (a BMC's subset
/// of the identifiers) is ordered against joins by [`lock_against_enrolments`] instead.
/// SQLite's write transaction holds the whole database already.
///
/// A batch of joins locks all its machines in one statement, in the order of the keys'
/// hashes, so that two transactions locking overlapping sets never wait on each other in a
/// cycle: the hashes are sorted in a materialized CTE, whose scan returns them in the order
/// they were written, and the locks are taken as the outer query reads them.
pub async fn lock_hardware_keys(conn: &impl ConnectionTrait, keys: &[&str]) -> anyhow::Result<()> {
    if conn.get_database_backend() != DbBackend::Postgres || keys.is_empty() {
        return Ok(());
    }
    // One array parameter, so that every batch is one SQL text (`batch_shapes`).
    let keys: Vec<String> = keys.iter().map(|key| (*key).to_owned()).collect();
    conn.execute_raw(sea_orm::Statement::from_sql_and_values(
        DbBackend::Postgres,
        "WITH keys AS MATERIALIZED (SELECT DISTINCT hashtext(key) AS hash \
         FROM unnest($2::text[]) AS given(key) ORDER BY hash) \
         SELECT pg_advisory_xact_lock($1, hash) FROM keys",
        [HARDWARE_KEY_LOCK_CLASS.into(), keys.into()],
    ))
    .await?;
    Ok(())
}

/// The class of the advisory lock that orders enrolments against joins (one lock for the
/// whole fleet: its second key is always 0).
const ENROLMENT_LOCK_CLASS: i32 = 0x6265_6e72;

/// Which side of the enrolment lock ([`lock_against_enrolments`]) a transaction takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnrolmentSide {
    /// A batch of joins: shared, so that joins never wait for each other.
    Joining,
    /// An enrolment of a machine by its identifiers: exclusive.
    Enrolling,
}

/// Orders enrolments against joins until the transaction ends (PostgreSQL; lock order, step
/// 1, after the hardware keys). A BMC reports a subset of its machine's identifiers, so an
/// enrolment's hardware key differs from the one the machine's daemon joins with and the key
/// locks do not order the two: a join looking for the node its machine was enrolled as would
/// not see an enrolment not yet committed, and would insert a second node. With this lock a
/// join waits for an enrolment under way and then finds the enrolled node by its identifiers.
/// SQLite's write transaction holds the whole database already.
pub async fn lock_against_enrolments(
    conn: &impl ConnectionTrait,
    side: EnrolmentSide,
) -> anyhow::Result<()> {
    if conn.get_database_backend() != DbBackend::Postgres {
        return Ok(());
    }
    let sql = match side {
        EnrolmentSide::Joining => "SELECT pg_advisory_xact_lock_shared($1, 0)",
        EnrolmentSide::Enrolling => "SELECT pg_advisory_xact_lock($1, 0)",
    };
    conn.execute_raw(sea_orm::Statement::from_sql_and_values(
        DbBackend::Postgres,
        sql,
        [ENROLMENT_LOCK_CLASS.into()],
    ))
    .await?;
    Ok(())
}

/// Says whether the node exists and, on PostgreSQL, locks its row until the transaction ends
/// (not remembered by [`super::WriteTxn::lock_nodes`]).
pub async fn lock_existing(conn: &impl ConnectionTrait, id: &NodeId) -> anyhow::Result<bool> {
    let select = node::Entity::find_by_id(id.to_string())
        .select_only()
        .column(node::Column::Id);
    let row = super::lock_for_update(select, conn)
        .into_tuple::<String>()
        .one(conn)
        .await?;
    Ok(row.is_some())
}

/// Live nodes' identity generations, without the rest of the nodes, in one statement per
/// [`IDS_PER_STATEMENT`] ids: what the gateway checks client certificates against. Ids that
/// name no node, or a deleted one, are left out.
pub async fn live_identity_generation_of_each(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<HashMap<NodeId, i64>> {
    let mut found = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(IDS_PER_STATEMENT) {
        let rows = node::Entity::find()
            .select_only()
            .column(node::Column::Id)
            .column(node::Column::IdentityGeneration)
            .filter(one_of(
                Expr::col(node::Column::Id),
                chunk,
                conn.get_database_backend(),
            ))
            .filter(node::Column::DeletedAt.is_null())
            .into_tuple::<(String, i64)>()
            .all(conn)
            .await?;
        for (id, generation) in rows {
            let id = NodeId::parse(&id).map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?;
            found.insert(id, generation);
        }
    }
    Ok(found)
}

/// Live or deleted nodes' spec generations and pools, without the rest of the nodes, in one
/// statement per thousand nodes: what sessions' looks at their nodes and inventory reports
/// ask of the nodes before they change them. Ids that name no node are left out.
pub async fn generation_and_pool_of_each(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<HashMap<NodeId, (i64, Option<bc_core::ids::PoolId>)>> {
    let mut found = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(IDS_PER_STATEMENT) {
        let rows = node::Entity::find()
            .select_only()
            .column(node::Column::Id)
            .column(node::Column::Generation)
            .column(node::Column::PoolId)
            .filter(one_of(
                Expr::col(node::Column::Id),
                chunk,
                conn.get_database_backend(),
            ))
            .into_tuple::<(String, i64, Option<String>)>()
            .all(conn)
            .await?;
        for (id, generation, pool) in rows {
            let id = NodeId::parse(&id).map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?;
            let pool = pool
                .map(|p| {
                    bc_core::ids::PoolId::parse(&p)
                        .map_err(|_| anyhow!("corrupt row: nodes.pool_id = `{p}`"))
                })
                .transpose()?;
            found.insert(id, (generation, pool));
        }
    }
    Ok(found)
}

/// Each node's pool (`None`: in no pool), live or deleted; ids that name no node are left
/// out ([`generation_and_pool_of_each`]).
pub async fn pool_of_each(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<HashMap<NodeId, Option<bc_core::ids::PoolId>>> {
    Ok(generation_and_pool_of_each(conn, ids)
        .await?
        .into_iter()
        .map(|(id, (_, pool))| (id, pool))
        .collect())
}

/// The live nodes holding these hardware keys as trusted, by key, in one statement per
/// thousand keys.
pub async fn trusted_hardware_key_holders(
    conn: &impl ConnectionTrait,
    keys: &[String],
) -> anyhow::Result<HashMap<String, NodeId>> {
    let mut holders = HashMap::new();
    for chunk in keys.chunks(IDS_PER_STATEMENT) {
        let rows = node::Entity::find()
            .select_only()
            .column(node::Column::HardwareKey)
            .column(node::Column::Id)
            .filter(one_of(
                Expr::col(node::Column::HardwareKey),
                chunk,
                conn.get_database_backend(),
            ))
            .filter(node::Column::HardwareKeyTrusted.eq(true))
            .filter(node::Column::DeletedAt.is_null())
            .into_tuple::<(String, String)>()
            .all(conn)
            .await?;
        for (key, id) in rows {
            let id = NodeId::parse(&id).map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?;
            holders.insert(key, id);
        }
    }
    Ok(holders)
}

/// The pools these nodes are in (nodes in no pool add nothing): [`pool_of_each`]'s pools.
pub async fn pools_of(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<std::collections::BTreeSet<bc_core::ids::PoolId>> {
    Ok(pool_of_each(conn, ids)
        .await?
        .into_values()
        .flatten()
        .collect())
}

/// Locks several node rows until the transaction ends, in id order (the lock order of
/// ARCHITECTURE.md's Invariants), without reading them: the PostgreSQL statement of
/// [`super::WriteTxn::lock_nodes`], which remembers what it locked and runs nothing on
/// SQLite.
pub(super) async fn lock_many(conn: &impl ConnectionTrait, ids: &[NodeId]) -> anyhow::Result<()> {
    let mut sorted: Vec<String> = ids.iter().map(ToString::to_string).collect();
    sorted.sort();
    for chunk in sorted.chunks(IDS_PER_STATEMENT) {
        let select = node::Entity::find()
            .select_only()
            .column(node::Column::Id)
            .filter(one_of(
                Expr::col(node::Column::Id),
                chunk,
                conn.get_database_backend(),
            ))
            .order_by_asc(node::Column::Id);
        super::lock_for_update(select, conn)
            .into_tuple::<String>()
            .all(conn)
            .await?;
    }
    Ok(())
}

/// How many node ids (or hardware keys) one statement binds, in [`load_many`] and the other
/// statements about many nodes: the backends bound a statement's parameters (SQLite 32,766).
const IDS_PER_STATEMENT: usize = 1000;

/// The nodes of `ids` (fewer where an id names no node), in id order, each with the child
/// sets `sets` names.
async fn read_by_ids(
    conn: &impl ConnectionTrait,
    ids: &[String],
    sets: ChildSets,
) -> anyhow::Result<Vec<NodeRecord>> {
    let select = node::Entity::find()
        .filter(one_of(
            Expr::col(node::Column::Id),
            ids,
            conn.get_database_backend(),
        ))
        .order_by_asc(node::Column::Id);
    read_records(conn, select, sets).await
}

/// Which of a node's child sets a read includes: its labels, its taints, its conditions.
/// Its no-schedule reasons are always read, because whether it is schedulable (the API's
/// `schedulability`) depends on them.
///
/// Everything that decides or changes a node reads all of them ([`ChildSets::ALL`]). Only a
/// page of the API may leave some out: a fleet table that shows no labels or conditions
/// would otherwise read 27 label and condition rows per node that it never shows, most of
/// its statement's time on PostgreSQL (BENCHMARKS.md: "A page reads the child rows it
/// shows"). Each combination of sets is a SQL text of its own, so a page's filter shape may
/// be up to eight texts in a connection's prepared-statement cache. The records it gets
/// have those sets empty, and the API view that holds them refuses to show them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChildSets {
    pub labels: bool,
    pub taints: bool,
    pub conditions: bool,
}

impl ChildSets {
    /// Every child set: a whole record.
    pub const ALL: ChildSets = ChildSets {
        labels: true,
        taints: true,
        conditions: true,
    };

    /// Whether each of [`CHILD_SET_COLUMNS`] is read, in its order.
    fn read_per_column(self) -> [bool; 4] {
        [self.labels, self.taints, self.conditions, true]
    }
}

/// Runs a select of node rows with [`with_children`] and makes each row a record.
async fn read_records(
    conn: &impl ConnectionTrait,
    select: sea_orm::Select<node::Entity>,
    sets: ChildSets,
) -> anyhow::Result<Vec<NodeRecord>> {
    let query = with_children(select.into_query(), conn.get_database_backend(), sets);
    conn.query_all(&query)
        .await?
        .iter()
        .map(|row| {
            let node = node::Model::from_query_result(row, "")?;
            let children = children_in(row, &node.id, sets)?;
            rows::node_record(node, children)
        })
        .collect()
}

/// `select` (of node rows) with each node's child rows (labels, taints, conditions, reasons;
/// those of `sets`) as up to four more columns, by correlated subqueries: the labels a JSON
/// object of their values by key, the others each a JSON array of the table's rows as arrays
/// of their columns. A node is then one row, decoded once, and its children come from the
/// row's snapshot (BENCHMARKS.md: "A page of nodes in one statement"). The subqueries name
/// the outer table `"nodes"`, so `select` must not alias it: an alias would fail only when
/// the statement runs.
///
/// Not for a locking read: PostgreSQL rereads a row it had to wait for at its newest version,
/// but runs the subqueries against the statement's snapshot, so the children could be older
/// than the row. Callers that lock take the locks first, in a statement of their own; the
/// read after it sees what the last writer committed because write transactions run at READ
/// COMMITTED, where each statement takes a new snapshot (at REPEATABLE READ it would not).
fn with_children(
    mut select: SelectStatement,
    backend: DbBackend,
    sets: ChildSets,
) -> SelectStatement {
    let subqueries = match backend {
        DbBackend::Postgres => &CHILD_SETS_POSTGRES,
        // SQLite, the store's only other backend.
        _ => &CHILD_SETS_SQLITE,
    };
    for ((alias, subquery), read) in CHILD_SET_COLUMNS
        .iter()
        .zip(subqueries)
        .zip(sets.read_per_column())
    {
        if read {
            select.expr_as(Expr::cust(*subquery), Alias::new(*alias));
        }
    }
    select
}

/// The columns [`with_children`] adds: labels, taints, conditions, reasons.
const CHILD_SET_COLUMNS: [&str; 4] = [
    "child_labels",
    "child_taints",
    "child_conditions",
    "child_reasons",
];

/// [`with_children`]'s subqueries on PostgreSQL. An aggregate over no rows is `NULL`, which
/// [`children_in`] reads as no rows (SQLite's gives `[]` or `{}`). Cast to text, they decode
/// like SQLite's; `json` renders a timestamp in RFC 3339. The
/// labels are an object because `json_object_agg` builds it in half the time `json_agg` takes
/// over an array per label (2.6 against 4.7 ms for a page of 100 nodes of 21 labels).
const CHILD_SETS_POSTGRES: [&str; 4] = [
    r#"(SELECT json_object_agg(l."key", l."value")::text FROM "node_labels" AS l WHERE l."node_id" = "nodes"."id")"#,
    r#"(SELECT json_agg(json_build_array(t."key", t."value", t."effect", t."added_by", t."added_at"))::text FROM "node_taints" AS t WHERE t."node_id" = "nodes"."id")"#,
    r#"(SELECT json_agg(json_build_array(c."condition_type", c."status", c."reason", c."message", c."set_by", c."no_schedule", c."last_transition_at", c."updated_at", c."proof"))::text FROM "node_conditions" AS c WHERE c."node_id" = "nodes"."id")"#,
    r#"(SELECT json_agg(json_build_array(r."reason", r."set_by", r."detail", r."since"))::text FROM "node_no_schedule_reasons" AS r WHERE r."node_id" = "nodes"."id")"#,
];

/// [`with_children`]'s subqueries on SQLite, which stores a boolean as 0 or 1 (made JSON's
/// `true` or `false` here), a timestamp as RFC 3339 text, and JSON as text (`json(…)` embeds
/// it as JSON, not as a string).
const CHILD_SETS_SQLITE: [&str; 4] = [
    r#"(SELECT json_group_object(l."key", l."value") FROM "node_labels" AS l WHERE l."node_id" = "nodes"."id")"#,
    r#"(SELECT json_group_array(json_array(t."key", t."value", t."effect", t."added_by", t."added_at")) FROM "node_taints" AS t WHERE t."node_id" = "nodes"."id")"#,
    r#"(SELECT json_group_array(json_array(c."condition_type", c."status", c."reason", c."message", c."set_by", json(iif(c."no_schedule", 'true', 'false')), c."last_transition_at", c."updated_at", json(c."proof"))) FROM "node_conditions" AS c WHERE c."node_id" = "nodes"."id")"#,
    r#"(SELECT json_group_array(json_array(r."reason", r."set_by", r."detail", r."since")) FROM "node_no_schedule_reasons" AS r WHERE r."node_id" = "nodes"."id")"#,
];

/// The child rows [`with_children`] put in `row`, as the tables' models; no rows for a set
/// that `sets` leaves out.
fn children_in(row: &QueryResult, node_id: &str, sets: ChildSets) -> anyhow::Result<NodeChildren> {
    use chrono::{DateTime, Utc};
    type Taint = (String, String, String, String, DateTime<Utc>);
    type ConditionCells = (
        String,
        String,
        String,
        String,
        String,
        bool,
        DateTime<Utc>,
        DateTime<Utc>,
        Option<serde_json::Value>,
    );
    type Reason = (String, String, String, DateTime<Utc>);
    fn set<T: serde::de::DeserializeOwned + Default>(
        row: &QueryResult,
        column: &str,
        read: bool,
        node_id: &str,
    ) -> anyhow::Result<T> {
        if !read {
            return Ok(T::default());
        }
        let Some(text) = row.try_get::<Option<String>>("", column)? else {
            return Ok(T::default());
        };
        serde_json::from_str(&text).map_err(|e| anyhow!("corrupt rows: {column} of {node_id}: {e}"))
    }
    let [labels, taints, conditions, reasons] = CHILD_SET_COLUMNS;
    let [read_labels, read_taints, read_conditions, read_reasons] = sets.read_per_column();
    let node = || node_id.to_owned();
    Ok(NodeChildren {
        labels: set::<HashMap<String, String>>(row, labels, read_labels, node_id)?
            .into_iter()
            .map(|(key, value)| node_label::Model {
                key,
                value,
                node_id: node(),
            })
            .collect(),
        taints: set::<Vec<Taint>>(row, taints, read_taints, node_id)?
            .into_iter()
            .map(
                |(key, value, effect, added_by, added_at)| node_taint::Model {
                    key,
                    value,
                    effect,
                    added_by,
                    added_at,
                    node_id: node(),
                },
            )
            .collect(),
        conditions: set::<Vec<ConditionCells>>(row, conditions, read_conditions, node_id)?
            .into_iter()
            .map(
                |(
                    condition_type,
                    status,
                    reason,
                    message,
                    set_by,
                    no_schedule,
                    last_transition_at,
                    updated_at,
                    proof,
                )| node_condition::Model {
                    condition_type,
                    status,
                    reason,
                    message,
                    set_by,
                    no_schedule,
                    last_transition_at,
                    updated_at,
                    proof,
                    node_id: node(),
                },
            )
            .collect(),
        reasons: set::<Vec<Reason>>(row, reasons, read_reasons, node_id)?
            .into_iter()
            .map(
                |(reason, set_by, detail, since)| node_no_schedule_reason::Model {
                    reason,
                    set_by,
                    detail,
                    since,
                    node_id: node(),
                },
            )
            .collect(),
    })
}

/// Writes a new node and its children.
pub async fn insert(conn: &impl ConnectionTrait, node: &NodeRecord) -> anyhow::Result<()> {
    node::Entity::insert(rows::node_row(node)?)
        .exec_without_returning(conn)
        .await?;
    write_children(conn, &[(None, node)]).await
}

/// Writes new nodes and their children (a batch of joins): a statement per run of nodes and
/// per run of each child table's rows ([`runs_of`]).
pub async fn insert_many(conn: &impl ConnectionTrait, nodes: &[NodeRecord]) -> anyhow::Result<()> {
    for run in runs_of::<node::Entity, _>(nodes.iter().collect()) {
        let rows = run
            .into_iter()
            .map(rows::node_row)
            .collect::<anyhow::Result<Vec<_>>>()?;
        node::Entity::insert_many(rows)
            .exec_without_returning(conn)
            .await?;
    }
    let writes: Vec<(Option<&NodeRecord>, &NodeRecord)> =
        nodes.iter().map(|node| (None, node)).collect();
    write_children(conn, &writes).await
}

/// Writes changed nodes over the rows they were loaded from, each `(as loaded, changed)`,
/// with their child rows: a statement per run of nodes ([`runs_of`]: 32 a statement) and, per
/// child table whose contents changed, a delete and an insert per run of its rows, not
/// statements per node (on SQLite every statement is a round trip to the database's thread
/// while every other writer waits).
///
/// The caller locked the rows in this transaction ([`super::WriteTxn::lock_nodes`]) and then
/// read them ([`load_many`]),
/// so nobody else can have written them since. The write checks it all the same: a row
/// whose stored `version` is not below the new one is left alone, and any such row fails
/// the whole write (the caller rolls back) rather than overwrite a newer node.
pub async fn save_many(
    conn: &impl ConnectionTrait,
    writes: &[(&NodeRecord, &NodeRecord)],
) -> anyhow::Result<()> {
    use sea_orm::sea_query::{Alias, OnConflict};
    use sea_orm::{IdenStatic, Iterable};
    for chunk in runs_of::<node::Entity, _>(writes.to_vec()) {
        let rows = chunk
            .iter()
            .map(|(_, after)| rows::node_row(after))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // INSERT … ON CONFLICT (id) DO UPDATE SET every column = excluded's, WHERE the stored
        // version is older: an update of many rows to different values in one statement,
        // on both backends. Every row exists (it was just loaded), so none is inserted.
        let newer = Expr::col((node::Entity, node::Column::Version)).lt(Expr::col((
            Alias::new("excluded"),
            Alias::new(node::Column::Version.as_str()),
        )));
        let upsert = OnConflict::column(node::Column::Id)
            .update_columns(node::Column::iter().filter(|c| !matches!(c, node::Column::Id)))
            .action_and_where(newer)
            .to_owned();
        let written = node::Entity::insert_many(rows)
            .on_conflict(upsert)
            .exec_without_returning(conn)
            .await?;
        if written != chunk.len() as u64 {
            return Err(anyhow!(
                "{} of {} nodes were newer than their locked read; nothing was written",
                chunk.len() as u64 - written,
                chunk.len()
            ));
        }
    }
    let writes: Vec<(Option<&NodeRecord>, &NodeRecord)> = writes
        .iter()
        .map(|(before, after)| (Some(*before), *after))
        .collect();
    write_children(conn, &writes).await
}

/// Rewrites each child table of the nodes whose contents there changed (`before` is `None`
/// for a new node, which has no rows yet): one delete per [`IDS_PER_STATEMENT`] nodes already
/// stored and an insert per run of rows ([`runs_of`] the table), per table.
async fn write_children(
    conn: &impl ConnectionTrait,
    writes: &[(Option<&NodeRecord>, &NodeRecord)],
) -> anyhow::Result<()> {
    // A new node has no rows to delete, so a join or an enrolment deletes nothing: four
    // statements fewer in its transaction (on SQLite each is a round trip to the database's
    // thread while every other writer waits).
    fn changed<'a, T: PartialEq>(
        writes: &[(Option<&'a NodeRecord>, &'a NodeRecord)],
        part: impl Fn(&NodeRecord) -> &T,
    ) -> Replaced<'a> {
        let mut replaced = Replaced::default();
        for (before, after) in writes {
            match before {
                None => replaced.written.push(*after),
                Some(before) if part(before) != part(after) => {
                    replaced.cleared.push(after.id.to_string());
                    replaced.written.push(*after);
                }
                Some(_) => {}
            }
        }
        replaced
    }
    replace_children(
        conn,
        node_label::Column::NodeId,
        changed(writes, |n| &n.labels),
        rows::label_rows,
    )
    .await?;
    replace_children(
        conn,
        node_taint::Column::NodeId,
        changed(writes, |n| &n.taints),
        rows::taint_rows,
    )
    .await?;
    replace_children(
        conn,
        node_condition::Column::NodeId,
        changed(writes, |n| &n.conditions),
        rows::condition_rows,
    )
    .await?;
    replace_children(
        conn,
        node_no_schedule_reason::Column::NodeId,
        changed(writes, |n| &n.no_schedule_reasons),
        rows::reason_rows,
    )
    .await
}

/// One child table's part of [`write_children`].
#[derive(Default)]
struct Replaced<'a> {
    /// The nodes whose stored rows are deleted first.
    cleared: Vec<String>,
    /// The nodes whose rows are then inserted.
    written: Vec<&'a NodeRecord>,
}

/// Replaces one child table's rows of some nodes with what `rows_of` makes of them.
async fn replace_children<E, A>(
    conn: &impl ConnectionTrait,
    node_id: E::Column,
    replaced: Replaced<'_>,
    rows_of: fn(&NodeRecord) -> Vec<A>,
) -> anyhow::Result<()>
where
    E: EntityTrait,
    A: sea_orm::ActiveModelTrait<Entity = E> + Send,
{
    for ids in replaced.cleared.chunks(IDS_PER_STATEMENT) {
        E::delete_many()
            .filter(one_of(Expr::col(node_id), ids, conn.get_database_backend()))
            .exec(conn)
            .await?;
    }
    let rows: Vec<A> = replaced.written.iter().flat_map(|n| rows_of(n)).collect();
    for run in runs_of::<E, _>(rows) {
        E::insert_many(run).exec_without_returning(conn).await?;
    }
    Ok(())
}

/// The live node holding a trusted hardware key, if any.
pub async fn by_trusted_hardware_key(
    conn: &impl ConnectionTrait,
    key: &str,
) -> anyhow::Result<Option<NodeId>> {
    let row = node::Entity::find()
        .filter(node::Column::HardwareKey.eq(key))
        .filter(node::Column::HardwareKeyTrusted.eq(true))
        .filter(node::Column::DeletedAt.is_null())
        .one(conn)
        .await?;
    row.map(|r| {
        NodeId::parse(&r.id).map_err(|_| anyhow::anyhow!("corrupt row: nodes.id = `{}`", r.id))
    })
    .transpose()
}

/// [`by_trusted_hardware_key`] for many keys in one query: the live node holding each key
/// that one holds.
pub async fn by_trusted_hardware_keys(
    conn: &impl ConnectionTrait,
    keys: &[&str],
) -> anyhow::Result<HashMap<String, NodeId>> {
    let mut found = HashMap::new();
    for run in keys.chunks(IDS_PER_STATEMENT) {
        let rows: Vec<(String, Option<String>)> = node::Entity::find()
            .select_only()
            .column(node::Column::Id)
            .column(node::Column::HardwareKey)
            .filter(one_of(
                Expr::col(node::Column::HardwareKey),
                run,
                conn.get_database_backend(),
            ))
            .filter(node::Column::HardwareKeyTrusted.eq(true))
            .filter(node::Column::DeletedAt.is_null())
            .into_tuple()
            .all(conn)
            .await?;
        for (id, key) in rows {
            let id = NodeId::parse(&id).map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?;
            if let Some(key) = key {
                found.insert(key, id);
            }
        }
    }
    Ok(found)
}

/// One page of nodes ordered by id, after the cursor `after`, at most `limit`, each with the
/// child sets `sets` names.
pub async fn list(
    conn: &impl ConnectionTrait,
    filter: &NodeFilter,
    after: Option<&str>,
    limit: u64,
    sets: ChildSets,
) -> anyhow::Result<Vec<NodeRecord>> {
    list_where(conn, filter.condition(), after, limit, Read::Unlocked(sets)).await
}

/// [`list`] inside a write transaction: the nodes are locked `FOR SHARE` (PostgreSQL), in id
/// order, until the transaction ends, and then read, so no node changes under the caller's
/// checks until it commits. Node rows come first in the lock order of ARCHITECTURE.md's
/// Invariants.
pub async fn list_locked(
    conn: &impl ConnectionTrait,
    filter: &NodeFilter,
    limit: u64,
) -> anyhow::Result<Vec<NodeRecord>> {
    list_where(conn, filter.condition(), None, limit, Read::Locked).await
}

/// How [`list_where`] reads: without locks and the child sets named, or whole records locked
/// `FOR SHARE` (a locking read decides, so it reads everything).
#[derive(Clone, Copy)]
enum Read {
    Unlocked(ChildSets),
    Locked,
}

/// Live `adopting`, `connected` nodes that reported their `gpus` section and have no
/// `diag.nvml` from `acceptor` in flight (queued, dispatched or running), by id, at most
/// `limit`: the nodes acceptance can act on now. A node waiting on its diagnostic is left
/// out in SQL (`ix_commands_node_id_status_lane` answers the check), so while thousands of
/// nodes run theirs the pass loads none of them, and the limit is spent on nodes with
/// something to decide.
pub async fn acceptance_candidates(
    conn: &impl ConnectionTrait,
    acceptor: &Actor,
    limit: u64,
) -> anyhow::Result<Vec<NodeRecord>> {
    let filter = NodeFilter {
        provision_states: vec![ProvisionState::Adopting],
        connectivity: vec![Connectivity::Connected],
        ..NodeFilter::default()
    };
    let node_id = || Expr::col((node::Entity, node::Column::Id));
    let reported_gpus = Query::select()
        .expr(Expr::value(1))
        .from(node_inventory_section::Entity)
        .and_where(
            Expr::col((
                node_inventory_section::Entity,
                node_inventory_section::Column::NodeId,
            ))
            .eq(node_id()),
        )
        .and_where(
            Expr::col((
                node_inventory_section::Entity,
                node_inventory_section::Column::Section,
            ))
            .eq("gpus"),
        )
        .take();
    let in_flight: Vec<&str> = CommandStatus::ALL
        .iter()
        .filter(|s| !s.is_final())
        .map(|s| s.as_static_str())
        .collect();
    let diagnostic_running = Query::select()
        .expr(Expr::value(1))
        .from(command::Entity)
        .and_where(Expr::col((command::Entity, command::Column::NodeId)).eq(node_id()))
        .and_where(Expr::col((command::Entity, command::Column::Status)).is_in(in_flight))
        .and_where(
            Expr::col((command::Entity, command::Column::Kind))
                .eq(CommandKind::DiagNvml.as_static_str()),
        )
        .and_where(
            Expr::col((command::Entity, command::Column::CreatedBy)).eq(acceptor.to_string()),
        )
        .take();
    let cond = filter
        .condition()
        .add(Expr::exists(reported_gpus))
        .add(Expr::exists(diagnostic_running).not());
    list_where(conn, cond, None, limit, Read::Unlocked(ChildSets::ALL)).await
}

async fn list_where(
    conn: &impl ConnectionTrait,
    cond: Condition,
    after: Option<&str>,
    limit: u64,
    read: Read,
) -> anyhow::Result<Vec<NodeRecord>> {
    let mut select = node::Entity::find().filter(cond);
    if let Some(after) = after {
        select = select.filter(node::Column::Id.gt(after));
    }
    let select = select.order_by_asc(node::Column::Id).limit(limit);
    match read {
        Read::Unlocked(sets) => read_records(conn, select, sets).await,
        // SQLite's write transaction holds the whole database already.
        Read::Locked if conn.get_database_backend() != DbBackend::Postgres => {
            read_records(conn, select, ChildSets::ALL).await
        }
        Read::Locked => {
            // The locks first, then the read (see `with_children`).
            let ids: Vec<String> = select
                .select_only()
                .column(node::Column::Id)
                .lock_shared()
                .into_tuple()
                .all(conn)
                .await?;
            let mut records = Vec::with_capacity(ids.len());
            for chunk in ids.chunks(IDS_PER_STATEMENT) {
                records.extend(read_by_ids(conn, chunk, ChildSets::ALL).await?);
            }
            Ok(records)
        }
    }
}

/// Live nodes in `states` whose spec generation is still 0 (id and version), at most `limit`:
/// the NodeSpec controller's work list, selected in SQL so a settled fleet costs one cheap
/// query per tick instead of loading every node.
pub async fn awaiting_first_spec(
    conn: &impl ConnectionTrait,
    states: &[ProvisionState],
    limit: u64,
) -> anyhow::Result<Vec<(NodeId, i64)>> {
    let rows = awaiting_first_spec_query(states, limit)
        .into_tuple::<(String, i64)>()
        .all(conn)
        .await?;
    rows.into_iter()
        .map(|(id, version)| {
            Ok((
                NodeId::parse(&id).map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?,
                version,
            ))
        })
        .collect()
}

/// [`awaiting_first_spec`]'s query. Its predicate is the partial index's
/// (`ix_nodes_awaiting_first_spec`, migration `m20261205_000022_nodes_awaiting_first_spec`)
/// written out, not bound: a plan for `generation = $1` cannot assume the index's
/// `generation = 0`, and PostgreSQL switches a prepared statement run often to such a generic
/// plan; with the literal, every plan may use the index.
fn awaiting_first_spec_query(
    states: &[ProvisionState],
    limit: u64,
) -> sea_orm::Select<node::Entity> {
    node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .column(node::Column::Version)
        .filter(Expr::cust("generation = 0 AND deleted_at IS NULL"))
        .filter(node::Column::ProvisionState.is_in(states.iter().map(ToString::to_string)))
        .limit(limit)
}

/// How many nodes match.
pub async fn count(conn: &impl ConnectionTrait, filter: &NodeFilter) -> anyhow::Result<u64> {
    use sea_orm::PaginatorTrait;
    Ok(node::Entity::find()
        .filter(filter.condition())
        .count(conn)
        .await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DatabaseConfig;
    use crate::service::store::Store;
    use sea_orm::QueryTrait;

    /// A migrated SQLite database in a temporary directory (it lives as long as the
    /// directory), and its URL. Each test opens a pool of its own on it after the migrations:
    /// a connection that read the schema before the last migration plans an EXPLAIN with the
    /// indexes it saw then (an EXPLAIN runs no transaction, so SQLite never notices the schema
    /// changed; a real statement would be prepared again).
    async fn migrated_sqlite() -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("bc.sqlite").display()
        );
        let migrating = Store::connect(&url, &DatabaseConfig::default())
            .await
            .expect("open SQLite");
        migrating.migrate().await.expect("migrate");
        migrating.close().await;
        (dir, url)
    }

    /// The NodeSpec controller's query reads the partial index, not the table: a settled fleet
    /// has no node at generation 0, and every Lifecycle pass asks.
    #[tokio::test]
    async fn nodes_awaiting_their_first_spec_are_found_through_their_index() {
        let (_dir, url) = migrated_sqlite().await;
        let store = Store::connect(&url, &DatabaseConfig::default())
            .await
            .expect("open SQLite");
        // Written out in the statement itself, not bound (see the query's comment).
        let postgres = awaiting_first_spec_query(&[ProvisionState::Adopted], 10)
            .build(DbBackend::Postgres)
            .sql;
        assert!(
            postgres.contains("generation = 0 AND deleted_at IS NULL"),
            "{postgres}"
        );
        let query = awaiting_first_spec_query(&[ProvisionState::Adopted], 10)
            .build(DbBackend::Sqlite)
            .to_string();
        let plan: Vec<String> = store
            .db()
            .query_all_raw(sea_orm::Statement::from_string(
                DbBackend::Sqlite,
                format!("EXPLAIN QUERY PLAN {query}"),
            ))
            .await
            .expect("explain")
            .into_iter()
            .map(|row| row.try_get::<String>("", "detail").expect("detail"))
            .collect();
        assert!(
            plan.iter()
                .any(|step| step.contains("ix_nodes_awaiting_first_spec")),
            "{query}: {plan:?}"
        );
    }

    /// A new node has no child rows, so writing it deletes none (a join ran four empty
    /// deletes); a node written over its loaded self replaces only the child tables that
    /// changed.
    #[tokio::test]
    async fn a_new_node_deletes_no_child_rows_and_a_changed_one_replaces_only_what_changed() {
        use bc_core::axes::SiteKind;
        use bc_core::catalog::{Placement, Site};
        use bc_core::ids::SiteId;
        use std::sync::{Arc, Mutex};

        let (_dir, url) = migrated_sqlite().await;
        let store = Store::connect(&url, &DatabaseConfig::default())
            .await
            .expect("open SQLite");
        // A handle of its own, to watch its statements.
        let mut db = store.db().clone();
        let ran = Arc::new(Mutex::new(Vec::<String>::new()));
        db.set_metric_callback({
            let ran = ran.clone();
            move |info| {
                let kind = super::super::statement_metrics::statement_kind(&info.statement.sql);
                ran.lock().expect("statements").push(kind);
            }
        });
        let take = || std::mem::take(&mut *ran.lock().expect("statements"));

        let now = chrono::Utc::now();
        let site = Site {
            id: SiteId::generate(),
            name: "dc1".into(),
            kind: SiteKind::Platform,
            owner_tenant_id: None,
            created_at: now,
        };
        super::super::catalog::insert_site(&db, &site)
            .await
            .expect("a site");
        let mut node = NodeRecord::new(
            Placement::new_node("gpu-1.dc1", &site, None, ProvisionState::Adopting),
            now,
        )
        .expect("a node");
        node.labels.insert("team".into(), "vision".into());
        take();

        insert(&db, &node).await.expect("insert");
        assert_eq!(take(), ["insert nodes", "insert node_labels"]);

        let mut changed = node.clone();
        changed.version += 1;
        changed.labels.insert("rack".into(), "r1".into());
        save_many(&db, &[(&node, &changed)]).await.expect("save");
        assert_eq!(
            take(),
            ["insert nodes", "delete node_labels", "insert node_labels"]
        );
        let stored = load(&db, &node.id).await.expect("load").expect("the node");
        assert_eq!(stored.labels, changed.labels);
    }
}
