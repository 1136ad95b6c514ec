//! `node_enrolled_identifiers`: the machine identifiers a node was enrolled with, one row per
//! normalised value (`kind` as `bc_core::hardware` names it: `system-uuid`, `mac`, …).

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_enrolled_identifiers")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub kind: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub value: String,
}

impl ActiveModelBehavior for ActiveModel {}
