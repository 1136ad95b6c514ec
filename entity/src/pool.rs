//! `pools`: a group of like nodes within a site.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "pools")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    /// Unique together with `name` (`Entity::find_by_site_name((site_id, name))`).
    #[sea_orm(column_type = "Text", unique_key = "site_name")]
    pub site_id: String,
    #[sea_orm(column_type = "Text", unique_key = "site_name")]
    pub name: String,
    /// `metal-host` | `vps-host` | `provider` | `metal-dedicated`.
    #[sea_orm(column_type = "Text")]
    pub kind: String,
    /// `bcd` | `none`.
    #[sea_orm(column_type = "Text")]
    pub agent: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub owner_tenant_id: Option<String>,
    #[sea_orm(column_type = "JsonBinary")]
    pub hardware_profile: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub drivers: Json,
    /// The remediation policy (`bc_core::remediation::RemediationPolicy` as JSON); `NULL`
    /// for the defaults.
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub remediation: Option<Json>,
    /// The acceptance checks (`bc_core::acceptance::AcceptancePolicy` as JSON); `NULL` for
    /// the defaults.
    #[sea_orm(column_type = "JsonBinary", nullable)]
    pub acceptance: Option<Json>,
    pub created_at: DateTimeUtc,

    #[sea_orm(belongs_to, from = "site_id", to = "id", on_delete = "Restrict")]
    pub site: BelongsTo<super::site::Entity>,
    #[sea_orm(
        belongs_to,
        from = "owner_tenant_id",
        to = "id",
        on_delete = "Restrict"
    )]
    pub owner_tenant: BelongsTo<Option<super::tenant::Entity>>,
    #[sea_orm(has_many)]
    pub nodes: HasMany<super::node::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
