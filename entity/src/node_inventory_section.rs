//! `node_inventory_sections`: the latest content of each inventory section a node reported,
//! with its canonical hash (so Hello can say which sections changed).

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_inventory_sections")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub section: String,
    #[sea_orm(column_type = "Text")]
    pub hash: String,
    #[sea_orm(column_type = "JsonBinary")]
    pub content: Json,
    pub reported_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
