//! `node_conditions`: one row per condition type reported for a node.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_conditions")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    /// The condition's type (column `condition_type`: `type` is a keyword).
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub condition_type: String,
    #[sea_orm(column_type = "Text")]
    pub status: String,
    #[sea_orm(column_type = "Text")]
    pub reason: String,
    #[sea_orm(column_type = "Text")]
    pub message: String,
    pub no_schedule: bool,
    #[sea_orm(column_type = "Text")]
    pub set_by: String,
    pub last_transition_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
    /// The progress of the condition's proof (`bc_core::clear::Proof` as JSON), for a
    /// condition that clears only on proof or by hand.
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub proof: Option<Json>,

    #[sea_orm(belongs_to, from = "node_id", to = "id", on_delete = "Cascade")]
    pub node: BelongsTo<super::node::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
