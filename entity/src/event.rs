//! `events`: the append-only event log. `node_id` has no foreign key on
//! purpose: events outlive (hard-)deleted nodes.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "events")]
pub struct Model {
    /// Auto-increment; leave `NotSet` on insert.
    #[sea_orm(primary_key, auto_increment = true)]
    pub seq: i64,
    #[sea_orm(column_type = "Text", nullable)]
    pub node_id: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub tenant_id: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub event_type: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub axis: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub from_value: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub to_value: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub actor: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub cause: Option<String>,
    #[sea_orm(column_type = "JsonBinary")]
    pub data: Json,
    pub created_at: DateTimeUtc,
    /// The node's version after the change, for node changes (`node.*` events); `NULL` for
    /// every other event. Indexed with `node_id`: a rebuild reads a range of versions.
    pub node_version: Option<i64>,
}

impl ActiveModelBehavior for ActiveModel {}
