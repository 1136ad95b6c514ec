//! Rows the gateway and JoinService write: join tokens, sessions, inventory sections.

use bc_core::ids::{JoinTokenId, NodeId, PoolId, SiteId};
use bc_entity::{join_token, node, node_inventory_section, node_session};
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::OnConflict;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder};
use std::collections::BTreeMap;

/// A join token as the domain sees it (never the secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub id: JoinTokenId,
    pub secret_hash: String,
    pub site_id: SiteId,
    pub pool_id: Option<PoolId>,
    pub description: String,
    pub expires_at: DateTime<Utc>,
    pub max_uses: i64,
    pub uses: i64,
    pub revoked_at: Option<DateTime<Utc>>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
}

fn join_token_from(row: join_token::Model) -> anyhow::Result<JoinToken> {
    let corrupt = |c: &str, v: &str| anyhow::anyhow!("corrupt row: join_tokens.{c} = `{v}`");
    Ok(JoinToken {
        id: JoinTokenId::parse(&row.id).map_err(|_| corrupt("id", &row.id))?,
        site_id: SiteId::parse(&row.site_id).map_err(|_| corrupt("site_id", &row.site_id))?,
        pool_id: row
            .pool_id
            .as_deref()
            .map(|p| PoolId::parse(p).map_err(|_| corrupt("pool_id", p)))
            .transpose()?,
        secret_hash: row.secret_hash,
        description: row.description,
        expires_at: row.expires_at,
        max_uses: row.max_uses,
        uses: row.uses,
        revoked_at: row.revoked_at,
        created_by: row.created_by,
        created_at: row.created_at,
    })
}

pub async fn insert_join_token(conn: &impl ConnectionTrait, t: &JoinToken) -> anyhow::Result<()> {
    let row = join_token::ActiveModel {
        id: Set(t.id.to_string()),
        secret_hash: Set(t.secret_hash.clone()),
        site_id: Set(t.site_id.to_string()),
        pool_id: Set(t.pool_id.as_ref().map(ToString::to_string)),
        description: Set(t.description.clone()),
        expires_at: Set(t.expires_at),
        max_uses: Set(t.max_uses),
        uses: Set(t.uses),
        revoked_at: Set(t.revoked_at),
        created_by: Set(t.created_by.clone()),
        created_at: Set(t.created_at),
    };
    join_token::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// One token, locked for the rest of the transaction where the database has row locks.
pub async fn join_token(
    conn: &impl ConnectionTrait,
    id: &JoinTokenId,
    for_update: bool,
) -> anyhow::Result<Option<JoinToken>> {
    let mut select = join_token::Entity::find_by_id(id.to_string());
    if for_update {
        select = super::lock_for_update(select, conn);
    }
    select.one(conn).await?.map(join_token_from).transpose()
}

pub async fn join_tokens(conn: &impl ConnectionTrait) -> anyhow::Result<Vec<JoinToken>> {
    join_token::Entity::find()
        .order_by_desc(join_token::Column::CreatedAt)
        .all(conn)
        .await?
        .into_iter()
        .map(join_token_from)
        .collect()
}

pub async fn count_join_token_use(
    conn: &impl ConnectionTrait,
    id: &JoinTokenId,
    uses: i64,
) -> anyhow::Result<()> {
    join_token::Entity::update_many()
        .col_expr(
            join_token::Column::Uses,
            sea_orm::sea_query::Expr::val(uses),
        )
        .filter(join_token::Column::Id.eq(id.to_string()))
        .exec(conn)
        .await?;
    Ok(())
}

pub async fn revoke_join_token(
    conn: &impl ConnectionTrait,
    id: &JoinTokenId,
    at: DateTime<Utc>,
) -> anyhow::Result<()> {
    join_token::Entity::update_many()
        .col_expr(
            join_token::Column::RevokedAt,
            sea_orm::sea_query::Expr::val(at),
        )
        .filter(join_token::Column::Id.eq(id.to_string()))
        .exec(conn)
        .await?;
    Ok(())
}

/// The live node holding a trusted hardware key, if any.
pub async fn node_by_trusted_hardware_key(
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

/// Opens a session: the next epoch for the node, connected now. Returns the epoch.
pub async fn open_session(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    gateway_id: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<i64> {
    let previous = node_session::Entity::find_by_id(node_id.to_string())
        .one(conn)
        .await?;
    let epoch = previous.map_or(1, |s| s.epoch + 1);
    let row = node_session::ActiveModel {
        node_id: Set(node_id.to_string()),
        epoch: Set(epoch),
        gateway_id: Set(gateway_id.to_owned()),
        connected_at: Set(now),
        disconnected_at: Set(None),
        last_seen: Set(now),
    };
    node_session::Entity::insert(row)
        .on_conflict(
            OnConflict::column(node_session::Column::NodeId)
                .update_columns([
                    node_session::Column::Epoch,
                    node_session::Column::GatewayId,
                    node_session::Column::ConnectedAt,
                    node_session::Column::DisconnectedAt,
                    node_session::Column::LastSeen,
                ])
                .to_owned(),
        )
        .exec_without_returning(conn)
        .await?;
    Ok(epoch)
}

/// Marks the session of `epoch` closed. Returns whether it was still the current session
/// (a newer epoch may have replaced it, in which case nothing changes).
pub async fn close_session(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    epoch: i64,
    now: DateTime<Utc>,
) -> anyhow::Result<bool> {
    let result = node_session::Entity::update_many()
        .col_expr(
            node_session::Column::DisconnectedAt,
            sea_orm::sea_query::Expr::val(now),
        )
        .filter(node_session::Column::NodeId.eq(node_id.to_string()))
        .filter(node_session::Column::Epoch.eq(epoch))
        .filter(node_session::Column::DisconnectedAt.is_null())
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// The epoch of the node's latest session (open or closed), if it ever had one.
pub async fn current_epoch(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
) -> anyhow::Result<Option<i64>> {
    Ok(node_session::Entity::find_by_id(node_id.to_string())
        .one(conn)
        .await?
        .map(|s| s.epoch))
}

/// Records heartbeats: `last_seen` of each (node, epoch) that is still the current, open
/// session. Returns the entries that were not (their session was superseded or closed).
pub async fn record_heartbeats(
    conn: &impl ConnectionTrait,
    beats: &[(NodeId, i64, DateTime<Utc>)],
) -> anyhow::Result<Vec<(NodeId, i64)>> {
    let mut stale = Vec::new();
    for (node_id, epoch, at) in beats {
        let result = node_session::Entity::update_many()
            .col_expr(
                node_session::Column::LastSeen,
                sea_orm::sea_query::Expr::val(*at),
            )
            .filter(node_session::Column::NodeId.eq(node_id.to_string()))
            .filter(node_session::Column::Epoch.eq(*epoch))
            .filter(node_session::Column::DisconnectedAt.is_null())
            .exec(conn)
            .await?;
        if result.rows_affected == 0 {
            stale.push((node_id.clone(), *epoch));
        }
    }
    Ok(stale)
}

/// The hash of each inventory section stored for a node.
pub async fn inventory_hashes(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
) -> anyhow::Result<BTreeMap<String, String>> {
    Ok(node_inventory_section::Entity::find()
        .filter(node_inventory_section::Column::NodeId.eq(node_id.to_string()))
        .all(conn)
        .await?
        .into_iter()
        .map(|row| (row.section, row.hash))
        .collect())
}

/// Stores (or replaces) one inventory section.
pub async fn put_inventory_section(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    section: &str,
    hash: &str,
    content: serde_json::Value,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    let row = node_inventory_section::ActiveModel {
        node_id: Set(node_id.to_string()),
        section: Set(section.to_owned()),
        hash: Set(hash.to_owned()),
        content: Set(content),
        reported_at: Set(now),
    };
    node_inventory_section::Entity::insert(row)
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

/// Closes whatever session of the node is open (its identity was replaced).
pub async fn close_open_session(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    node_session::Entity::update_many()
        .col_expr(
            node_session::Column::DisconnectedAt,
            sea_orm::sea_query::Expr::val(now),
        )
        .filter(node_session::Column::NodeId.eq(node_id.to_string()))
        .filter(node_session::Column::DisconnectedAt.is_null())
        .exec(conn)
        .await?;
    Ok(())
}

/// Every stored inventory section of a node, by name.
pub async fn inventory_sections(
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
    devices: &[bc_core::health::Device],
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    use bc_entity::node_device;
    node_device::Entity::delete_many()
        .filter(node_device::Column::NodeId.eq(node_id.to_string()))
        .exec(conn)
        .await?;
    if devices.is_empty() {
        return Ok(());
    }
    let rows = devices.iter().map(|d| node_device::ActiveModel {
        node_id: Set(node_id.to_string()),
        name: Set(d.name.clone()),
        kind: Set("gpu".to_owned()),
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
    Ok(())
}

/// A node's devices, in name order.
pub async fn devices(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
) -> anyhow::Result<Vec<bc_entity::node_device::Model>> {
    use bc_entity::node_device;
    Ok(node_device::Entity::find()
        .filter(node_device::Column::NodeId.eq(node_id.to_string()))
        .order_by_asc(node_device::Column::Name)
        .all(conn)
        .await?)
}
