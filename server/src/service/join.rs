//! Joining and node identity (JoinService), join tokens, and the session use cases the
//! gateway calls.

use bc_core::Actor;
use bc_core::axes::Connectivity;
use bc_core::catalog::Placement;
use bc_core::event::{Axis, Change, EventType};
use bc_core::hardware::hardware_key;
use bc_core::ids::{JoinTokenId, NodeId, PoolId, SiteId};
use bc_core::node::{NewNode, NodeRecord};
use bc_core::protocol::{CERTIFICATE_LIFETIME_HOURS, IssuedIdentity, JoinRequest, RenewRequest};
use bc_core::provision::JOIN_STATE;
use chrono::{DateTime, Duration, Utc};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use subtle::ConstantTimeEq;

use super::Services;
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};
use crate::pki::NodeIdentity;
use crate::store::gateway::JoinToken;
use crate::store::{catalog, events, gateway, nodes};

/// A join token lives a day unless asked otherwise: long enough to image a rack, short
/// enough that a leaked one is soon worthless.
pub const DEFAULT_JOIN_TOKEN_LIFETIME: Duration = Duration::hours(24);
/// The longest a join token may live.
pub const MAX_JOIN_TOKEN_LIFETIME: Duration = Duration::days(365);
/// The most joins one token may admit.
pub const MAX_JOIN_TOKEN_USES: i64 = 1_000_000;
/// Random bytes in a token's secret.
const SECRET_BYTES: usize = 32;

fn secret_hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Parameters of a new join token.
pub struct NewJoinToken {
    pub site_id: SiteId,
    pub pool_id: Option<PoolId>,
    pub lifetime: Option<Duration>,
    pub max_uses: Option<i64>,
    pub description: String,
}

/// A session the gateway opened.
pub struct OpenedSession {
    pub epoch: i64,
    pub want_sections: Vec<String>,
    pub spec_generation: i64,
}

fn refused(why: &str) -> ApiError {
    ApiError::Unauthenticated(format!("join refused: {why}"))
}

impl Services {
    /// `createJoinToken`: returns the token and its secret, `<jt_id>.<secret>`, which is shown
    /// this once and stored only as a hash.
    pub async fn create_join_token(
        &self,
        principal: &Principal,
        new: NewJoinToken,
    ) -> ApiResult<(JoinToken, String)> {
        principal.require_platform_admin()?;
        let lifetime = new.lifetime.unwrap_or(DEFAULT_JOIN_TOKEN_LIFETIME);
        if lifetime <= Duration::zero() || lifetime > MAX_JOIN_TOKEN_LIFETIME {
            return Err(ApiError::BadUserInput(format!(
                "a join token lives between 1 second and {} days",
                MAX_JOIN_TOKEN_LIFETIME.num_days()
            )));
        }
        let max_uses = new.max_uses.unwrap_or(1);
        if !(1..=MAX_JOIN_TOKEN_USES).contains(&max_uses) {
            return Err(ApiError::BadUserInput(format!(
                "maxUses must be between 1 and {MAX_JOIN_TOKEN_USES}"
            )));
        }
        let txn = self.store.write().await?;
        let site = catalog::site(&*txn, &new.site_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("site `{}` does not exist", new.site_id)))?;
        if let Some(pool_id) = &new.pool_id {
            catalog::pool(&*txn, pool_id)
                .await?
                .filter(|p| p.site_id == site.id)
                .ok_or_else(|| {
                    ApiError::NotFound(format!(
                        "pool `{pool_id}` does not exist in site `{}`",
                        site.id
                    ))
                })?;
        }
        let id = JoinTokenId::generate();
        let secret_part: String = {
            use rand::Rng;
            let bytes: [u8; SECRET_BYTES] = rand::rng().random();
            hex::encode(bytes)
        };
        let now = self.clock.now();
        let token = JoinToken {
            id: id.clone(),
            secret_hash: secret_hash(&secret_part),
            site_id: site.id,
            pool_id: new.pool_id,
            description: new.description,
            expires_at: now + lifetime,
            max_uses,
            uses: 0,
            revoked_at: None,
            created_by: principal.actor().to_string(),
            created_at: now,
        };
        gateway::insert_join_token(&*txn, &token).await?;
        let data = serde_json::json!({ "joinTokenId": id, "siteId": token.site_id, "poolId": token.pool_id, "maxUses": max_uses });
        events::append_other(
            &*txn,
            EventType::JoinTokenCreated,
            None,
            &principal.actor(),
            data,
            now,
        )
        .await?;
        txn.commit().await?;
        Ok((token, format!("{id}.{secret_part}")))
    }

    pub async fn join_tokens(&self, principal: &Principal) -> ApiResult<Vec<JoinToken>> {
        principal.require_platform_admin()?;
        Ok(gateway::join_tokens(self.store.db()).await?)
    }

    pub async fn revoke_join_token(
        &self,
        principal: &Principal,
        id: &JoinTokenId,
    ) -> ApiResult<JoinToken> {
        principal.require_platform_admin()?;
        let txn = self.store.write().await?;
        let mut token = gateway::join_token(&*txn, id, true)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("join token `{id}` does not exist")))?;
        if token.revoked_at.is_none() {
            let now = self.clock.now();
            gateway::revoke_join_token(&*txn, id, now).await?;
            events::append_other(
                &*txn,
                EventType::JoinTokenRevoked,
                None,
                &principal.actor(),
                serde_json::json!({ "joinTokenId": id }),
                now,
            )
            .await?;
            token.revoked_at = Some(now);
        }
        txn.commit().await?;
        Ok(token)
    }

    /// JoinService: admits a daemon in one transaction (token use, node row, certificate,
    /// event), or refuses it and creates nothing.
    pub async fn join(&self, request: &JoinRequest) -> ApiResult<IssuedIdentity> {
        let (id, secret) = request.token.split_once('.').ok_or_else(|| {
            ApiError::BadUserInput("the join token is malformed: expected `<jt_…>.<secret>`".into())
        })?;
        let token_id = JoinTokenId::parse(id)
            .map_err(|_| ApiError::BadUserInput("the join token is malformed".into()))?;
        bc_core::node::validate_hostname(&request.hostname)?;
        let now = self.clock.now();
        let hw = hardware_key(&request.identifiers);

        let txn = self.store.write().await?;
        let token = gateway::join_token(&*txn, &token_id, true)
            .await?
            .ok_or_else(|| refused("unknown token"))?;
        let presented = secret_hash(secret);
        if !bool::from(presented.as_bytes().ct_eq(token.secret_hash.as_bytes())) {
            return Err(refused("wrong token secret"));
        }
        if token.revoked_at.is_some() {
            return Err(refused("the token was revoked"));
        }
        if token.expires_at <= now {
            return Err(refused("the token has expired"));
        }
        if token.uses >= token.max_uses {
            return Err(refused("the token has been used up"));
        }
        let site = catalog::site(&*txn, &token.site_id).await?.ok_or_else(|| {
            ApiError::internal(anyhow::anyhow!(
                "join token {} names a missing site",
                token.id
            ))
        })?;
        let pool = match &token.pool_id {
            Some(pool_id) => Some(catalog::pool(&*txn, pool_id).await?.ok_or_else(|| {
                ApiError::internal(anyhow::anyhow!(
                    "join token {} names a missing pool",
                    token.id
                ))
            })?),
            None => None,
        };
        // Check the CSR before writing anything; it is signed again below with the final
        // identity generation.
        self.ca
            .sign_node(
                &request.csr_pem,
                &NodeId::generate(),
                0,
                now,
                Duration::hours(1),
            )
            .map_err(|e| ApiError::BadUserInput(e.to_string()))?;

        let actor = Actor::System;
        let reclaimed = match (&hw.key, hw.trusted) {
            (Some(key), true) => gateway::node_by_trusted_hardware_key(&*txn, key).await?,
            _ => None,
        };
        let node = match reclaimed.clone() {
            Some(existing_id) => {
                let existing = nodes::load(&*txn, &existing_id, true)
                    .await?
                    .ok_or_else(|| {
                        ApiError::internal(anyhow::anyhow!("node {existing_id} vanished"))
                    })?;
                if existing.site_id != site.id {
                    return Err(ApiError::BadUserInput(format!(
                        "this machine's hardware key belongs to node `{existing_id}` in site `{}`; delete that node or join with a token of its site",
                        existing.site_id
                    )));
                }
                let (node, _) = self
                    .change_node_in(
                        &txn,
                        &actor,
                        &existing_id,
                        None,
                        &|_| true,
                        "join:reclaim",
                        |n, _, _| {
                            let mut changes = n.bump_identity_generation("re-joined in place");
                            changes.push(
                                Change::new(
                                    EventType::NodeRejoined,
                                    Axis::Lifecycle,
                                    None::<String>,
                                    Some(request.hostname.as_str()),
                                )
                                .with_detail(format!("join token {}", token.id)),
                            );
                            Ok(changes)
                        },
                    )
                    .await?;
                node
            }
            None => {
                let placement = Placement::of(&site, pool.as_ref());
                let mut node = NodeRecord::new(
                    NewNode {
                        hostname: request.hostname.clone(),
                        site_id: site.id.clone(),
                        pool_id: pool.as_ref().map(|p| p.id.clone()),
                        owner_tenant_id: placement.owner_tenant_id,
                        role: placement.role,
                        trust: placement.trust,
                        adapter: pool
                            .as_ref()
                            .map_or(bc_core::axes::Adapter::BcdV1, |p| p.agent.adapter()),
                        drivers: pool
                            .as_ref()
                            .map(|p| p.drivers.clone())
                            .unwrap_or_else(BTreeMap::new),
                        provision_state: JOIN_STATE,
                    },
                    now,
                )?;
                node.hardware_key = hw.key.clone();
                node.hardware_key_trusted = hw.trusted;
                nodes::insert(&*txn, &node).await?;
                let change = Change::new(
                    EventType::NodeJoined,
                    Axis::Lifecycle,
                    None::<String>,
                    Some(JOIN_STATE.as_static_str()),
                )
                .with_detail(format!("join token {}", token.id));
                events::append_node_changes(&*txn, &node, &[change], &actor, Some("join"), now)
                    .await?;
                node
            }
        };
        gateway::count_join_token_use(&*txn, &token.id, token.uses + 1).await?;
        let identity = self.issue(&request.csr_pem, &node.id, node.identity_generation, now)?;
        txn.commit().await?;
        if reclaimed.is_some() {
            self.sessions
                .kick(&node.id, bc_core::protocol::close::IDENTITY_REVOKED);
        }
        metrics::counter!("bc_joins_total", "outcome" => if reclaimed.is_some() { "reclaimed" } else { "joined" }).increment(1);
        Ok(identity)
    }

    /// Renewal with a current certificate: same node, same generation, a fresh lifetime.
    pub async fn renew(
        &self,
        identity: &NodeIdentity,
        request: &RenewRequest,
    ) -> ApiResult<IssuedIdentity> {
        let node = self.current_node(identity).await?;
        let now = self.clock.now();
        let issued = self.issue(&request.csr_pem, &node.id, node.identity_generation, now)?;
        metrics::counter!("bc_certificate_renewals_total").increment(1);
        Ok(issued)
    }

    fn issue(
        &self,
        csr_pem: &str,
        node_id: &NodeId,
        generation: i64,
        now: DateTime<Utc>,
    ) -> ApiResult<IssuedIdentity> {
        let lifetime = Duration::hours(CERTIFICATE_LIFETIME_HOURS);
        let signed = self
            .ca
            .sign_node(csr_pem, node_id, generation, now, lifetime)
            .map_err(|e| ApiError::BadUserInput(e.to_string()))?;
        Ok(IssuedIdentity {
            node_id: node_id.to_string(),
            identity_generation: generation,
            certificate_pem: signed.pem,
            ca_certificate_pem: self.ca.cert_pem().to_owned(),
            expires_at: signed.not_after,
            renew_after: now + lifetime * 2 / 3,
        })
    }

    /// The node a client certificate names, if the certificate is of its current identity
    /// generation and the node is not deleted; `FORBIDDEN` otherwise.
    pub async fn current_node(&self, identity: &NodeIdentity) -> ApiResult<NodeRecord> {
        let node = nodes::load(&self.store.read().await?, &identity.node_id, false)
            .await?
            .filter(|n| n.deleted_at.is_none())
            .ok_or_else(|| {
                ApiError::Forbidden(format!("node `{}` no longer exists", identity.node_id))
            })?;
        if node.identity_generation != identity.identity_generation {
            return Err(ApiError::Forbidden(format!(
                "this certificate is of identity generation {}, but node `{}` is at {}: its identity was revoked or replaced",
                identity.identity_generation, node.id, node.identity_generation
            )));
        }
        Ok(node)
    }

    /// The gateway accepted `hello`: in one transaction, a new session epoch, `connected`,
    /// and the observed generation the daemon reported.
    pub async fn open_session(
        &self,
        identity: &NodeIdentity,
        gateway_id: &str,
        inventory_hashes: &BTreeMap<String, String>,
        observed_generation: i64,
    ) -> ApiResult<OpenedSession> {
        self.current_node(identity).await?;
        let gateway = Actor::Controller("gateway".into());
        let txn = self.store.write().await?;
        let generation = identity.identity_generation;
        let epoch =
            gateway::open_session(&*txn, &identity.node_id, gateway_id, self.clock.now()).await?;
        let cause = format!("session:{epoch}");
        let (node, changes) = self
            .change_node_in(
                &txn,
                &gateway,
                &identity.node_id,
                None,
                &|n| n.identity_generation == generation,
                &cause,
                |n, by, now| {
                    let mut changes = n.set_connectivity(Connectivity::Connected, by, now);
                    changes.extend(n.report_observed_generation(observed_generation)?);
                    Ok(changes)
                },
            )
            .await
            .map_err(|e| match e {
                ApiError::NotFound(_) => {
                    ApiError::Forbidden("the node's identity was replaced".into())
                }
                other => other,
            })?;
        let stored = gateway::inventory_hashes(&*txn, &identity.node_id).await?;
        txn.commit().await?;
        self.after_node_commit(&node, &changes);
        let want_sections = inventory_hashes
            .iter()
            .filter(|(section, hash)| stored.get(*section) != Some(*hash))
            .map(|(section, _)| section.clone())
            .collect();
        Ok(OpenedSession {
            epoch,
            want_sections,
            spec_generation: node.generation,
        })
    }

    /// The session of `epoch` ended: if it was still the current one, the node becomes
    /// `disconnected` in the same transaction.
    pub async fn close_session(&self, node_id: &NodeId, epoch: i64) -> ApiResult<()> {
        let gateway = Actor::Controller("gateway".into());
        let txn = self.store.write().await?;
        let now = self.clock.now();
        // Still the node's latest session: its end disconnects the node, even when the row
        // was already closed (a revoked identity closes it in the revoking transaction).
        let closed = gateway::close_session(&*txn, node_id, epoch, now).await?;
        if closed || gateway::current_epoch(&*txn, node_id).await? == Some(epoch) {
            let cause = format!("session:{epoch}");
            let result = self
                .change_node_in(
                    &txn,
                    &gateway,
                    node_id,
                    None,
                    &|_| true,
                    &cause,
                    |n, by, now| {
                        // Only a connected node becomes disconnected: if Liveness already
                        // marked it unreachable or lost, the session's end is old news, and
                        // moving it would restart the lost timer.
                        Ok(match n.connectivity {
                            Connectivity::Connected => {
                                n.set_connectivity(Connectivity::Disconnected, by, now)
                            }
                            _ => Vec::new(),
                        })
                    },
                )
                .await;
            match result {
                Ok(_) | Err(ApiError::NotFound(_)) => {}
                Err(other) => return Err(other),
            }
        }
        txn.commit().await?;
        Ok(())
    }

    /// The node's current spec generation (what the gateway sends as `spec`).
    pub async fn spec_generation(&self, node_id: &NodeId) -> ApiResult<i64> {
        Ok(nodes::load(&self.store.read().await?, node_id, false)
            .await?
            .map_or(0, |n| n.generation))
    }

    /// The daemon converged spec `generation`: the node's `observedGeneration`.
    pub async fn report_converged(&self, node_id: &NodeId, generation: i64) -> ApiResult<()> {
        let actor = Actor::Node(node_id.to_string());
        self.apply_node_change(
            &actor,
            node_id,
            None,
            &|_| true,
            "daemon:converged",
            |n, _, _| n.report_observed_generation(generation),
        )
        .await?;
        Ok(())
    }

    /// Stores one inventory section a daemon sent and, in the same transaction, runs the
    /// Inventory controller over it: devices and atoms, inventory labels, the GPU count, the
    /// health conditions with their `noScheduleReasons`, and the hardware key.
    pub async fn store_inventory_section(
        &self,
        node_id: &NodeId,
        section: &str,
        hash: &str,
        content: serde_json::Value,
    ) -> ApiResult<()> {
        let controller = Actor::Controller("inventory".into());
        let txn = self.store.write().await?;
        let now = self.clock.now();
        gateway::put_inventory_section(&*txn, node_id, section, hash, content, now).await?;
        if matches!(section, "gpus" | "system" | "network") {
            let sections = gateway::inventory_sections(&*txn, node_id).await?;
            let node = nodes::load(&*txn, node_id, false)
                .await?
                .ok_or_else(|| ApiError::NotFound(format!("node `{node_id}` does not exist")))?;
            let expected_gpus = match &node.pool_id {
                Some(pool_id) => catalog::pool(&*txn, pool_id)
                    .await?
                    .and_then(|p| p.hardware_profile.gpu_count),
                None => None,
            };
            let facts = match sections.get("gpus") {
                Some(gpus) => Some(
                    bc_core::health::interpret_gpus(gpus, expected_gpus)
                        .map_err(|e| ApiError::BadUserInput(e.to_string()))?,
                ),
                None => None,
            };
            // The key is recomputed only from a complete set of identifiers (both sections
            // reported): sections arrive one by one, and a key from half of them would
            // differ from the join's, or be untrusted, until the other half arrives.
            let complete = sections.contains_key("system") && sections.contains_key("network");
            let ids = if complete {
                bc_core::health::identifiers(sections.get("system"), sections.get("network"))
            } else {
                BTreeMap::new()
            };
            let hw = hardware_key(&ids);
            // A trusted key must be unique across live nodes: one already held by another
            // node is kept, but untrusted, rather than letting two nodes claim one machine.
            let held_elsewhere = match (&hw.key, hw.trusted) {
                (Some(key), true) => gateway::node_by_trusted_hardware_key(&*txn, key)
                    .await?
                    .is_some_and(|other| &other != node_id),
                _ => false,
            };
            let trusted = hw.trusted && !held_elsewhere;
            self.change_node_in(
                &txn,
                &controller,
                node_id,
                None,
                &|_| true,
                &format!("inventory:{section}"),
                |n, by, now| {
                    let mut changes = match &facts {
                        Some(facts) => n.apply_gpu_inventory(facts, by, now)?,
                        None => Vec::new(),
                    };
                    if hw.key.is_some() {
                        changes.extend(n.set_hardware_key(hw.key.clone(), trusted));
                    }
                    Ok(changes)
                },
            )
            .await?;
            if let Some(facts) = &facts {
                gateway::replace_devices(&*txn, node_id, &facts.devices, now).await?;
            }
        }
        txn.commit().await?;
        Ok(())
    }

    /// Records a batch of heartbeats in one transaction; returns the (node, epoch) pairs
    /// whose session is no longer current, so the gateway can end them.
    pub async fn record_heartbeats(
        &self,
        beats: &[(NodeId, i64, DateTime<Utc>)],
    ) -> ApiResult<Vec<(NodeId, i64)>> {
        let txn = self.store.write().await?;
        let stale = gateway::record_heartbeats(&*txn, beats).await?;
        txn.commit().await?;
        Ok(stale)
    }
}
