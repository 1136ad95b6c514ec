//! `atom_bookings`: one row per atom an active allocation holds, deleted on release. Its
//! primary key `(node_id, atom)` is what makes a double booking impossible.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "atom_bookings")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub atom: String,
    #[sea_orm(column_type = "Text")]
    pub allocation_id: String,
}

impl ActiveModelBehavior for ActiveModel {}
