//! Inventory: the sections a daemon reported (`node_inventory_sections`, by hash) and the
//! devices the Inventory controller derived from them (`node_devices`).

use super::batch_shapes::{one_of, runs_of_at_most};
use bc_core::health::{Device, GPU_DEVICE_KIND};
use bc_core::ids::NodeId;
use bc_entity::{node_device, node_inventory_section};
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::{Expr, OnConflict};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use std::collections::{BTreeMap, HashMap};

/// Each node's stored section hashes (`section → hash`), in one statement per thousand
/// nodes; a node with none is left out.
pub async fn hashes_of(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<HashMap<NodeId, BTreeMap<String, String>>> {
    let mut hashes: HashMap<NodeId, BTreeMap<String, String>> = HashMap::new();
    for chunk in ids.chunks(1_000) {
        // The hashes only: the sections' contents are the bulk of the rows.
        let rows = node_inventory_section::Entity::find()
            .select_only()
            .column(node_inventory_section::Column::NodeId)
            .column(node_inventory_section::Column::Section)
            .column(node_inventory_section::Column::Hash)
            .filter(one_of(
                Expr::col(node_inventory_section::Column::NodeId),
                chunk,
                conn.get_database_backend(),
            ))
            .into_tuple::<(String, String, String)>()
            .all(conn)
            .await?;
        for (node_id, section, hash) in rows {
            let node_id = NodeId::parse(&node_id).map_err(|_| {
                anyhow::anyhow!("corrupt row: node_inventory_sections.node_id = `{node_id}`")
            })?;
            hashes.entry(node_id).or_default().insert(section, hash);
        }
    }
    Ok(hashes)
}

/// The most rows one statement of [`put_sections`] or [`replace_devices`] writes (a power of
/// two: [`runs`]). Kept small because a database connection keeps what its largest statement
/// needed for as long as it lives: sqlx's PostgreSQL connection keeps its write buffer at the
/// size of the largest message it sent, and each connection's statement cache keeps every
/// statement shape it prepared, with its parameters' types (SQLite: its compiled program).
/// With 1,024 rows a statement, a run of inventory sections (about 2 KB of JSON each) was a
/// 1.9 MB message, and at 10,000 nodes on PostgreSQL the pool's 14 connections held 26.9 MB
/// of write buffers and 39.9 MB of prepared statements' metadata (`heaptrack`, BENCHMARKS.md).
/// 128 rows still make a few statements of a bring-up's batch, not one per node. Bounded by
/// the bytes of a section's JSON rather than by its parameters; each table's own bound
/// ([`runs_of_at_most`]) applies as well.
const ROWS_PER_INSERT: usize = 128;

/// One inventory section as stored: the node, the section's name, its hash and content.
pub struct SectionRow {
    pub node_id: NodeId,
    pub section: String,
    pub hash: String,
    pub content: serde_json::Value,
}

/// Stores (or replaces) inventory sections of any number of nodes, in a statement per run of
/// at most [`ROWS_PER_INSERT`] sections.
pub async fn put_sections(
    conn: &impl ConnectionTrait,
    sections: Vec<SectionRow>,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    let rows: Vec<_> = sections
        .into_iter()
        .map(|row| node_inventory_section::ActiveModel {
            node_id: Set(row.node_id.to_string()),
            section: Set(row.section),
            hash: Set(row.hash),
            content: Set(row.content),
            reported_at: Set(now),
        })
        .collect();
    for run in runs_of_at_most::<node_inventory_section::Entity, _>(rows, ROWS_PER_INSERT) {
        node_inventory_section::Entity::insert_many(run)
            .on_conflict(
                OnConflict::columns([
                    node_inventory_section::Column::NodeId,
                    node_inventory_section::Column::Section,
                ])
                .update_columns([
                    node_inventory_section::Column::Hash,
                    node_inventory_section::Column::Content,
                    node_inventory_section::Column::ReportedAt,
                ])
                .to_owned(),
            )
            .exec_without_returning(conn)
            .await?;
    }
    Ok(())
}

/// Every stored inventory section of several nodes, by node and name, in one statement per
/// thousand nodes; a node with none is left out.
pub async fn sections_of(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<HashMap<NodeId, BTreeMap<String, serde_json::Value>>> {
    let mut sections: HashMap<NodeId, BTreeMap<String, serde_json::Value>> = HashMap::new();
    for chunk in ids.chunks(1_000) {
        let rows = node_inventory_section::Entity::find()
            .filter(one_of(
                Expr::col(node_inventory_section::Column::NodeId),
                chunk,
                conn.get_database_backend(),
            ))
            .all(conn)
            .await?;
        for row in rows {
            let node_id = parse_node_id(&row.node_id)?;
            sections
                .entry(node_id)
                .or_default()
                .insert(row.section, row.content);
        }
    }
    Ok(sections)
}

fn parse_node_id(raw: &str) -> anyhow::Result<NodeId> {
    NodeId::parse(raw)
        .map_err(|_| anyhow::anyhow!("corrupt row: node_inventory_sections.node_id = `{raw}`"))
}

/// Every stored inventory section of a node, by name.
pub async fn sections(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
) -> anyhow::Result<BTreeMap<String, serde_json::Value>> {
    Ok(node_inventory_section::Entity::find()
        .filter(node_inventory_section::Column::NodeId.eq(node_id.to_string()))
        .all(conn)
        .await?
        .into_iter()
        .map(|row| (row.section, row.content))
        .collect())
}

/// Replaces each node's devices with its list, and recounts the placer's index of free atoms
/// (ARCHITECTURE.md, Invariants), for any number of nodes in a few statements: the free-count
/// rows locked, one delete, an insert per run of at most [`ROWS_PER_INSERT`] devices, one
/// recount.
pub async fn replace_devices(
    conn: &impl ConnectionTrait,
    devices: &[(NodeId, Vec<Device>)],
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    if devices.is_empty() {
        return Ok(());
    }
    let ids: Vec<NodeId> = devices.iter().map(|(id, _)| id.clone()).collect();
    super::placement::lock_free_counts(conn, &ids).await?;
    for chunk in ids.chunks(1_000) {
        node_device::Entity::delete_many()
            .filter(one_of(
                Expr::col(node_device::Column::NodeId),
                chunk,
                conn.get_database_backend(),
            ))
            .exec(conn)
            .await?;
    }
    let rows: Vec<node_device::ActiveModel> = devices
        .iter()
        .flat_map(|(node_id, list)| list.iter().map(move |d| (node_id, d)))
        .map(|(node_id, d)| node_device::ActiveModel {
            node_id: Set(node_id.to_string()),
            name: Set(d.name.clone()),
            kind: Set(GPU_DEVICE_KIND.to_owned()),
            uuid: Set(d.uuid.clone()),
            pci_bus_id: Set(d.pci_bus_id.clone()),
            model: Set(d.model.clone()),
            memory_mib: Set(i64::try_from(d.memory_mib).unwrap_or(i64::MAX)),
            serial: Set(d.serial.clone()),
            atom: Set(d.atom.clone()),
            healthy: Set(d.healthy),
            updated_at: Set(now),
        })
        .collect();
    for run in runs_of_at_most::<node_device::Entity, _>(rows, ROWS_PER_INSERT) {
        node_device::Entity::insert_many(run)
            .exec_without_returning(conn)
            .await?;
    }
    super::placement::recount_free_atoms(conn, &ids).await
}

/// A node's devices, in name order.
pub async fn devices(conn: &impl ConnectionTrait, node_id: &NodeId) -> anyhow::Result<Vec<Device>> {
    node_device::Entity::find()
        .filter(node_device::Column::NodeId.eq(node_id.to_string()))
        .order_by_asc(node_device::Column::Name)
        .all(conn)
        .await?
        .into_iter()
        .map(super::rows::device)
        .collect()
}
