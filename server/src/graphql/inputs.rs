//! GraphQL input types, each with its [`Validate`]: which limit of `limits.rs` each field
//! has (SECURITY.md, "Input limits", is the table).

use async_graphql::{ID, InputObject};

use super::input_limits::{
    COMMAND_TIMEOUT_SECONDS, COMMAND_TTL_SECONDS, EXPECTED_GPU_COUNT, Field,
    JOIN_TOKEN_LIFETIME_SECONDS, JOIN_TOKEN_USES, MAX_COMMAND_NODE_IDS, MAX_DRIVERS,
    MAX_FILTER_VALUES, MAX_LABELS_PER_CHANGE, Text, Timestamp, VERSION, Validate,
};
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
    pub deadline: Option<Timestamp>,
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
    pub not_before: Option<Timestamp>,
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

type Checked = Result<(), crate::error::ApiError>;

/// A node and the `version` the caller read, the start of every node mutation.
fn node_and_version(at: &Field, id: &ID, version: i64) -> Checked {
    at.at("id").id(id)?;
    at.at("version").int(version, VERSION)
}

impl Validate for LabelSelectorInput {
    fn validate(&self, at: &Field) -> Checked {
        let LabelSelectorInput { key, value } = self;
        at.at("key").text(key, Text::LabelKeyFilter)?;
        at.at("value")
            .text_opt(value.as_deref(), Text::LabelValueFilter)
    }
}

impl Validate for NodeFilterInput {
    fn validate(&self, at: &Field) -> Checked {
        let NodeFilterInput {
            provision_state,
            connectivity,
            maintenance: _,
            cordoned: _,
            role,
            trust,
            site_id,
            pool_id,
            labels,
            reason,
            bucket,
            schedulable: _,
            hostname,
        } = self;
        let max = MAX_FILTER_VALUES;
        at.at("provisionState")
            .bounded(provision_state.as_deref(), max)?;
        at.at("connectivity")
            .bounded(connectivity.as_deref(), max)?;
        at.at("role").bounded(role.as_deref(), max)?;
        at.at("trust").bounded(trust.as_deref(), max)?;
        at.at("bucket").bounded(bucket.as_deref(), max)?;
        at.at("siteId")
            .list_opt(site_id.as_deref(), max, Field::id)?;
        at.at("poolId")
            .list_opt(pool_id.as_deref(), max, Field::id)?;
        at.at("labels")
            .list_opt(labels.as_deref(), max, |at, l| at.object(l))?;
        at.at("reason").list_opt(reason.as_deref(), max, |at, r| {
            at.text(r, Text::ReasonFilter)
        })?;
        at.at("hostname")
            .text_opt(hostname.as_deref(), Text::HostnameFilter)
    }
}

impl Validate for CordonNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let CordonNodeInput {
            id,
            version,
            reason,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("reason").text(reason, Text::Reason)
    }
}

impl Validate for NodeVersionInput {
    fn validate(&self, at: &Field) -> Checked {
        let NodeVersionInput { id, version } = self;
        node_and_version(at, id, *version)
    }
}

impl Validate for DrainNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let DrainNodeInput {
            id,
            version,
            reason,
            deadline,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("reason").text(reason, Text::Reason)?;
        at.at("deadline").time(deadline.as_ref())
    }
}

impl Validate for TaintNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let TaintNodeInput {
            id,
            version,
            key,
            value,
            effect: _,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("key").text(key, Text::LabelKey)?;
        at.at("value").text(value, Text::LabelValue)
    }
}

impl Validate for UntaintNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let UntaintNodeInput { id, version, key } = self;
        node_and_version(at, id, *version)?;
        at.at("key").text(key, Text::LabelKey)
    }
}

impl Validate for LabelInput {
    fn validate(&self, at: &Field) -> Checked {
        let LabelInput { key, value } = self;
        at.at("key").text(key, Text::LabelKey)?;
        at.at("value").text(value, Text::LabelValue)
    }
}

impl Validate for LabelNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let LabelNodeInput {
            id,
            version,
            set,
            remove,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("set")
            .list(set, MAX_LABELS_PER_CHANGE, |at, l| at.object(l))?;
        at.at("remove")
            .list(remove, MAX_LABELS_PER_CHANGE, |at, k| {
                at.text(k, Text::LabelKey)
            })
    }
}

impl Validate for TransitionNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let TransitionNodeInput {
            id,
            version,
            action: _,
            reason,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("reason").text_opt(reason.as_deref(), Text::Reason)
    }
}

impl Validate for ReasonedNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let ReasonedNodeInput {
            id,
            version,
            reason,
        } = self;
        node_and_version(at, id, *version)?;
        at.at("reason").text(reason, Text::Reason)
    }
}

impl Validate for EnrollNodeInput {
    fn validate(&self, at: &Field) -> Checked {
        let EnrollNodeInput {
            hostname,
            site_id,
            pool_id,
        } = self;
        at.at("hostname").text(hostname, Text::Hostname)?;
        at.at("siteId").id(site_id)?;
        pool_id.as_ref().map_or(Ok(()), |p| at.at("poolId").id(p))
    }
}

impl Validate for CreateSiteInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreateSiteInput {
            name,
            kind: _,
            owner_tenant_id,
        } = self;
        at.at("name").text(name, Text::Name)?;
        owner_tenant_id
            .as_ref()
            .map_or(Ok(()), |t| at.at("ownerTenantId").id(t))
    }
}

impl Validate for CreatePoolInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreatePoolInput {
            site_id,
            name,
            kind: _,
            agent: _,
            owner_tenant_id,
            expected_gpu_count,
            expected_gpu_model,
            drivers,
        } = self;
        at.at("siteId").id(site_id)?;
        at.at("name").text(name, Text::Name)?;
        owner_tenant_id
            .as_ref()
            .map_or(Ok(()), |t| at.at("ownerTenantId").id(t))?;
        at.at("expectedGpuCount")
            .int_opt(expected_gpu_count.map(i64::from), EXPECTED_GPU_COUNT)?;
        at.at("expectedGpuModel")
            .text_opt(expected_gpu_model.as_deref(), Text::GpuModel)?;
        at.at("drivers")
            .list(drivers, MAX_DRIVERS, |at, d| at.object(d))
    }
}

impl Validate for CreateJoinTokenInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreateJoinTokenInput {
            site_id,
            pool_id,
            expires_in_seconds,
            max_uses,
            description,
        } = self;
        at.at("siteId").id(site_id)?;
        pool_id.as_ref().map_or(Ok(()), |p| at.at("poolId").id(p))?;
        at.at("expiresInSeconds")
            .int_opt(*expires_in_seconds, JOIN_TOKEN_LIFETIME_SECONDS)?;
        at.at("maxUses").int_opt(*max_uses, JOIN_TOKEN_USES)?;
        at.at("description").text(description, Text::Description)
    }
}

impl Validate for SendCommandInput {
    fn validate(&self, at: &Field) -> Checked {
        let SendCommandInput {
            node_ids,
            filter,
            kind: _,
            params,
            timeout_seconds,
            not_before,
            expires_in_seconds,
            force: _,
        } = self;
        at.at("nodeIds")
            .list_opt(node_ids.as_deref(), MAX_COMMAND_NODE_IDS, Field::id)?;
        filter
            .as_ref()
            .map_or(Ok(()), |f| at.at("filter").object(f))?;
        params
            .as_ref()
            .map_or(Ok(()), |p| at.at("params").json(&p.0))?;
        at.at("timeoutSeconds")
            .int_opt(*timeout_seconds, COMMAND_TIMEOUT_SECONDS)?;
        at.at("notBefore").time(not_before.as_ref())?;
        at.at("expiresInSeconds")
            .int_opt(*expires_in_seconds, COMMAND_TTL_SECONDS)
    }
}

impl Validate for CommandFilterInput {
    fn validate(&self, at: &Field) -> Checked {
        let CommandFilterInput {
            node_id,
            status,
            kind,
        } = self;
        at.at("nodeId")
            .list_opt(node_id.as_deref(), MAX_FILTER_VALUES, Field::id)?;
        at.at("status")
            .bounded(status.as_deref(), MAX_FILTER_VALUES)?;
        at.at("kind").bounded(kind.as_deref(), MAX_FILTER_VALUES)
    }
}
