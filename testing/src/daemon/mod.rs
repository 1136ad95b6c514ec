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

use crate::inventory::{self, Machine};
use bc_core::command::{CommandKind, Outcome};
use bc_core::protocol::{
    self, DaemonMessage, ErrorBody, GatewayMessage, IssuedIdentity, JoinRequest, RenewRequest,
};
use chrono::{DateTime, Utc};
use futures::{SinkExt, StreamExt};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::{
    self, Message, client::IntoClientRequest, http, protocol::CloseFrame,
    protocol::WebSocketConfig, protocol::frame::coding::CloseCode,
};

/// The first reconnect delay: PROTOCOL.md's "1 s doubling to 60 s".
pub const RECONNECT_BACKOFF_BASE: Duration = Duration::from_secs(1);
/// The longest reconnect delay.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(60);
/// The share of each backoff delay that is random: a delay `d` becomes uniform in
/// `(d × (1 − RECONNECT_JITTER), d]`, so a fleet that lost its gateway at once does not come
/// back at once.
pub const RECONNECT_JITTER: f64 = 0.5;
/// A session that lasted this long was healthy: the next reconnect starts the backoff over.
/// Shorter sessions keep escalating it, so a gateway that accepts and then drops a daemon is
/// not hammered once a second.
const HEALTHY_SESSION: Duration = Duration::from_secs(30);
/// How long a join, renewal or CA fetch may take before it counts as failed.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long opening a session may take: TCP, TLS, the WebSocket upgrade and `welcome`.
const SESSION_OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long to wait for the gateway's close frame after the daemon sent its own, or after a
/// `goodbye`, before dropping the connection.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// When a renewal fails for a reason that may pass, the next try comes this much later.
const RENEW_RETRY_DELAY: Duration = Duration::from_secs(30);
/// Up to this share of the time until `renewAfter` is taken off at random, so a fleet that
/// joined together does not renew together.
const RENEW_JITTER: f64 = 0.05;
/// The WebSocket read buffer. tungstenite's default (128 KiB, zero-filled on every read) is
/// sized for throughput; a daemon receives a few small frames and a fleet holds thousands of
/// sessions in one process.
const WS_READ_BUFFER_BYTES: usize = 4096;
/// The WebSocket write buffer: frames are written out as soon as they are sent.
const WS_WRITE_BUFFER_BYTES: usize = 0;

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
            DaemonError::BadGatewayUrl { .. }
            | DaemonError::Ca(_)
            | DaemonError::CaFingerprintMismatch { .. }
            | DaemonError::Pem(_)
            | DaemonError::Key(_)
            | DaemonError::Verifier(_)
            | DaemonError::IdentityRevoked(_)
            | DaemonError::AlreadyRunning => true,
            _ => false,
        }
    }
}

/// How the daemon decides to trust the control plane's CA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaTrust {
    /// The CA certificate (PEM), given out of band.
    Pem(String),
    /// The SHA-256 fingerprint (hex, of the DER) of the CA certificate, as `createJoinToken`
    /// returns it: the CA is fetched from `/v1/ca.pem` without verification and kept only if
    /// it matches (like kubeadm's discovery hash). `sha256:` prefixes and `:` separators are
    /// accepted.
    Sha256Pin(String),
    /// Fetch `/v1/ca.pem` and trust whatever it is (with a warning): development only.
    TrustOnFirstUse,
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
    pub gpu_count: u32,
    pub gpu_model: String,
    pub gpu_memory_mib: u64,
    /// The GPU diagnostic reports a failing GPU.
    pub fail_diagnostics: bool,
    /// XID errors the GPUs report (the n-th on GPU n mod gpu_count).
    pub xid_errors: Vec<u32>,
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
            fail_diagnostics: false,
            xid_errors: Vec::new(),
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
    pub sessions: AtomicU64,
    pub heartbeats_sent: AtomicU64,
    pub renewals: AtomicU64,
}

/// The gateway a daemon talks to and the CA it trusts, resolved once; a fleet shares one.
pub struct GatewayContext {
    base: reqwest::Url,
    /// `host:port`, IPv6 hosts in brackets, as the WebSocket URL carries it.
    authority: String,
    /// The host as TCP connects to it (IPv6 without brackets).
    host: String,
    port: u16,
    server_name: ServerName<'static>,
    trust: Arc<Trust>,
    /// Joins carry no client certificate, so every daemon of a fleet can share one client
    /// (and its kept-alive connections).
    join_client: reqwest::Client,
    /// Bounds concurrent joins and session handshakes (None: no bound).
    handshake_limit: Option<Arc<Semaphore>>,
}

impl std::fmt::Debug for GatewayContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayContext")
            .field("base", &self.base.as_str())
            .field("ca_sha256", &self.trust.sha256)
            .finish()
    }
}

impl GatewayContext {
    /// Parses the gateway URL (`https://host:port`) and settles on the CA to trust, fetching
    /// `/v1/ca.pem` when `ca` is a pin or trust on first use.
    pub async fn resolve(gateway_url: &str, ca: &CaTrust) -> Result<GatewayContext, DaemonError> {
        let bad = |reason: &str| DaemonError::BadGatewayUrl {
            url: gateway_url.to_owned(),
            reason: reason.to_owned(),
        };
        let base = reqwest::Url::parse(gateway_url).map_err(|e| bad(&e.to_string()))?;
        if base.scheme() != "https" {
            return Err(bad("the gateway always speaks TLS: use https://"));
        }
        let port = base.port_or_known_default().ok_or_else(|| bad("no port"))?;
        // `host_str` writes IPv6 addresses in brackets, as an authority needs them and TCP
        // and TLS server names do not.
        let url_host = base.host_str().ok_or_else(|| bad("no host"))?;
        let authority = format!("{url_host}:{port}");
        let host = url_host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let server_name = ServerName::try_from(host.clone()).map_err(|e| bad(&e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let trust = match ca {
            CaTrust::Pem(pem) => Trust::from_pem(pem, provider)?,
            CaTrust::Sha256Pin(pin) => {
                let fetched = fetch_ca_unverified(&base, provider.clone()).await?;
                let trust = Trust::from_pem(&fetched, provider)?;
                let expected = normalize_fingerprint(pin);
                if trust.sha256 != expected {
                    return Err(DaemonError::CaFingerprintMismatch {
                        expected,
                        actual: trust.sha256.clone(),
                    });
                }
                tracing::debug!(ca_sha256 = %trust.sha256, "fetched the control plane CA; it matches the pin");
                trust
            }
            CaTrust::TrustOnFirstUse => {
                let fetched = fetch_ca_unverified(&base, provider.clone()).await?;
                let trust = Trust::from_pem(&fetched, provider)?;
                tracing::warn!(
                    ca_sha256 = %trust.sha256,
                    "trusting the control plane CA on first use, unverified; pin it with its SHA-256 fingerprint outside development"
                );
                trust
            }
        };
        let join_client = trust.http_client(None)?;
        Ok(GatewayContext {
            base,
            authority,
            host,
            port,
            server_name,
            trust: Arc::new(trust),
            join_client,
            handshake_limit: None,
        })
    }

    /// Allows at most `limit` joins and session handshakes at once among the daemons sharing
    /// this context, so ten thousand of them do not stampede the gateway (or their own process).
    pub fn with_handshake_limit(mut self, limit: usize) -> GatewayContext {
        self.handshake_limit = Some(Arc::new(Semaphore::new(limit.max(1))));
        self
    }

    pub fn gateway_url(&self) -> &str {
        self.base.as_str()
    }

    /// The trusted CA certificate (PEM).
    pub fn ca_pem(&self) -> &str {
        &self.trust.pem
    }

    /// The trusted CA's SHA-256 fingerprint (lower-case hex, of the DER).
    pub fn ca_sha256(&self) -> &str {
        &self.trust.sha256
    }

    fn endpoint(&self, path: &str) -> Result<reqwest::Url, DaemonError> {
        self.base
            .join(path)
            .map_err(|e| DaemonError::BadGatewayUrl {
                url: self.base.to_string(),
                reason: e.to_string(),
            })
    }

    async fn handshake_permit(&self) -> Option<OwnedSemaphorePermit> {
        match &self.handshake_limit {
            // The semaphore is never closed, so acquiring only fails if it were.
            Some(limit) => limit.clone().acquire_owned().await.ok(),
            None => None,
        }
    }
}

/// The CA a daemon trusts and what rustls builds from it.
struct Trust {
    pem: String,
    /// SHA-256 (lower-case hex) of the first certificate's DER.
    sha256: String,
    provider: Arc<CryptoProvider>,
    verifier: Arc<WebPkiServerVerifier>,
}

impl Trust {
    fn from_pem(pem: &str, provider: Arc<CryptoProvider>) -> Result<Trust, DaemonError> {
        let certs =
            CertificateDer::pem_slice_iter(pem.as_bytes()).collect::<Result<Vec<_>, _>>()?;
        let first = certs
            .first()
            .ok_or_else(|| DaemonError::Ca("no certificate in the CA PEM".to_owned()))?;
        let sha256 = hex::encode(Sha256::digest(first.as_ref()));
        let mut roots = RootCertStore::empty();
        for cert in certs {
            roots.add(cert)?;
        }
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()?;
        Ok(Trust {
            pem: pem.to_owned(),
            sha256,
            provider,
            verifier,
        })
    }

    /// A TLS client configuration trusting only this CA, presenting `client_auth` if given.
    fn client_config(
        &self,
        client_auth: Option<(&[CertificateDer<'static>], &PrivateKeyDer<'static>)>,
    ) -> Result<ClientConfig, DaemonError> {
        let builder = ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_webpki_verifier(self.verifier.clone());
        let mut config = match client_auth {
            Some((chain, key)) => builder.with_client_auth_cert(chain.to_vec(), key.clone_key())?,
            None => builder.with_no_client_auth(),
        };
        // The WebSocket upgrade is HTTP/1.1, and so are the join and renewal requests.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }

    fn http_client(
        &self,
        client_auth: Option<(&[CertificateDer<'static>], &PrivateKeyDer<'static>)>,
    ) -> Result<reqwest::Client, DaemonError> {
        Ok(reqwest::Client::builder()
            .tls_backend_preconfigured(self.client_config(client_auth)?)
            .timeout(HTTP_TIMEOUT)
            .https_only(true)
            .build()?)
    }
}

/// Accepts any server certificate. Used for exactly one request: fetching `/v1/ca.pem`
/// before the daemon knows the CA, whose answer is then checked against the pin (or trusted
/// on first use). The handshake signatures are still checked against the presented
/// certificate.
#[derive(Debug)]
struct AcceptAnyServerCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyServerCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `GET /v1/ca.pem` without verifying the server: the caller must check what it gets.
async fn fetch_ca_unverified(
    base: &reqwest::Url,
    provider: Arc<CryptoProvider>,
) -> Result<String, DaemonError> {
    let mut config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAnyServerCertificate(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let client = reqwest::Client::builder()
        .tls_backend_preconfigured(config)
        .timeout(HTTP_TIMEOUT)
        .https_only(true)
        .build()?;
    let url = base
        .join("/v1/ca.pem")
        .map_err(|e| DaemonError::BadGatewayUrl {
            url: base.to_string(),
            reason: e.to_string(),
        })?;
    let response = client.get(url).send().await?;
    let status = response.status();
    let body = response.text().await?;
    if !status.is_success() {
        return Err(DaemonError::Ca(format!(
            "GET /v1/ca.pem answered {status}: {body}"
        )));
    }
    Ok(body)
}

/// Lower-case hex without `sha256:` prefix or `:` separators.
pub fn normalize_fingerprint(pin: &str) -> String {
    let pin = pin.trim();
    let pin = pin
        .strip_prefix("sha256:")
        .or_else(|| pin.strip_prefix("SHA256:"))
        .unwrap_or(pin);
    pin.chars()
        .filter(|c| *c != ':')
        .flat_map(char::to_lowercase)
        .collect()
}

/// Exponential backoff: `base` doubling to `max`, each delay jittered down by up to
/// `jitter` of itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    pub jitter: f64,
    attempt: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: RECONNECT_BACKOFF_BASE,
            max: RECONNECT_BACKOFF_MAX,
            jitter: RECONNECT_JITTER,
            attempt: 0,
        }
    }
}

impl Backoff {
    /// The delay before try `attempt` (0-based) without jitter.
    pub fn nominal(&self, attempt: u32) -> Duration {
        self.base
            .saturating_mul(2u32.saturating_pow(attempt))
            .min(self.max)
    }

    /// The next delay, jittered; each call doubles the following one.
    pub fn next_delay(&mut self) -> Duration {
        let nominal = self.nominal(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let random: f64 = rand::random();
        nominal.mul_f64(1.0 - self.jitter.clamp(0.0, 1.0) * random)
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// A fresh key pair and a CSR (PEM) for it, subject CN = `hostname`.
pub fn key_and_csr(hostname: &str) -> Result<(rcgen::KeyPair, String), DaemonError> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    let mut name = rcgen::DistinguishedName::new();
    name.push(rcgen::DnType::CommonName, hostname);
    params.distinguished_name = name;
    let csr = params.serialize_request(&key)?.pem()?;
    Ok((key, csr))
}

/// The node's identity: its certificate, its key and the TLS configuration built from them.
struct Identity {
    issued: IssuedIdentity,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    session_tls: Arc<ClientConfig>,
    renew_at: Instant,
}

impl Identity {
    fn new(
        issued: IssuedIdentity,
        key: &rcgen::KeyPair,
        trust: &Trust,
        knobs: &DaemonKnobs,
    ) -> Result<Identity, DaemonError> {
        let chain = CertificateDer::pem_slice_iter(issued.certificate_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()?;
        if chain.is_empty() {
            return Err(DaemonError::BadAnswer {
                operation: "join",
                message: "no certificate in certificatePem".to_owned(),
            });
        }
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let session_tls = Arc::new(trust.client_config(Some((&chain, &key)))?);
        let renew_at = match knobs.renew_interval_override {
            Some(interval) => Instant::now() + interval,
            None => {
                let until = (issued.renew_after - Utc::now())
                    .to_std()
                    .unwrap_or(Duration::ZERO);
                let random: f64 = rand::random();
                Instant::now() + until.mul_f64(1.0 - RENEW_JITTER * random)
            }
        };
        Ok(Identity {
            issued,
            chain,
            key,
            session_tls,
            renew_at,
        })
    }

    fn expired(&self) -> bool {
        self.issued.expires_at <= Utc::now()
    }
}

/// How a session ended.
enum SessionEnd {
    Stopped,
    /// The gateway closed it (after a `goodbye`, or not); `reconnect` is the goodbye's advice.
    Closed {
        reason: String,
        reconnect: bool,
    },
    /// The flapping knob dropped it.
    Flapped,
    Revoked(String),
    Failed(DaemonError),
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
        FakeDaemon::build(source, join_secret, knobs, Some(counters))
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
            }),
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

    /// The simulated inventory, by section.
    pub fn inventory(&self) -> BTreeMap<String, Value> {
        self.shared.machine.inventory(&self.shared.knobs)
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

    async fn run_until_done(&self) -> Result<(), DaemonError> {
        let context = match &self.shared.source {
            Source::Resolved(context) => context.clone(),
            Source::Unresolved { gateway_url, ca } => {
                let mut backoff = Backoff::default();
                loop {
                    match self
                        .unless_stopped(GatewayContext::resolve(gateway_url, ca))
                        .await
                    {
                        None => return Ok(()),
                        Some(Ok(context)) => break Arc::new(context),
                        Some(Err(err)) if err.is_permanent() => return Err(err),
                        Some(Err(err)) => {
                            tracing::info!(hostname = %self.hostname(), error = %err, "cannot reach the gateway yet");
                            self.record_error(&err);
                            if !self.back_off(backoff.next_delay()).await {
                                return Ok(());
                            }
                        }
                    }
                }
            }
        };
        let inventory = self.inventory();
        let hashes = inventory::hashes(&inventory);
        let mut trust = context.trust.clone();
        let mut identity: Option<Identity> = None;
        let mut backoff = Backoff::default();
        loop {
            if self.is_stopped() {
                return Ok(());
            }
            let mut current = match identity.take() {
                Some(current) if !current.expired() => current,
                expired => {
                    if let Some(expired) = expired {
                        tracing::warn!(hostname = %self.hostname(), node = %expired.issued.node_id, "the node certificate expired; joining again");
                    }
                    match self.join(&context, &mut trust).await {
                        None => return Ok(()),
                        Some(Ok(joined)) => joined,
                        Some(Err(err)) if err.is_permanent() => return Err(err),
                        Some(Err(err)) => {
                            tracing::info!(hostname = %self.hostname(), error = %err, "join failed; retrying");
                            self.record_error(&err);
                            if !self.back_off(backoff.next_delay()).await {
                                return Ok(());
                            }
                            continue;
                        }
                    }
                }
            };
            let started = Instant::now();
            let end = self
                .session(&context, &mut trust, &mut current, &hashes, &inventory)
                .await;
            self.set_connected(false);
            let healthy = started.elapsed() >= HEALTHY_SESSION;
            let delay = match end {
                SessionEnd::Stopped => return Ok(()),
                SessionEnd::Revoked(reason) => {
                    self.update(|s| s.last_close_reason = Some(reason.clone()));
                    if !self.shared.knobs.rejoin_when_revoked {
                        return Err(DaemonError::IdentityRevoked(reason));
                    }
                    tracing::info!(hostname = %self.hostname(), %reason, "identity revoked; joining again");
                    backoff.next_delay()
                }
                SessionEnd::Closed { reason, reconnect } => {
                    self.update(|s| s.last_close_reason = Some(reason.clone()));
                    if !reconnect {
                        tracing::info!(hostname = %self.hostname(), %reason, "the gateway said not to reconnect");
                        return Ok(());
                    }
                    tracing::debug!(hostname = %self.hostname(), %reason, "the gateway closed the session");
                    if healthy {
                        backoff.reset();
                    }
                    identity = Some(current);
                    backoff.next_delay()
                }
                SessionEnd::Flapped => {
                    self.update(|s| s.last_close_reason = Some("flapping".to_owned()));
                    identity = Some(current);
                    backoff.reset();
                    backoff.next_delay()
                }
                SessionEnd::Failed(err) => {
                    tracing::debug!(hostname = %self.hostname(), error = %err, "session failed");
                    let message = err.to_string();
                    self.record_error(&err);
                    self.update(|s| s.last_close_reason = Some(message));
                    if healthy {
                        backoff.reset();
                    }
                    identity = Some(current);
                    backoff.next_delay()
                }
            };
            if !self.back_off(delay).await {
                return Ok(());
            }
        }
    }

    /// `POST /v1/join` with a fresh key; None if stopped.
    async fn join(
        &self,
        context: &GatewayContext,
        trust: &mut Arc<Trust>,
    ) -> Option<Result<Identity, DaemonError>> {
        self.update(|s| s.phase = Phase::Joining);
        let _permit = self.unless_stopped(context.handshake_permit()).await?;
        let result = self
            .unless_stopped(async {
                let (key, csr_pem) = key_and_csr(self.hostname())?;
                let request = JoinRequest {
                    token: self.shared.join_secret.clone(),
                    csr_pem,
                    hostname: self.hostname().to_owned(),
                    identifiers: self.shared.machine.identifiers.clone(),
                };
                let response = context
                    .join_client
                    .post(context.endpoint("/v1/join")?)
                    .json(&request)
                    .send()
                    .await?;
                let issued = issued_identity("join", response).await?;
                self.adopt_ca(context, trust, &issued)?;
                Identity::new(issued, &key, trust, &self.shared.knobs)
            })
            .await?;
        if let Ok(identity) = &result {
            let first = self.shared.status.borrow().joins == 0;
            if first {
                self.shared.counters.joined.fetch_add(1, Ordering::Relaxed);
            }
            let issued = identity.issued.clone();
            tracing::debug!(hostname = %self.hostname(), node = %issued.node_id, generation = issued.identity_generation, "joined");
            self.update(|s| {
                s.joins += 1;
                s.node_id = Some(issued.node_id);
                s.identity_generation = Some(issued.identity_generation);
                s.certificate_expires_at = Some(issued.expires_at);
            });
        }
        Some(result)
    }

    /// `POST /v1/renew` with the current certificate and a fresh key.
    async fn renew(
        &self,
        context: &GatewayContext,
        trust: &mut Arc<Trust>,
        identity: &Identity,
    ) -> Result<Identity, DaemonError> {
        let (key, csr_pem) = key_and_csr(self.hostname())?;
        let client = trust.http_client(Some((&identity.chain, &identity.key)))?;
        let response = client
            .post(context.endpoint("/v1/renew")?)
            .json(&RenewRequest { csr_pem })
            .send()
            .await?;
        let issued = issued_identity("renewal", response).await?;
        if issued.node_id != identity.issued.node_id {
            return Err(DaemonError::BadAnswer {
                operation: "renewal",
                message: format!("renewed {} as {}", identity.issued.node_id, issued.node_id),
            });
        }
        self.adopt_ca(context, trust, &issued)?;
        Identity::new(issued, &key, trust, &self.shared.knobs)
    }

    /// The CA in an answer that arrived over a verified connection replaces the one the
    /// daemon trusts if they differ (a rotation).
    fn adopt_ca(
        &self,
        context: &GatewayContext,
        trust: &mut Arc<Trust>,
        issued: &IssuedIdentity,
    ) -> Result<(), DaemonError> {
        if issued.ca_certificate_pem.trim() == trust.pem.trim() {
            return Ok(());
        }
        let rotated = Trust::from_pem(&issued.ca_certificate_pem, context.trust.provider.clone())?;
        if rotated.sha256 != trust.sha256 {
            tracing::warn!(hostname = %self.hostname(), from = %trust.sha256, to = %rotated.sha256, "the control plane sent another CA; trusting it from now on");
            *trust = Arc::new(rotated);
        }
        Ok(())
    }

    async fn session(
        &self,
        context: &GatewayContext,
        trust: &mut Arc<Trust>,
        identity: &mut Identity,
        hashes: &BTreeMap<String, String>,
        inventory: &BTreeMap<String, Value>,
    ) -> SessionEnd {
        self.update(|s| s.phase = Phase::Connecting);
        let Some(permit) = self.unless_stopped(context.handshake_permit()).await else {
            return SessionEnd::Stopped;
        };
        let observed_generation = self.shared.status.borrow().observed_generation;
        let hello = DaemonMessage::Hello {
            daemon_version: self.shared.knobs.daemon_version.clone(),
            inventory_hashes: hashes.clone(),
            observed_generation,
        };
        let opened = self
            .unless_stopped(tokio::time::timeout(
                SESSION_OPEN_TIMEOUT,
                open_session(context, identity, &hello),
            ))
            .await;
        drop(permit);
        let (mut ws, welcome) = match opened {
            None => return SessionEnd::Stopped,
            Some(Err(_elapsed)) => {
                return SessionEnd::Failed(DaemonError::Timeout("opening the session"));
            }
            Some(Ok(Err(Opening::Revoked(reason)))) => return SessionEnd::Revoked(reason),
            Some(Ok(Err(Opening::Closed { reason, reconnect }))) => {
                return SessionEnd::Closed { reason, reconnect };
            }
            Some(Ok(Err(Opening::Failed(err)))) => return SessionEnd::Failed(err),
            Some(Ok(Ok(opened))) => opened,
        };
        let Welcome {
            epoch,
            gateway_id,
            want_sections,
            heartbeat_interval_secs,
            generation,
        } = welcome;
        self.shared
            .counters
            .sessions
            .fetch_add(1, Ordering::Relaxed);
        self.update(|s| {
            s.phase = Phase::Connected;
            s.epoch = Some(epoch);
            s.gateway_id = Some(gateway_id.clone());
            s.sessions += 1;
            // The simulated machine converges a new spec at once.
            s.observed_generation = generation;
        });
        self.set_connected(true);
        tracing::debug!(hostname = %self.hostname(), epoch, %gateway_id, wanted = ?want_sections, "session up");

        for section in &want_sections {
            let Some(content) = inventory.get(section) else {
                tracing::warn!(hostname = %self.hostname(), %section, "the gateway wants a section this daemon does not have");
                continue;
            };
            let message = DaemonMessage::Inventory {
                section: section.clone(),
                hash: protocol::section_hash(content),
                content: content.clone(),
            };
            if let Err(err) = send(&mut ws, &message).await {
                return SessionEnd::Failed(err);
            }
            self.update(|s| s.inventory_sections_sent += 1);
        }

        // The simulated machine converges a new spec at once and says so.
        if generation > observed_generation
            && let Err(err) = send(&mut ws, &DaemonMessage::Converged { generation }).await
        {
            return SessionEnd::Failed(err);
        }

        let knobs = &self.shared.knobs;
        // Commands under way: when each finishes, and what it is.
        let mut running: Vec<Running> = Vec::new();
        let mut heartbeats = (!knobs.skip_heartbeats).then(|| {
            let base = knobs
                .heartbeat_interval_override
                .unwrap_or(Duration::from_secs(heartbeat_interval_secs.max(1)));
            let period = base + knobs.heartbeat_delay;
            let mut interval = tokio::time::interval_at(Instant::now() + period, period);
            interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
            interval
        });
        let flap_at = knobs.flapping.map(|every| Instant::now() + every);
        let mut seq: u64 = 0;
        let mut goodbye: Option<(String, bool)> = None;
        let mut stop = self.shared.stop.subscribe();
        loop {
            tokio::select! {
                () = stopped(&mut stop) => {
                    close(&mut ws, "daemon stopping").await;
                    return SessionEnd::Stopped;
                }
                () = tick(&mut heartbeats) => {
                    seq += 1;
                    if let Err(err) = send(&mut ws, &DaemonMessage::Heartbeat { seq }).await {
                        return SessionEnd::Failed(err);
                    }
                    self.shared.counters.heartbeats_sent.fetch_add(1, Ordering::Relaxed);
                    self.update(|s| s.heartbeats_sent += 1);
                }
                () = sleep_until(flap_at) => {
                    tracing::debug!(hostname = %self.hostname(), "flapping: dropping the session");
                    close(&mut ws, "flapping").await;
                    return SessionEnd::Flapped;
                }
                () = tokio::time::sleep_until(identity.renew_at) => {
                    match self.renew(context, trust, identity).await {
                        Ok(renewed) => {
                            tracing::debug!(hostname = %self.hostname(), node = %renewed.issued.node_id, "certificate renewed");
                            self.shared.counters.renewals.fetch_add(1, Ordering::Relaxed);
                            let expires_at = renewed.issued.expires_at;
                            let generation = renewed.issued.identity_generation;
                            self.update(|s| {
                                s.renewals += 1;
                                s.certificate_expires_at = Some(expires_at);
                                s.identity_generation = Some(generation);
                            });
                            *identity = renewed;
                        }
                        Err(DaemonError::Refused { status: 403, message, .. }) => {
                            close(&mut ws, "identity revoked").await;
                            return SessionEnd::Revoked(message);
                        }
                        Err(err) => {
                            tracing::info!(hostname = %self.hostname(), error = %err, "renewal failed; retrying later");
                            self.record_error(&err);
                            identity.renew_at = Instant::now() + RENEW_RETRY_DELAY;
                        }
                    }
                }
                () = sleep_until(running.iter().map(|r| r.done_at).min()) => {
                    let now = Instant::now();
                    let (done, still): (Vec<Running>, Vec<Running>) = running.into_iter().partition(|r| r.done_at <= now);
                    running = still;
                    for command in done {
                        match self.finish_command(&mut ws, command, inventory).await {
                            Ok(CommandEffect::None) => {}
                            Ok(CommandEffect::Reboot) => {
                                close(&mut ws, "rebooting").await;
                                return SessionEnd::Flapped;
                            }
                            Err(err) => return SessionEnd::Failed(err),
                        }
                    }
                }
                frame = ws.next() => match frame {
                    Some(Ok(Message::Text(text))) => match serde_json::from_str::<GatewayMessage>(text.as_str()) {
                        Ok(GatewayMessage::Goodbye { reason, reconnect }) => {
                            tracing::debug!(hostname = %self.hostname(), %reason, reconnect, "goodbye");
                            goodbye = Some((reason, reconnect));
                        }
                        Ok(GatewayMessage::Welcome { .. }) => {
                            tracing::warn!(hostname = %self.hostname(), "a second welcome; ignored");
                        }
                        Ok(GatewayMessage::Command { id, kind, params, .. }) => {
                            if let Err(err) = send(&mut ws, &DaemonMessage::CommandStarted { id: id.clone() }).await {
                                return SessionEnd::Failed(err);
                            }
                            self.update(|s| s.commands_received += 1);
                            running.push(Running { done_at: Instant::now() + simulated_duration(kind), id, kind, params });
                        }
                        Ok(GatewayMessage::Cancel { id }) => {
                            if let Some(position) = running.iter().position(|r| r.id == id) {
                                running.remove(position);
                                let cancelled = DaemonMessage::CommandResult {
                                    id,
                                    outcome: Outcome::Cancelled,
                                    exit_code: None,
                                    output: "cancelled by the control plane\n".to_owned(),
                                    result: None,
                                };
                                if let Err(err) = send(&mut ws, &cancelled).await {
                                    return SessionEnd::Failed(err);
                                }
                            }
                        }
                        Ok(GatewayMessage::Spec { spec }) => {
                            self.update(|s| s.observed_generation = spec.generation);
                            if let Err(err) = send(&mut ws, &DaemonMessage::Converged { generation: spec.generation }).await {
                                return SessionEnd::Failed(err);
                            }
                        }
                        Err(err) => {
                            // Newer gateways may send messages this daemon does not know yet.
                            tracing::warn!(hostname = %self.hostname(), error = %err, frame = %truncate(text.as_str()), "an unknown gateway message; ignored");
                        }
                    },
                    Some(Ok(Message::Close(frame))) => {
                        let (code, close_reason) = frame.map_or((None, String::new()), |f| (Some(u16::from(f.code)), f.reason.to_string()));
                        drain(&mut ws).await;
                        return ended_by_gateway(goodbye, code, close_reason);
                    }
                    Some(Ok(Message::Binary(_))) => {
                        tracing::warn!(hostname = %self.hostname(), "a binary frame from the gateway; ignored");
                    }
                    Some(Ok(_)) => {}
                    Some(Err(err)) => {
                        return match goodbye {
                            Some((reason, reconnect)) => SessionEnd::Closed { reason, reconnect },
                            None => SessionEnd::Failed(err.into()),
                        };
                    }
                    None => {
                        return match goodbye {
                            Some((reason, reconnect)) => SessionEnd::Closed { reason, reconnect },
                            None => SessionEnd::Failed(DaemonError::Protocol("the connection closed without a close frame".to_owned())),
                        };
                    }
                }
            }
        }
    }
}

/// A command the simulated machine is running.
struct Running {
    done_at: Instant,
    id: String,
    kind: CommandKind,
    params: Value,
}

/// What finishing a command does to the session.
enum CommandEffect {
    None,
    /// The machine reboots: the session drops and the daemon comes back.
    Reboot,
}

/// How long the simulated machine takes for each kind: short, so tests and `dev --sim` move
/// quickly, with the diagnostic the slowest as on real hardware.
fn simulated_duration(kind: CommandKind) -> Duration {
    match kind {
        CommandKind::DiagNvml => Duration::from_millis(300),
        CommandKind::NodeReboot => Duration::from_millis(200),
        _ => Duration::from_millis(50),
    }
}

impl FakeDaemon {
    /// Ends a command: the result the simulated machine produces, sent to the gateway.
    async fn finish_command(
        &self,
        ws: &mut WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>,
        command: Running,
        inventory: &BTreeMap<String, Value>,
    ) -> Result<CommandEffect, DaemonError> {
        let mut effect = CommandEffect::None;
        let (outcome, exit_code, output, result) = match command.kind {
            CommandKind::DiagNvml => {
                let diagnostics = inventory
                    .get("gpus")
                    .and_then(|g| g.get("diagnostics"))
                    .cloned()
                    .unwrap_or(Value::Null);
                let failures = diagnostics
                    .get("failures")
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!([]));
                let passed = !self.shared.knobs.fail_diagnostics;
                let level = command
                    .params
                    .get("level")
                    .cloned()
                    .unwrap_or(Value::from(1));
                let output = if passed {
                    format!("dcgmi diag -r {level}: all tests passed\n")
                } else {
                    format!("dcgmi diag -r {level}: FAIL\n{failures}\n")
                };
                let outcome = if passed {
                    Outcome::Succeeded
                } else {
                    Outcome::Failed
                };
                (
                    outcome,
                    Some(i32::from(!passed)),
                    output,
                    serde_json::json!({ "passed": passed, "level": level, "failures": failures }),
                )
            }
            CommandKind::InventoryRefresh => {
                let wanted: Vec<String> =
                    match command.params.get("sections").and_then(Value::as_array) {
                        Some(list) => list
                            .iter()
                            .filter_map(|s| s.as_str().map(str::to_owned))
                            .collect(),
                        None => inventory.keys().cloned().collect(),
                    };
                for section in &wanted {
                    if let Some(content) = inventory.get(section) {
                        let message = DaemonMessage::Inventory {
                            section: section.clone(),
                            hash: protocol::section_hash(content),
                            content: content.clone(),
                        };
                        send(ws, &message).await?;
                    }
                }
                (
                    Outcome::Succeeded,
                    Some(0),
                    format!("reported {} sections\n", wanted.len()),
                    serde_json::json!({ "sections": wanted }),
                )
            }
            CommandKind::LogsCollect => {
                let output = format!(
                    "{}: journal, dmesg and nvidia-bug-report collected\nkernel: NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n",
                    self.hostname()
                );
                (
                    Outcome::Succeeded,
                    Some(0),
                    output,
                    serde_json::json!({ "archive": format!("logs-{}.tar.zst", self.hostname()) }),
                )
            }
            CommandKind::GpuReset => {
                let gpu = command
                    .params
                    .get("gpu")
                    .cloned()
                    .unwrap_or_else(|| Value::from("all"));
                (
                    Outcome::Succeeded,
                    Some(0),
                    format!("nvidia-smi -r: GPU {gpu} reset\n"),
                    serde_json::json!({ "reset": gpu }),
                )
            }
            CommandKind::NodeReboot => {
                effect = CommandEffect::Reboot;
                (
                    Outcome::Succeeded,
                    Some(0),
                    "rebooting\n".to_owned(),
                    serde_json::json!({ "rebooting": true }),
                )
            }
        };
        let message = DaemonMessage::CommandResult {
            id: command.id,
            outcome,
            exit_code,
            output,
            result: Some(result),
        };
        send(ws, &message).await?;
        self.update(|s| s.commands_finished += 1);
        Ok(effect)
    }
}

/// What `welcome` said.
struct Welcome {
    epoch: i64,
    gateway_id: String,
    want_sections: Vec<String>,
    heartbeat_interval_secs: u64,
    generation: i64,
}

/// Why a session did not open.
enum Opening {
    Revoked(String),
    Closed { reason: String, reconnect: bool },
    Failed(DaemonError),
}

impl From<DaemonError> for Opening {
    fn from(err: DaemonError) -> Opening {
        Opening::Failed(err)
    }
}

impl From<std::io::Error> for Opening {
    fn from(err: std::io::Error) -> Opening {
        Opening::Failed(err.into())
    }
}

impl From<tungstenite::Error> for Opening {
    fn from(err: tungstenite::Error) -> Opening {
        Opening::Failed(err.into())
    }
}

type Session = WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>;

/// TCP, TLS with the node certificate, the WebSocket upgrade (`bcd.v1`), `hello`, `welcome`.
async fn open_session(
    context: &GatewayContext,
    identity: &Identity,
    hello: &DaemonMessage,
) -> Result<(Session, Welcome), Opening> {
    let tcp = TcpStream::connect((context.host.as_str(), context.port)).await?;
    tcp.set_nodelay(true)?;
    let tls = tokio_rustls::TlsConnector::from(identity.session_tls.clone())
        .connect(context.server_name.clone(), tcp)
        .await?;
    let mut request = format!("wss://{}/v1/session", context.authority).into_client_request()?;
    request.headers_mut().insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        http::HeaderValue::from_static(protocol::PROTOCOL),
    );
    let config = WebSocketConfig::default()
        .read_buffer_size(WS_READ_BUFFER_BYTES)
        .write_buffer_size(WS_WRITE_BUFFER_BYTES)
        .max_message_size(Some(protocol::MAX_FRAME_BYTES))
        .max_frame_size(Some(protocol::MAX_FRAME_BYTES));
    let (mut ws, _response) =
        match tokio_tungstenite::client_async_with_config(request, tls, Some(config)).await {
            Ok(upgraded) => upgraded,
            Err(tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                let body = response.body().as_deref().unwrap_or_default();
                let (code, message) = match serde_json::from_slice::<ErrorBody>(body) {
                    Ok(error) => (error.code, error.message),
                    Err(_) => (String::new(), String::from_utf8_lossy(body).into_owned()),
                };
                if status == 403 {
                    return Err(Opening::Revoked(if message.is_empty() {
                        "403 on /v1/session".to_owned()
                    } else {
                        message
                    }));
                }
                return Err(Opening::Failed(DaemonError::Refused {
                    operation: "session",
                    status,
                    code,
                    message,
                }));
            }
            Err(err) => return Err(err.into()),
        };
    send(&mut ws, hello).await?;
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) => {
                return match serde_json::from_str::<GatewayMessage>(text.as_str()) {
                    Ok(GatewayMessage::Welcome {
                        epoch,
                        gateway_id,
                        want_sections,
                        heartbeat_interval_secs,
                        spec,
                    }) => Ok((
                        ws,
                        Welcome {
                            epoch,
                            gateway_id,
                            want_sections,
                            heartbeat_interval_secs,
                            generation: spec.generation,
                        },
                    )),
                    Ok(GatewayMessage::Goodbye { reason, reconnect }) => {
                        drain(&mut ws).await;
                        Err(Opening::Closed { reason, reconnect })
                    }
                    Ok(_) => Err(Opening::Failed(DaemonError::Protocol(format!(
                        "expected welcome, got {}",
                        truncate(text.as_str())
                    )))),
                    Err(err) => Err(Opening::Failed(DaemonError::Protocol(format!(
                        "expected welcome, got {} ({err})",
                        truncate(text.as_str())
                    )))),
                };
            }
            Some(Ok(Message::Close(frame))) => {
                drain(&mut ws).await;
                let (code, reason) = frame.map_or((None, String::new()), |f| {
                    (Some(u16::from(f.code)), f.reason.to_string())
                });
                return Err(match ended_by_gateway(None, code, reason.clone()) {
                    SessionEnd::Revoked(reason) => Opening::Revoked(reason),
                    SessionEnd::Closed { reason, reconnect } => {
                        Opening::Closed { reason, reconnect }
                    }
                    SessionEnd::Failed(err) => Opening::Failed(err),
                    SessionEnd::Stopped | SessionEnd::Flapped => Opening::Closed {
                        reason,
                        reconnect: true,
                    },
                });
            }
            Some(Ok(Message::Binary(_))) => {
                return Err(Opening::Failed(DaemonError::Protocol(
                    "a binary frame before welcome".to_owned(),
                )));
            }
            Some(Ok(_)) => {}
            Some(Err(err)) => return Err(err.into()),
            None => {
                return Err(Opening::Failed(DaemonError::Protocol(
                    "the connection closed before welcome".to_owned(),
                )));
            }
        }
    }
}

/// How a session the gateway closed ended: a revoked identity, or a close to come back from
/// (unless a goodbye said not to).
fn ended_by_gateway(
    goodbye: Option<(String, bool)>,
    code: Option<u16>,
    close_reason: String,
) -> SessionEnd {
    let reconnect = goodbye.as_ref().is_none_or(|(_, reconnect)| *reconnect);
    let reason = match goodbye {
        Some((reason, _)) => reason,
        None if close_reason.is_empty() => {
            code.map_or_else(|| "closed".to_owned(), |code| format!("closed ({code})"))
        }
        None => match code {
            Some(code) => format!("{close_reason} ({code})"),
            None => close_reason.clone(),
        },
    };
    if close_reason == protocol::close::IDENTITY_REVOKED
        || reason == protocol::close::IDENTITY_REVOKED
    {
        return SessionEnd::Revoked(reason);
    }
    SessionEnd::Closed { reason, reconnect }
}

/// An IssuedIdentity from a 200, or the gateway's refusal.
async fn issued_identity(
    operation: &'static str,
    response: reqwest::Response,
) -> Result<IssuedIdentity, DaemonError> {
    let status = response.status();
    let body = response.bytes().await?;
    if status.is_success() {
        return serde_json::from_slice(&body).map_err(|e| DaemonError::BadAnswer {
            operation,
            message: e.to_string(),
        });
    }
    let (code, message) = match serde_json::from_slice::<ErrorBody>(&body) {
        Ok(error) => (error.code, error.message),
        Err(_) => (String::new(), String::from_utf8_lossy(&body).into_owned()),
    };
    Err(DaemonError::Refused {
        operation,
        status: status.as_u16(),
        code,
        message,
    })
}

async fn send(ws: &mut Session, message: &DaemonMessage) -> Result<(), DaemonError> {
    let text = serde_json::to_string(message).map_err(|e| DaemonError::Protocol(e.to_string()))?;
    ws.send(Message::text(text)).await?;
    Ok(())
}

/// Sends a normal close and waits (briefly) for the gateway's.
async fn close(ws: &mut Session, reason: &str) {
    let frame = CloseFrame {
        code: CloseCode::Normal,
        reason: reason.to_owned().into(),
    };
    if ws.close(Some(frame)).await.is_ok() {
        drain(ws).await;
    }
}

/// Reads until the connection ends, at most [`CLOSE_TIMEOUT`], so the closing handshake
/// completes.
async fn drain(ws: &mut Session) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
        while let Some(Ok(_)) = ws.next().await {}
    })
    .await;
}

/// Resolves once the daemon is told to stop. (The guard `wait_for` returns must not live
/// across an await, so it is dropped here.)
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

async fn tick(interval: &mut Option<Interval>) {
    match interval {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The first few hundred characters of a frame, for logs.
fn truncate(text: &str) -> &str {
    const MAX_LOGGED: usize = 200;
    match text.char_indices().nth(MAX_LOGGED) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csr_parses_and_its_signature_verifies() {
        let (key, pem) = key_and_csr("gpu-001").expect("a CSR");
        assert!(pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
        let parsed = rcgen::CertificateSigningRequestParams::from_pem(&pem)
            .expect("a valid, self-signed CSR");
        use rcgen::PublicKeyData;
        assert_eq!(parsed.public_key.der_bytes(), key.der_bytes());
        assert_eq!(
            parsed
                .params
                .distinguished_name
                .get(&rcgen::DnType::CommonName),
            Some(&rcgen::DnValue::Utf8String("gpu-001".to_owned()))
        );
        assert_eq!(
            key.algorithm(),
            &rcgen::PKCS_ECDSA_P256_SHA256,
            "ECDSA P-256"
        );
        // A tampered CSR does not verify.
        let der = rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(pem.as_bytes())
            .expect("DER");
        let mut bytes = der.as_ref().to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        assert!(rcgen::CertificateSigningRequestParams::from_der(&bytes.into()).is_err());
        // Every CSR has its own key.
        let (other, _) = key_and_csr("gpu-001").expect("a CSR");
        assert_ne!(key.serialize_der(), other.serialize_der());
    }

    #[test]
    fn backoff_doubles_from_one_second_to_sixty_with_jitter() {
        let mut backoff = Backoff::default();
        let nominal: Vec<u64> = (0..9).map(|n| backoff.nominal(n).as_secs()).collect();
        assert_eq!(nominal, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff.nominal(u32::MAX), RECONNECT_BACKOFF_MAX);
        for attempt in 0..12 {
            let delay = backoff.next_delay();
            let top = backoff.nominal(attempt);
            assert!(
                delay <= top && delay >= top.mul_f64(1.0 - RECONNECT_JITTER),
                "attempt {attempt}: {delay:?} vs {top:?}"
            );
        }
        backoff.reset();
        assert!(backoff.next_delay() <= RECONNECT_BACKOFF_BASE);
        // Jitter spreads a fleet: a hundred first delays are not all equal.
        let delays: std::collections::BTreeSet<Duration> =
            (0..100).map(|_| Backoff::default().next_delay()).collect();
        assert!(delays.len() > 50);
    }

    #[test]
    fn fingerprints_are_normalized() {
        assert_eq!(normalize_fingerprint("sha256:AB:cd:01"), "abcd01");
        assert_eq!(normalize_fingerprint(" abcd01 "), "abcd01");
    }

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

    #[test]
    fn gateway_closes_are_classified() {
        assert!(matches!(
            ended_by_gateway(None, Some(1008), protocol::close::IDENTITY_REVOKED.into()),
            SessionEnd::Revoked(_)
        ));
        assert!(matches!(
            ended_by_gateway(
                Some((protocol::close::SUPERSEDED.into(), true)),
                Some(1000),
                String::new()
            ),
            SessionEnd::Closed {
                reconnect: true,
                ..
            }
        ));
        assert!(matches!(
            ended_by_gateway(Some(("maintenance".into(), false)), None, String::new()),
            SessionEnd::Closed {
                reconnect: false,
                ..
            }
        ));
        match ended_by_gateway(None, Some(1008), "unknown message type".into()) {
            SessionEnd::Closed { reason, reconnect } => {
                assert!(reconnect);
                assert_eq!(reason, "unknown message type (1008)");
            }
            _ => panic!("a close to come back from"),
        }
    }
}
