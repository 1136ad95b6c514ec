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
    Ok(Arc::new(config))
}
