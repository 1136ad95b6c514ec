//! The gateway's TLS: a server certificate from the CA, and client certificates verified
//! against the CA but optional, because a joining daemon has none yet. Handlers decide which
//! routes need one.

use chrono::{DateTime, Utc};
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use std::sync::Arc;

use crate::pki::Ca;

pub fn server_config(
    ca: &Ca,
    hostnames: &[String],
    now: DateTime<Utc>,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots.add(ca.cert_der().clone())?;
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()?;
    let (chain, key) = ca.server_certificate(hostnames, now)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    // WebSocket upgrades are HTTP/1.1.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    // No resumption, so no session tickets. A resumed TLS 1.3 session brings back the
    // client's certificate chain without checking it or its expiry again, and the
    // certificate is what a daemon proves itself with (docs/decisions.md). It would not
    // have paid either: rustls sends two tickets after every handshake by default, kept
    // (with the client's chain) in this process's cache of 256, the last 128 handshakes', so
    // a daemon could resume only on the replica it just left, and in a failover, when
    // thousands reconnect to other replicas, never; every one of them paid for two tickets
    // on both ends.
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(Arc::new(config))
}
