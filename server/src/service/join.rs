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
    admitting(join_tokens::get(conn, id, false).await?, secret, now)
}

/// `token`, as read, if it exists and admits one more join by someone presenting `secret`
/// at `now`.
fn admitting(token: Option<JoinToken>, secret: &str, now: DateTime<Utc>) -> ApiResult<JoinToken> {
    let token = token.ok_or_else(|| refused("unknown token"))?;
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

/// What became of a transaction of joins ([`Services::write_joins`]).
enum BatchOutcome {
    /// It committed: each join's answer, in order.
    Written(Vec<ApiResult<IssuedIdentity>>),
    /// It wrote nothing: this token no longer admits any join (used up, revoked or expired
    /// since its joins were admitted), and `refusal` says which.
    TokenRefused {
        token: JoinTokenId,
        refusal: ApiError,
    },
    /// It wrote nothing: a token has fewer uses left than the joins through it, which must
    /// decide one at a time.
    TooFewUses,
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
    let read = match tokens.get(&token_id) {
        Some(token) => token.clone(),
        None => {
            let token = join_tokens::get(services.store.db(), &token_id, false).await?;
            tokens.insert(token_id, token.clone());
            token
        }
    };
    let token = admitting(read, secret, now)?;
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

impl AdmittedJoin<'_> {
    /// The machine's hardware key, if it is trusted: the key its node is found by.
    fn trusted_key(&self) -> Option<&str> {
        self.hardware
            .key
            .as_deref()
            .filter(|_| self.hardware.trusted)
    }
}

/// Items in rounds, each holding a key once (items without a key go in the first round),
/// every item with its index among `items`: an item whose key an earlier item has is in the
/// round after that item's. A batch of joins is written in rounds of machines (their trusted
/// hardware keys), so that a machine's second join sees its first.
fn rounds<'a, T>(
    items: &'a [T],
    key: impl Fn(&'a T) -> Option<&'a str>,
) -> Vec<Vec<(usize, &'a T)>> {
    let mut rounds: Vec<Vec<(usize, &T)>> = Vec::new();
    // The keys of each round.
    let mut keys: Vec<BTreeSet<&str>> = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let key = key(item);
        let round = keys
            .iter()
            .position(|keys| key.is_none_or(|key| !keys.contains(key)))
            .unwrap_or_else(|| {
                keys.push(BTreeSet::new());
                rounds.push(Vec::new());
                rounds.len() - 1
            });
        keys[round].extend(key);
        rounds[round].push((index, item));
    }
    rounds
}

/// A join's new node, in the token's site and pool, with the machine's hardware key.
fn new_node(
    join: &AdmittedJoin<'_>,
    site: &Site,
    pool: Option<&Pool>,
    now: DateTime<Utc>,
) -> ApiResult<NodeRecord> {
    let mut node = NodeRecord::new(
        Placement::new_node(&join.request.hostname, site, pool, JOIN_STATE),
        now,
    )?;
    node.hardware_key = join.hardware.key.clone();
    node.hardware_key_trusted = join.hardware.trusted;
    Ok(node)
}

/// The live nodes enrolled with any identifier of these joins' machines, each with all its
/// enrolled identifiers: one query for a round of joins.
async fn enrolled_nodes_sharing(
    txn: &WriteTxn,
    joins: &[&AdmittedJoin<'_>],
) -> ApiResult<Vec<(NodeId, enrolled_identifiers::Identifiers)>> {
    let mut any: enrolled_identifiers::Identifiers = BTreeMap::new();
    for join in joins {
        for (kind, values) in &join.hardware.identifiers {
            any.entry(kind.clone())
                .or_default()
                .extend(values.iter().cloned());
        }
    }
    Ok(enrolled_identifiers::sharing_any(&**txn, &any).await?)
}

/// The one node among `enrolled` that a machine with these identifiers was enrolled as
/// ([`bc_core::hardware::same_machine`]), if any. Two such nodes are one machine enrolled
/// twice, which a join cannot choose between: refused, naming both.
fn enrolled_as(
    enrolled: &[(NodeId, enrolled_identifiers::Identifiers)],
    identifiers: &enrolled_identifiers::Identifiers,
) -> ApiResult<Option<NodeId>> {
    let mut matches: Vec<&NodeId> = enrolled
        .iter()
        .filter(|(_, known)| same_machine(known, identifiers))
        .map(|(id, _)| id)
        .collect();
    match matches.len() {
        0 | 1 => Ok(matches.pop().cloned()),
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

/// A join's answer, which every path of a batch gives; none would be a bug, answered as one.
fn answered<T>(answer: Option<ApiResult<T>>) -> ApiResult<T> {
    answer.unwrap_or_else(|| {
        Err(ApiError::internal(anyhow::anyhow!(
            "a join went unanswered"
        )))
    })
}

/// The answer for the other joins of a batch that met `fault` (a server fault): the same
/// kind, `UNAVAILABLE` or `INTERNAL` (whose cause was logged once, with the first).
fn same_fault(fault: &ApiError) -> ApiError {
    match fault {
        ApiError::Unavailable(message) => ApiError::Unavailable(message.clone()),
        _ => ApiError::Internal(anyhow::anyhow!(
            "the join's batch failed on the server's side"
        )),
    }
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
        answered(self.join_many(std::slice::from_ref(request)).await.pop())
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
    /// counts each token's uses once and inserts the events once. A token that no longer
    /// admits any join (used up, revoked or expired meanwhile) refuses its joins and the rest
    /// are written again without them; should the transaction fail otherwise (a token has
    /// fewer uses left than the batch needs, or the database refused one join's rows), the
    /// joins are written again one at a time, each deciding alone. A database that gave no
    /// connection in time answers every join `UNAVAILABLE` at once.
    pub async fn join_many(&self, requests: &[JoinRequest]) -> Vec<ApiResult<IssuedIdentity>> {
        let admitted_at = self.clock.now();
        let mut answers: Vec<Option<ApiResult<IssuedIdentity>>> =
            requests.iter().map(|_| None).collect();
        let mut tokens = HashMap::new();
        let mut admitted = Vec::with_capacity(requests.len());
        for (index, request) in requests.iter().enumerate() {
            match admit_join(self, request, &mut tokens, admitted_at).await {
                Ok(join) => admitted.push((index, join)),
                // The database failed reading a token (busy, or down): the rest of the batch
                // would wait for it again, one after another, so all of it answers so.
                Err(err) if err.is_server_fault() => {
                    for answer in answers.iter_mut().filter(|answer| answer.is_none()) {
                        *answer = Some(Err(same_fault(&err)));
                    }
                    return answers.into_iter().map(answered).collect();
                }
                Err(err) => answers[index] = Some(Err(err)),
            }
        }
        let mut pending: Vec<&(usize, AdmittedJoin)> = admitted.iter().collect();
        while !pending.is_empty() {
            let joins: Vec<&AdmittedJoin> = pending.iter().map(|(_, join)| join).collect();
            let written = match self.write_joins(&joins).await {
                Ok(BatchOutcome::Written(written)) => written,
                // The token's joins are refused as it says; the rest go in again without them.
                Ok(BatchOutcome::TokenRefused { token, refusal }) => {
                    let message = refusal.message();
                    pending.retain(|(index, join)| {
                        let refused = join.token.id == token;
                        if refused {
                            answers[*index] = Some(Err(ApiError::Unauthenticated(message.clone())));
                        }
                        !refused
                    });
                    continue;
                }
                Ok(BatchOutcome::TooFewUses) => {
                    tracing::debug!(
                        joins = joins.len(),
                        "a token has fewer uses left than a batch of joins needs; writing them one at a time"
                    );
                    self.write_one_at_a_time(&joins).await
                }
                // No connection in time: one at a time, each would wait as long again.
                Err(err @ ApiError::Unavailable(_)) => {
                    joins.iter().map(|_| Err(same_fault(&err))).collect()
                }
                Err(err) if joins.len() == 1 => vec![Err(err)],
                Err(err) => {
                    tracing::warn!(joins = joins.len(), error = ?err, "a batch of joins failed as a whole; writing them one at a time");
                    self.write_one_at_a_time(&joins).await
                }
            };
            for ((index, _), answer) in pending.iter().zip(written) {
                answers[*index] = Some(answer);
            }
            break;
        }
        answers.into_iter().map(answered).collect()
    }

    /// Joins that could not be written together, each in its own transaction, in order: each
    /// decides alone, as it would have without batching.
    async fn write_one_at_a_time(
        &self,
        joins: &[&AdmittedJoin<'_>],
    ) -> Vec<ApiResult<IssuedIdentity>> {
        let mut written = Vec::with_capacity(joins.len());
        for join in joins {
            written.push(match self.write_joins(&[*join]).await {
                Ok(BatchOutcome::Written(mut one)) => answered(one.pop()),
                Ok(BatchOutcome::TokenRefused { refusal, .. }) => Err(refusal),
                Ok(BatchOutcome::TooFewUses) => Err(ApiError::internal(anyhow::anyhow!(
                    "join token {} admits the join, but counting its use found it did not",
                    join.token.id
                ))),
                Err(err) => Err(err),
            });
        }
        written
    }

    /// Writes admitted joins in one transaction and answers each. A join refused on what the
    /// transaction finds (its machine's node is in another site, its identifiers match two
    /// enrolled nodes) is answered with its error and writes nothing; anything else that
    /// fails, fails the whole transaction, which writes nothing.
    ///
    /// The joins are written in rounds, each holding a machine once: a machine joining twice
    /// (a daemon retrying a slow join) takes back, in the next round, the node its first join
    /// created, as it would have one join after the other. Each round looks its machines up
    /// and inserts its new nodes in a few statements, however many joins it holds.
    async fn write_joins(&self, joins: &[&AdmittedJoin<'_>]) -> ApiResult<BatchOutcome> {
        if joins.is_empty() {
            return Ok(BatchOutcome::Written(Vec::new()));
        }
        let txn = self.store.write().await?;
        // The time of the writes, once the writer is ours (it may have been a while).
        let now = self.clock.now();
        // One join or enrolment of a machine at a time, from its lookup to its commit (lock
        // order, step 1); and no enrolment under way while the machines with a trusted key
        // look for the nodes they were enrolled as.
        let keys: Vec<&str> = joins
            .iter()
            .filter_map(|join| join.trusted_key())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        nodes::lock_hardware_keys(&*txn, &keys).await?;
        if !keys.is_empty() {
            nodes::lock_against_enrolments(&*txn, nodes::EnrolmentSide::Joining).await?;
        }
        let mut placements: HashMap<&JoinTokenId, (Site, Option<Pool>)> = HashMap::new();
        for join in joins {
            if !placements.contains_key(&join.token.id) {
                placements.insert(&join.token.id, token_placement(&txn, &join.token).await?);
            }
        }
        let mut outcomes: Vec<Option<ApiResult<PlacedJoin>>> = joins.iter().map(|_| None).collect();
        for round in rounds(joins, |join| join.trusted_key()) {
            let round: Vec<(usize, &AdmittedJoin)> = round
                .into_iter()
                .map(|(index, join)| (index, *join))
                .collect();
            let placed = self.place_joins(&txn, &round, &placements, now).await?;
            for ((index, _), outcome) in round.iter().zip(placed) {
                outcomes[*index] = Some(outcome);
            }
        }
        let outcomes: Vec<ApiResult<PlacedJoin>> = outcomes.into_iter().map(answered).collect();
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
                // the token says which, and its joins are refused. One that still admits a
                // join has fewer uses left than this batch needs, and its joins must decide
                // one at a time; for a single join it would mean the statement's condition
                // and `JoinToken::admit` disagree. Either way this transaction writes nothing.
                return match admitting_token(&*txn, token_id, secret, now).await {
                    Err(refusal) if !refusal.is_server_fault() => Ok(BatchOutcome::TokenRefused {
                        token: token_id.clone(),
                        refusal,
                    }),
                    Err(fault) => Err(fault),
                    Ok(_) if uses > 1 => Ok(BatchOutcome::TooFewUses),
                    Ok(_) => Err(ApiError::internal(anyhow::anyhow!(
                        "join token {token_id} admits the join, but counting its use found it did not"
                    ))),
                };
            }
        }
        txn.commit().await?;
        Ok(BatchOutcome::Written(outcomes
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
            .collect()))
    }

    /// One round of a join transaction, each machine in it once: every join's node (its
    /// machine's own, found by its trusted hardware key or by the identifiers it was
    /// enrolled with and taken back, or a new one), its event and its certificate, answered
    /// in the round's order. Its token's use is counted by the caller. A server fault fails
    /// the round, and so the transaction; any other refusal is that join's answer.
    async fn place_joins(
        &self,
        txn: &WriteTxn,
        round: &[(usize, &AdmittedJoin<'_>)],
        placements: &HashMap<&JoinTokenId, (Site, Option<Pool>)>,
        now: DateTime<Utc>,
    ) -> ApiResult<Vec<ApiResult<PlacedJoin>>> {
        let keys: Vec<&str> = round
            .iter()
            .filter_map(|(_, join)| join.trusted_key())
            .collect();
        let by_key = nodes::by_trusted_hardware_keys(&**txn, &keys).await?;
        // The machines with a trusted key and no node holding it may have been enrolled
        // through their BMC: the enrolled nodes sharing any of their identifiers, in one query,
        // which each join then compares with its own identifiers as a whole.
        let unclaimed: Vec<&AdmittedJoin<'_>> = round
            .iter()
            .map(|(_, join)| *join)
            .filter(|join| {
                join.trusted_key()
                    .is_some_and(|key| !by_key.contains_key(key))
            })
            .collect();
        let enrolled = enrolled_nodes_sharing(txn, &unclaimed).await?;
        let mut placed: Vec<Option<ApiResult<PlacedJoin>>> = round.iter().map(|_| None).collect();
        let mut new_nodes: Vec<(usize, NodeRecord)> = Vec::new();
        // Each machine's node, if it has one: the live node holding its trusted hardware key
        // (it joined before), else the one it was enrolled as through its BMC.
        let found: Vec<ApiResult<Option<(NodeId, &str)>>> = round
            .iter()
            .map(|(_, join)| match join.trusted_key() {
                Some(key) => match by_key.get(key) {
                    Some(id) => Ok(Some((id.clone(), "its hardware key"))),
                    None => enrolled_as(&enrolled, &join.hardware.identifiers)
                        .map(|id| id.map(|id| (id, "the identifiers it was enrolled with"))),
                },
                None => Ok(None),
            })
            .collect();
        // The nodes taken back, locked in id order before any is changed (lock order, step
        // 2): taking one back may close its session, a later step.
        let taken: Vec<NodeId> = found
            .iter()
            .filter_map(|found| found.as_ref().ok()?.as_ref().map(|(id, _)| id.clone()))
            .collect();
        txn.lock_nodes(&taken).await?;
        // Taken back in node id order too: taking one back may close its session, and a
        // transaction locks session rows in node id order (step 5).
        let mut order: Vec<usize> = (0..round.len()).collect();
        order.sort_by_cached_key(|&at| {
            found[at]
                .as_ref()
                .ok()
                .and_then(|found| found.as_ref().map(|(id, _)| id.clone()))
        });
        let mut found: Vec<Option<_>> = found.into_iter().map(Some).collect();
        for at in order {
            let join = round[at].1;
            let found = found[at].take().expect("each join is looked at once");
            let (site, pool) = &placements[&join.token.id];
            let outcome = match found {
                Ok(Some((existing, matched_by))) => {
                    self.take_back(txn, join, &existing, matched_by, site, now)
                        .await
                }
                Ok(None) => match new_node(join, site, pool.as_ref(), now) {
                    Ok(node) => {
                        new_nodes.push((at, node));
                        continue;
                    }
                    Err(err) => Err(err),
                },
                Err(err) => Err(err),
            };
            match outcome {
                Err(err) if err.is_server_fault() => return Err(err),
                outcome => placed[at] = Some(outcome),
            }
        }
        let records: Vec<NodeRecord> = new_nodes.iter().map(|(_, node)| node.clone()).collect();
        nodes::insert_many(&**txn, &records).await?;
        for (at, node) in new_nodes {
            let join = round[at].1;
            let change = Change::new(
                EventType::NodeJoined,
                Axis::Lifecycle,
                None::<String>,
                Some(JOIN_STATE.as_static_str()),
            )
            .with_detail(format!("join token {}", join.token.id));
            events::append_node_changes(
                txn,
                None,
                &node,
                &[change],
                &Actor::System,
                Some("join"),
                now,
            )?;
            let identity = self.issue(&join.csr, &node.id, node.identity_generation, now)?;
            placed[at] = Some(Ok(PlacedJoin {
                node_id: node.id,
                reclaimed: false,
                identity,
            }));
        }
        Ok(placed.into_iter().map(answered).collect())
    }

    /// A join of a machine that has a node (`existing`, found by `matched_by`): the node,
    /// which must be in the token's site, takes the join's identity (the next generation,
    /// whose certificate replaces the old one) and the daemon's hardware key.
    async fn take_back(
        &self,
        txn: &WriteTxn,
        join: &AdmittedJoin<'_>,
        existing_id: &NodeId,
        matched_by: &str,
        site: &Site,
        now: DateTime<Utc>,
    ) -> ApiResult<PlacedJoin> {
        let (request, hw, token) = (join.request, &join.hardware, &join.token);
        // Locked with the batch's other taken-back nodes, in id order, before any was changed.
        let existing = nodes::load(&**txn, existing_id)
            .await?
            .ok_or_else(|| ApiError::internal(anyhow::anyhow!("node {existing_id} vanished")))?;
        if existing.site_id != site.id {
            return Err(ApiError::BadUserInput(format!(
                "this machine's hardware key belongs to node `{existing_id}` in site `{}`; delete that node or join with a token of its site",
                existing.site_id
            )));
        }
        let (node, _) = self
            .change_node_in(
                txn,
                &Actor::System,
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
                    // An enrolled node takes the key of the daemon's identifiers, which the
                    // inventory will report (unchanged for a node found by its key).
                    changes.extend(n.set_hardware_key(hw.key.clone(), hw.trusted));
                    Ok(changes)
                },
            )
            .await?;
        let identity = self.issue(&join.csr, &node.id, node.identity_generation, now)?;
        Ok(PlacedJoin {
            node_id: node.id,
            reclaimed: true,
            identity,
        })
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
    /// that the node is not deleted; `FORBIDDEN` otherwise ([`Services::check_identities`]).
    pub async fn check_identity(&self, identity: &NodeIdentity) -> ApiResult<()> {
        let mut answers = self
            .check_identities(std::slice::from_ref(identity))
            .await?;
        answers.pop().unwrap_or_else(|| {
            Err(ApiError::Internal(anyhow::anyhow!(
                "no answer for the identity"
            )))
        })
    }

    /// [`Services::check_identity`] for many certificates at once, answered in the order
    /// given. The gateway asks this of every connection before it upgrades to a session, so
    /// a failover's thousands of reconnecting daemons are checked a batch at a time
    /// (`gateway.identity`), and it reads each node's identity generation, not the whole node.
    pub async fn check_identities(
        &self,
        identities: &[NodeIdentity],
    ) -> ApiResult<Vec<ApiResult<()>>> {
        let ids: Vec<NodeId> = identities.iter().map(|i| i.node_id.clone()).collect();
        let current = nodes::live_identity_generation_of_each(self.store.db(), &ids).await?;
        Ok(identities
            .iter()
            .map(|identity| check_generation(identity, current.get(&identity.node_id).copied()))
            .collect())
    }
}

/// `FORBIDDEN` unless a certificate is of its node's `current` identity generation (`None`:
/// the node is deleted or never existed).
fn check_generation(identity: &NodeIdentity, current: Option<i64>) -> ApiResult<()> {
    let Some(current) = current else {
        return Err(ApiError::Forbidden(format!(
            "node `{}` no longer exists",
            identity.node_id
        )));
    };
    if current != identity.identity_generation {
        return Err(ApiError::Forbidden(format!(
            "this certificate is of identity generation {}, but node `{}` is at {current}: its identity was revoked or replaced",
            identity.identity_generation, identity.node_id
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::rounds;

    #[test]
    fn rounds_hold_each_key_once_in_the_order_given() {
        let keys = [
            Some("a"),
            Some("b"),
            Some("a"),
            None,
            Some("a"),
            Some("b"),
            None,
        ];
        let indices: Vec<Vec<usize>> = rounds(&keys, |key| *key)
            .into_iter()
            .map(|round| round.into_iter().map(|(index, _)| index).collect())
            .collect();
        assert_eq!(indices, vec![vec![0, 1, 3, 6], vec![2, 5], vec![4]]);
        let nothing: [Option<&str>; 0] = [];
        assert!(rounds(&nothing, |key| *key).is_empty());
    }
}
