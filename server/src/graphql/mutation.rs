//! Mutations. Each one that changes a node takes the `version` the caller read.

use async_graphql::{Context, ID, Object};
use bc_core::catalog::HardwareProfile;
use bc_core::ids::{CommandId, JoinTokenId, NodeId, PoolId, SiteId, TenantId};
use bc_core::provision::ProvisionMove;
use std::collections::BTreeMap;

use super::input_limits::{Field, Text, Validated, seconds};
use super::inputs::{
    CordonNodeInput, CreateJoinTokenInput, CreatePoolInput, CreateSiteInput, DrainNodeInput,
    EnrollNodeInput, LabelNodeInput, NodeVersionInput, ReasonedNodeInput, SendCommandInput,
    TaintNodeInput, TransitionNodeInput, UntaintNodeInput,
};
use super::types::{Command, CreatedJoinToken, JoinToken, NodeDetail, Pool, Site, Tenant};
use super::{parse_id, principal, services};
use crate::error::ApiError;
use crate::service::catalog::NewPool;
use crate::service::join::NewJoinToken;

pub struct MutationRoot;

fn node_id(id: &ID) -> Result<NodeId, ApiError> {
    parse_id(id, NodeId::parse)
}

#[Object]
impl MutationRoot {
    /// No new work lands on the node. Already cordoned: nothing changes.
    async fn cordon_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<CordonNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        Ok(NodeDetail(
            s.cordon_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.reason,
            )
            .await?,
        ))
    }

    /// Lifts a cordon, and ends a drain under way.
    async fn uncordon_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<NodeVersionInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        Ok(NodeDetail(
            s.uncordon_node(principal(ctx)?, &node_id(&input.id)?, input.version)
                .await?,
        ))
    }

    /// Cordons the node and keeps `draining` in `noScheduleReasons` until its allocations are
    /// released or the deadline passes.
    async fn drain_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<DrainNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let id = node_id(&input.id)?;
        Ok(NodeDetail(
            s.drain_node(
                principal(ctx)?,
                &id,
                input.version,
                &input.reason,
                input.deadline.map(|d| d.value()).transpose()?,
            )
            .await?,
        ))
    }

    /// Adds or replaces a taint; a `NO_SCHEDULE` taint adds `taint:<key>` to `noScheduleReasons`.
    async fn taint_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<TaintNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let id = node_id(&input.id)?;
        let p = principal(ctx)?;
        Ok(NodeDetail(
            s.taint_node(
                p,
                &id,
                input.version,
                &input.key,
                &input.value,
                input.effect.into(),
            )
            .await?,
        ))
    }

    async fn untaint_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<UntaintNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        Ok(NodeDetail(
            s.untaint_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.key,
            )
            .await?,
        ))
    }

    /// Sets and removes labels in one change.
    async fn label_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<LabelNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let id = node_id(&input.id)?;
        let mut set = BTreeMap::new();
        for label in input.set {
            if set.insert(label.key.clone(), label.value).is_some() {
                return Err(
                    ApiError::BadUserInput(format!("label `{}` is set twice", label.key)).into(),
                );
            }
        }
        Ok(NodeDetail(
            s.label_node(principal(ctx)?, &id, input.version, &set, &input.remove)
                .await?,
        ))
    }

    /// `adopting` → `adopted` (`nodes.adopt`).
    async fn adopt_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<NodeVersionInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let id = node_id(&input.id)?;
        Ok(NodeDetail(
            s.move_node(
                principal(ctx)?,
                &id,
                input.version,
                ProvisionMove::Adopt,
                None,
            )
            .await?,
        ))
    }

    /// Starts retirement: `adopted`, `ready` or `failed` → `retiring`.
    async fn retire_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<ReasonedNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let id = node_id(&input.id)?;
        let p = principal(ctx)?;
        Ok(NodeDetail(
            s.move_node(
                p,
                &id,
                input.version,
                ProvisionMove::Retire,
                Some(&input.reason),
            )
            .await?,
        ))
    }

    /// Any move of `provisionStateTable`, including the bare-metal workflow moves.
    async fn transition_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<TransitionNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let id = node_id(&input.id)?;
        let p = principal(ctx)?;
        Ok(NodeDetail(
            s.move_node(
                p,
                &id,
                input.version,
                input.action.into(),
                input.reason.as_deref(),
            )
            .await?,
        ))
    }

    /// Bumps `identityGeneration`: every certificate issued before stops working.
    async fn revoke_node_identity(
        &self,
        ctx: &Context<'_>,
        input: Validated<ReasonedNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let id = node_id(&input.id)?;
        Ok(NodeDetail(
            s.revoke_node_identity(principal(ctx)?, &id, input.version, &input.reason)
                .await?,
        ))
    }

    /// Deletes a node in `adopting`, `enrolling`, `failed` or `retired`. Its history stays.
    async fn delete_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<NodeVersionInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        Ok(NodeDetail(
            s.delete_node(principal(ctx)?, &node_id(&input.id)?, input.version)
                .await?,
        ))
    }

    /// `metal.enroll`: registers a bare-metal machine, which starts `enrolling`.
    async fn enroll_node(
        &self,
        ctx: &Context<'_>,
        input: Validated<EnrollNodeInput>,
    ) -> async_graphql::Result<NodeDetail> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let site = parse_id(&input.site_id, SiteId::parse)?;
        let pool = input
            .pool_id
            .as_ref()
            .map(|p| parse_id(p, PoolId::parse))
            .transpose()?;
        Ok(NodeDetail(
            s.enroll_node(principal(ctx)?, &input.hostname, &site, pool.as_ref())
                .await?,
        ))
    }

    /// Queues a command on one node or many. Destructive kinds need the nodes cordoned (or
    /// `force` by an admin); all targets are checked before any is queued.
    async fn send_command(
        &self,
        ctx: &Context<'_>,
        input: Validated<SendCommandInput>,
    ) -> async_graphql::Result<Vec<Command>> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let has_filter = input.filter.is_some();
        let mut filter = match input.filter {
            Some(filter) => super::query::node_filter(filter)?,
            None => crate::service::NodeFilter::default(),
        };
        match input.node_ids {
            Some(ids) if !ids.is_empty() => {
                filter.ids = ids.iter().map(node_id).collect::<Result<_, _>>()?;
            }
            Some(_) => return Err(ApiError::BadUserInput("nodeIds is empty".into()).into()),
            None if !has_filter => {
                return Err(ApiError::BadUserInput("give nodeIds or a filter".into()).into());
            }
            None => {}
        }
        let new = bc_core::command::NewCommand {
            kind: input.kind.into(),
            params: input.params.map_or(serde_json::Value::Null, |p| p.0),
            timeout: input.timeout_seconds.map(seconds),
            not_before: input.not_before.map(|t| t.value()).transpose()?,
            ttl: input.expires_in_seconds.map(seconds),
            force: input.force,
        };
        Ok(s.send_command(principal(ctx)?, filter, new)
            .await?
            .into_iter()
            .map(Command)
            .collect())
    }

    /// Cancels a queued, dispatched or running command.
    async fn cancel_command(&self, ctx: &Context<'_>, id: ID) -> async_graphql::Result<Command> {
        let id = parse_id(&id, CommandId::parse)?;
        Ok(Command(
            services(ctx)?.cancel_command(principal(ctx)?, &id).await?,
        ))
    }

    /// A join token for daemons; the secret is shown only in this answer.
    async fn create_join_token(
        &self,
        ctx: &Context<'_>,
        input: Validated<CreateJoinTokenInput>,
    ) -> async_graphql::Result<CreatedJoinToken> {
        let input = input.check("input")?;
        let s = services(ctx)?;
        let new = NewJoinToken {
            site_id: parse_id(&input.site_id, SiteId::parse)?,
            pool_id: input
                .pool_id
                .as_ref()
                .map(|p| parse_id(p, PoolId::parse))
                .transpose()?,
            lifetime: input.expires_in_seconds.map(seconds),
            max_uses: input.max_uses,
            description: input.description,
        };
        let (token, secret) = s.create_join_token(principal(ctx)?, new).await?;
        Ok(CreatedJoinToken {
            token: token.into(),
            secret,
            ca_certificate_sha256: s.ca.fingerprint().to_owned(),
        })
    }

    /// Revokes a join token: no further joins with it.
    async fn revoke_join_token(
        &self,
        ctx: &Context<'_>,
        id: ID,
    ) -> async_graphql::Result<JoinToken> {
        let id = parse_id(&id, JoinTokenId::parse)?;
        Ok(services(ctx)?
            .revoke_join_token(principal(ctx)?, &id)
            .await?
            .into())
    }

    async fn create_tenant(
        &self,
        ctx: &Context<'_>,
        name: String,
    ) -> async_graphql::Result<Tenant> {
        Field::argument("name").text(&name, Text::Name)?;
        Ok(services(ctx)?
            .create_tenant(principal(ctx)?, &name)
            .await?
            .into())
    }

    async fn create_site(
        &self,
        ctx: &Context<'_>,
        input: Validated<CreateSiteInput>,
    ) -> async_graphql::Result<Site> {
        let input = input.check("input")?;
        let owner = input
            .owner_tenant_id
            .as_ref()
            .map(|t| parse_id(t, TenantId::parse))
            .transpose()?;
        Ok(services(ctx)?
            .create_site(
                principal(ctx)?,
                &input.name,
                input.kind.into(),
                owner.as_ref(),
            )
            .await?
            .into())
    }

    async fn create_pool(
        &self,
        ctx: &Context<'_>,
        input: Validated<CreatePoolInput>,
    ) -> async_graphql::Result<Pool> {
        let input = input.check("input")?;
        let gpu_count = input
            .expected_gpu_count
            .map(|c| {
                u32::try_from(c).map_err(|_| {
                    ApiError::BadUserInput("expectedGpuCount must not be negative".into())
                })
            })
            .transpose()?;
        let new = NewPool {
            site_id: parse_id(&input.site_id, SiteId::parse)?,
            name: input.name,
            kind: input.kind.into(),
            agent: input.agent.into(),
            owner_tenant_id: input
                .owner_tenant_id
                .as_ref()
                .map(|t| parse_id(t, TenantId::parse))
                .transpose()?,
            hardware_profile: HardwareProfile {
                gpu_count,
                gpu_model: input.expected_gpu_model,
            },
            drivers: input
                .drivers
                .into_iter()
                .map(|d| (d.key, d.value))
                .collect(),
        };
        Ok(services(ctx)?
            .create_pool(principal(ctx)?, new)
            .await?
            .into())
    }
}
