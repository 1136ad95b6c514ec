//! GraphQL input types.

use async_graphql::{ID, InputObject};
use chrono::{DateTime, Utc};

use super::types::{
    CapacityBucket, Connectivity, NodeRole, PoolAgent, PoolKind, ProvisionMove, ProvisionState,
    SiteKind, TaintEffect, Trust,
};

/// A label selector term: the key present, or present with this value.
#[derive(InputObject, Clone)]
pub struct LabelSelectorInput {
    pub key: String,
    pub value: Option<String>,
}

/// Which nodes to list. Values within one field are alternatives ("any of"); fields and
/// label selectors must all hold.
#[derive(InputObject, Default, Clone)]
pub struct NodeFilterInput {
    pub provision_state: Option<Vec<ProvisionState>>,
    pub connectivity: Option<Vec<Connectivity>>,
    pub maintenance: Option<bool>,
    pub cordoned: Option<bool>,
    pub role: Option<Vec<NodeRole>>,
    pub trust: Option<Vec<Trust>>,
    pub site_id: Option<Vec<ID>>,
    pub pool_id: Option<Vec<ID>>,
    pub labels: Option<Vec<LabelSelectorInput>>,
    /// Nodes carrying any of these `noScheduleReasons` (e.g. `taint:gpu-burn`, `unreachable`).
    pub reason: Option<Vec<String>>,
    pub bucket: Option<Vec<CapacityBucket>>,
    pub schedulable: Option<bool>,
    /// A substring of the hostname.
    pub hostname: Option<String>,
}

#[derive(InputObject)]
pub struct CordonNodeInput {
    pub id: ID,
    /// The `version` you read.
    pub version: i64,
    pub reason: String,
}

#[derive(InputObject)]
pub struct NodeVersionInput {
    pub id: ID,
    pub version: i64,
}

#[derive(InputObject)]
pub struct DrainNodeInput {
    pub id: ID,
    pub version: i64,
    pub reason: String,
    /// When `draining` leaves `noScheduleReasons` even if allocations remain.
    pub deadline: Option<DateTime<Utc>>,
}

#[derive(InputObject)]
pub struct TaintNodeInput {
    pub id: ID,
    pub version: i64,
    pub key: String,
    #[graphql(default)]
    pub value: String,
    #[graphql(default_with = "TaintEffect::NoSchedule")]
    pub effect: TaintEffect,
}

#[derive(InputObject)]
pub struct UntaintNodeInput {
    pub id: ID,
    pub version: i64,
    pub key: String,
}

#[derive(InputObject)]
pub struct LabelInput {
    pub key: String,
    pub value: String,
}

#[derive(InputObject)]
pub struct LabelNodeInput {
    pub id: ID,
    pub version: i64,
    #[graphql(default)]
    pub set: Vec<LabelInput>,
    #[graphql(default)]
    pub remove: Vec<String>,
}

#[derive(InputObject)]
pub struct TransitionNodeInput {
    pub id: ID,
    pub version: i64,
    #[graphql(name = "move")]
    pub action: ProvisionMove,
    /// Kept with the event; for `FAIL`, also the maintenance reason.
    pub reason: Option<String>,
}

#[derive(InputObject)]
pub struct ReasonedNodeInput {
    pub id: ID,
    pub version: i64,
    pub reason: String,
}

#[derive(InputObject)]
pub struct EnrollNodeInput {
    pub hostname: String,
    pub site_id: ID,
    pub pool_id: Option<ID>,
}

#[derive(InputObject)]
pub struct CreateSiteInput {
    pub name: String,
    pub kind: SiteKind,
    /// Required for a `CUSTOM` site, refused for a `PLATFORM` one.
    pub owner_tenant_id: Option<ID>,
}

#[derive(InputObject)]
pub struct CreatePoolInput {
    pub site_id: ID,
    pub name: String,
    pub kind: PoolKind,
    #[graphql(default_with = "PoolAgent::Bcd")]
    pub agent: PoolAgent,
    pub owner_tenant_id: Option<ID>,
    pub expected_gpu_count: Option<i32>,
    pub expected_gpu_model: Option<String>,
    #[graphql(default)]
    pub drivers: Vec<LabelInput>,
}

#[derive(InputObject)]
pub struct CreateJoinTokenInput {
    pub site_id: ID,
    /// Nodes joining with this token land in this pool (which decides their role).
    pub pool_id: Option<ID>,
    /// Default 86400 (a day); at most a year.
    pub expires_in_seconds: Option<i64>,
    /// Default 1 (single-use).
    pub max_uses: Option<i64>,
    #[graphql(default)]
    pub description: String,
}

/// A command for one node or many.
#[derive(InputObject)]
pub struct SendCommandInput {
    /// Target these nodes…
    pub node_ids: Option<Vec<ID>>,
    /// …or every node this filter matches (at most 10,000).
    pub filter: Option<NodeFilterInput>,
    pub kind: super::types::CommandKind,
    pub params: Option<async_graphql::Json<serde_json::Value>>,
    /// Default: the kind's own (diag.nvml 15 min, node.reboot 20 min, …).
    pub timeout_seconds: Option<i64>,
    /// Not dispatched before this time.
    pub not_before: Option<DateTime<Utc>>,
    /// Expires if still queued this long after it could first run (default 3600).
    pub expires_in_seconds: Option<i64>,
    /// Send a destructive command to an uncordoned node (admins only).
    #[graphql(default)]
    pub force: bool,
}

/// Which commands to list.
#[derive(InputObject, Default)]
pub struct CommandFilterInput {
    pub node_id: Option<Vec<ID>>,
    pub status: Option<Vec<super::types::CommandStatus>>,
    pub kind: Option<Vec<super::types::CommandKind>>,
}
