//! Join tokens and joining: `createJoinToken`, `revokeJoinToken`, JoinService (token and
//! CSR in, node and certificate out, in one transaction), renewal, and the identity check
//! every gateway route makes.

use bc_core::Actor;
use bc_core::catalog::Placement;
use bc_core::catalog::{Pool, Site};
use bc_core::event::{Axis, Change, EventType};
use bc_core::hardware::{HardwareKey, hardware_key, same_machine};
use bc_core::ids::{JoinTokenId, NodeId, PoolId, SiteId};
use bc_core::join::{JoinToken, secret_hash};
use bc_core::node::NodeRecord;
use bc_core::protocol::{CERTIFICATE_LIFETIME_HOURS, IssuedIdentity, JoinRequest, RenewRequest};
use bc_core::provision::JOIN_STATE;
use chrono::{DateTime, Duration, Utc};
use sea_orm::ConnectionTrait;
use std::collections::{BTreeMap, BTreeSet, HashMap};

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
    conn: &impl ConnectionTrait,
    id: &JoinTokenId,
    secret: &str,
    now: DateTime<Utc>,
) -> ApiResult<JoinToken> {
    let token = join_tokens::get(conn, id, false)
        .await?
        .ok_or_else(|| refused("unknown token"))?;
    token
        .admit(secret, now)
        .map_err(|refusal| refused(&refusal.to_string()))?;
    Ok(token)
}

/// A join request that is well-formed and whose token admits it, as read before the join's
/// transaction: what the transaction needs of it.
struct AdmittedJoin<'r> {
    request: &'r JoinRequest,
    /// The secret half of the request's token.
    secret: &'r str,
    token: JoinToken,
    csr: NodeCsr,
    hardware: HardwareKey,
}

/// What one join of a transaction wrote, to answer it once the transaction commits.
struct PlacedJoin {
    node_id: NodeId,
    /// It took back the machine's existing node, whose old certificate's session must end.
    reclaimed: bool,
    identity: IssuedIdentity,
}

/// Checks a join request before its transaction: its token (read once per batch into
/// `tokens`, unlocked, since its use is decided when it is counted, locked, at the end of the
/// transaction), its hostname, and only then, so that nobody without a token makes the server
/// verify signatures, its CSR. A refused request is refused here, having written nothing.
async fn admit_join<'r>(
    services: &Services,
    request: &'r JoinRequest,
    tokens: &mut HashMap<JoinTokenId, Option<JoinToken>>,
    now: DateTime<Utc>,
) -> ApiResult<AdmittedJoin<'r>> {
    let (id, secret) = request.token.split_once('.').ok_or_else(|| {
        ApiError::BadUserInput("the join token is malformed: expected `<jt_…>.<secret>`".into())
    })?;
    let token_id = JoinTokenId::parse(id)
        .map_err(|_| ApiError::BadUserInput("the join token is malformed".into()))?;
    bc_core::node::validate_hostname(&request.hostname)?;
    let token = match tokens.get(&token_id) {
        Some(token) => token.clone(),
        None => {
            let token = join_tokens::get(services.store.db(), &token_id, false).await?;
            tokens.insert(token_id, token.clone());
            token
        }
    }
    .ok_or_else(|| refused("unknown token"))?;
    token
        .admit(secret, now)
        .map_err(|refusal| refused(&refusal.to_string()))?;
    let csr = parse_csr(&request.csr_pem)?;
    Ok(AdmittedJoin {
        request,
        secret,
        token,
        csr,
        hardware: hardware_key(&request.identifiers),
    })
}

/// The site and pool a token's nodes join.
async fn token_placement(txn: &WriteTxn, token: &JoinToken) -> ApiResult<(Site, Option<Pool>)> {
    let site = catalog::site(&**txn, &token.site_id)
        .await?
        .ok_or_else(|| {
            ApiError::internal(anyhow::anyhow!(
                "join token {} names a missing site",
                token.id
            ))
        })?;
    let pool = match &token.pool_id {
        Some(pool_id) => Some(catalog::pool(&**txn, pool_id).await?.ok_or_else(|| {
            ApiError::internal(anyhow::anyhow!(
                "join token {} names a missing pool",
                token.id
            ))
        })?),
        None => None,
    };
    Ok((site, pool))
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
    /// event), or refuses it and creates nothing. One join is a batch of one
    /// ([`Services::join_many`]).
    pub async fn join(&self, request: &JoinRequest) -> ApiResult<IssuedIdentity> {
        self.join_many(std::slice::from_ref(request))
            .await
            .pop()
            .unwrap_or_else(|| {
                Err(ApiError::internal(anyhow::anyhow!(
                    "a join went unanswered"
                )))
            })
    }

    /// JoinService for the joins the gateway collected while its last batch was written:
    /// each is answered, in the order given, as if it had been a transaction of its own, and
    /// a refused one creates nothing.
    ///
    /// A fleet coming up joins by the thousand through one token, and every join counts its
    /// use on that token's row and writes its event under the event-order lock: one join per
    /// transaction made every join of every replica wait for those two locks in turn (at
    /// 100,000 nodes, four in five of the statements slower than 100 ms were the token's
    /// update: BENCHMARKS.md). So the admitted joins are written in one transaction, which
    /// counts each token's uses once and inserts the events once. Should that fail as a
    /// whole (the token has fewer uses left than the batch needs, or the database refused
    /// one join's rows), the joins are written again one at a time, each deciding alone.
    pub async fn join_many(&self, requests: &[JoinRequest]) -> Vec<ApiResult<IssuedIdentity>> {
        let now = self.clock.now();
        let mut answers: Vec<Option<ApiResult<IssuedIdentity>>> =
            requests.iter().map(|_| None).collect();
        let mut tokens = HashMap::new();
        let mut admitted = Vec::with_capacity(requests.len());
        for (index, request) in requests.iter().enumerate() {
            match admit_join(self, request, &mut tokens, now).await {
                Ok(join) => admitted.push((index, join)),
                Err(err) => answers[index] = Some(Err(err)),
            }
        }
        let joins: Vec<&AdmittedJoin> = admitted.iter().map(|(_, join)| join).collect();
        let written = match self.write_joins(&joins, now).await {
            Ok(written) => written,
            Err(err) if joins.len() == 1 => vec![Err(err)],
            Err(err) => {
                if err.is_server_fault() {
                    tracing::warn!(joins = joins.len(), error = ?err, "a batch of joins failed as a whole; writing them one at a time");
                } else {
                    tracing::debug!(joins = joins.len(), reason = %err.message(), "a batch of joins cannot be written together; writing them one at a time");
                }
                let mut written = Vec::with_capacity(joins.len());
                for join in &joins {
                    written.push(match self.write_joins(&[*join], now).await {
                        Ok(mut one) => one.pop().unwrap_or_else(|| {
                            Err(ApiError::internal(anyhow::anyhow!(
                                "a join went unanswered"
                            )))
                        }),
                        Err(err) => Err(err),
                    });
                }
                written
            }
        };
        for ((index, _), answer) in admitted.iter().zip(written) {
            answers[*index] = Some(answer);
        }
        answers
            .into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| {
                    Err(ApiError::internal(anyhow::anyhow!(
                        "a join went unanswered"
                    )))
                })
            })
            .collect()
    }

    /// Writes admitted joins in one transaction and answers each. A join refused on what the
    /// transaction finds (its machine's node is in another site, its identifiers match two
    /// enrolled nodes) is answered with its error and writes nothing; anything else that
    /// fails, fails the whole transaction, which writes nothing.
    async fn write_joins(
        &self,
        joins: &[&AdmittedJoin<'_>],
        now: DateTime<Utc>,
    ) -> ApiResult<Vec<ApiResult<IssuedIdentity>>> {
        let txn = self.store.write().await?;
        // One join of a machine at a time, from its lookup to its commit (lock order, step
        // 1), the batch's machines in key order so that two batches never wait on each
        // other in a cycle. Two joins of one machine in one batch are written in turn: the
        // second takes back the node the first created, as it would have one after the other.
        let keys: BTreeSet<&str> = joins
            .iter()
            .filter(|join| join.hardware.trusted)
            .filter_map(|join| join.hardware.key.as_deref())
            .collect();
        for key in keys {
            nodes::lock_hardware_key(&*txn, key).await?;
        }
        let mut placements: HashMap<&JoinTokenId, (Site, Option<Pool>)> = HashMap::new();
        let mut outcomes = Vec::with_capacity(joins.len());
        for join in joins {
            let token = &join.token;
            if !placements.contains_key(&token.id) {
                placements.insert(&token.id, token_placement(&txn, token).await?);
            }
            let (site, pool) = &placements[&token.id];
            match self.place_join(&txn, join, site, pool.as_ref(), now).await {
                Ok(placed) => outcomes.push(Ok(placed)),
                Err(err) if err.is_server_fault() => return Err(err),
                Err(err) => outcomes.push(Err(err)),
            }
        }
        // Each token's uses are counted on its row, locked from here to the commit (lock
        // order, step 7), tokens in id order.
        let mut spent: BTreeMap<&JoinTokenId, (i64, &str)> = BTreeMap::new();
        for (join, outcome) in joins.iter().zip(&outcomes) {
            if outcome.is_ok() {
                spent.entry(&join.token.id).or_insert((0, join.secret)).0 += 1;
            }
        }
        for (token_id, (uses, secret)) in spent {
            if !join_tokens::spend_uses(&*txn, token_id, uses, now).await? {
                // Joins that committed meanwhile used it up, or it was revoked or expired:
                // the token says which. One that still admits a join has fewer uses left than
                // this batch needs, and its joins must decide one at a time; for a single join
                // it would mean the statement's condition and `JoinToken::admit` disagree.
                admitting_token(&*txn, token_id, secret, now).await?;
                return Err(if uses > 1 {
                    refused("the token has fewer uses left than the joins waiting on it")
                } else {
                    ApiError::internal(anyhow::anyhow!(
                        "join token {token_id} admits the join, but counting its use found it did not"
                    ))
                });
            }
        }
        txn.commit().await?;
        Ok(outcomes
            .into_iter()
            .map(|outcome| {
                let placed = outcome?;
                if placed.reclaimed {
                    self.sessions
                        .kick(&placed.node_id, bc_core::protocol::close::IDENTITY_REVOKED);
                }
                metrics::counter!("bc_joins_total", "outcome" => if placed.reclaimed { "reclaimed" } else { "joined" }).increment(1);
                Ok(placed.identity)
            })
            .collect())
    }

    /// One join's writes in a join transaction: the machine's node (taken back if it joined
    /// before or was enrolled through its BMC, else created), its event and its certificate.
    /// Its token's use is counted by the caller.
    async fn place_join(
        &self,
        txn: &WriteTxn,
        join: &AdmittedJoin<'_>,
        site: &Site,
        pool: Option<&Pool>,
        now: DateTime<Utc>,
    ) -> ApiResult<PlacedJoin> {
        let (request, hw, token) = (join.request, &join.hardware, &join.token);
        let actor = Actor::System;
        // The machine's node, if it has one: the live node holding its trusted hardware key
        // (it joined before), else the one it was enrolled as through its BMC.
        let reclaimed = match (&hw.key, hw.trusted) {
            (Some(key), true) => match nodes::by_trusted_hardware_key(&**txn, key).await? {
                Some(id) => Some((id, "its hardware key")),
                None => self
                    .enrolled_as(txn, &hw.identifiers)
                    .await?
                    .map(|id| (id, "the identifiers it was enrolled with")),
            },
            _ => None,
        };
        let node = match &reclaimed {
            Some((existing_id, matched_by)) => {
                let existing = nodes::load(&**txn, existing_id, true)
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
                        txn,
                        &actor,
                        existing_id,
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
                    Placement::new_node(&request.hostname, site, pool, JOIN_STATE),
                    now,
                )?;
                node.hardware_key = hw.key.clone();
                node.hardware_key_trusted = hw.trusted;
                nodes::insert(&**txn, &node).await?;
                let change = Change::new(
                    EventType::NodeJoined,
                    Axis::Lifecycle,
                    None::<String>,
                    Some(JOIN_STATE.as_static_str()),
                )
                .with_detail(format!("join token {}", token.id));
                events::append_node_changes(
                    txn,
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
        let identity = self.issue(&join.csr, &node.id, node.identity_generation, now)?;
        Ok(PlacedJoin {
            node_id: node.id,
            reclaimed: reclaimed.is_some(),
            identity,
        })
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
