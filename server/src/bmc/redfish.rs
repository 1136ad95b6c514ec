//! The Redfish power driver: DMTF Redfish over HTTPS with basic authentication, following
//! the schema rather than a vendor's paths. From the service root (`/redfish/v1/`) to its
//! `Systems` collection to the machine's `ComputerSystem`, whose `PowerState` is the power,
//! whose `Actions/#ComputerSystem.Reset` (`target`, `ResetType@Redfish.AllowableValues`) is
//! how to change it, and whose `Boot` object takes a one-time boot override (PATCH).
//!
//! Choices, where BMCs differ:
//! - the system: the one named by `systemId`; else the collection's only member; else the
//!   member whose `UUID` is the machine's enrolled `system-uuid`; else an error naming them;
//! - `PowerState`: `On` and `Paused` are on, `Off` is off; `PoweringOn` and `PoweringOff`
//!   are read as where they are going (the BMC has accepted the change). Anything else is
//!   an unexpected answer;
//! - reset types: on is `On` (else `ForceOn`), off is `ForceOff`, cycle is `PowerCycle` where
//!   the BMC lists it and `ForceRestart` otherwise (many BMCs, the emulator included, do
//!   not implement `PowerCycle`). A type the BMC's `AllowableValues` leaves out is
//!   `Unsupported`, before anything is sent;
//! - virtual media: the system's own `VirtualMedia` collection (Redfish 2021 and later), else
//!   those of the managers in its `Links/ManagedBy`; the first device whose `MediaTypes`
//!   name `CD` or `DVD`, through its `#VirtualMedia.InsertMedia` action (ejecting another
//!   image first), and `#VirtualMedia.EjectMedia` to take it out once the deployed system
//!   runs. A BMC without one answers "no virtual media", and the deploy boots from the
//!   network instead;
//! - redirects are not followed (a 3xx is an unexpected answer), so credentials never leave
//!   for another host; answers are read up to 1 MiB.

use bc_core::axes::Power;
use bc_core::bare_metal::PowerAction;
use reqwest::{Method, StatusCode, Url};
use serde_json::{Value, json};
use std::sync::Mutex;

use super::{BmcEndpoint, BmcError, BootTarget, DriverSettings, PowerDriver};
use crate::credentials::BmcCredentials;

/// The largest answer read from a BMC. Redfish resources are a few KiB.
const MAX_ANSWER_BYTES: usize = 1024 * 1024;
/// The Redfish service root, the only fixed path of the protocol.
const SERVICE_ROOT: &str = "/redfish/v1/";
const RESET_ACTION: &str = "#ComputerSystem.Reset";
const INSERT_MEDIA_ACTION: &str = "#VirtualMedia.InsertMedia";
const EJECT_MEDIA_ACTION: &str = "#VirtualMedia.EjectMedia";

pub struct RedfishDriver {
    client: reqwest::Client,
    base: Url,
    system_id: Option<String>,
    system_uuid: Option<String>,
    credentials: BmcCredentials,
    timeout_secs: u64,
    /// The system's path, once found (or as stored).
    system_path: Mutex<Option<String>>,
}

impl RedfishDriver {
    pub fn new(endpoint: BmcEndpoint, settings: DriverSettings) -> Result<Self, BmcError> {
        let https = endpoint.address.scheme() == "https";
        if !https && !settings.allow_insecure_http {
            return Err(BmcError::Unsupported(
                "plain http BMC addresses are not allowed (bare_metal.allow_insecure_http)".into(),
            ));
        }
        let client = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .connect_timeout(settings.request_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .https_only(https)
            // BMCs close idle connections early and some mishandle reuse; one request at a
            // time per poll gains nothing from a pool.
            .pool_max_idle_per_host(0)
            // Set for plain http too: the client then never looks for a process-wide
            // crypto provider.
            .tls_backend_preconfigured(super::tls::client_config(&endpoint.tls)?)
            .build()
            .map_err(|e| BmcError::Unsupported(format!("no HTTP client: {e}")))?;
        Ok(RedfishDriver {
            client,
            base: endpoint.address,
            system_id: endpoint.system_id,
            system_uuid: endpoint.system_uuid,
            credentials: endpoint.credentials,
            timeout_secs: settings.request_timeout.as_secs(),
            system_path: Mutex::new(endpoint.system_path),
        })
    }

    fn url(&self, path: &str) -> Result<Url, BmcError> {
        if !path.starts_with('/') || path.starts_with("//") {
            return Err(BmcError::UnexpectedAnswer(format!(
                "a link that is not a path on this service: `{}`",
                shorten(path)
            )));
        }
        self.base
            .join(path)
            .map_err(|e| BmcError::UnexpectedAnswer(format!("a link that is not a path: {e}")))
    }

    /// One request; the answer's JSON (`Null` for an empty body).
    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, BmcError> {
        let url = self.url(path)?;
        let mut request = self
            .client
            .request(method.clone(), url)
            .basic_auth(&self.credentials.username, Some(&self.credentials.password))
            .header(reqwest::header::ACCEPT, "application/json");
        if let Some(body) = body {
            request = request.json(&body);
        }
        let mut response = request.send().await.map_err(|e| self.failed(&e))?;
        let status = response.status();
        if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return Err(BmcError::Unauthorized(status.as_u16()));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| self.failed(&e))? {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(BmcError::UnexpectedAnswer(format!(
                    "{method} {path} answered more than {MAX_ANSWER_BYTES} bytes"
                )));
            }
            bytes.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            return Err(BmcError::UnexpectedAnswer(format!(
                "{method} {path} answered HTTP {}{}",
                status.as_u16(),
                redfish_message(&bytes)
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            )));
        }
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|_| {
            BmcError::UnexpectedAnswer(format!("{method} {path} answered something not JSON"))
        })
    }

    async fn get(&self, path: &str) -> Result<Value, BmcError> {
        match self.request(Method::GET, path, None).await? {
            Value::Null => Err(BmcError::UnexpectedAnswer(format!(
                "GET {path} answered nothing"
            ))),
            value => Ok(value),
        }
    }

    fn failed(&self, e: &reqwest::Error) -> BmcError {
        if e.is_timeout() {
            return BmcError::Timeout(self.timeout_secs);
        }
        // reqwest's own text is terse ("error sending request"); the causes say why.
        let mut text = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        BmcError::Unreachable(shorten(&text))
    }

    /// The `ComputerSystem`'s path: stored, or found from the service root.
    async fn system(&self) -> Result<String, BmcError> {
        if let Some(path) = self.cached_path() {
            return Ok(path);
        }
        let root = self.get(SERVICE_ROOT).await?;
        let systems = link(&root, "Systems")?;
        let path = match &self.system_id {
            Some(id) => format!("{}/{id}", systems.trim_end_matches('/')),
            None => self.find_system(&systems).await?,
        };
        *self
            .system_path
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(path.clone());
        Ok(path)
    }

    fn cached_path(&self) -> Option<String> {
        self.system_path
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    async fn find_system(&self, systems: &str) -> Result<String, BmcError> {
        let collection = self.get(systems).await?;
        let members: Vec<String> = collection
            .get("Members")
            .and_then(Value::as_array)
            .ok_or_else(|| BmcError::UnexpectedAnswer(format!("{systems} has no `Members` list")))?
            .iter()
            .map(|m| {
                m.get("@odata.id")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        BmcError::UnexpectedAnswer(format!("a member of {systems} has no link"))
                    })
            })
            .collect::<Result<_, _>>()?;
        match (members.as_slice(), &self.system_uuid) {
            ([], _) => Err(BmcError::UnexpectedAnswer(format!(
                "{systems} lists no system"
            ))),
            ([only], _) => Ok(only.clone()),
            (several, Some(uuid)) => {
                for member in several {
                    let system = self.get(member).await?;
                    if system
                        .get("UUID")
                        .and_then(Value::as_str)
                        .is_some_and(|u| same_uuid(u, uuid))
                    {
                        return Ok(member.clone());
                    }
                }
                Err(BmcError::UnexpectedAnswer(format!(
                    "none of the {} systems of {systems} has the UUID {uuid}",
                    several.len()
                )))
            }
            (several, None) => Err(BmcError::UnexpectedAnswer(format!(
                "{systems} lists {} systems; name one with `systemId`",
                several.len()
            ))),
        }
    }

    /// A request on the system that failed because the stored path went stale (the BMC was
    /// replaced) is retried once from the service root.
    async fn on_system<T, F, Fut>(&self, run: F) -> Result<T, BmcError>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Result<T, BmcError>>,
    {
        let cached = self.cached_path().is_some();
        let path = self.system().await?;
        match run(path).await {
            Err(BmcError::UnexpectedAnswer(why)) if cached && why.contains("HTTP 404") => {
                *self
                    .system_path
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                let path = self.system().await?;
                run(path).await
            }
            other => other,
        }
    }
}

#[async_trait::async_trait]
impl PowerDriver for RedfishDriver {
    async fn power_state(&self) -> Result<Power, BmcError> {
        self.on_system(|path| async move {
            let system = self.get(&path).await?;
            power_of(&system)
        })
        .await
    }

    async fn power(&self, action: PowerAction) -> Result<(), BmcError> {
        self.on_system(|path| async move {
            let system = self.get(&path).await?;
            let reset = system
                .get("Actions")
                .and_then(|a| a.get(RESET_ACTION))
                .ok_or_else(|| {
                    BmcError::Unsupported(format!("{path} offers no {RESET_ACTION} action"))
                })?;
            let target = reset.get("target").and_then(Value::as_str).ok_or_else(|| {
                BmcError::UnexpectedAnswer(format!("{path}'s {RESET_ACTION} has no target"))
            })?;
            let allowed: Option<Vec<&str>> = reset
                .get("ResetType@Redfish.AllowableValues")
                .and_then(Value::as_array)
                .map(|values| values.iter().filter_map(Value::as_str).collect());
            let reset_type = reset_type(action, allowed.as_deref())?;
            self.request(
                Method::POST,
                target,
                Some(json!({ "ResetType": reset_type })),
            )
            .await?;
            Ok(())
        })
        .await
    }

    async fn boot_once(&self, target: BootTarget) -> Result<(), BmcError> {
        let target = match target {
            BootTarget::Pxe => "Pxe",
            BootTarget::Hdd => "Hdd",
            BootTarget::Cd => "Cd",
        };
        self.on_system(|path| async move {
            self.request(
                Method::PATCH,
                &path,
                Some(json!({
                    "Boot": {
                        "BootSourceOverrideTarget": target,
                        "BootSourceOverrideEnabled": "Once",
                    }
                })),
            )
            .await?;
            Ok(())
        })
        .await
    }

    async fn insert_media(&self, image: &str) -> Result<bool, BmcError> {
        self.on_system(|path| async move {
            match self.system_cd(&path).await? {
                Some(device) => {
                    self.insert_into(&device, image).await?;
                    Ok(true)
                }
                None => Ok(false),
            }
        })
        .await
    }

    async fn eject_media(&self) -> Result<bool, BmcError> {
        self.on_system(|path| async move {
            let Some(device) = self.system_cd(&path).await? else {
                return Ok(false);
            };
            if device.get("Inserted").and_then(Value::as_bool) != Some(true) {
                return Ok(false);
            }
            let eject = device_action(&device, EJECT_MEDIA_ACTION).ok_or_else(|| {
                BmcError::Unsupported(format!(
                    "the virtual CD offers no {EJECT_MEDIA_ACTION} action"
                ))
            })?;
            self.request(Method::POST, &eject, Some(json!({}))).await?;
            Ok(true)
        })
        .await
    }

    fn system_path(&self) -> Option<String> {
        self.cached_path()
    }
}

impl RedfishDriver {
    /// The system's virtual CD: the first CD or DVD device of its own `VirtualMedia`
    /// collection, else of its managers' (`Links/ManagedBy`); `None` when it has none.
    async fn system_cd(&self, path: &str) -> Result<Option<Value>, BmcError> {
        let system = self.get(path).await?;
        let mut collections: Vec<String> = link(&system, "VirtualMedia").ok().into_iter().collect();
        for manager in links(system.get("Links"), "ManagedBy") {
            let manager = self.get(&manager).await?;
            collections.extend(link(&manager, "VirtualMedia").ok());
        }
        for collection in collections {
            if let Some(device) = self.virtual_cd(&collection).await? {
                return Ok(Some(device));
            }
        }
        Ok(None)
    }

    /// The first device of a `VirtualMedia` collection that takes a CD or DVD.
    async fn virtual_cd(&self, collection: &str) -> Result<Option<Value>, BmcError> {
        let list = self.get(collection).await?;
        for member in links(Some(&list), "Members") {
            let device = self.get(&member).await?;
            let cd = device
                .get("MediaTypes")
                .and_then(Value::as_array)
                .is_some_and(|types| {
                    types
                        .iter()
                        .any(|t| matches!(t.as_str(), Some("CD" | "DVD")))
                });
            if cd {
                return Ok(Some(device));
            }
        }
        Ok(None)
    }

    /// Inserts `image` into `device`: nothing when it is in already, else ejecting what is
    /// in first.
    async fn insert_into(&self, device: &Value, image: &str) -> Result<(), BmcError> {
        let inserted = device.get("Inserted").and_then(Value::as_bool) == Some(true);
        let current = device.get("Image").and_then(Value::as_str).unwrap_or("");
        if inserted && current == image {
            return Ok(());
        }
        if inserted && let Some(eject) = device_action(device, EJECT_MEDIA_ACTION) {
            self.request(Method::POST, &eject, Some(json!({}))).await?;
        }
        let insert = device_action(device, INSERT_MEDIA_ACTION).ok_or_else(|| {
            BmcError::Unsupported(format!(
                "the virtual CD offers no {INSERT_MEDIA_ACTION} action"
            ))
        })?;
        self.request(
            Method::POST,
            &insert,
            Some(json!({ "Image": image, "Inserted": true, "WriteProtected": true })),
        )
        .await?;
        Ok(())
    }
}

/// The target of a virtual media device's action `name` (`#VirtualMedia.InsertMedia`, …).
fn device_action(device: &Value, name: &str) -> Option<String> {
    device
        .get("Actions")
        .and_then(|a| a.get(name))
        .and_then(|a| a.get("target"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// UUIDs compared as their 32 hex digits, whatever the dashes, braces and case.
fn same_uuid(a: &str, b: &str) -> bool {
    let digits = |s: &str| -> String {
        s.chars()
            .filter(char::is_ascii_hexdigit)
            .map(|c| c.to_ascii_lowercase())
            .collect()
    };
    digits(a) == digits(b)
}

/// `resource[name]["@odata.id"]`.
fn link(resource: &Value, name: &str) -> Result<String, BmcError> {
    resource
        .get(name)
        .and_then(|l| l.get("@odata.id"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| BmcError::UnexpectedAnswer(format!("the service root has no `{name}` link")))
}

/// The `@odata.id` of every entry of the link list `resource[name]` (`Members`,
/// `ManagedBy`); an entry without one is skipped, a missing list is empty.
fn links(resource: Option<&Value>, name: &str) -> Vec<String> {
    resource
        .and_then(|r| r.get(name))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.get("@odata.id").and_then(Value::as_str))
        .map(str::to_owned)
        .collect()
}

/// A `ComputerSystem`'s `PowerState` as the `power` axis.
pub fn power_of(system: &Value) -> Result<Power, BmcError> {
    match system.get("PowerState").and_then(Value::as_str) {
        Some("On" | "PoweringOn" | "Paused") => Ok(Power::On),
        Some("Off" | "PoweringOff") => Ok(Power::Off),
        Some(other) => Err(BmcError::UnexpectedAnswer(format!(
            "the system's PowerState is `{}`, not a Redfish power state",
            shorten(other)
        ))),
        None => Err(BmcError::UnexpectedAnswer(
            "the system has no PowerState".into(),
        )),
    }
}

/// The `ResetType` for `action`, among those the BMC allows (`None`: it does not say).
pub fn reset_type(action: PowerAction, allowed: Option<&[&str]>) -> Result<&'static str, BmcError> {
    let offers = |t: &str| allowed.is_none_or(|a| a.contains(&t));
    let preference: &[&'static str] = match action {
        PowerAction::On => &["On", "ForceOn"],
        PowerAction::Off => &["ForceOff"],
        // `PowerCycle` only where it is listed: BMCs that do not list their reset types
        // rarely implement it.
        PowerAction::Cycle if allowed.is_some_and(|a| a.contains(&"PowerCycle")) => &["PowerCycle"],
        PowerAction::Cycle => &["ForceRestart"],
    };
    preference
        .iter()
        .copied()
        .find(|t| offers(t))
        .ok_or_else(|| {
            BmcError::Unsupported(format!(
                "the BMC allows none of {} for `{action}` (it allows {})",
                preference.join(", "),
                allowed.unwrap_or_default().join(", ")
            ))
        })
}

/// A Redfish error body's message (`error.message`, or the first extended message).
fn redfish_message(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let error = value.get("error")?;
    let message = error
        .get("@Message.ExtendedInfo")
        .and_then(|i| i.get(0))
        .and_then(|i| i.get("Message"))
        .or_else(|| error.get("message"))?
        .as_str()?;
    Some(shorten(message))
}

/// BMC text put into errors and conditions is cut to a sane length.
fn shorten(text: &str) -> String {
    const MAX: usize = 300;
    if text.len() <= MAX {
        return text.to_owned();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_states_map_to_the_axis() {
        for (state, power) in [
            ("On", Power::On),
            ("PoweringOn", Power::On),
            ("Off", Power::Off),
            ("PoweringOff", Power::Off),
        ] {
            assert_eq!(power_of(&json!({ "PowerState": state })).ok(), Some(power));
        }
        assert!(matches!(
            power_of(&json!({ "PowerState": "Banana" })),
            Err(BmcError::UnexpectedAnswer(_))
        ));
        assert!(power_of(&json!({})).is_err());
    }

    #[test]
    fn reset_types_follow_what_the_bmc_allows() {
        let emulator = [
            "On",
            "ForceOff",
            "GracefulShutdown",
            "ForceRestart",
            "ForceOn",
        ];
        assert_eq!(
            reset_type(PowerAction::On, Some(&emulator[..])).ok(),
            Some("On")
        );
        assert_eq!(
            reset_type(PowerAction::Cycle, Some(&emulator[..])).ok(),
            Some("ForceRestart")
        );
        assert_eq!(
            reset_type(PowerAction::Cycle, Some(&["PowerCycle", "On"][..])).ok(),
            Some("PowerCycle")
        );
        assert_eq!(
            reset_type(PowerAction::On, Some(&["ForceOn"][..])).ok(),
            Some("ForceOn")
        );
        assert_eq!(reset_type(PowerAction::Off, None).ok(), Some("ForceOff"));
        assert!(matches!(
            reset_type(PowerAction::Off, Some(&["On"][..])),
            Err(BmcError::Unsupported(_))
        ));
    }

    #[test]
    fn error_bodies_give_their_message() {
        let body = br#"{"error":{"code":"Base.1.0.GeneralError","message":"Fake system nope was not found"}}"#;
        assert_eq!(
            redfish_message(body).as_deref(),
            Some("Fake system nope was not found")
        );
        assert_eq!(redfish_message(b"<html>"), None);
        assert_eq!(shorten(&"é".repeat(400)).chars().count(), 151);
    }
}
