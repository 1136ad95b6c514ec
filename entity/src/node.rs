//! `nodes`: one machine under management. Soft-deleted via `deleted_at`.
//!
//! Enum-like columns are plain `String`s; the server maps them to the domain
//! enums in `bc-core` explicitly.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "nodes")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    #[sea_orm(column_type = "Text")]
    pub hostname: String,
    #[sea_orm(column_type = "Text")]
    pub site_id: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub pool_id: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub owner_tenant_id: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub role: String,
    #[sea_orm(column_type = "Text")]
    pub trust: String,
    #[sea_orm(column_type = "Text")]
    pub adapter: String,
    #[sea_orm(column_type = "JsonBinary")]
    pub drivers: Json,
    /// Unique among live nodes with a trusted key (partial unique index
    /// `ux_nodes_hardware_key_trusted`).
    #[sea_orm(column_type = "Text", nullable)]
    pub hardware_key: Option<String>,
    pub hardware_key_trusted: bool,
    pub generation: i64,
    pub observed_generation: i64,
    pub identity_generation: i64,
    /// Optimistic-concurrency version of the row.
    pub version: i64,
    #[sea_orm(column_type = "Text")]
    pub provision_state: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub failed_from: Option<String>,
    pub maintenance: bool,
    #[sea_orm(column_type = "Text", nullable)]
    pub maintenance_reason: Option<String>,
    pub cordoned: bool,
    #[sea_orm(column_type = "Text", nullable)]
    pub cordon_reason: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub cordoned_by: Option<String>,
    #[sea_orm(nullable)]
    pub cordoned_at: Option<DateTimeUtc>,
    #[sea_orm(nullable)]
    pub drain_started_at: Option<DateTimeUtc>,
    #[sea_orm(nullable)]
    pub drain_deadline: Option<DateTimeUtc>,
    #[sea_orm(column_type = "Text")]
    pub power: String,
    #[sea_orm(column_type = "Text")]
    pub connectivity: String,
    pub connectivity_since: DateTimeUtc,
    /// Canonical JSON array of reason strings, `[]` when empty. Stored as
    /// TEXT (not JSON) so SQL can compare it to `'[]'` on every backend.
    #[sea_orm(column_type = "Text")]
    pub no_schedule_reasons: String,
    pub gpu_count: i32,
    pub created_at: DateTimeUtc,
    pub updated_at: DateTimeUtc,
    #[sea_orm(nullable)]
    pub deleted_at: Option<DateTimeUtc>,

    #[sea_orm(belongs_to, from = "site_id", to = "id", on_delete = "Restrict")]
    pub site: BelongsTo<super::site::Entity>,
    #[sea_orm(belongs_to, from = "pool_id", to = "id", on_delete = "Restrict")]
    pub pool: BelongsTo<Option<super::pool::Entity>>,
    #[sea_orm(
        belongs_to,
        from = "owner_tenant_id",
        to = "id",
        on_delete = "Restrict"
    )]
    pub owner_tenant: BelongsTo<Option<super::tenant::Entity>>,
    #[sea_orm(has_many)]
    pub labels: HasMany<super::node_label::Entity>,
    #[sea_orm(has_many)]
    pub taints: HasMany<super::node_taint::Entity>,
    #[sea_orm(has_many)]
    pub conditions: HasMany<super::node_condition::Entity>,
    #[sea_orm(has_many)]
    pub no_schedule_reason_rows: HasMany<super::node_no_schedule_reason::Entity>,
    #[sea_orm(has_one)]
    pub session: HasOne<super::node_session::Entity>,
}

impl ActiveModelBehavior for ActiveModel {}
