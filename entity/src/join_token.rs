//! `join_tokens`: credentials a daemon presents to join. Only the secret's hash is stored.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "join_tokens")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub id: String,
    /// SHA-256 (hex) of the secret part of the token.
    #[sea_orm(column_type = "Text")]
    pub secret_hash: String,
    #[sea_orm(column_type = "Text")]
    pub site_id: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub pool_id: Option<String>,
    #[sea_orm(column_type = "Text")]
    pub description: String,
    pub expires_at: DateTimeUtc,
    pub max_uses: i64,
    pub uses: i64,
    #[sea_orm(nullable)]
    pub revoked_at: Option<DateTimeUtc>,
    #[sea_orm(column_type = "Text")]
    pub created_by: String,
    pub created_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
