//! `commands`: the command queue, one row per command sent to a node.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "commands")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    #[sea_orm(column_type = "Text")]
    pub node_id: String,
    /// The node's owner when the command was sent, for tenant-scoped reads and events.
    #[sea_orm(column_type = "Text", nullable)]
    pub tenant_id: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub kind: String,
    #[sea_orm(column_type = "Text")]
    pub lane: String,
    #[sea_orm(column_type = "JsonBinary")]
    pub params: Json,
    #[sea_orm(column_type = "Text")]
    pub status: String,
    pub force: bool,
    pub not_before: DateTimeUtc,
    pub timeout_secs: i64,
    pub expires_at: DateTimeUtc,
    pub attempts: i32,
    /// The session epoch the command was last dispatched to.
    #[sea_orm(nullable)]
    pub session_epoch: Option<i64>,
    #[sea_orm(nullable)]
    pub exit_code: Option<i32>,
    #[sea_orm(column_type = "Text")]
    pub output: String,
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub result: Option<Json>,
    #[sea_orm(column_type = "Text", nullable)]
    pub error: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub created_by: String,
    pub created_at: DateTimeUtc,
    #[sea_orm(nullable)]
    pub dispatched_at: Option<DateTimeUtc>,
    #[sea_orm(nullable)]
    pub started_at: Option<DateTimeUtc>,
    #[sea_orm(nullable)]
    pub finished_at: Option<DateTimeUtc>,
    pub updated_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
