//! Power drivers: how the control plane reaches a machine's BMC. A pool's `drivers.power`
//! chooses one for each of its nodes ([`bc_core::bare_metal::PowerDriverKind`]): `redfish`
//! ([`redfish::RedfishDriver`], DMTF Redfish over HTTPS) or `none` ([`NoPowerDriver`], for
//! machines without a BMC, which answers every request with [`BmcError::Unsupported`]).
//!
//! A driver is IO and nothing else: it knows nothing of nodes, rows or events. The service
//! layer builds one from a node's stored BMC ([`BmcEndpoint`]) and records what it answers;
//! the Power controller polls through it. Every request is bounded by
//! `bare_metal.request_timeout_secs`, and every failure is typed ([`BmcError`]), because
//! operators act differently on a BMC that is down, one that refuses the password and one
//! that answers nonsense.

pub mod redfish;
mod tls;

pub use tls::AcceptAnyCertificate;

pub use tls::roots_from_pem;

use bc_core::axes::Power;
use bc_core::bare_metal::{BmcTlsVerification, PowerAction, PowerDriverKind};
use std::time::Duration;

use crate::credentials::BmcCredentials;

/// Why a BMC request failed. [`BmcError::reason`] is the `BmcUnreachable` condition's reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BmcError {
    /// No connection: refused, reset, no route, DNS, a TLS handshake that failed (a
    /// certificate that does not verify included).
    #[error("the BMC could not be reached: {0}")]
    Unreachable(String),
    /// Connected (or tried to) but no answer within the request timeout.
    #[error("the BMC did not answer within {0} s")]
    Timeout(u64),
    /// The BMC refused the credentials (HTTP 401 or 403).
    #[error("the BMC refused the credentials (HTTP {0})")]
    Unauthorized(u16),
    /// An answer the Redfish schema does not allow: an error status, no JSON, a missing or
    /// unknown field.
    #[error("the BMC answered unexpectedly: {0}")]
    UnexpectedAnswer(String),
    /// The driver or the BMC does not offer this (no power driver; a reset type the BMC
    /// does not list).
    #[error("not supported: {0}")]
    Unsupported(String),
}

impl BmcError {
    /// A PascalCase word for conditions and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            BmcError::Unreachable(_) => "Unreachable",
            BmcError::Timeout(_) => "Timeout",
            BmcError::Unauthorized(_) => "Unauthorized",
            BmcError::UnexpectedAnswer(_) => "UnexpectedAnswer",
            BmcError::Unsupported(_) => "Unsupported",
        }
    }
}

/// How to check the BMC's certificate.
#[derive(Clone, PartialEq, Eq)]
pub enum BmcTls {
    /// Against the platform's roots (the operating system's store).
    Verify,
    /// Against this CA (PEM), given at enrolment.
    CustomCa(String),
    /// Not at all.
    Off,
}

impl BmcTls {
    pub fn verification(&self) -> BmcTlsVerification {
        match self {
            BmcTls::Verify => BmcTlsVerification::Verify,
            BmcTls::CustomCa(_) => BmcTlsVerification::CustomCa,
            BmcTls::Off => BmcTlsVerification::Off,
        }
    }
}

/// Everything a driver needs to reach one machine's BMC. `Debug` leaves out the credentials.
#[derive(Clone)]
pub struct BmcEndpoint {
    /// The service's base URL: scheme, host and port, nothing else ([`parse_address`]).
    pub address: reqwest::Url,
    /// The `ComputerSystem`'s id, when the BMC serves several (a chassis manager, the
    /// emulator); otherwise the only one is used.
    pub system_id: Option<String>,
    /// The machine's system UUID from its enrolment, to pick the right system among several
    /// when no id was given.
    pub system_uuid: Option<String>,
    /// The system's path as found before, which saves walking the service root again.
    pub system_path: Option<String>,
    pub tls: BmcTls,
    pub credentials: BmcCredentials,
}

impl std::fmt::Debug for BmcEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BmcEndpoint")
            .field("address", &self.address.as_str())
            .field("system_id", &self.system_id)
            .field("tls", &self.tls.verification())
            .finish_non_exhaustive()
    }
}

/// What every driver shares: the request timeout, and whether plain HTTP is allowed.
#[derive(Debug, Clone, Copy)]
pub struct DriverSettings {
    pub request_timeout: Duration,
    pub allow_insecure_http: bool,
}

/// A one-time boot override for the next boot (the workflows' network boot, the deploy
/// image's virtual media).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootTarget {
    /// Network boot (Redfish `Pxe`).
    Pxe,
    /// The local disk (Redfish `Hdd`).
    Hdd,
    /// The virtual CD the BMC serves (Redfish `Cd`), where [`PowerDriver::insert_media`]
    /// put an image.
    Cd,
}

/// A machine's power, through whatever its pool's `drivers.power` names.
#[async_trait::async_trait]
pub trait PowerDriver: Send + Sync {
    /// The machine's power as the BMC reports it now.
    async fn power_state(&self) -> Result<Power, BmcError>;
    /// Asks the BMC to act. Success means the BMC accepted the request; the power state
    /// follows when the BMC has acted (seconds later, for some).
    async fn power(&self, action: PowerAction) -> Result<(), BmcError>;
    /// Boots from `target` at the next boot only.
    async fn boot_once(&self, target: BootTarget) -> Result<(), BmcError>;
    /// Inserts the image at `image` (an address the BMC downloads from) into the BMC's
    /// virtual CD. `Ok(false)`: the BMC has no virtual CD, and nothing was done. Inserting
    /// the image that is inserted already does nothing, so a step may repeat it.
    async fn insert_media(&self, image: &str) -> Result<bool, BmcError>;
    /// Ejects the image in the BMC's virtual CD. `Ok(false)`: nothing was inserted (or the
    /// BMC has no virtual CD), and nothing was done; so a step may repeat it.
    async fn eject_media(&self) -> Result<bool, BmcError>;
    /// The system's path as found, for the caller to keep (`None` before it is found, and
    /// for drivers without one).
    fn system_path(&self) -> Option<String>;
}

/// The driver `kind` names, for `endpoint`.
pub fn driver(
    kind: PowerDriverKind,
    endpoint: Option<BmcEndpoint>,
    settings: DriverSettings,
) -> Result<Box<dyn PowerDriver>, BmcError> {
    match (kind, endpoint) {
        (PowerDriverKind::Redfish, Some(endpoint)) => {
            Ok(Box::new(redfish::RedfishDriver::new(endpoint, settings)?))
        }
        (PowerDriverKind::Redfish, None) => Err(BmcError::Unsupported(
            "the node's power driver is redfish, but no BMC was enrolled for it".into(),
        )),
        (PowerDriverKind::None, _) => Ok(Box::new(NoPowerDriver)),
    }
}

/// `drivers.power = none`: a machine without a BMC. Its power stays `unknown`.
pub struct NoPowerDriver;

fn no_driver() -> BmcError {
    BmcError::Unsupported("the node's pool has no power driver (drivers.power is none)".into())
}

#[async_trait::async_trait]
impl PowerDriver for NoPowerDriver {
    async fn power_state(&self) -> Result<Power, BmcError> {
        Err(no_driver())
    }
    async fn power(&self, _action: PowerAction) -> Result<(), BmcError> {
        Err(no_driver())
    }
    async fn boot_once(&self, _target: BootTarget) -> Result<(), BmcError> {
        Err(no_driver())
    }
    async fn insert_media(&self, _image: &str) -> Result<bool, BmcError> {
        Err(no_driver())
    }
    async fn eject_media(&self) -> Result<bool, BmcError> {
        Err(no_driver())
    }
    fn system_path(&self) -> Option<String> {
        None
    }
}

/// The longest BMC address accepted.
pub const MAX_ADDRESS_BYTES: usize = 2048;

/// Parses a BMC address: `https://host[:port]` and nothing more (no user, path, query or
/// fragment: credentials travel in their own fields, and a system is named by `systemId`).
/// `http://` only when `allow_insecure_http` (tests, labs).
pub fn parse_address(raw: &str, allow_insecure_http: bool) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(raw.trim())
        .map_err(|e| format!("is not a URL ({e}); write https://host[:port]"))?;
    match url.scheme() {
        "https" => {}
        "http" if allow_insecure_http => {}
        "http" => {
            return Err(
                "is plain http, which would send the BMC's password in the clear; use https \
                 (bare_metal.allow_insecure_http allows http, for tests)"
                    .into(),
            );
        }
        other => return Err(format!("has the scheme `{other}`; use https")),
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("has no host".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("carries credentials; give them in `username` and `password`".into());
    }
    if !matches!(url.path(), "" | "/") || url.query().is_some() || url.fragment().is_some() {
        return Err(
            "has a path, query or fragment; give the service's https://host[:port] (and the \
             system's id in `systemId`)"
                .into(),
        );
    }
    Ok(url)
}

/// A Redfish resource id (`systemId`): what may follow `/redfish/v1/Systems/`.
pub fn validate_system_id(id: &str) -> Result<(), String> {
    let valid = !id.is_empty()
        && id.len() <= 128
        && !id.bytes().all(|b| b == b'.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if valid {
        Ok(())
    } else {
        Err("is not a Redfish resource id (1-128 of A-Z, a-z, 0-9, - _ . :)".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_https_hosts_only() {
        assert!(parse_address("https://10.0.0.5", false).is_ok());
        assert!(parse_address("https://bmc-1.dc1.example.com:8443/", false).is_ok());
        let refused = [
            "http://10.0.0.5",
            "ftp://10.0.0.5",
            "https://admin:pw@10.0.0.5",
            "https://10.0.0.5/redfish/v1/Systems/1",
            "https://10.0.0.5/?x=1",
            "10.0.0.5",
            "",
        ];
        for raw in refused {
            assert!(parse_address(raw, false).is_err(), "{raw}");
        }
        assert!(parse_address("http://127.0.0.1:8000", true).is_ok());
    }

    #[test]
    fn system_ids_are_resource_ids() {
        assert!(validate_system_id("11111111-1111-4111-8111-000000000001").is_ok());
        assert!(validate_system_id("System.Embedded.1").is_ok());
        assert!(validate_system_id("../x").is_err() && validate_system_id("").is_err());
        assert!(validate_system_id("..").is_err());
    }

    #[test]
    fn endpoints_do_not_show_credentials() {
        let endpoint = BmcEndpoint {
            address: parse_address("https://10.0.0.5", false).expect("valid"),
            system_id: None,
            system_uuid: None,
            system_path: None,
            tls: BmcTls::Off,
            credentials: BmcCredentials {
                username: "root".into(),
                password: "calvin".into(),
            },
        };
        let shown = format!("{endpoint:?}");
        assert!(
            !shown.contains("calvin") && !shown.contains("root"),
            "{shown}"
        );
    }
}
