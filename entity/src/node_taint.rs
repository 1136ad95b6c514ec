//! `node_taints`: scheduling taints on a node.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_taints")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub key: String,
    #[sea_orm(column_type = "Text")]
    pub value: String,
    #[sea_orm(column_type = "Text")]
    pub effect: String,
    #[sea_orm(column_type = "Text")]
    pub added_by: String,
    pub added_at: DateTimeUtc,

    #[sea_orm(belongs_to, from = "node_id", to = "id", on_delete = "Cascade")]
    pub node: BelongsTo<super::node::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
