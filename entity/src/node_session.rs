//! `node_sessions`: the agent connection session of a node (at most one).

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_sessions")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    pub epoch: i64,
    #[sea_orm(column_type = "Text")]
    pub gateway_id: String,
    pub connected_at: DateTimeUtc,
    #[sea_orm(nullable)]
    pub disconnected_at: Option<DateTimeUtc>,
    pub last_seen: DateTimeUtc,

    #[sea_orm(belongs_to, from = "node_id", to = "id", on_delete = "Cascade")]
    pub node: BelongsTo<super::node::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
