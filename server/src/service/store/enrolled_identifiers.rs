//! The identifiers a node was enrolled with (`node_enrolled_identifiers`), normalised by kind
//! as [`bc_core::hardware::HardwareKey::identifiers`] holds them.

use bc_core::ids::NodeId;
use bc_entity::{node, node_enrolled_identifier};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, Condition, ConnectionTrait, EntityTrait, QueryFilter, QuerySelect};
use std::collections::{BTreeMap, BTreeSet};

use super::batch_shapes::one_of;

/// Identifiers by kind.
pub type Identifiers = BTreeMap<String, BTreeSet<String>>;

pub async fn insert(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    identifiers: &Identifiers,
) -> anyhow::Result<()> {
    let rows: Vec<_> = identifiers
        .iter()
        .flat_map(|(kind, values)| {
            values
                .iter()
                .map(move |value| node_enrolled_identifier::ActiveModel {
                    node_id: Set(node_id.to_string()),
                    kind: Set(kind.clone()),
                    value: Set(value.clone()),
                })
        })
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    node_enrolled_identifier::Entity::insert_many(rows)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// The live nodes enrolled with any of `identifiers`, each with every identifier it was
/// enrolled with (which the caller compares as a whole).
pub async fn sharing_any(
    conn: &impl ConnectionTrait,
    identifiers: &Identifiers,
) -> anyhow::Result<Vec<(NodeId, Identifiers)>> {
    if identifiers.is_empty() {
        return Ok(Vec::new());
    }
    // Every list is one of a few shapes (`batch_shapes`): a batch of joins asks with the
    // identifiers of up to 256 machines.
    let backend = conn.get_database_backend();
    let mut any = Condition::any();
    for (kind, values) in identifiers {
        any = any.add(
            Condition::all()
                .add(node_enrolled_identifier::Column::Kind.eq(kind.as_str()))
                .add(one_of(
                    Expr::col(node_enrolled_identifier::Column::Value),
                    &values.iter().collect::<Vec<_>>(),
                    backend,
                )),
        );
    }
    let node_ids: Vec<String> = node_enrolled_identifier::Entity::find()
        .select_only()
        .column(node_enrolled_identifier::Column::NodeId)
        .distinct()
        .filter(any)
        .into_tuple()
        .all(conn)
        .await?;
    if node_ids.is_empty() {
        return Ok(Vec::new());
    }
    let live: Vec<String> = node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .filter(one_of(Expr::col(node::Column::Id), &node_ids, backend))
        .filter(node::Column::DeletedAt.is_null())
        .into_tuple()
        .all(conn)
        .await?;
    let rows = node_enrolled_identifier::Entity::find()
        .filter(one_of(
            Expr::col(node_enrolled_identifier::Column::NodeId),
            &live,
            backend,
        ))
        .all(conn)
        .await?;
    let mut by_node: BTreeMap<String, Identifiers> = BTreeMap::new();
    for row in rows {
        by_node
            .entry(row.node_id)
            .or_default()
            .entry(row.kind)
            .or_default()
            .insert(row.value);
    }
    by_node
        .into_iter()
        .map(|(id, identifiers)| {
            let id = NodeId::parse(&id).map_err(|_| {
                anyhow::anyhow!("corrupt row: node_enrolled_identifiers.node_id = `{id}`")
            })?;
            Ok((id, identifiers))
        })
        .collect()
}
