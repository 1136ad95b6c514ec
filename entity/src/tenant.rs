//! `tenants`: an owner of sites, pools and nodes.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "tenants")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    #[sea_orm(unique, column_type = "Text")]
    pub name: String,
    pub created_at: DateTimeUtc,

    #[sea_orm(has_many)]
    pub sites: HasMany<super::site::Entity>,
    #[sea_orm(has_many)]
    pub pools: HasMany<super::pool::Entity>,
    #[sea_orm(has_many)]
    pub nodes: HasMany<super::node::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
