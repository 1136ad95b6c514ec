//! `sites`: a place nodes live in (`platform` or a tenant's `custom` site).

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "sites")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    #[sea_orm(unique, column_type = "Text")]
    pub name: String,
    /// `platform` | `custom`.
    #[sea_orm(column_type = "Text")]
    pub kind: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub owner_tenant_id: Option<String>,
    pub created_at: DateTimeUtc,

    #[sea_orm(
        belongs_to,
        from = "owner_tenant_id",
        to = "id",
        on_delete = "Restrict"
    )]
    pub owner_tenant: BelongsTo<Option<super::tenant::Entity>>,
    #[sea_orm(has_many)]
    pub pools: HasMany<super::pool::Entity>,
    #[sea_orm(has_many)]
    pub nodes: HasMany<super::node::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
