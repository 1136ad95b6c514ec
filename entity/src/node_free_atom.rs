//! `node_free_atoms`: the atoms of a node a reservation could book now (healthy, not
//! booked), recounted whenever its devices or bookings change; the placer's index.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_free_atoms")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub pool_id: Option<String>,
    pub free: i64,
}

impl ActiveModelBehavior for ActiveModel {}
