//! Inventory: the sections a daemon reported (`node_inventory_sections`, by hash) and the
//! devices the Inventory controller derived from them (`node_devices`).

use bc_core::health::{Device, GPU_DEVICE_KIND};
use bc_core::ids::NodeId;
use bc_entity::{node_device, node_inventory_section};
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::OnConflict;
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
            .filter(
                node_inventory_section::Column::NodeId.is_in(chunk.iter().map(ToString::to_string)),
            )
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

/// Stores (or replaces) a node's inventory sections, `(section, hash, content)`, in one
/// statement.
pub async fn put_sections(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    sections: impl IntoIterator<Item = (String, String, serde_json::Value)>,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    let rows: Vec<_> = sections
        .into_iter()
        .map(
            |(section, hash, content)| node_inventory_section::ActiveModel {
                node_id: Set(node_id.to_string()),
                section: Set(section),
                hash: Set(hash),
                content: Set(content),
                reported_at: Set(now),
            },
        )
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    node_inventory_section::Entity::insert_many(rows)
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
    Ok(())
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

/// Replaces a node's devices with `devices`.
pub async fn replace_devices(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    devices: &[Device],
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    super::placement::lock_free_counts(conn, std::slice::from_ref(node_id)).await?;
    node_device::Entity::delete_many()
        .filter(node_device::Column::NodeId.eq(node_id.to_string()))
        .exec(conn)
        .await?;
    if devices.is_empty() {
        return super::placement::recount_free_atoms(conn, std::slice::from_ref(node_id)).await;
    }
    let rows = devices.iter().map(|d| node_device::ActiveModel {
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
    });
    node_device::Entity::insert_many(rows)
        .exec_without_returning(conn)
        .await?;
    // The placer's index counts these devices (ARCHITECTURE.md, Invariants).
    super::placement::recount_free_atoms(conn, std::slice::from_ref(node_id)).await
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
