//! `reservations`: requests for GPUs that the placer books (see `bc_core::placement`).

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "reservations")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    #[sea_orm(column_type = "Text")]
    pub tenant_id: String,
    #[sea_orm(column_type = "Text")]
    pub pool_id: String,
    pub gpus_per_node: i32,
    pub node_count: i32,
    #[sea_orm(column_type = "Text", nullable)]
    pub gpu_model: Option<String>,
    /// `[{ "key": …, "value": … | null }]`.
    #[sea_orm(column_type = "JsonBinary")]
    pub selector: Json,
    /// Taint keys tolerated: `["gpu-burn", …]`.
    #[sea_orm(column_type = "JsonBinary")]
    pub tolerations: Json,
    /// `bin-pack` | `spread`.
    #[sea_orm(column_type = "Text")]
    pub policy: String,
    /// `pending` | `placed` | `released` | `failed`.
    #[sea_orm(column_type = "Text")]
    pub state: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub reason: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub idempotency_key: Option<String>,
    #[sea_orm(nullable)]
    pub expires_at: Option<DateTimeUtc>,
    pub version: i64,
    #[sea_orm(column_type = "Text")]
    pub created_by: String,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
