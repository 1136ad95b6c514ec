//! Bare metal: enrolment by BMC, the operators' bare-metal view of a node, power actions,
//! and the Power controller's reads and writes.
//!
//! A node enrolled through its BMC is an ordinary enrolled node (`enrolling`, hardware key
//! and identifiers from [`Services::enroll_in`]) plus a `node_bmcs` row: the BMC's address,
//! how to check its certificate, and its credentials sealed with the credential key
//! ([`crate::credentials`]). The credentials are opened only to build a driver, in memory,
//! and never leave the server.
//!
//! The `power` axis has one writer, the Power controller, which reads it from the BMC: a
//! power action (`powerNode`) asks the BMC, records a `node.power_action` event and makes
//! the BMC due for a poll at once, and the poll that sees the change writes the axis.

use bc_core::Actor;
use bc_core::axes::{ConditionStatus, Power};
use bc_core::bare_metal::{
    BMC_UNREACHABLE, BmcTlsVerification, PowerAction, PowerDriverKind, power_driver_of,
};
use bc_core::event::EventType;
use bc_core::ids::{NodeId, PoolId, SiteId};
use bc_core::node::NodeRecord;
use bc_core::view::NodeDetail;
use chrono::{DateTime, Utc};
use std::sync::Arc;

use super::Services;
use super::nodes::not_found;
use super::store::bare_metal::{self as store, PollRecord, StoredBmc};
use super::store::{events, nodes, placement};
use crate::auth::{Principal, Role};
use crate::bmc::{self, BmcEndpoint, BmcError, BmcTls, DriverSettings, PowerDriver};
use crate::config::BareMetalConfig;
use crate::credentials::{BmcCredentials, CredentialKey};
use crate::error::{ApiError, ApiResult};

pub use super::store::bare_metal::DueBmc;

/// The Power controller's name: events and conditions say `controller:power`.
pub const POWER_ACTOR: &str = "power";

/// What bare metal needs besides storage: the credential key and `[bare_metal]`.
#[derive(Debug)]
pub struct BareMetal {
    pub key: CredentialKey,
    pub config: BareMetalConfig,
}

impl BareMetal {
    pub fn new(key: CredentialKey, config: BareMetalConfig) -> BareMetal {
        BareMetal { key, config }
    }

    /// A throwaway key and the defaults: services built without a configuration.
    pub fn ephemeral() -> BareMetal {
        BareMetal::new(CredentialKey::ephemeral(), BareMetalConfig::default())
    }

    pub fn settings(&self) -> DriverSettings {
        DriverSettings {
            request_timeout: self.config.request_timeout(),
            allow_insecure_http: self.config.allow_insecure_http,
        }
    }
}

/// A BMC as an operator enrols it.
#[derive(Debug, Clone)]
pub struct NewBmc {
    pub address: String,
    pub system_id: Option<String>,
    pub credentials: BmcCredentials,
    /// `false`: accept any certificate.
    pub verify_tls: bool,
    /// Verify against this CA instead of the platform's roots.
    pub ca_pem: Option<String>,
}

/// The operators' bare-metal view of a node: what `NodeDetail` leaves out on purpose.
#[derive(Debug, Clone)]
pub struct BareMetalNode {
    pub node: NodeDetail,
    pub power: Power,
    pub power_driver: PowerDriverKind,
    /// `None` for a node enrolled without a BMC (or joined by its daemon).
    pub bmc: Option<BmcStatus>,
    /// Its newest bare-metal workflows, newest first (the running one, if any, is first).
    pub workflows: Vec<bc_core::workflow::Workflow>,
}

/// A node's BMC without its credentials.
#[derive(Debug, Clone)]
pub struct BmcStatus {
    pub address: String,
    pub system_id: Option<String>,
    pub system_path: Option<String>,
    pub tls_verification: BmcTlsVerification,
    /// `None` before the first poll.
    pub reachable: Option<bool>,
    pub last_error: Option<String>,
    pub consecutive_failures: i64,
    pub last_polled_at: Option<DateTime<Utc>>,
    pub next_poll_at: DateTime<Utc>,
    /// Whether `BmcUnreachable` is `true` on the node.
    pub unreachable_condition: bool,
}

/// What one poll of one BMC found (the controller's input to [`Services::record_power_polls`]).
#[derive(Debug, Clone)]
pub struct PowerPoll {
    pub node_id: NodeId,
    pub result: Result<Power, BmcError>,
    /// The failures in a row before this poll.
    pub failures_before: i64,
    pub system_path: Option<String>,
    /// The node's `power` and `BmcUnreachable` as the work list read them: a poll that
    /// changes neither skips the node's row (and its lock) altogether.
    pub known_power: Power,
    pub known_unreachable: bool,
}

/// What [`Services::record_power_polls`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PollReport {
    /// Nodes whose `power` axis moved.
    pub power_changed: usize,
    /// Nodes that got `BmcUnreachable` (true).
    pub became_unreachable: usize,
    /// Nodes whose `BmcUnreachable` cleared.
    pub became_reachable: usize,
}

impl From<BmcError> for ApiError {
    fn from(err: BmcError) -> Self {
        ApiError::Bmc {
            kind: err.reason(),
            message: err.to_string(),
        }
    }
}

impl Services {
    /// `enrollBareMetalNode`: a machine known by its BMC enters as `enrolling`, exactly as
    /// `enrollNode` enrols it (hardware key, identifiers, the checks against known machines),
    /// with its BMC stored beside it and due for a first poll at once. The pool's
    /// `drivers.power` must be `redfish`; the address `https` (unless
    /// `bare_metal.allow_insecure_http`). Nothing is written when anything is refused.
    #[allow(clippy::too_many_arguments)]
    pub async fn enroll_bare_metal_node(
        &self,
        principal: &Principal,
        hostname: &str,
        site_id: &SiteId,
        pool_id: &PoolId,
        identifiers: &[(String, String)],
        bmc: NewBmc,
    ) -> ApiResult<BareMetalNode> {
        principal.require(Role::Admin)?;
        let address = bmc::parse_address(&bmc.address, self.bare_metal.config.allow_insecure_http)
            .map_err(|why| field("input.bmc.address", &why))?;
        if let Some(id) = &bmc.system_id {
            bmc::validate_system_id(id).map_err(|why| field("input.bmc.systemId", &why))?;
        }
        let tls_verification = match (bmc.verify_tls, &bmc.ca_pem) {
            (true, None) => BmcTlsVerification::Verify,
            (true, Some(pem)) => {
                bmc::roots_from_pem(pem).map_err(|why| field("input.bmc.caCertificate", &why))?;
                BmcTlsVerification::CustomCa
            }
            (false, None) => BmcTlsVerification::Off,
            (false, Some(_)) => {
                return Err(field(
                    "input.bmc.caCertificate",
                    "is only used with verifyTls: true",
                ));
            }
        };
        let txn = self.store.write().await?;
        let record = self
            .enroll_in(
                &txn,
                principal,
                hostname,
                site_id,
                Some(pool_id),
                identifiers,
                "enrollBareMetalNode",
            )
            .await?;
        match power_driver_of(&record)? {
            PowerDriverKind::Redfish => {}
            other => {
                return Err(ApiError::BadUserInput(format!(
                    "pool `{pool_id}` has the power driver `{other}`; a machine enrolled by its BMC goes to a pool whose drivers say power = redfish"
                )));
            }
        }
        let now = self.clock.now();
        let stored = StoredBmc {
            node_id: record.id.clone(),
            address: address.to_string(),
            system_id: bmc.system_id,
            tls_verification,
            ca_pem: bmc.ca_pem,
            credential_key_id: self.bare_metal.key.id().to_owned(),
            sealed_credentials: bmc
                .credentials
                .seal(&self.bare_metal.key, record.id.as_str())?,
            system_path: None,
            reachable: None,
            last_error: None,
            consecutive_failures: 0,
            last_polled_at: None,
            next_poll_at: now,
            created_at: now,
        };
        store::insert(&*txn, &stored).await?;
        txn.commit().await?;
        tracing::info!(node = %record.id, address = %stored.address, "enrolled a bare-metal node by its BMC");
        let node = self
            .detail_of(self.store.db(), vec![record.clone()])
            .await?
            .pop()
            .ok_or_else(|| not_found(&record.id))?;
        Ok(view(node, &record, Some(&stored), Vec::new()))
    }

    /// `bareMetalNode(id)`: operators only (the BMC's address is infrastructure detail
    /// viewers and tenants' viewers need not see); `NOT_FOUND` for nodes the principal may
    /// not see.
    pub async fn bare_metal_node(
        &self,
        principal: &Principal,
        id: &NodeId,
    ) -> ApiResult<BareMetalNode> {
        principal.require(Role::Operator)?;
        let read = self.store.read().await?;
        let record = nodes::load(&read, id)
            .await?
            .filter(|n| n.deleted_at.is_none() && principal.can_see(n.owner_tenant_id.as_ref()))
            .ok_or_else(|| not_found(id))?;
        let stored = store::load(&read, id).await?;
        let workflows = self.workflows_of(&read, id).await?;
        let node = self
            .detail_of(&read, vec![record.clone()])
            .await?
            .pop()
            .ok_or_else(|| not_found(id))?;
        Ok(view(node, &record, stored.as_ref(), workflows))
    }

    /// `powerNode`: asks the node's BMC to power it on, off or cycle it. The node must still
    /// be at `version`; turning off (or cycling) a node that holds active allocations needs
    /// `force`, which needs an admin. The BMC is asked outside any transaction (it may take
    /// seconds); on success a `node.power_action` event is written and the BMC is polled on
    /// the Power controller's next tick, which writes the `power` axis. A BMC that fails
    /// answers a `BMC_ERROR` naming why, and nothing is written.
    pub async fn power_node(
        &self,
        principal: &Principal,
        id: &NodeId,
        version: i64,
        action: PowerAction,
        force: bool,
    ) -> ApiResult<BareMetalNode> {
        principal.require(Role::Operator)?;
        let (record, stored, system_uuid, allocations) = {
            let read = self.store.read().await?;
            let record = nodes::load(&read, id)
                .await?
                .filter(|n| n.deleted_at.is_none() && principal.can_see(n.owner_tenant_id.as_ref()))
                .ok_or_else(|| not_found(id))?;
            let stored = store::load(&read, id).await?;
            let uuid = store::system_uuid(&read, id).await?;
            let allocations = placement::active_on_nodes(&read, std::slice::from_ref(id))
                .await?
                .len();
            (record, stored, uuid, allocations)
        };
        record.expect_version(version)?;
        if action.interrupts_work() && allocations > 0 {
            if !force {
                return Err(ApiError::BadUserInput(format!(
                    "node `{id}` holds {allocations} active allocation(s); powering it {} loses their work: drain it first, or have an admin force it",
                    if action == PowerAction::Off {
                        "off"
                    } else {
                        "through a cycle"
                    }
                )));
            }
            principal.require(Role::Admin).map_err(|_| {
                ApiError::Forbidden(
                    "forcing a power action on a node with work needs the admin role".into(),
                )
            })?;
        }
        let driver = self.power_driver(&record, stored.as_ref(), system_uuid)?;
        driver.power(action).await.inspect_err(|err| {
            tracing::info!(node = %id, %action, reason = err.reason(), error = %err, "a power action failed at the BMC");
        })?;
        let now = self.clock.now();
        let txn = self.store.write().await?;
        // Lock order: the node row first, then its BMC row; the event at commit.
        if !nodes::lock_existing(&*txn, id).await? {
            return Err(not_found(id));
        }
        store::poll_at(&*txn, id, now).await?;
        events::append_node_action(
            &txn,
            &record,
            EventType::NodePowerAction,
            &principal.actor(),
            Some("powerNode"),
            serde_json::json!({ "action": action, "force": force, "version": record.version }),
            now,
        );
        txn.commit().await?;
        tracing::info!(node = %id, %action, actor = %principal.actor(), "the BMC accepted a power action");
        self.bare_metal_node(principal, id).await
    }

    /// The driver for a node, with its credentials opened.
    pub(super) fn power_driver(
        &self,
        record: &NodeRecord,
        stored: Option<&StoredBmc>,
        system_uuid: Option<String>,
    ) -> ApiResult<Box<dyn PowerDriver>> {
        let kind = power_driver_of(record)?;
        let endpoint = stored
            .map(|s| self.endpoint_of(s, system_uuid))
            .transpose()?;
        Ok(bmc::driver(kind, endpoint, self.bare_metal.settings())?)
    }

    /// What a driver needs of a stored BMC: the credentials opened with the credential key.
    pub fn endpoint_of(
        &self,
        stored: &StoredBmc,
        system_uuid: Option<String>,
    ) -> ApiResult<BmcEndpoint> {
        let key = &self.bare_metal.key;
        if stored.credential_key_id != key.id() {
            return Err(ApiError::internal(anyhow::anyhow!(
                "the BMC credentials of node {} were sealed with another key ({}, this server has {}): set bare_metal.credential_key_file to that key, or enrol the machine again",
                stored.node_id,
                stored.credential_key_id,
                key.id()
            )));
        }
        let credentials =
            BmcCredentials::open(key, stored.node_id.as_str(), &stored.sealed_credentials)?;
        let address = reqwest::Url::parse(&stored.address).map_err(|e| {
            ApiError::internal(anyhow::anyhow!(
                "corrupt row: node_bmcs.address of {}: {e}",
                stored.node_id
            ))
        })?;
        let tls = match stored.tls_verification {
            BmcTlsVerification::Verify => BmcTls::Verify,
            BmcTlsVerification::Off => BmcTls::Off,
            BmcTlsVerification::CustomCa => {
                BmcTls::CustomCa(stored.ca_pem.clone().ok_or_else(|| {
                    ApiError::internal(anyhow::anyhow!(
                        "corrupt row: node_bmcs.ca_pem of {} is missing",
                        stored.node_id
                    ))
                })?)
            }
        };
        Ok(BmcEndpoint {
            address,
            system_id: stored.system_id.clone(),
            system_uuid,
            system_path: stored.system_path.clone(),
            tls,
            credentials,
        })
    }

    /// The Power controller's work list: BMCs due for a poll now, at most `limit`.
    pub async fn bmcs_due(&self, limit: u64) -> ApiResult<Vec<DueBmc>> {
        Ok(store::due(self.store.db(), self.clock.now(), limit).await?)
    }

    /// The driver the Power controller polls `due` through.
    pub fn poll_driver(&self, due: &DueBmc) -> ApiResult<Arc<dyn PowerDriver>> {
        let kind = bc_core::bare_metal::power_driver_of_drivers(&due.drivers)?;
        let endpoint = self.endpoint_of(&due.bmc, due.system_uuid.clone())?;
        Ok(Arc::from(bmc::driver(
            kind,
            Some(endpoint),
            self.bare_metal.settings(),
        )?))
    }

    /// Writes what a pass of polls found, in one transaction: each node whose `power` or
    /// `BmcUnreachable` must change (by what the work list read; a node changed since is
    /// set right by the transition, which re-reads it under its lock) goes through
    /// [`Services::change_node_in`] (node rows in id order, as the lock order says), then every
    /// BMC's bookkeeping (answered or not,
    /// failures in a row, the next poll: an interval away, jittered). A node that changed
    /// or vanished meanwhile is simply polled again.
    pub async fn record_power_polls(&self, mut polls: Vec<PowerPoll>) -> ApiResult<PollReport> {
        if polls.is_empty() {
            return Ok(PollReport::default());
        }
        polls.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        let config = &self.bare_metal.config;
        let threshold = i64::from(config.unreachable_after_failures);
        let actor = Actor::Controller(POWER_ACTOR.into());
        let now = self.clock.now();
        let everyone = |_: &NodeRecord| true;
        let mut report = PollReport::default();
        let mut committed = Vec::new();
        let txn = self.store.write().await?;
        let mut records = Vec::with_capacity(polls.len());
        for poll in &polls {
            let failures = match poll.result {
                Ok(_) => 0,
                Err(_) => poll.failures_before + 1,
            };
            let needs_change = match &poll.result {
                Ok(power) => *power != poll.known_power || poll.known_unreachable,
                Err(_) if failures >= threshold => {
                    !poll.known_unreachable || poll.known_power != Power::Unknown
                }
                Err(_) => false,
            };
            if !needs_change {
                records.push(PollRecord {
                    node_id: poll.node_id.clone(),
                    polled_at: now,
                    error: poll.result.as_ref().err().map(ToString::to_string),
                    consecutive_failures: failures,
                    next_poll_at: now + jittered(config),
                    system_path: poll.system_path.clone(),
                });
                continue;
            }
            let result = poll.result.clone();
            let outcome = self
                .change_node_in(
                    &txn,
                    &actor,
                    &poll.node_id,
                    None,
                    &everyone,
                    "power:poll",
                    move |n, by, at| match result {
                        Ok(power) => {
                            let mut changes = n.set_bmc_reachability(None, by, at)?;
                            changes.extend(n.set_power(power));
                            Ok(changes)
                        }
                        Err(err) if failures >= threshold => {
                            n.set_bmc_reachability(Some((err.reason(), &err.to_string())), by, at)
                        }
                        Err(_) => Ok(Vec::new()),
                    },
                )
                .await;
            match outcome {
                Ok((after, changes)) => {
                    for change in &changes {
                        match (change.event_type, change.to.as_deref()) {
                            (EventType::NodePowerChanged, _) => report.power_changed += 1,
                            (EventType::NodeConditionChanged, Some(to))
                                if to == format!("{BMC_UNREACHABLE}={}", ConditionStatus::True) =>
                            {
                                report.became_unreachable += 1;
                            }
                            (EventType::NodeConditionChanged, Some(to))
                                if to
                                    == format!("{BMC_UNREACHABLE}={}", ConditionStatus::False) =>
                            {
                                report.became_reachable += 1;
                            }
                            _ => {}
                        }
                    }
                    if !changes.is_empty() {
                        committed.push((after, changes));
                    }
                }
                // Deleted since the work list was read: its row goes with it.
                Err(ApiError::NotFound(_)) => continue,
                Err(err) => return Err(err),
            }
            records.push(PollRecord {
                node_id: poll.node_id.clone(),
                polled_at: now,
                error: poll.result.as_ref().err().map(ToString::to_string),
                consecutive_failures: failures,
                next_poll_at: now + jittered(config),
                system_path: poll.system_path.clone(),
            });
        }
        store::record_polls(&*txn, &records).await?;
        txn.commit().await?;
        for (after, changes) in &committed {
            self.after_node_commit(after, changes);
        }
        Ok(report)
    }
}

/// The poll interval moved by up to the jitter either way.
fn jittered(config: &BareMetalConfig) -> chrono::Duration {
    use rand::Rng;
    let jitter = i64::try_from(config.poll_jitter_secs).unwrap_or(0);
    let offset = if jitter > 0 {
        rand::rng().random_range(-jitter * 1000..=jitter * 1000)
    } else {
        0
    };
    config.poll_interval() + chrono::Duration::milliseconds(offset)
}

/// `BAD_USER_INPUT` about one field of `enrollBareMetalNode`'s input, named as the client
/// wrote it, like the input limits' refusals: "`input.bmc.address` is plain http, …".
fn field(path: &str, why: &str) -> ApiError {
    ApiError::InvalidField {
        field: path.to_owned(),
        message: format!("`{path}` {why}"),
    }
}

fn view(
    node: NodeDetail,
    record: &NodeRecord,
    stored: Option<&StoredBmc>,
    workflows: Vec<bc_core::workflow::Workflow>,
) -> BareMetalNode {
    BareMetalNode {
        workflows,
        node,
        power: record.power,
        power_driver: power_driver_of(record).unwrap_or(PowerDriverKind::None),
        bmc: stored.map(|s| BmcStatus {
            address: s.address.clone(),
            system_id: s.system_id.clone(),
            system_path: s.system_path.clone(),
            tls_verification: s.tls_verification,
            reachable: s.reachable,
            last_error: s.last_error.clone(),
            consecutive_failures: s.consecutive_failures,
            last_polled_at: s.last_polled_at,
            next_poll_at: s.next_poll_at,
            unreachable_condition: record
                .conditions
                .iter()
                .any(|c| c.kind == BMC_UNREACHABLE && c.status == ConditionStatus::True),
        }),
    }
}
