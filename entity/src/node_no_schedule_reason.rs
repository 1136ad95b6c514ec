//! `node_no_schedule_reasons`: the normalized form of
//! `nodes.no_schedule_reasons`, one row per active reason.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_no_schedule_reasons")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub reason: String,
    #[sea_orm(column_type = "Text")]
    pub set_by: String,
    pub since: DateTimeUtc,
    #[sea_orm(column_type = "Text")]
    pub detail: String,

    #[sea_orm(belongs_to, from = "node_id", to = "id", on_delete = "Cascade")]
    pub node: BelongsTo<super::node::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
