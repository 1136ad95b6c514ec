//! `node_devices`: a node's GPUs (stable names in PCI bus order) and the atom on each.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_devices")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub name: String,
    #[sea_orm(column_type = "Text")]
    pub kind: String,
    #[sea_orm(column_type = "Text")]
    pub uuid: String,
    #[sea_orm(column_type = "Text")]
    pub pci_bus_id: String,
    #[sea_orm(column_type = "Text")]
    pub model: String,
    pub memory_mib: i64,
    #[sea_orm(column_type = "Text", nullable)]
    pub serial: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub atom: String,
    pub healthy: bool,
    pub updated_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
