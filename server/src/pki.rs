//! The control plane's certificate authority: created on first start, kept on disk, and used
//! to sign node certificates (from the daemon's CSR) and the gateway's server certificate.

use anyhow::{Context, anyhow};
use bc_core::ids::NodeId;
use chrono::{DateTime, Duration, Utc};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};
use std::path::Path;

/// How long the CA itself is valid. Long, because replacing it means re-issuing every node's
/// identity; rotation is an operator's decision, not an expiry surprise.
const CA_LIFETIME_DAYS: i64 = 3650;
/// The gateway's server certificate is re-issued at every start; a week covers any uptime
/// between restarts of a development server and is short enough not to matter if leaked.
const SERVER_CERT_LIFETIME_DAYS: i64 = 7;
/// Clock skew between the control plane and nodes that a fresh certificate tolerates.
const NOT_BEFORE_SKEW_MINUTES: i64 = 5;
/// The URI SAN prefix carrying a node's identity: `bc://node/<id>/identity/<generation>`.
const NODE_URI_PREFIX: &str = "bc://node/";

pub struct Ca {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    fingerprint: String,
}

/// A signed certificate and when it expires.
pub struct Signed {
    pub pem: String,
    pub not_after: DateTime<Utc>,
}

/// Who a client certificate says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeIdentity {
    pub node_id: NodeId,
    pub identity_generation: i64,
}

/// Why a CSR was refused, or could not be signed.
#[derive(Debug, thiserror::Error)]
pub enum CsrError {
    #[error("the CSR is not a valid PKCS#10 request: {0}")]
    Malformed(String),
    /// The CA could not sign a certificate for a valid CSR: the server's fault, not the
    /// requester's.
    #[error("signing the node certificate failed: {0}")]
    Signing(String),
}

/// A node's certificate signing request, parsed, with its signature verified: it proves the
/// requester holds the key. A join parses it once its token admits it and before it writes
/// anything, so that a bad one is refused with nothing written, and the CA signs it at the
/// join's end.
pub struct NodeCsr(CertificateSigningRequestParams);

impl NodeCsr {
    pub fn parse(pem: &str) -> Result<NodeCsr, CsrError> {
        CertificateSigningRequestParams::from_pem(pem)
            .map(NodeCsr)
            .map_err(|e| CsrError::Malformed(e.to_string()))
    }
}

fn to_time(t: DateTime<Utc>) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(t.timestamp())
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

fn random_serial() -> SerialNumber {
    use rand::Rng;
    let mut bytes: [u8; 16] = rand::rng().random();
    // Positive, as RFC 5280 requires.
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

impl Ca {
    /// Loads the CA from `dir` (`ca.crt`, `ca.key`), creating it there on first start.
    pub fn load_or_create(dir: &Path, now: DateTime<Utc>) -> anyhow::Result<Ca> {
        let cert_path = dir.join("ca.crt");
        let key_path = dir.join("ca.key");
        if cert_path.exists() && key_path.exists() {
            let cert_pem = std::fs::read_to_string(&cert_path)
                .with_context(|| format!("reading {}", cert_path.display()))?;
            let key = KeyPair::from_pem(&std::fs::read_to_string(&key_path)?)
                .context("parsing the CA key")?;
            let issuer =
                Issuer::from_ca_cert_pem(&cert_pem, key).context("parsing the CA certificate")?;
            return Ca::new(cert_pem, issuer);
        }
        std::fs::create_dir_all(dir)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, "Better Compute control plane CA");
        name.push(DnType::OrganizationName, "Better Compute");
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = to_time(now - Duration::minutes(NOT_BEFORE_SKEW_MINUTES));
        params.not_after = to_time(now + Duration::days(CA_LIFETIME_DAYS));
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key)?;
        crate::private_file::write_private(&key_path, key.serialize_pem().as_bytes())?;
        std::fs::write(&cert_path, cert.pem())?;
        tracing::info!(path = %cert_path.display(), "created the control plane CA");
        Ca::new(cert.pem(), Issuer::new(params, key))
    }

    fn new(cert_pem: String, issuer: Issuer<'static, KeyPair>) -> anyhow::Result<Ca> {
        let der = rustls_pki_types::pem::PemObject::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| anyhow!("the CA certificate is not PEM: {e}"))?;
        let cert_der: CertificateDer<'static> = der;
        let fingerprint = hex::encode(Sha256::digest(cert_der.as_ref()));
        Ok(Ca {
            cert_pem,
            cert_der,
            issuer,
            fingerprint,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// SHA-256 (hex) of the CA certificate's DER: what a daemon pins.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Signs a node certificate for the key of `csr`. Everything else in the CSR is ignored:
    /// the identity comes from the control plane, never from the requester.
    pub fn sign_node(
        &self,
        csr: &NodeCsr,
        node_id: &NodeId,
        identity_generation: i64,
        now: DateTime<Utc>,
        lifetime: Duration,
    ) -> Result<Signed, CsrError> {
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, node_id.as_str());
        name.push(DnType::OrganizationName, "Better Compute nodes");
        params.distinguished_name = name;
        let uri = format!("{NODE_URI_PREFIX}{node_id}/identity/{identity_generation}");
        params.subject_alt_names =
            vec![SanType::URI(uri.try_into().map_err(|_| {
                CsrError::Signing("node id does not fit a URI".into())
            })?)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let not_after = now + lifetime;
        params.not_before = to_time(now - Duration::minutes(NOT_BEFORE_SKEW_MINUTES));
        params.not_after = to_time(not_after);
        params.serial_number = Some(random_serial());
        let cert = params
            .signed_by(&csr.0.public_key, &self.issuer)
            .map_err(|e| CsrError::Signing(e.to_string()))?;
        Ok(Signed {
            pem: cert.pem(),
            not_after,
        })
    }

    /// A fresh server certificate and key for the gateway listener, valid for `hostnames`
    /// (DNS names or IP addresses).
    pub fn server_certificate(
        &self,
        hostnames: &[String],
        now: DateTime<Utc>,
    ) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(hostnames.to_vec())?;
        params
            .distinguished_name
            .push(DnType::CommonName, "Better Compute gateway");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.not_before = to_time(now - Duration::minutes(NOT_BEFORE_SKEW_MINUTES));
        params.not_after = to_time(now + Duration::days(SERVER_CERT_LIFETIME_DAYS));
        params.serial_number = Some(random_serial());
        let cert = params.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![cert.der().clone(), self.cert_der.clone()], key_der))
    }
}

/// Reads the node identity from a client certificate the TLS layer already verified.
pub fn node_identity(cert: &CertificateDer<'_>) -> Option<NodeIdentity> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let san = parsed.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|name| match name {
        x509_parser::extensions::GeneralName::URI(uri) => {
            let rest = uri.strip_prefix(NODE_URI_PREFIX)?;
            let (id, generation) = rest.split_once("/identity/")?;
            Some(NodeIdentity {
                node_id: NodeId::parse(id).ok()?,
                identity_generation: generation.parse().ok()?,
            })
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_persists_and_signs_node_certificates_carrying_the_identity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let now = Utc::now();
        let ca = Ca::load_or_create(dir.path(), now).expect("created");
        let again = Ca::load_or_create(dir.path(), now).expect("loaded");
        assert_eq!(ca.fingerprint(), again.fingerprint());

        let key = KeyPair::generate().expect("key");
        let csr = CertificateParams::new(vec!["ignored.example".to_owned()])
            .expect("params")
            .serialize_request(&key)
            .expect("csr")
            .pem()
            .expect("pem");
        let node = NodeId::generate();
        let signed = again
            .sign_node(
                &NodeCsr::parse(&csr).expect("a CSR"),
                &node,
                3,
                now,
                Duration::hours(24),
            )
            .expect("signed");
        let der: CertificateDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(signed.pem.as_bytes()).expect("pem");
        assert_eq!(
            node_identity(&der),
            Some(NodeIdentity {
                node_id: node,
                identity_generation: 3
            })
        );
    }

    #[test]
    fn garbage_and_tampered_csrs_are_refused() {
        assert!(NodeCsr::parse("not a csr").is_err());
        let key = KeyPair::generate().expect("key");
        let csr = CertificateParams::new(vec!["a.example".to_owned()])
            .expect("params")
            .serialize_request(&key)
            .expect("csr");
        let mut der = csr.der().to_vec();
        let last = der.len() - 1;
        der[last] ^= 0xff;
        let tampered = pem_encode("CERTIFICATE REQUEST", &der);
        assert!(NodeCsr::parse(&tampered).is_err());
    }

    fn pem_encode(label: &str, der: &[u8]) -> String {
        use base64::Engine;
        let body = base64::engine::general_purpose::STANDARD.encode(der);
        let lines: Vec<&str> = body
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap_or_default())
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        )
    }
}
