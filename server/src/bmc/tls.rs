//! The TLS client configuration of one BMC: the platform's roots, a CA of the operator's, or
//! no verification at all. TLS 1.2 stays enabled: many BMCs (and the Redfish emulator) speak
//! nothing newer.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_platform_verifier::BuilderVerifierExt;
use std::sync::Arc;

use super::{BmcError, BmcTls};

/// The client configuration for `tls`.
pub(super) fn client_config(tls: &BmcTls) -> Result<ClientConfig, BmcError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        BmcError::Unsupported(format!("the BMC's TLS settings do not work: {what}: {e}"))
    };
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("protocol versions", &e))?;
    let mut config = match tls {
        BmcTls::Verify => builder
            .with_platform_verifier()
            .map_err(|e| bad("the platform's roots", &e))?
            .with_no_client_auth(),
        BmcTls::CustomCa(pem) => builder
            .with_root_certificates(roots_from_pem(pem).map_err(|e| bad("the CA", &e))?)
            .with_no_client_auth(),
        BmcTls::Off => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate(provider)))
            .with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The certificates of a PEM bundle as trust roots; an error if there is none or one does
/// not parse.
pub fn roots_from_pem(pem: &str) -> Result<RootCertStore, String> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("is not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("holds no certificate".into());
    }
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| format!("holds a certificate that does not parse: {e}"))?;
    }
    Ok(roots)
}

/// Accepts any server certificate, but still checks the handshake's signatures against it
/// (so the session is with whoever holds that key): a BMC's `tlsVerification: OFF`, and the
/// FakeDaemon's one request for the gateway's CA before it can check it against its pin.
#[derive(Debug)]
pub struct AcceptAnyCertificate(Arc<CryptoProvider>);

impl AcceptAnyCertificate {
    /// Checks handshake signatures with `provider`'s algorithms.
    pub fn new(provider: Arc<CryptoProvider>) -> AcceptAnyCertificate {
        AcceptAnyCertificate(provider)
    }
}

impl ServerCertVerifier for AcceptAnyCertificate {
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
