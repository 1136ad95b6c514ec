//! [`FakeDaemon`]: the daemon side of `bcd/v1` (PROTOCOL.md), for real.
//!
//! It generates its own ECDSA P-256 key, joins over HTTPS with a join token and a CSR, keeps
//! and renews its node certificate, and holds a WebSocket session over TLS with that
//! certificate as the client certificate: `hello`, the inventory sections the gateway wants,
//! heartbeats, and reconnection with exponential backoff and jitter when the session drops.
//! Everything it reports about its machine is simulated ([`crate::inventory`]); the knobs
//! ([`DaemonKnobs`]) make it a sick or misbehaving machine.
//!
//! A daemon resolves whom to trust once ([`GatewayContext::resolve`], from a CA PEM, a
//! SHA-256 pin of the CA or trust on first use); a fleet shares one context, and so one CA
//! fetch, one join HTTP client and one limit on concurrent handshakes.
//!
//! The parts: `identity` (the key, the CSR and the node certificate: joining and renewing),
//! `tls` (whom to trust, the TLS client configurations, connecting), `session` (one session:
//! open it, report, then a loop that hands each frame and timer to a small handler),
//! `commands` (what the simulated machine does with a command, and the result it reports) and
//! `reconnect` (the daemon's life: join, hold a session, back off, again).

mod commands;
mod identity;
mod reconnect;
mod session;
mod tls;

pub use identity::key_and_csr;
pub use reconnect::{Backoff, RECONNECT_BACKOFF_BASE, RECONNECT_BACKOFF_MAX, RECONNECT_JITTER};
pub use tls::{CaTrust, GatewayContext, normalize_fingerprint};

use crate::inventory::Machine;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite;

/// The daemon version sent in `hello`.
pub const DAEMON_VERSION: &str = concat!("fake-", env!("CARGO_PKG_VERSION"));

/// Why a daemon stopped or an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("the gateway URL {url:?} is not usable: {reason}")]
    BadGatewayUrl { url: String, reason: String },
    #[error("the control plane CA is not usable: {0}")]
    Ca(String),
    #[error("the control plane CA's SHA-256 fingerprint is {actual}, not the pinned {expected}")]
    CaFingerprintMismatch { expected: String, actual: String },
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("TLS verifier: {0}")]
    Verifier(#[from] rustls::client::VerifierBuilderError),
    #[error("PEM: {0}")]
    Pem(#[from] rustls_pki_types::pem::Error),
    #[error("key or CSR: {0}")]
    Key(#[from] rcgen::Error),
    #[error("HTTP: {0}")]
    Http(#[from] reqwest::Error),
    #[error("the gateway refused the {operation} ({status} {code}): {message}")]
    Refused {
        operation: &'static str,
        status: u16,
        code: String,
        message: String,
    },
    #[error("the gateway answered the {operation} with something unexpected: {message}")]
    BadAnswer {
        operation: &'static str,
        message: String,
    },
    #[error("WebSocket: {0}")]
    WebSocket(#[from] tungstenite::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0} timed out")]
    Timeout(&'static str),
    #[error("the session broke the protocol: {0}")]
    Protocol(String),
    #[error("the node's identity was revoked: {0}")]
    IdentityRevoked(String),
    #[error("this daemon is already running")]
    AlreadyRunning,
}

impl DaemonError {
    /// Errors that retrying cannot fix: a refused token or CSR, an untrusted CA, a bad URL.
    /// Timeouts, connection failures, 5xx answers and a busy gateway (429) are worth another try.
    pub fn is_permanent(&self) -> bool {
        match self {
            DaemonError::Refused { status, .. } => {
                (400..500).contains(status) && *status != 408 && *status != 429
            }
            _ => self.is_configuration_or_identity(),
        }
    }

    /// A failure of the daemon's own configuration or identity (its gateway URL, CA, keys,
    /// a revoked identity, a second daemon on one state directory): no retry mends it.
    /// Every variant is named, so that a new one must be placed.
    fn is_configuration_or_identity(&self) -> bool {
        match self {
            DaemonError::BadGatewayUrl { .. }
            | DaemonError::Ca(_)
            | DaemonError::CaFingerprintMismatch { .. }
            | DaemonError::Pem(_)
            | DaemonError::Key(_)
            | DaemonError::Verifier(_)
            | DaemonError::IdentityRevoked(_)
            | DaemonError::AlreadyRunning => true,
            DaemonError::Tls(_)
            | DaemonError::Http(_)
            | DaemonError::Refused { .. }
            | DaemonError::BadAnswer { .. }
            | DaemonError::WebSocket(_)
            | DaemonError::Io(_)
            | DaemonError::Timeout(_)
            | DaemonError::Protocol(_) => false,
        }
    }

    /// What kind of failure this is, for a fleet's count of errors by kind.
    pub fn kind(&self) -> DaemonErrorKind {
        match self {
            DaemonError::Timeout(_) => DaemonErrorKind::Timeout,
            DaemonError::Refused { .. } | DaemonError::WebSocket(tungstenite::Error::Http(_)) => {
                DaemonErrorKind::Refused
            }
            DaemonError::Protocol(_) | DaemonError::BadAnswer { .. } => DaemonErrorKind::Protocol,
            DaemonError::Tls(_) => DaemonErrorKind::Tls,
            DaemonError::Io(err) | DaemonError::WebSocket(tungstenite::Error::Io(err)) => {
                kind_of_io(err)
            }
            DaemonError::WebSocket(
                tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed,
            ) => DaemonErrorKind::Transport,
            DaemonError::WebSocket(_) => DaemonErrorKind::Protocol,
            DaemonError::Http(err) => kind_of_http(err),
            other => {
                debug_assert!(other.is_configuration_or_identity());
                DaemonErrorKind::Other
            }
        }
    }
}

/// An I/O error's kind: nothing listening, a timeout, a TLS handshake that failed (tokio-rustls
/// reports those as I/O errors), or another failure of the connection.
fn kind_of_io(err: &std::io::Error) -> DaemonErrorKind {
    match err.kind() {
        std::io::ErrorKind::ConnectionRefused => DaemonErrorKind::Unreachable,
        std::io::ErrorKind::TimedOut => DaemonErrorKind::Timeout,
        _ if err
            .get_ref()
            .is_some_and(|inner| inner.is::<rustls::Error>()) =>
        {
            DaemonErrorKind::Tls
        }
        _ => DaemonErrorKind::Transport,
    }
}

/// A join's or renewal's HTTP error's kind, from what reqwest wraps.
fn kind_of_http(err: &reqwest::Error) -> DaemonErrorKind {
    if err.is_timeout() {
        return DaemonErrorKind::Timeout;
    }
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if cause.is::<rustls::Error>() {
            return DaemonErrorKind::Tls;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return kind_of_io(io);
        }
        source = cause.source();
    }
    DaemonErrorKind::Transport
}

/// The kinds of [`DaemonError`] a fleet counts apart: during a failover they tell the
/// killed gateway (`unreachable`: nothing listens) from a full one (`transport`: it closes a
/// connection it cannot hold at once) and from one too slow to open a session (`timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaemonErrorKind {
    /// Nothing listens at the gateway's address (the connection was refused).
    Unreachable,
    /// The connection was reset or closed, or failed another way.
    Transport,
    /// The TLS handshake failed.
    Tls,
    /// A session did not open within the daemon's wait, or a request timed out.
    Timeout,
    /// The gateway answered with an HTTP error status (a 5xx, a 429 when busy, or a 4xx that
    /// refused the request).
    Refused,
    /// The gateway's answer was not what `bcd/v1` says.
    Protocol,
    /// Anything else (a bad URL or CA, a key that could not be made, …).
    Other,
}

/// Errors counted by [`DaemonErrorKind`]. Sent between processes as JSON (a simulator
/// process's progress line), so each kind is a named field, absent meaning none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ErrorCounts {
    pub unreachable: u64,
    pub transport: u64,
    pub tls: u64,
    pub timeout: u64,
    pub refused: u64,
    pub protocol: u64,
    pub other: u64,
}

impl ErrorCounts {
    /// Counts one error of `kind`.
    pub fn count(&mut self, kind: DaemonErrorKind) {
        let counter = match kind {
            DaemonErrorKind::Unreachable => &mut self.unreachable,
            DaemonErrorKind::Transport => &mut self.transport,
            DaemonErrorKind::Tls => &mut self.tls,
            DaemonErrorKind::Timeout => &mut self.timeout,
            DaemonErrorKind::Refused => &mut self.refused,
            DaemonErrorKind::Protocol => &mut self.protocol,
            DaemonErrorKind::Other => &mut self.other,
        };
        *counter += 1;
    }

    /// Every count with its kind's spelling in reports (its field's name).
    fn each(&self) -> [(&'static str, u64); 7] {
        [
            ("unreachable", self.unreachable),
            ("transport", self.transport),
            ("tls", self.tls),
            ("timeout", self.timeout),
            ("refused", self.refused),
            ("protocol", self.protocol),
            ("other", self.other),
        ]
    }

    /// `self` and `other` combined by `op`, kind by kind.
    fn zip(&self, other: &ErrorCounts, op: impl Fn(u64, u64) -> u64) -> ErrorCounts {
        ErrorCounts {
            unreachable: op(self.unreachable, other.unreachable),
            transport: op(self.transport, other.transport),
            tls: op(self.tls, other.tls),
            timeout: op(self.timeout, other.timeout),
            refused: op(self.refused, other.refused),
            protocol: op(self.protocol, other.protocol),
            other: op(self.other, other.other),
        }
    }

    /// The errors counted since `earlier` (counts only grow).
    pub fn since(&self, earlier: &ErrorCounts) -> ErrorCounts {
        self.zip(earlier, u64::saturating_sub)
    }
}

impl std::ops::Add for ErrorCounts {
    type Output = ErrorCounts;
    fn add(self, other: ErrorCounts) -> ErrorCounts {
        self.zip(&other, |a, b| a + b)
    }
}

/// The kinds that were counted, as `unreachable 3, timeout 12` (or `none`).
impl std::fmt::Display for ErrorCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let counted: Vec<String> = self
            .each()
            .into_iter()
            .filter(|(_, count)| *count > 0)
            .map(|(kind, count)| format!("{kind} {count}"))
            .collect();
        if counted.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&counted.join(", "))
        }
    }
}

/// What a simulated machine looks like and how its daemon misbehaves.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonKnobs {
    /// The machine's seed: its identifiers, GPU UUIDs and default hostname derive from it.
    /// None: random (a new machine). Two daemons with one seed are one machine.
    pub seed: Option<u64>,
    /// None: derived from the seed.
    pub hostname: Option<String>,
    /// The identifiers sent with the join (`system-uuid`, `board-serial`, `mac`). None: derived
    /// from the seed. Set them to simulate the same machine joining again.
    pub identifiers: Option<BTreeMap<String, String>>,
    /// GPUs on the machine; 0 is a machine without GPUs (no NVIDIA driver either: its `gpus`
    /// section is empty and `diag.nvml` fails, as DCGM does without a GPU).
    pub gpu_count: u32,
    pub gpu_model: String,
    pub gpu_memory_mib: u64,
    /// The NVIDIA driver version the machine runs (`gpus.driverVersion`, `drivers.nvidia`).
    pub driver_version: String,
    /// The GPU diagnostic reports a failing GPU.
    pub fail_diagnostics: bool,
    /// XID errors the GPUs report (the n-th on GPU n mod gpu_count): the machine's simulated
    /// faults. While one of the hardware XIDs (`bc_core::health`'s reset, reboot and person
    /// lists) is present, `diag.nvml` fails, as DCGM's would on that GPU.
    pub xid_errors: Vec<u32>,
    /// The XIDs appear this long after the daemon starts (a GPU that fails in service, after
    /// acceptance) instead of from the start. When they appear the daemon reconnects, so that
    /// `hello` announces the changed `gpus` section (bcd/v1 sends sections only when asked).
    pub xid_after: Option<Duration>,
    /// `gpu.reset` clears the faults a reset recovers from (`bc_core::health::RESET_XIDS`).
    /// Off: the reset "succeeds" and the fault stays (a remediation that fails).
    pub reset_clears_faults: bool,
    /// `node.reboot` clears the faults a reset or a reboot recovers from. Off: the machine
    /// comes back as broken as it went down.
    pub reboot_clears_faults: bool,
    /// Drop the session and reconnect this long after each session starts.
    pub flapping: Option<Duration>,
    /// Added to every heartbeat interval: slow heartbeats.
    pub heartbeat_delay: Duration,
    /// Send no heartbeats at all (the session stays open): lost heartbeats.
    pub skip_heartbeats: bool,
    /// Heartbeat at this interval instead of the gateway's `heartbeatIntervalSecs`.
    pub heartbeat_interval_override: Option<Duration>,
    /// Renew this long after each join or renewal instead of at `renewAfter`.
    pub renew_interval_override: Option<Duration>,
    /// When the identity is revoked, join again with the join token instead of stopping.
    pub rejoin_when_revoked: bool,
    pub daemon_version: String,
}

impl Default for DaemonKnobs {
    fn default() -> Self {
        DaemonKnobs {
            seed: None,
            hostname: None,
            identifiers: None,
            gpu_count: 8,
            gpu_model: "NVIDIA H100 80GB HBM3".to_owned(),
            gpu_memory_mib: 81_559,
            driver_version: crate::inventory::NVIDIA_DRIVER.to_owned(),
            fail_diagnostics: false,
            xid_errors: Vec::new(),
            xid_after: None,
            reset_clears_faults: true,
            reboot_clears_faults: true,
            flapping: None,
            heartbeat_delay: Duration::ZERO,
            skip_heartbeats: false,
            heartbeat_interval_override: None,
            renew_interval_override: None,
            rejoin_when_revoked: false,
            daemon_version: DAEMON_VERSION.to_owned(),
        }
    }
}

/// Where a daemon is in its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Phase {
    #[default]
    Idle,
    Joining,
    Connecting,
    Connected,
    /// Waiting before the next try.
    Backoff,
    /// Stopped by [`FakeDaemon::stop`] or told not to reconnect.
    Stopped,
    /// Gave up on an error retrying cannot fix (see `last_error`).
    Failed,
}

/// One daemon's state, for tests and progress reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonStatus {
    pub hostname: String,
    pub phase: Phase,
    pub node_id: Option<String>,
    pub identity_generation: Option<i64>,
    pub certificate_expires_at: Option<DateTime<Utc>>,
    pub joins: u64,
    pub renewals: u64,
    pub connected: bool,
    /// The epoch of the current (or last) session.
    pub epoch: Option<i64>,
    pub gateway_id: Option<String>,
    pub sessions: u64,
    pub heartbeats_sent: u64,
    pub inventory_sections_sent: u64,
    /// Commands the gateway sent, and those the simulated machine finished.
    pub commands_received: u64,
    pub commands_finished: u64,
    /// `disk.wipe`s the simulated machine carried out.
    pub disk_wipes: u64,
    /// The spec generation the daemon converged (it converges at once).
    pub observed_generation: i64,
    /// Why the last session ended: the gateway's goodbye or close reason, or the error.
    pub last_close_reason: Option<String>,
    pub errors: u64,
    pub last_error: Option<String>,
}

/// Counters shared by every daemon of a fleet (each daemon alone has its own), so progress is
/// read in constant time however many daemons there are.
#[derive(Debug, Default)]
pub struct FleetCounters {
    /// Daemons that joined at least once.
    pub joined: AtomicU64,
    /// Daemons whose session is up now.
    pub connected: AtomicU64,
    /// Daemons that gave up.
    pub failed: AtomicU64,
    /// Daemons that stopped.
    pub stopped: AtomicU64,
    pub errors: AtomicU64,
    /// `errors` by kind (rare enough for a lock).
    pub errors_by_kind: std::sync::Mutex<ErrorCounts>,
    pub sessions: AtomicU64,
    pub heartbeats_sent: AtomicU64,
    pub renewals: AtomicU64,
}

struct Shared {
    source: Source,
    join_secret: String,
    knobs: DaemonKnobs,
    machine: Machine,
    status: watch::Sender<DaemonStatus>,
    stop: watch::Sender<bool>,
    running: AtomicBool,
    counters: Arc<FleetCounters>,
    /// The XIDs the machine reports now: the knobs' (from the start, or once `xid_after`
    /// passed, or injected), less what a reset or reboot cleared. A change makes the live
    /// session reconnect to report it.
    faults: watch::Sender<Vec<u32>>,
    /// Whether the knobs' XIDs appeared yet (they appear once).
    faults_appeared: AtomicBool,
    /// When the daemon first ran (`xid_after` counts from it).
    started: std::sync::OnceLock<tokio::time::Instant>,
    /// The gateway of its context it uses now (wrapping around the context's list).
    gateway: AtomicUsize,
}

enum Source {
    Resolved(Arc<GatewayContext>),
    Unresolved { gateway_url: String, ca: CaTrust },
}

/// A simulated node's daemon. Cheap to clone: clones share the daemon.
#[derive(Clone)]
pub struct FakeDaemon {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FakeDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeDaemon")
            .field("hostname", &self.shared.machine.hostname)
            .finish()
    }
}

impl FakeDaemon {
    /// A daemon for the gateway at `gateway_url` (`https://host:port`) that joins with
    /// `join_secret` (`<jt_id>.<secret>`), with default knobs. Nothing happens until
    /// [`FakeDaemon::start`] or [`FakeDaemon::run`].
    pub fn new(
        gateway_url: impl Into<String>,
        join_secret: impl Into<String>,
        ca: CaTrust,
    ) -> FakeDaemon {
        FakeDaemon::build(
            Source::Unresolved {
                gateway_url: gateway_url.into(),
                ca,
            },
            join_secret.into(),
            DaemonKnobs::default(),
            None,
        )
    }

    /// A daemon sharing a resolved context (and its counters) with others: what a fleet uses.
    pub fn with_context(
        context: Arc<GatewayContext>,
        join_secret: impl Into<String>,
        knobs: DaemonKnobs,
        counters: Arc<FleetCounters>,
    ) -> FakeDaemon {
        FakeDaemon::build(
            Source::Resolved(context),
            join_secret.into(),
            knobs,
            Some(counters),
        )
    }

    /// The same daemon with other knobs (before it starts).
    pub fn with_knobs(self, knobs: DaemonKnobs) -> FakeDaemon {
        let gateway = self.gateway();
        let (source, join_secret, counters) = match Arc::try_unwrap(self.shared) {
            Ok(shared) => (shared.source, shared.join_secret, shared.counters),
            Err(shared) => (
                match &shared.source {
                    Source::Resolved(context) => Source::Resolved(context.clone()),
                    Source::Unresolved { gateway_url, ca } => Source::Unresolved {
                        gateway_url: gateway_url.clone(),
                        ca: ca.clone(),
                    },
                },
                shared.join_secret.clone(),
                shared.counters.clone(),
            ),
        };
        FakeDaemon::build(source, join_secret, knobs, Some(counters)).starting_at_gateway(gateway)
    }

    fn build(
        source: Source,
        join_secret: String,
        mut knobs: DaemonKnobs,
        counters: Option<Arc<FleetCounters>>,
    ) -> FakeDaemon {
        let seed = *knobs.seed.get_or_insert_with(rand::random);
        let machine = Machine::new(seed, knobs.hostname.clone(), knobs.identifiers.clone());
        let status = DaemonStatus {
            hostname: machine.hostname.clone(),
            ..DaemonStatus::default()
        };
        let from_start = knobs.xid_after.is_none();
        let faults = if from_start {
            knobs.xid_errors.clone()
        } else {
            Vec::new()
        };
        FakeDaemon {
            shared: Arc::new(Shared {
                source,
                join_secret,
                knobs,
                machine,
                status: watch::Sender::new(status),
                stop: watch::Sender::new(false),
                running: AtomicBool::new(false),
                counters: counters.unwrap_or_default(),
                faults: watch::Sender::new(faults),
                faults_appeared: AtomicBool::new(from_start),
                started: std::sync::OnceLock::new(),
                gateway: AtomicUsize::new(0),
            }),
        }
    }

    /// Starts with gateway `index` of its context (wrapping around): a fleet spreads its
    /// daemons over the control plane's replicas so.
    pub fn starting_at_gateway(self, index: usize) -> FakeDaemon {
        self.shared.gateway.store(index, Ordering::Relaxed);
        self
    }

    /// The gateway of its context the daemon uses now.
    pub(crate) fn gateway(&self) -> usize {
        self.shared.gateway.load(Ordering::Relaxed)
    }

    /// Moves on to another of the context's `gateways` (the same one when there is only
    /// one), chosen at random so a dead replica's daemons spread over the others: what a
    /// daemon does when it cannot join or hold a session where it is, as a daemon given
    /// several replicas' addresses would.
    pub(crate) fn next_gateway(&self, gateways: usize) {
        if gateways > 1 {
            let step = rand::random_range(1..gateways);
            self.shared.gateway.fetch_add(step, Ordering::Relaxed);
        }
    }

    pub fn knobs(&self) -> &DaemonKnobs {
        &self.shared.knobs
    }

    pub fn machine(&self) -> &Machine {
        &self.shared.machine
    }

    pub fn hostname(&self) -> &str {
        &self.shared.machine.hostname
    }

    /// The simulated inventory, by section, with the faults the machine has now.
    pub fn inventory(&self) -> BTreeMap<String, Value> {
        let mut knobs = self.shared.knobs.clone();
        knobs.xid_errors = self.faults();
        self.shared.machine.inventory(&knobs)
    }

    /// The XIDs the machine reports now.
    pub fn faults(&self) -> Vec<u32> {
        self.shared.faults.borrow().clone()
    }

    /// A GPU fails now: the machine reports these XIDs (on top of what it has), and the
    /// daemon reconnects to report them.
    pub fn inject_xids(&self, xids: &[u32]) {
        self.shared.faults_appeared.store(true, Ordering::SeqCst);
        self.shared.faults.send_modify(|faults| faults.extend(xids));
    }

    /// The knobs' XIDs appear, if they have not yet (`xid_after`).
    pub(crate) fn faults_appear(&self) {
        if !self.shared.faults_appeared.swap(true, Ordering::SeqCst) {
            let xids = self.shared.knobs.xid_errors.clone();
            self.shared.faults.send_modify(|faults| faults.extend(xids));
        }
    }

    /// When the knobs' XIDs are due to appear (None: they have, or never will).
    pub(crate) fn faults_due(&self) -> Option<tokio::time::Instant> {
        if self.shared.faults_appeared.load(Ordering::SeqCst) {
            return None;
        }
        let after = self.shared.knobs.xid_after?;
        Some(*self.shared.started.get_or_init(tokio::time::Instant::now) + after)
    }

    /// What a `gpu.reset` (`reboot: false`) or `node.reboot` does to the faults, as the knobs
    /// say; returns whether any cleared.
    pub(crate) fn remedy(&self, reboot: bool) -> bool {
        use bc_core::health::{REBOOT_XIDS, RESET_XIDS};
        let knobs = &self.shared.knobs;
        let works = if reboot {
            knobs.reboot_clears_faults
        } else {
            knobs.reset_clears_faults
        };
        if !works {
            return false;
        }
        let mut cleared = false;
        self.shared.faults.send_if_modified(|faults| {
            let before = faults.len();
            faults.retain(|x| !(RESET_XIDS.contains(x) || (reboot && REBOOT_XIDS.contains(x))));
            cleared = faults.len() != before;
            cleared
        });
        cleared
    }

    /// Whether a hardware fault (a reset, reboot or person XID) is present: the diagnostic
    /// fails then.
    pub(crate) fn has_hardware_fault(&self) -> bool {
        use bc_core::health::{PERSON_XIDS, REBOOT_XIDS, RESET_XIDS};
        self.shared
            .faults
            .borrow()
            .iter()
            .any(|x| RESET_XIDS.contains(x) || REBOOT_XIDS.contains(x) || PERSON_XIDS.contains(x))
    }

    /// Follows changes of the faults.
    pub(crate) fn watch_faults(&self) -> watch::Receiver<Vec<u32>> {
        self.shared.faults.subscribe()
    }

    /// A snapshot of the daemon's state.
    pub fn status(&self) -> DaemonStatus {
        self.shared.status.borrow().clone()
    }

    /// Reads the state without copying it.
    pub fn with_status<T>(&self, read: impl FnOnce(&DaemonStatus) -> T) -> T {
        read(&self.shared.status.borrow())
    }

    /// Follows the daemon's state.
    pub fn subscribe(&self) -> watch::Receiver<DaemonStatus> {
        self.shared.status.subscribe()
    }

    /// Waits until `predicate` holds for the state, at most `timeout`; returns the state
    /// then, or the last state seen as the error.
    pub async fn wait_for(
        &self,
        predicate: impl FnMut(&DaemonStatus) -> bool,
        timeout: Duration,
    ) -> Result<DaemonStatus, DaemonStatus> {
        let mut status = self.subscribe();
        match tokio::time::timeout(timeout, status.wait_for(predicate)).await {
            Ok(Ok(found)) => Ok(found.clone()),
            _ => Err(self.status()),
        }
    }

    /// Asks the daemon to close its session and stop. It does not start again.
    pub fn stop(&self) {
        self.shared.stop.send_replace(true);
    }

    pub fn is_stopped(&self) -> bool {
        *self.shared.stop.borrow()
    }

    /// Runs the daemon on a new task.
    pub fn start(&self) -> tokio::task::JoinHandle<Result<(), DaemonError>> {
        let daemon = self.clone();
        tokio::spawn(async move { daemon.run().await })
    }

    /// Runs the daemon here until it is stopped (`Ok`) or gives up (the error).
    pub async fn run(&self) -> Result<(), DaemonError> {
        if self.shared.running.swap(true, Ordering::SeqCst) {
            return Err(DaemonError::AlreadyRunning);
        }
        self.shared.started.get_or_init(tokio::time::Instant::now);
        let result = self.run_until_done().await;
        self.shared.running.store(false, Ordering::SeqCst);
        self.set_connected(false);
        match &result {
            Ok(()) => {
                self.shared.counters.stopped.fetch_add(1, Ordering::Relaxed);
                self.update(|s| s.phase = Phase::Stopped);
                tracing::debug!(hostname = %self.hostname(), "daemon stopped");
            }
            Err(err) => {
                self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
                self.record_error(err);
                self.update(|s| s.phase = Phase::Failed);
                tracing::warn!(hostname = %self.hostname(), error = %err, "daemon gave up");
            }
        }
        result
    }

    fn update(&self, change: impl FnOnce(&mut DaemonStatus)) {
        self.shared.status.send_modify(change);
    }

    fn record_error(&self, err: &DaemonError) {
        self.shared.counters.errors.fetch_add(1, Ordering::Relaxed);
        // A panic elsewhere while counting leaves the counts whole (a count is one add), so
        // a poisoned lock is taken as it is rather than losing every later error.
        self.shared
            .counters
            .errors_by_kind
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .count(err.kind());
        let message = err.to_string();
        self.update(|s| {
            s.errors += 1;
            s.last_error = Some(message);
        });
    }

    fn set_connected(&self, connected: bool) {
        let mut changed = false;
        self.update(|s| {
            changed = s.connected != connected;
            s.connected = connected;
        });
        if changed {
            if connected {
                self.shared
                    .counters
                    .connected
                    .fetch_add(1, Ordering::Relaxed);
            } else {
                self.shared
                    .counters
                    .connected
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Runs `work` unless the daemon is stopped first (None).
    async fn unless_stopped<F: Future>(&self, work: F) -> Option<F::Output> {
        let mut stop = self.shared.stop.subscribe();
        tokio::select! {
            biased;
            () = stopped(&mut stop) => None,
            output = work => Some(output),
        }
    }

    /// Sleeps `delay` in the backoff phase; false if stopped meanwhile.
    async fn back_off(&self, delay: Duration) -> bool {
        self.update(|s| s.phase = Phase::Backoff);
        self.unless_stopped(tokio::time::sleep(delay))
            .await
            .is_some()
    }
}

/// Resolves once the daemon is told to stop. (The guard `wait_for` returns must not live
/// across an await, so it is dropped here.)
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_errors_are_not_retried() {
        let refused = |status| DaemonError::Refused {
            operation: "join",
            status,
            code: String::new(),
            message: String::new(),
        };
        assert!(refused(401).is_permanent());
        assert!(refused(409).is_permanent());
        assert!(!refused(429).is_permanent());
        assert!(!refused(503).is_permanent());
        assert!(!DaemonError::Timeout("x").is_permanent());
        assert!(
            DaemonError::CaFingerprintMismatch {
                expected: "a".into(),
                actual: "b".into()
            }
            .is_permanent()
        );
    }

    /// The kinds a failover report tells apart: the killed gateway (nothing listens), a full
    /// one (the connection closed at once), a failed TLS handshake (tokio-rustls reports it
    /// as an I/O error), a wait that ran out, and an HTTP refusal.
    #[test]
    fn errors_are_counted_by_what_went_wrong() {
        use std::io::{Error, ErrorKind};
        let io = |kind| DaemonError::Io(Error::from(kind));
        let cases = [
            (
                io(ErrorKind::ConnectionRefused),
                DaemonErrorKind::Unreachable,
            ),
            (io(ErrorKind::ConnectionReset), DaemonErrorKind::Transport),
            (io(ErrorKind::UnexpectedEof), DaemonErrorKind::Transport),
            (io(ErrorKind::TimedOut), DaemonErrorKind::Timeout),
            (
                DaemonError::Io(Error::new(
                    ErrorKind::InvalidData,
                    rustls::Error::InvalidCertificate(rustls::CertificateError::Expired),
                )),
                DaemonErrorKind::Tls,
            ),
            (
                DaemonError::WebSocket(tungstenite::Error::Io(Error::from(
                    ErrorKind::ConnectionRefused,
                ))),
                DaemonErrorKind::Unreachable,
            ),
            (
                DaemonError::WebSocket(tungstenite::Error::ConnectionClosed),
                DaemonErrorKind::Transport,
            ),
            (
                DaemonError::Timeout("opening the session"),
                DaemonErrorKind::Timeout,
            ),
            (
                DaemonError::Refused {
                    operation: "join",
                    status: 429,
                    code: "BUSY".into(),
                    message: String::new(),
                },
                DaemonErrorKind::Refused,
            ),
            (
                DaemonError::Protocol("expected welcome".into()),
                DaemonErrorKind::Protocol,
            ),
            (DaemonError::AlreadyRunning, DaemonErrorKind::Other),
        ];
        let mut counts = ErrorCounts::default();
        for (error, kind) in cases {
            assert_eq!(error.kind(), kind, "{error}");
            counts.count(error.kind());
        }
        assert_eq!(
            counts.to_string(),
            "unreachable 2, transport 3, tls 1, timeout 2, refused 1, protocol 1, other 1"
        );
        let earlier = ErrorCounts {
            transport: 1,
            ..ErrorCounts::default()
        };
        assert_eq!(
            counts.since(&earlier).to_string(),
            "unreachable 2, transport 2, tls 1, timeout 2, refused 1, protocol 1, other 1"
        );
        assert_eq!(ErrorCounts::default().to_string(), "none");
    }
}
