//! The node's identity: its own ECDSA P-256 key (never sent), the CSR, the certificate the
//! control plane signs for it, joining (`/v1/join`) and renewing (`/v1/renew`), and adopting
//! a rotated CA.

use super::tls::{GatewayContext, Trust};
use super::{DaemonError, DaemonKnobs, FakeDaemon, Phase};
use bc_core::protocol::{ErrorBody, IssuedIdentity, JoinRequest, RenewRequest};
use chrono::Utc;
use rustls::ClientConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;

/// When a renewal fails for a reason that may pass, the next try comes this much later.
pub(super) const RENEW_RETRY_DELAY: Duration = Duration::from_secs(30);
/// Up to this share of the time until `renewAfter` is taken off at random, so a fleet that
/// joined together does not renew together.
const RENEW_JITTER: f64 = 0.05;

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
pub(super) struct Identity {
    pub(super) issued: IssuedIdentity,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    pub(super) session_tls: Arc<ClientConfig>,
    /// When to renew; a failed renewal moves it [`RENEW_RETRY_DELAY`] on.
    pub(super) renew_at: Instant,
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

    pub(super) fn expired(&self) -> bool {
        self.issued.expires_at <= Utc::now()
    }
}

impl FakeDaemon {
    /// `POST /v1/join` with a fresh key; None if stopped.
    pub(super) async fn join(
        &self,
        context: &GatewayContext,
        trust: &mut Arc<Trust>,
    ) -> Option<Result<Identity, DaemonError>> {
        self.update(|s| s.phase = Phase::Joining);
        let _permit = self.unless_stopped(context.join_permit()).await?;
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
                    .post(context.endpoint(self.gateway(), "/v1/join")?)
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
    pub(super) async fn renew(
        &self,
        context: &GatewayContext,
        trust: &mut Arc<Trust>,
        identity: &Identity,
    ) -> Result<Identity, DaemonError> {
        let (key, csr_pem) = key_and_csr(self.hostname())?;
        let client = trust.http_client(Some((&identity.chain, &identity.key)))?;
        let response = client
            .post(context.endpoint(self.gateway(), "/v1/renew")?)
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

    /// Counts a renewal and shows the new certificate in the status.
    pub(super) fn record_renewal(&self, renewed: &Identity) {
        tracing::debug!(hostname = %self.hostname(), node = %renewed.issued.node_id, "certificate renewed");
        self.shared
            .counters
            .renewals
            .fetch_add(1, Ordering::Relaxed);
        let expires_at = renewed.issued.expires_at;
        let generation = renewed.issued.identity_generation;
        self.update(|s| {
            s.renewals += 1;
            s.certificate_expires_at = Some(expires_at);
            s.identity_generation = Some(generation);
        });
    }
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
}
