//! Mutations. Each takes one `input` (checked in `input_limits.rs`) and answers a payload
//! object of its own (`payloads.rs`); each that changes a node takes the `version` the caller
//! read.

use async_graphql::{Context, ID, MaybeUndefined, Object};
use bc_core::catalog::HardwareProfile;
use bc_core::ids::{CommandId, JoinTokenId, NodeId, PoolId, SiteId, TenantId};
use bc_core::provision::ProvisionMove;
use std::collections::BTreeMap;

use super::input_limits::{Validated, seconds};
use super::inputs::{
    AdoptNodeInput, CancelCommandInput, ClearNodeConditionInput, CordonNodeInput,
    CreateJoinTokenInput, CreatePoolInput, CreateSiteInput, CreateTenantInput, DeleteNodeInput,
    DrainNodeInput, EnrollNodeInput, LabelNodeInput, RetireNodeInput, RevokeJoinTokenInput,
    RevokeNodeIdentityInput, SendCommandInput, TaintNodeInput, TransitionNodeInput,
    UncordonNodeInput, UntaintNodeInput, UpdatePoolInput,
};
use super::payloads::{
    AdoptNodePayload, CancelCommandPayload, ClearNodeConditionPayload, CordonNodePayload,
    CreateJoinTokenPayload, CreatePoolPayload, CreateSitePayload, CreateTenantPayload,
    DeleteNodePayload, DrainNodePayload, EnrollNodePayload, LabelNodePayload, RetireNodePayload,
    RevokeJoinTokenPayload, RevokeNodeIdentityPayload, SendCommandPayload, TaintNodePayload,
    TransitionNodePayload, UncordonNodePayload, UntaintNodePayload, UpdatePoolPayload,
};
use super::types::{Command, NodeDetail};
use super::{parse_id, principal, services};
use crate::error::ApiError;
use crate::service::catalog::{NewPool, PoolUpdate};
use crate::service::join::NewJoinToken;

/// The `Mutation` root (named so in the schema, as clients and tools expect).
pub struct MutationRoot;

fn node_id(id: &ID) -> Result<NodeId, ApiError> {
    parse_id(id, NodeId::parse)
}

// Merged into the schema's `Mutation` root (graphql/mod.rs), so its own name must differ.
#[Object(name = "NodeMutationRoot")]
impl MutationRoot {
    /// No new work lands on the node. Already cordoned: nothing changes.
    async fn cordon_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, and why.")] input: Validated<
            CordonNodeInput,
        >,
    ) -> async_graphql::Result<CordonNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .cordon_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.reason,
            )
            .await?;
        Ok(CordonNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Clears a `TRUE` condition by hand, with a reason of your own (kept on the condition
    /// and in its event, with you as the actor): for a condition whose proof cannot come
    /// (the GPU was replaced, the evidence was wrong). Clearing `GpuNeedsPerson` also ends
    /// the maintenance that remediation turned on when it gave up. A condition that is not
    /// `TRUE`, or a blank reason, is `BAD_USER_INPUT`.
    async fn clear_node_condition(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, the condition's type, and why.")]
        input: Validated<ClearNodeConditionInput>,
    ) -> async_graphql::Result<ClearNodeConditionPayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .clear_node_condition(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.kind,
                &input.reason,
            )
            .await?;
        Ok(ClearNodeConditionPayload {
            node: NodeDetail::from(node),
        })
    }

    /// Lifts a cordon, and ends a drain under way.
    async fn uncordon_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node and the version you read.")] input: Validated<UncordonNodeInput>,
    ) -> async_graphql::Result<UncordonNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .uncordon_node(principal(ctx)?, &node_id(&input.id)?, input.version)
            .await?;
        Ok(UncordonNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Cordons the node and keeps `draining` in `noScheduleReasons` until its allocations are
    /// released or the deadline passes.
    async fn drain_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, why, and an optional deadline.")]
        input: Validated<DrainNodeInput>,
    ) -> async_graphql::Result<DrainNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .drain_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.reason,
                input.deadline.map(|d| d.value()).transpose()?,
            )
            .await?;
        Ok(DrainNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Adds or replaces a taint; a `NO_SCHEDULE` taint adds `taint:<key>` to `noScheduleReasons`.
    async fn taint_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, and the taint.")] input: Validated<
            TaintNodeInput,
        >,
    ) -> async_graphql::Result<TaintNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .taint_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.key,
                &input.value,
                input.effect.into(),
            )
            .await?;
        Ok(TaintNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Removes a taint; a `NO_SCHEDULE` one takes `taint:<key>` out of `noScheduleReasons`.
    async fn untaint_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, and the taint's key.")] input: Validated<
            UntaintNodeInput,
        >,
    ) -> async_graphql::Result<UntaintNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .untaint_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.key,
            )
            .await?;
        Ok(UntaintNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Sets and removes labels in one change.
    async fn label_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, labels to set and keys to remove.")]
        input: Validated<LabelNodeInput>,
    ) -> async_graphql::Result<LabelNodePayload> {
        let input = input.check("input")?;
        let id = node_id(&input.id)?;
        let mut set = BTreeMap::new();
        for label in input.set {
            if set.insert(label.key.clone(), label.value).is_some() {
                return Err(
                    ApiError::BadUserInput(format!("label `{}` is set twice", label.key)).into(),
                );
            }
        }
        let node = services(ctx)?
            .label_node(principal(ctx)?, &id, input.version, &set, &input.remove)
            .await?;
        Ok(LabelNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// `adopting` → `adopted` (`nodes.adopt`).
    async fn adopt_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node and the version you read.")] input: Validated<AdoptNodeInput>,
    ) -> async_graphql::Result<AdoptNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .move_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                ProvisionMove::Adopt,
                None,
            )
            .await?;
        Ok(AdoptNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Starts retirement: `adopted`, `ready` or `failed` → `retiring`.
    async fn retire_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, and why.")] input: Validated<
            RetireNodeInput,
        >,
    ) -> async_graphql::Result<RetireNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .move_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                ProvisionMove::Retire,
                Some(&input.reason),
            )
            .await?;
        Ok(RetireNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Any move of `provisionStateTable`, including the bare-metal workflow moves.
    async fn transition_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, the move, and an optional reason.")]
        input: Validated<TransitionNodeInput>,
    ) -> async_graphql::Result<TransitionNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .move_node(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                input.action.into(),
                input.reason.as_deref(),
            )
            .await?;
        Ok(TransitionNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Bumps `identityGeneration`: every certificate issued before stops working.
    async fn revoke_node_identity(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node, the version you read, and why.")] input: Validated<
            RevokeNodeIdentityInput,
        >,
    ) -> async_graphql::Result<RevokeNodeIdentityPayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .revoke_node_identity(
                principal(ctx)?,
                &node_id(&input.id)?,
                input.version,
                &input.reason,
            )
            .await?;
        Ok(RevokeNodeIdentityPayload {
            node: NodeDetail::from(node),
        })
    }

    /// Deletes a node in `adopting`, `enrolling`, `failed` or `retired`. Its history stays.
    async fn delete_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node and the version you read.")] input: Validated<DeleteNodeInput>,
    ) -> async_graphql::Result<DeleteNodePayload> {
        let input = input.check("input")?;
        let node = services(ctx)?
            .delete_node(principal(ctx)?, &node_id(&input.id)?, input.version)
            .await?;
        Ok(DeleteNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// `metal.enroll`: registers a bare-metal machine, which starts `enrolling`.
    async fn enroll_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The machine's hostname, site and pool.")] input: Validated<
            EnrollNodeInput,
        >,
    ) -> async_graphql::Result<EnrollNodePayload> {
        let input = input.check("input")?;
        let site = parse_id(&input.site_id, SiteId::parse)?;
        let pool = input
            .pool_id
            .as_ref()
            .map(|p| parse_id(p, PoolId::parse))
            .transpose()?;
        let identifiers: Vec<(String, String)> = input
            .identifiers
            .iter()
            .map(|i| (i.name.clone(), i.value.clone()))
            .collect();
        let node = services(ctx)?
            .enroll_node(
                principal(ctx)?,
                &input.hostname,
                &site,
                pool.as_ref(),
                &identifiers,
            )
            .await?;
        Ok(EnrollNodePayload {
            node: NodeDetail::from(node),
        })
    }

    /// Queues a command on one node or many. Destructive kinds need the nodes cordoned (or
    /// `force` by an admin); all targets are checked before any is queued.
    async fn send_command(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The targets (ids or a filter), the kind, its parameters and timing.")]
        input: Validated<SendCommandInput>,
    ) -> async_graphql::Result<SendCommandPayload> {
        let input = input.check("input")?;
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
        let commands = services(ctx)?
            .send_command(principal(ctx)?, filter, new)
            .await?;
        Ok(SendCommandPayload {
            commands: commands.into_iter().map(Command).collect(),
        })
    }

    /// Cancels a queued, dispatched or running command.
    async fn cancel_command(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The command to cancel.")] input: Validated<CancelCommandInput>,
    ) -> async_graphql::Result<CancelCommandPayload> {
        let input = input.check("input")?;
        let id = parse_id(&input.id, CommandId::parse)?;
        let command = services(ctx)?.cancel_command(principal(ctx)?, &id).await?;
        Ok(CancelCommandPayload {
            command: Command(command),
        })
    }

    /// A join token for daemons; the secret is shown only in this answer (platform admins
    /// only).
    async fn create_join_token(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Where joining nodes land, how long and how often the token works.")]
        input: Validated<CreateJoinTokenInput>,
    ) -> async_graphql::Result<CreateJoinTokenPayload> {
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
        Ok(CreateJoinTokenPayload {
            join_token: token.into(),
            secret,
            ca_certificate_sha256: s.ca.fingerprint().to_owned(),
        })
    }

    /// Revokes a join token: no further joins with it (platform admins only). Nodes that
    /// already joined keep their identities.
    async fn revoke_join_token(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The token to revoke.")] input: Validated<RevokeJoinTokenInput>,
    ) -> async_graphql::Result<RevokeJoinTokenPayload> {
        let input = input.check("input")?;
        let id = parse_id(&input.id, JoinTokenId::parse)?;
        let token = services(ctx)?
            .revoke_join_token(principal(ctx)?, &id)
            .await?;
        Ok(RevokeJoinTokenPayload {
            join_token: token.into(),
        })
    }

    /// Creates a tenant (platform admins only).
    async fn create_tenant(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The tenant's name.")] input: Validated<CreateTenantInput>,
    ) -> async_graphql::Result<CreateTenantPayload> {
        let input = input.check("input")?;
        let tenant = services(ctx)?
            .create_tenant(principal(ctx)?, &input.name)
            .await?;
        Ok(CreateTenantPayload {
            tenant: tenant.into(),
        })
    }

    /// Creates a site (platform admins only).
    async fn create_site(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The site's name, kind and owner.")] input: Validated<CreateSiteInput>,
    ) -> async_graphql::Result<CreateSitePayload> {
        let input = input.check("input")?;
        let owner = input
            .owner_tenant_id
            .as_ref()
            .map(|t| parse_id(t, TenantId::parse))
            .transpose()?;
        let site = services(ctx)?
            .create_site(
                principal(ctx)?,
                &input.name,
                input.kind.into(),
                owner.as_ref(),
            )
            .await?;
        Ok(CreateSitePayload { site: site.into() })
    }

    /// Creates a pool in a site (platform admins only).
    async fn create_pool(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The pool's site, name, kind, owner, expected hardware and drivers.")]
        input: Validated<CreatePoolInput>,
    ) -> async_graphql::Result<CreatePoolPayload> {
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
                driver_version: input.expected_driver_version,
            },
            drivers: input
                .drivers
                .into_iter()
                .map(|d| (d.key, d.value))
                .collect(),
            remediation: input.remediation.as_ref().map(|r| r.policy()),
            acceptance: input.acceptance.as_ref().map(|a| a.policy()),
        };
        let pool = services(ctx)?.create_pool(principal(ctx)?, new).await?;
        Ok(CreatePoolPayload { pool: pool.into() })
    }

    /// Changes a pool's settings (platform admins only): its health remediation policy, its
    /// acceptance checks and its hardware expectations (GPU count, GPU model, driver
    /// version). New expectations are compared with every node of the pool at once.
    async fn update_pool(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The pool, and what to change.")] input: Validated<UpdatePoolInput>,
    ) -> async_graphql::Result<UpdatePoolPayload> {
        let input = input.check("input")?;
        let id = parse_id(&input.id, PoolId::parse)?;
        /// `MaybeUndefined` as an update: absent keeps, `null` removes, a value sets.
        fn change<T, U>(value: MaybeUndefined<T>, map: impl FnOnce(T) -> U) -> Option<Option<U>> {
            match value {
                MaybeUndefined::Undefined => None,
                MaybeUndefined::Null => Some(None),
                MaybeUndefined::Value(v) => Some(Some(map(v))),
            }
        }
        let update = PoolUpdate {
            remediation: input.remediation.as_ref().map(|r| r.policy()),
            acceptance: input.acceptance.as_ref().map(|a| a.policy()),
            // The range is checked before (`EXPECTED_GPU_COUNT`), so the count is not negative.
            gpu_count: change(input.expected_gpu_count, |c| u32::try_from(c).unwrap_or(0)),
            gpu_model: change(input.expected_gpu_model, |m| m),
            driver_version: change(input.expected_driver_version, |v| v),
        };
        let pool = services(ctx)?
            .update_pool(principal(ctx)?, &id, update)
            .await?;
        Ok(UpdatePoolPayload { pool: pool.into() })
    }
}
