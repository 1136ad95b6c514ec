//! `node_bmcs`: how to reach a bare-metal node's BMC (address, TLS, sealed credentials) and
//! what the Power controller last saw there. At most one per node.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[sea_orm::model]
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "node_bmcs")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub node_id: String,
    /// The Redfish service's base URL (`https://bmc.example.com`).
    #[sea_orm(column_type = "Text")]
    pub address: String,
    /// The `ComputerSystem`'s id under `/redfish/v1/Systems`, when the operator named one.
    #[sea_orm(column_type = "Text", nullable)]
    pub system_id: Option<String>,
    /// `verify`, `custom-ca` or `off`.
    #[sea_orm(column_type = "Text")]
    pub tls_verification: String,
    #[sea_orm(column_type = "Text", nullable)]
    pub ca_pem: Option<String>,
    /// Which credential key sealed `sealed_credentials` (a fingerprint, not the key).
    #[sea_orm(column_type = "Text")]
    pub credential_key_id: String,
    /// Nonce and ciphertext, base64: never the credentials themselves.
    #[sea_orm(column_type = "Text")]
    pub sealed_credentials: String,
    /// The `ComputerSystem`'s path as the service root led to it, once found.
    #[sea_orm(column_type = "Text", nullable)]
    pub system_path: Option<String>,
    /// Whether the last poll got an answer; `None` before the first.
    #[sea_orm(nullable)]
    pub reachable: Option<bool>,
    #[sea_orm(column_type = "Text", nullable)]
    pub last_error: Option<String>,
    pub consecutive_failures: i64,
    #[sea_orm(nullable)]
    pub last_polled_at: Option<DateTimeUtc>,
    pub next_poll_at: DateTimeUtc,
    pub created_at: DateTimeUtc,
}

impl ActiveModelBehavior for ActiveModel {}
