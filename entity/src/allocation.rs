//! `allocations`: atoms of one node booked for one reservation. Kept after release (with
//! `released_at`) as the history of what ran where.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "allocations")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    #[sea_orm(column_type = "Text")]
    pub reservation_id: String,
    #[sea_orm(column_type = "Text")]
    pub tenant_id: String,
    #[sea_orm(column_type = "Text")]
    pub pool_id: String,
    #[sea_orm(column_type = "Text")]
    pub node_id: String,
    /// The booked atoms: `["gpu0/whole", …]`.
    #[sea_orm(column_type = "JsonBinary")]
    pub atoms: Json,
    pub booked_at: DateTimeUtc,
    #[sea_orm(nullable)]
    pub released_at: Option<DateTimeUtc>,
    #[sea_orm(column_type = "Text", nullable)]
    pub release_reason: Option<String>,
}

impl ActiveModelBehavior for ActiveModel {}
