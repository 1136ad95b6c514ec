//! `remediation_attempts`: one row per try of health remediation on a node (an action and its
//! verification), so a restarted server resumes a remediation where it was.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "remediation_attempts")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    /// The first try of the run this one belongs to.
    #[sea_orm(column_type = "Text")]
    pub run_id: String,
    #[sea_orm(column_type = "Text")]
    pub node_id: String,
    #[sea_orm(column_type = "Text")]
    pub condition_type: String,
    /// The policy's ladder when the run started (`Vec<RemediationStep>` as JSON).
    #[sea_orm(column_type = "JsonBinary")]
    pub ladder: Json,
    pub step: i32,
    pub attempt: i32,
    /// The step's action (`gpu.reset`, `node.reboot`), for readers of the table.
    #[sea_orm(column_type = "Text")]
    pub action: String,
    /// `waiting` | `acting` | `verifying` | `succeeded` | `failed` | `gave_up` | `cancelled`.
    #[sea_orm(column_type = "Text")]
    pub status: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub action_command_id: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub refresh_command_id: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub verify_command_id: Option<String>,
    pub next_attempt_at: DateTimeUtc,
    #[sea_orm(column_type = "Text", nullable)]
    pub note: Option<String>,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
    pub finished_at: Option<DateTimeUtc>,
}

impl ActiveModelBehavior for ActiveModel {}
