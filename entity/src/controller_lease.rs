//! `controller_leases`: the server that runs the controllers, until `expires_at` unless it
//! renews the lease.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "controller_leases")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub name: String,
    /// The holding server's identity (`ControllerLoop`'s holder id).
    #[sea_orm(column_type = "Text")]
    pub holder: String,
    /// When this holder took the lease (kept across renewals).
    pub since: DateTimeUtc,
    pub expires_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
