//! `liveness_brakes`: a site whose fleet brake tripped, until the episode ends
//! (`bc_core::brake`).

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "liveness_brakes")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub site_id: String,
    /// `paused` | `released`.
    #[sea_orm(column_type = "Text")]
    pub status: String,
    /// The site's numbers when the brake tripped.
    pub silent: i64,
    pub recently_unreachable: i64,
    pub watched: i64,
    pub tripped_at: DateTimeUtc,
    /// The admin who released it (an actor's spelling), why and when.
    #[sea_orm(column_type = "Text", nullable)]
    pub released_by: Option<String>,
    #[sea_orm(column_type = "Text", nullable)]
    pub release_reason: Option<String>,
    pub released_at: Option<DateTimeUtc>,
}

impl ActiveModelBehavior for ActiveModel {}
