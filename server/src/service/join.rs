//! Join tokens and joining: `createJoinToken`, `revokeJoinToken`, JoinService (token and
//! CSR in, node and certificate out, in one transaction), renewal, and the identity check
//! every gateway route makes.

use bc_core::Actor;
use bc_core::catalog::Placement;
use bc_core::event::{Axis, Change, EventType};
use bc_core::hardware::{hardware_key, same_machine};
use bc_core::ids::{JoinTokenId, NodeId, PoolId, SiteId};
use bc_core::join::{JoinToken, secret_hash};
use bc_core::node::NodeRecord;
use bc_core::protocol::{CERTIFICATE_LIFETIME_HOURS, IssuedIdentity, JoinRequest, RenewRequest};
use bc_core::provision::JOIN_STATE;
use chrono::{DateTime, Duration, Utc};

use super::Services;
use super::catalog::Page;
use super::store::{WriteTxn, catalog, enrolled_identifiers, events, join_tokens, nodes};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};
use crate::pki::{NodeCsr, NodeIdentity};

/// A join token lives a day unless asked otherwise: long enough to image a rack, short
/// enough that a leaked one is soon worthless.
pub const DEFAULT_JOIN_TOKEN_LIFETIME: Duration = Duration::hours(24);
/// The longest a join token may live.
pub const MAX_JOIN_TOKEN_LIFETIME: Duration = Duration::days(365);
/// The most joins one token may admit.
pub const MAX_JOIN_TOKEN_USES: i64 = 1_000_000;
/// Random bytes in a token's secret.
const SECRET_BYTES: usize = 32;

/// Parameters of a new join token.
pub struct NewJoinToken {
    pub site_id: SiteId,
    pub pool_id: Option<PoolId>,
    pub lifetime: Option<Duration>,
    pub max_uses: Option<i64>,
    pub description: String,
}

/// `pem` as a node's CSR; `BAD_USER_INPUT` if it is not one or its signature is wrong.
fn parse_csr(pem: &str) -> ApiResult<NodeCsr> {
    NodeCsr::parse(pem).map_err(|e| ApiError::BadUserInput(e.to_string()))
}

/// The token `id` if it admits one more join by someone presenting `secret` at `now`.
async fn admitting_token(
    txn: &WriteTxn,
    id: &JoinTokenId,
    secret: &str,
    now: DateTime<Utc>,
) -> ApiResult<JoinToken> {
    let token = join_tokens::get(&**txn, id, false)
        .await?
        .ok_or_else(|| refused("unknown token"))?;
    token
        .admit(secret, now)
        .map_err(|refusal| refused(&refusal.to_string()))?;
    Ok(token)
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
        join_tokens::insert(&*txn, &token).await?;
        let data = serde_json::json!({ "joinTokenId": id, "siteId": token.site_id, "poolId": token.pool_id, "maxUses": max_uses });
        events::append_other(
            &txn,
            EventType::JoinTokenCreated,
            None,
            &principal.actor(),
            data,
            now,
        );
        txn.commit().await?;
        Ok((token, format!("{id}.{secret_part}")))
    }

    /// `joinTokens(first, after)`: newest first (platform admins only).
    pub async fn join_tokens(
        &self,
        principal: &Principal,
        after: Option<&JoinTokenId>,
        first: u64,
    ) -> ApiResult<Page<JoinToken>> {
        principal.require_platform_admin()?;
        let list = join_tokens::page(self.store.db(), after, first + 1).await?;
        Ok(Page::of(list, first))
    }

    pub async fn count_join_tokens(&self, principal: &Principal) -> ApiResult<u64> {
        principal.require_platform_admin()?;
        Ok(join_tokens::count(self.store.db()).await?)
    }

    pub async fn revoke_join_token(
        &self,
        principal: &Principal,
        id: &JoinTokenId,
    ) -> ApiResult<JoinToken> {
        principal.require_platform_admin()?;
        let txn = self.store.write().await?;
        let mut token = join_tokens::get(&*txn, id, true)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("join token `{id}` does not exist")))?;
        if token.revoked_at.is_none() {
            let now = self.clock.now();
            join_tokens::revoke(&*txn, id, now).await?;
            events::append_other(
                &txn,
                EventType::JoinTokenRevoked,
                None,
                &principal.actor(),
                serde_json::json!({ "joinTokenId": id }),
                now,
            );
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
        // The token admits the join twice: here, unlocked, so that a refused join writes
        // nothing; and at the end, where its use is counted on its row, which stays locked
        // for the rest of the transaction and decides (see `spend_use` below).
        let token = admitting_token(&txn, &token_id, secret, now).await?;
        // The CSR is checked once the token admits the join, so that nobody without a token
        // makes the server verify signatures, and before anything is written. It is signed
        // at the end, with the node's final identity.
        let csr = parse_csr(&request.csr_pem)?;
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
        let actor = Actor::System;
        // One join of this machine at a time, from its lookup to its commit (lock order,
        // step 1).
        if let (Some(key), true) = (&hw.key, hw.trusted) {
            nodes::lock_hardware_key(&*txn, key).await?;
        }
        // The machine's node, if it has one: the live node holding its trusted hardware key
        // (it joined before), else the one it was enrolled as through its BMC.
        let reclaimed = match (&hw.key, hw.trusted) {
            (Some(key), true) => match nodes::by_trusted_hardware_key(&*txn, key).await? {
                Some(id) => Some((id, "its hardware key")),
                None => self
                    .enrolled_as(&txn, &hw.identifiers)
                    .await?
                    .map(|id| (id, "the identifiers it was enrolled with")),
            },
            _ => None,
        };
        let node = match reclaimed.clone() {
            Some((existing_id, matched_by)) => {
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
                                .with_detail(format!(
                                    "join token {}; the machine was recognised by {matched_by}",
                                    token.id
                                )),
                            );
                            // An enrolled node takes the key of the daemon's identifiers, which
                            // the inventory will report (unchanged for a node found by its key).
                            changes.extend(n.set_hardware_key(hw.key.clone(), hw.trusted));
                            Ok(changes)
                        },
                    )
                    .await?;
                node
            }
            None => {
                let mut node = NodeRecord::new(
                    Placement::new_node(&request.hostname, &site, pool.as_ref(), JOIN_STATE),
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
                events::append_node_changes(
                    &txn,
                    None,
                    &node,
                    &[change],
                    &actor,
                    Some("join"),
                    now,
                )?;
                node
            }
        };
        let identity = self.issue(&csr, &node.id, node.identity_generation, now)?;
        // Every join through one token counts its use on the token's row, so joins wait on
        // each other for that row's lock: taken last, it is held for this statement, the
        // events' insert and the commit only, not for the whole join (on PostgreSQL at
        // 10,000 joins, holding it from the start made 7,883 of them wait more than 25 ms,
        // and joins ran one at a time; at 100,000 nodes on seven replicas, most of their
        // connections waited here: BENCHMARKS.md).
        if !join_tokens::spend_use(&*txn, &token_id, now).await? {
            // Joins that committed meanwhile used it up, or it was revoked or expired: the
            // token says which. One that still admits the join would mean the statement's
            // condition and `JoinToken::admit` disagree.
            admitting_token(&txn, &token_id, secret, now).await?;
            return Err(ApiError::internal(anyhow::anyhow!(
                "join token {token_id} admits the join, but counting its use found it did not"
            )));
        }
        txn.commit().await?;
        if reclaimed.is_some() {
            self.sessions
                .kick(&node.id, bc_core::protocol::close::IDENTITY_REVOKED);
        }
        metrics::counter!("bc_joins_total", "outcome" => if reclaimed.is_some() { "reclaimed" } else { "joined" }).increment(1);
        Ok(identity)
    }

    /// The live node a machine with these identifiers was enrolled as
    /// ([`bc_core::hardware::same_machine`]), if any. Two such nodes are one machine enrolled
    /// twice, which a join cannot choose between: refused, naming both.
    async fn enrolled_as(
        &self,
        txn: &WriteTxn,
        identifiers: &enrolled_identifiers::Identifiers,
    ) -> ApiResult<Option<NodeId>> {
        let mut matches: Vec<NodeId> = enrolled_identifiers::sharing_any(&**txn, identifiers)
            .await?
            .into_iter()
            .filter(|(_, enrolled)| same_machine(enrolled, identifiers))
            .map(|(id, _)| id)
            .collect();
        match matches.len() {
            0 | 1 => Ok(matches.pop()),
            _ => Err(ApiError::BadUserInput(format!(
                "this machine's identifiers match several enrolled nodes ({}); delete all but one",
                matches
                    .iter()
                    .map(|id| format!("`{id}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// Renewal with a current certificate: same node, same generation, a fresh lifetime.
    pub async fn renew(
        &self,
        identity: &NodeIdentity,
        request: &RenewRequest,
    ) -> ApiResult<IssuedIdentity> {
        self.check_identity(identity).await?;
        let now = self.clock.now();
        let issued = self.issue(
            &parse_csr(&request.csr_pem)?,
            &identity.node_id,
            identity.identity_generation,
            now,
        )?;
        metrics::counter!("bc_certificate_renewals_total").increment(1);
        Ok(issued)
    }

    fn issue(
        &self,
        csr: &NodeCsr,
        node_id: &NodeId,
        generation: i64,
        now: DateTime<Utc>,
    ) -> ApiResult<IssuedIdentity> {
        let lifetime = Duration::hours(CERTIFICATE_LIFETIME_HOURS);
        let signed = self
            .ca
            .sign_node(csr, node_id, generation, now, lifetime)
            .map_err(ApiError::internal)?;
        Ok(IssuedIdentity {
            node_id: node_id.to_string(),
            identity_generation: generation,
            certificate_pem: signed.pem,
            ca_certificate_pem: self.ca.cert_pem().to_owned(),
            expires_at: signed.not_after,
            renew_after: now + lifetime * 2 / 3,
        })
    }

    /// Checks that a client certificate is of its node's current identity generation and
    /// that the node is not deleted; `FORBIDDEN` otherwise. Every gateway route asks this, so
    /// it reads one column of one row, not the whole node.
    pub async fn check_identity(&self, identity: &NodeIdentity) -> ApiResult<()> {
        let current = nodes::live_identity_generation(self.store.db(), &identity.node_id)
            .await?
            .ok_or_else(|| {
                ApiError::Forbidden(format!("node `{}` no longer exists", identity.node_id))
            })?;
        if current != identity.identity_generation {
            return Err(ApiError::Forbidden(format!(
                "this certificate is of identity generation {}, but node `{}` is at {current}: its identity was revoked or replaced",
                identity.identity_generation, identity.node_id
            )));
        }
        Ok(())
    }
}
