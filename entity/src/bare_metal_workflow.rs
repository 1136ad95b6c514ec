//! `bare_metal_workflows`: one bare-metal workflow run on a node (inspect, release, retire)
//! with its steps, so a restarted server resumes it where it was.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "bare_metal_workflows")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    #[sea_orm(column_type = "Text")]
    pub node_id: String,
    /// `inspect` | `release` | `retire`.
    #[sea_orm(column_type = "Text")]
    pub kind: String,
    /// `running` | `succeeded` | `failed` | `aborted`.
    #[sea_orm(column_type = "Text")]
    pub status: String,
    /// The index of the step under way (or the last reached).
    pub current_step: i64,
    /// The steps, in order (`bc_core::workflow::Step` as JSON).
    #[sea_orm(column_type = "JsonBinary")]
    pub steps: Json,
    #[sea_orm(column_type = "Text", nullable)]
    pub reason: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub started_by: String,
    /// The node's identity generation when the workflow started.
    pub identity_generation: i64,
    pub version: i64,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
    pub finished_at: Option<DateTimeUtc>,
}

impl ActiveModelBehavior for ActiveModel {}
