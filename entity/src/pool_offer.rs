//! `pool_offers`: the tenants a pool is offered to (`offerPool`); they may reserve in it.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "pool_offers")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub pool_id: String,
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub tenant_id: String,
    #[sea_orm(column_type = "Text")]
    pub offered_by: String,
    pub offered_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
