//! Whom the daemon trusts and how it reaches the gateway: the CA (given, pinned or trusted on
//! first use), the TLS client configurations built from it, and connecting a session (TCP,
//! TLS with the node certificate, the WebSocket upgrade).

use super::DaemonError;
use super::identity::Identity;
use super::session::{Opening, Session};
use bc_core::protocol::{self, ErrorBody};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::tungstenite::{
    self, client::IntoClientRequest, http, protocol::WebSocketConfig,
};

/// How long a join, renewal or CA fetch may take before it counts as failed.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// The WebSocket read buffer. tungstenite's default (128 KiB, zero-filled on every read) is
/// sized for throughput; a daemon receives a few small frames and a fleet holds thousands of
/// sessions in one process.
const WS_READ_BUFFER_BYTES: usize = 4096;
/// The WebSocket write buffer: frames are written out as soon as they are sent.
const WS_WRITE_BUFFER_BYTES: usize = 0;

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

/// The gateways a daemon may talk to (replicas of one control plane) and the CA it trusts,
/// resolved once; a fleet shares one.
pub struct GatewayContext {
    /// At least one. A daemon uses one at a time and moves to the next when it cannot join or
    /// hold a session there (see [`FakeDaemon::next_gateway`](super::FakeDaemon)).
    gateways: Vec<Gateway>,
    pub(super) trust: Arc<Trust>,
    /// Joins carry no client certificate, so every daemon of a fleet can share one client
    /// (and its kept-alive connections).
    pub(super) join_client: reqwest::Client,
    /// Bounds concurrent joins and, apart, concurrent session handshakes (None: no bound).
    handshake_limits: Option<HandshakeLimits>,
}

/// One gateway's address, parsed once.
struct Gateway {
    base: reqwest::Url,
    /// `host:port`, IPv6 hosts in brackets, as the WebSocket URL carries it.
    authority: String,
    /// The host as TCP connects to it (IPv6 without brackets).
    host: String,
    port: u16,
    server_name: ServerName<'static>,
}

impl Gateway {
    fn parse(gateway_url: &str) -> Result<Gateway, DaemonError> {
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
        Ok(Gateway {
            base,
            authority,
            host,
            port,
            server_name,
        })
    }
}

impl std::fmt::Debug for GatewayContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayContext")
            .field(
                "gateways",
                &self
                    .gateways
                    .iter()
                    .map(|g| g.base.as_str())
                    .collect::<Vec<_>>(),
            )
            .field("ca_sha256", &self.trust.sha256)
            .finish()
    }
}

impl GatewayContext {
    /// Parses the gateway URL (`https://host:port`) and settles on the CA to trust, fetching
    /// `/v1/ca.pem` when `ca` is a pin or trust on first use.
    pub async fn resolve(gateway_url: &str, ca: &CaTrust) -> Result<GatewayContext, DaemonError> {
        GatewayContext::resolve_all(&[gateway_url], ca).await
    }

    /// [`GatewayContext::resolve`] for several gateways of one control plane (replicas, which
    /// share the CA): the CA is fetched from the first that answers.
    pub async fn resolve_all(
        gateway_urls: &[impl AsRef<str>],
        ca: &CaTrust,
    ) -> Result<GatewayContext, DaemonError> {
        let gateways = gateway_urls
            .iter()
            .map(|url| Gateway::parse(url.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if gateways.is_empty() {
            return Err(DaemonError::BadGatewayUrl {
                url: String::new(),
                reason: "no gateway given".to_owned(),
            });
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let trust = match ca {
            CaTrust::Pem(pem) => Trust::from_pem(pem, provider)?,
            CaTrust::Sha256Pin(pin) => {
                let fetched = fetch_ca_from_any(&gateways, &provider).await?;
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
                let fetched = fetch_ca_from_any(&gateways, &provider).await?;
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
            gateways,
            trust: Arc::new(trust),
            join_client,
            handshake_limits: None,
        })
    }

    /// Allows at most `limit` joins, and apart from them at most `limit` session handshakes,
    /// at once among the daemons sharing this context, so ten thousand of them do not
    /// stampede the gateway (or their own process). The two queue apart because a real daemon
    /// connects as soon as it has joined: with one queue (first come, first served) every
    /// daemon's first connect waited behind all the joins queued before it, and a fleet
    /// connected only once the whole fleet had joined.
    pub fn with_handshake_limit(mut self, limit: usize) -> GatewayContext {
        let limit = limit.max(1);
        self.handshake_limits = Some(HandshakeLimits {
            joins: Arc::new(Semaphore::new(limit)),
            sessions: Arc::new(Semaphore::new(limit)),
        });
        self
    }

    /// The first gateway's URL.
    pub fn gateway_url(&self) -> &str {
        self.gateways[0].base.as_str()
    }

    /// How many gateways the daemons may use.
    pub fn gateways(&self) -> usize {
        self.gateways.len()
    }

    /// The trusted CA certificate (PEM).
    pub fn ca_pem(&self) -> &str {
        &self.trust.pem
    }

    /// The trusted CA's SHA-256 fingerprint (lower-case hex, of the DER).
    pub fn ca_sha256(&self) -> &str {
        &self.trust.sha256
    }

    /// `path` on gateway `gateway` (any number: it wraps around the list).
    pub(super) fn endpoint(&self, gateway: usize, path: &str) -> Result<reqwest::Url, DaemonError> {
        let base = &self.gateway(gateway).base;
        base.join(path).map_err(|e| DaemonError::BadGatewayUrl {
            url: base.to_string(),
            reason: e.to_string(),
        })
    }

    fn gateway(&self, gateway: usize) -> &Gateway {
        &self.gateways[gateway % self.gateways.len()]
    }

    /// A slot for a join (None: no bound).
    pub(super) async fn join_permit(&self) -> Option<OwnedSemaphorePermit> {
        let limits = self.handshake_limits.as_ref()?;
        // The semaphore is never closed, so acquiring only fails if it were.
        limits.joins.clone().acquire_owned().await.ok()
    }

    /// A slot for a session handshake (None: no bound).
    pub(super) async fn session_permit(&self) -> Option<OwnedSemaphorePermit> {
        let limits = self.handshake_limits.as_ref()?;
        limits.sessions.clone().acquire_owned().await.ok()
    }
}

/// The fleet-wide bounds of [`GatewayContext::with_handshake_limit`].
struct HandshakeLimits {
    joins: Arc<Semaphore>,
    sessions: Arc<Semaphore>,
}

/// The CA a daemon trusts and what rustls builds from it.
pub(super) struct Trust {
    pub(super) pem: String,
    /// SHA-256 (lower-case hex) of the first certificate's DER.
    pub(super) sha256: String,
    pub(super) provider: Arc<CryptoProvider>,
    verifier: Arc<WebPkiServerVerifier>,
}

impl Trust {
    pub(super) fn from_pem(pem: &str, provider: Arc<CryptoProvider>) -> Result<Trust, DaemonError> {
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
    pub(super) fn client_config(
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

    pub(super) fn http_client(
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

/// [`fetch_ca_unverified`] from each gateway in turn until one answers (the last error if none
/// does): replicas share the CA, and one that is down must not keep a daemon from starting.
async fn fetch_ca_from_any(
    gateways: &[Gateway],
    provider: &Arc<CryptoProvider>,
) -> Result<String, DaemonError> {
    let mut last_error = None;
    for gateway in gateways {
        match fetch_ca_unverified(&gateway.base, provider.clone()).await {
            Ok(pem) => return Ok(pem),
            Err(err) => {
                tracing::info!(gateway = %gateway.base, error = %err, "fetching the CA failed; trying the next gateway");
                last_error = Some(err);
            }
        }
    }
    Err(last_error.expect("at least one gateway"))
}

/// `GET /v1/ca.pem` without verifying the server: the caller must check what it gets.
async fn fetch_ca_unverified(
    base: &reqwest::Url,
    provider: Arc<CryptoProvider>,
) -> Result<String, DaemonError> {
    let mut config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(
            // Used for exactly one request: fetching `/v1/ca.pem` before the daemon knows
            // the CA, whose answer is then checked against the pin (or trusted on first use).
            Arc::new(better_compute::bmc::AcceptAnyCertificate::new(provider)),
        )
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

/// TCP, TLS with the node certificate, and the WebSocket upgrade (`bcd.v1`). The gateway
/// refuses the upgrade with a 403 when the node's identity was revoked.
pub(super) async fn connect(
    context: &GatewayContext,
    gateway: usize,
    identity: &Identity,
) -> Result<Session, Opening> {
    let gateway = context.gateway(gateway);
    let tcp = TcpStream::connect((gateway.host.as_str(), gateway.port)).await?;
    tcp.set_nodelay(true)?;
    let tls = tokio_rustls::TlsConnector::from(identity.session_tls.clone())
        .connect(gateway.server_name.clone(), tcp)
        .await?;
    let mut request = format!("wss://{}/v1/session", gateway.authority).into_client_request()?;
    request.headers_mut().insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        http::HeaderValue::from_static(protocol::PROTOCOL),
    );
    let config = WebSocketConfig::default()
        .read_buffer_size(WS_READ_BUFFER_BYTES)
        .write_buffer_size(WS_WRITE_BUFFER_BYTES)
        .max_message_size(Some(protocol::MAX_FRAME_BYTES))
        .max_frame_size(Some(protocol::MAX_FRAME_BYTES));
    match tokio_tungstenite::client_async_with_config(request, tls, Some(config)).await {
        Ok((ws, _response)) => Ok(ws),
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
            Err(Opening::Failed(DaemonError::Refused {
                operation: "session",
                status,
                code,
                message,
            }))
        }
        Err(err) => Err(err.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_normalized() {
        assert_eq!(normalize_fingerprint("sha256:AB:cd:01"), "abcd01");
        assert_eq!(normalize_fingerprint(" abcd01 "), "abcd01");
    }
}
