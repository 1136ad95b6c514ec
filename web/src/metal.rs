//! Bare metal, the pure parts: a node's bare-metal view as the dashboard holds it (power, its
//! BMC, its workflows with their steps and logs), how its parts read, when the node page
//! keeps polling it, the enrol form's checks, where a server's refusal of a field belongs, and
//! when a power action needs the operator to force it. Unit-tested; the pages are in
//! `bare_metal.rs`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::format::timestamp;
use crate::gql::{ApiError, enroll_bare_metal_node};
use crate::model::seed_spelling;
use crate::placement::duration_text;

/// The pool driver key that names a machine's power driver, and the driver of machines
/// enrolled by their BMC (`bc_core::bare_metal`).
pub const POWER_DRIVER_KEY: &str = "power";
pub const REDFISH: &str = "redfish";

/// A node's bare-metal view: the `BareMetalFields` fragment. `graphql_client` generates it
/// once per operation (the query and each mutation's answer), so each is read into this one
/// type through JSON, the way reservations are. Enumerations keep their wire spelling (`ON`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BareMetal {
    pub node: MetalNode,
    /// `ON`, `OFF` or `UNKNOWN`.
    pub power: String,
    /// `REDFISH` or `NONE`.
    pub power_driver: String,
    pub bmc_reachable: Option<bool>,
    pub bmc: Option<Bmc>,
    /// Newest first; a running workflow is the first.
    pub workflows: Vec<Workflow>,
}

/// What the bare-metal view carries of the node itself.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetalNode {
    pub id: String,
    pub hostname: String,
    /// What power actions and aborts pass.
    pub version: i64,
    pub provision_state: String,
}

/// The node's BMC as the server shows it: never its credentials.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bmc {
    pub address: String,
    pub system_id: Option<String>,
    pub system_path: Option<String>,
    /// `VERIFY`, `CUSTOM_CA` or `OFF`.
    pub tls_verification: String,
    /// `None` before the first poll.
    pub reachable: Option<bool>,
    pub last_error: Option<String>,
    pub consecutive_failures: i64,
    pub last_polled_at: Option<String>,
    pub next_poll_at: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Workflow {
    pub id: String,
    /// `INSPECT`, `COMMISSION`, `DEPLOY`, `RELEASE`, `RESCUE` or `RETIRE`.
    pub kind: String,
    /// `RUNNING`, `SUCCEEDED`, `FAILED` or `ABORTED`.
    pub status: String,
    pub reason: Option<String>,
    pub started_by: String,
    pub current_step: i64,
    pub created_at: String,
    pub updated_at: String,
    pub finished_at: Option<String>,
    pub steps: Vec<Step>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    /// `BOOT_NETWORK_ONCE`, `POWER_ON`, `BURN_IN`, …
    pub kind: String,
    /// `PENDING`, `RUNNING`, `SUCCEEDED`, `FAILED` or `ABORTED`.
    pub status: String,
    pub attempts: i64,
    pub max_attempts: i64,
    pub timeout_seconds: i64,
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    pub deadline: Option<String>,
    pub command_id: Option<String>,
    pub log: Vec<LogLine>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogLine {
    pub at: String,
    pub message: String,
}

impl BareMetal {
    /// The view in any generated type that selects the `BareMetalFields` fragment. The fields
    /// are the fragment's, so this fails only if the operations change; then the console says
    /// so and the panel is left out.
    pub fn of(fragment: &impl Serialize) -> Option<BareMetal> {
        match serde_json::to_value(fragment).and_then(serde_json::from_value) {
            Ok(view) => Some(view),
            Err(err) => {
                leptos::logging::error!("a bare-metal view does not read as one: {err}");
                None
            }
        }
    }

    /// Whether the node is a bare-metal machine at all: its pool binds a power driver, or it
    /// was enrolled with a BMC. Every other node's page shows no bare-metal panel.
    pub fn is_bare_metal(&self) -> bool {
        self.power_driver != "NONE" || self.bmc.is_some()
    }

    /// The workflow under way, if one is.
    pub fn running(&self) -> Option<&Workflow> {
        self.workflows.iter().find(|w| w.status == "RUNNING")
    }

    /// Whether the node page should read the view again soon although no event came: a
    /// workflow's steps log without writing events, a BMC's first failed polls change no
    /// axis, and a power action shows only once the Power controller has read the BMC again
    /// (until `watch_until`).
    pub fn wants_polling(&self, now: DateTime<Utc>, watch_until: Option<DateTime<Utc>>) -> bool {
        self.running().is_some()
            || self.bmc.as_ref().is_some_and(|b| b.reachable.is_none())
            || watch_until.is_some_and(|until| now < until)
    }

    /// How the BMC answers, as a class (`good`, `bad`, `muted`) and a sentence.
    pub fn reachability(&self) -> (&'static str, String) {
        let Some(bmc) = &self.bmc else {
            return ("muted", "no BMC enrolled".to_owned());
        };
        match (bmc.reachable, self.bmc_reachable) {
            (None, _) => ("muted", "not polled yet".to_owned()),
            (_, Some(true)) => ("good", "reachable".to_owned()),
            _ => {
                let polls = match bmc.consecutive_failures {
                    1 => "1 failed poll".to_owned(),
                    n => format!("{n} failed polls in a row"),
                };
                let why = bmc
                    .last_error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default();
                ("bad", format!("unreachable ({polls}){why}"))
            }
        }
    }
}

/// `ON` → `on`: power as the page writes it.
pub fn power_text(power: &str) -> String {
    seed_spelling(power)
}

/// How the BMC's certificate is checked, in words.
pub fn tls_text(verification: &str) -> &'static str {
    match verification {
        "VERIFY" => "certificate checked against the platform's roots",
        "CUSTOM_CA" => "certificate checked against the CA given at enrolment",
        _ => "certificate not checked (labs only)",
    }
}

/// What a step does, as the page names it.
pub fn step_name(kind: &str) -> String {
    match kind {
        "BOOT_NETWORK_ONCE" => "Boot from the network once".to_owned(),
        "BOOT_DEPLOY_IMAGE" => "Boot the deploy image".to_owned(),
        "POWER_ON" => "Power on".to_owned(),
        "AWAIT_DAEMON" => "Wait for the daemon".to_owned(),
        "CHECK_IDENTIFIERS" => "Check the identifiers".to_owned(),
        "BURN_IN" => "Burn in (diag.nvml)".to_owned(),
        "RECORD_FIRMWARE" => "Record the firmware".to_owned(),
        "WIPE_DISKS" => "Wipe the disks (disk.wipe)".to_owned(),
        "POWER_OFF" => "Power off".to_owned(),
        other => seed_spelling(other),
    }
}

/// Seconds between two RFC 3339 times, if both parse.
fn seconds_between(from: &str, to: DateTime<Utc>) -> Option<i64> {
    let from = DateTime::parse_from_rfc3339(from).ok()?;
    Some((to - from.with_timezone(&Utc)).num_seconds())
}

fn parse(at: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(at)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// One line about a workflow: where it is, since when, or how it ended and why.
pub fn workflow_summary(w: &Workflow, now: DateTime<Utc>) -> String {
    let kind = seed_spelling(&w.kind);
    let total = w.steps.len();
    let at = usize::try_from(w.current_step).unwrap_or(0);
    let step = w
        .steps
        .get(at)
        .map(|s| step_name(&s.kind))
        .unwrap_or_default();
    let position = format!("step {} of {total}", (at + 1).min(total.max(1)));
    match w.status.as_str() {
        "RUNNING" => {
            let running = seconds_between(&w.created_at, now)
                .map(|s| format!(", running for {}", duration_text(s.max(0))))
                .unwrap_or_default();
            format!(
                "{kind}: {position}, {step}{running} (started by {})",
                w.started_by
            )
        }
        "SUCCEEDED" => {
            let took = w
                .finished_at
                .as_deref()
                .and_then(parse)
                .and_then(|end| seconds_between(&w.created_at, end))
                .map(|s| format!(" in {}", duration_text(s.max(0))))
                .unwrap_or_default();
            format!("{kind} succeeded{took}")
        }
        status => {
            let why = w
                .reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            format!(
                "{kind} {} at {position} ({step}){why}",
                seed_spelling(status)
            )
        }
    }
}

/// "1 of 3": the attempts a step has begun of those it gets.
pub fn attempts_text(step: &Step) -> String {
    format!("{} of {}", step.attempts, step.max_attempts)
}

/// How long a step took, or has been running, at `now`.
pub fn step_duration(step: &Step, now: DateTime<Utc>) -> String {
    let Some(started) = step.started_at.as_deref() else {
        return String::new();
    };
    let end = step.finished_at.as_deref().and_then(parse).unwrap_or(now);
    seconds_between(started, end)
        .map(|s| duration_text(s.max(0)))
        .unwrap_or_default()
}

/// A running step's deadline at `now`: "in 4 min" or "passed 20 s ago"; blank for a step
/// that is not running (its deadline no longer binds).
pub fn deadline_text(step: &Step, now: DateTime<Utc>) -> String {
    match (step.status.as_str(), step.deadline.as_deref()) {
        ("RUNNING", Some(deadline)) => match parse(deadline) {
            Some(at) => {
                let secs = (at - now).num_seconds();
                if secs >= 0 {
                    format!("in {}", duration_text(secs))
                } else {
                    format!("passed {} ago", duration_text(-secs))
                }
            }
            None => timestamp(deadline),
        },
        _ => String::new(),
    }
}

/// What `powerNode` may ask, as the page offers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PowerChoice {
    On,
    Off,
    Cycle,
}

impl PowerChoice {
    pub const ALL: [PowerChoice; 3] = [PowerChoice::On, PowerChoice::Off, PowerChoice::Cycle];

    pub fn title(self) -> &'static str {
        match self {
            PowerChoice::On => "Power on",
            PowerChoice::Off => "Power off",
            PowerChoice::Cycle => "Power cycle",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            PowerChoice::On => "on",
            PowerChoice::Off => "off",
            PowerChoice::Cycle => "cycle",
        }
    }

    /// Off and cycle stop whatever runs on the machine (`bc_core::bare_metal`).
    pub fn interrupts_work(self) -> bool {
        !matches!(self, PowerChoice::On)
    }
}

/// Whether the server refused `choice` only because the node holds allocations, which an
/// admin may override with `force`. The server says so with `BAD_USER_INPUT` naming the
/// active allocations (`service::bare_metal::power_node`); every other refusal stands.
pub fn needs_force(err: &ApiError, choice: PowerChoice) -> bool {
    choice.interrupts_work()
        && err.code == "BAD_USER_INPUT"
        && err.message.contains("active allocation")
}

/// The provision moves the panel offers a bare-metal machine: each starts its state's
/// workflow (`RECOVER` starts the failed one over). The moves that finish a workflow are the
/// Workflow controller's, and `FAIL` is the abort. Each with its button's words and whether
/// the workflow it starts wipes the machine's disks.
pub const PANEL_MOVES: [(&str, &str, bool); 7] = [
    ("INSPECT", "Inspect", false),
    ("DEPLOY", "Deploy", false),
    ("RESCUE", "Rescue", false),
    ("UNRESCUE", "Unrescue", false),
    ("RELEASE", "Release", true),
    ("RETIRE", "Retire", true),
    ("RECOVER", "Recover", false),
];

/// One edge of `provisionStateTable`: a move and the states it may start from.
#[derive(Clone, Debug, PartialEq)]
pub struct Edge {
    pub step: String,
    pub from: Vec<String>,
}

/// The panel's moves that `table` allows from `state`, in the panel's order.
pub fn moves_from(table: &[Edge], state: &str) -> Vec<(&'static str, &'static str, bool)> {
    PANEL_MOVES
        .into_iter()
        .filter(|(name, _, _)| {
            table
                .iter()
                .any(|e| e.step == *name && e.from.iter().any(|f| f == state))
        })
        .collect()
}

/// The enrol form's inputs, each of which a server refusal may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EnrolField {
    Site,
    Pool,
    Hostname,
    Address,
    SystemId,
    Username,
    Password,
    CaCertificate,
    Identifiers,
}

impl EnrolField {
    /// How tests and styles name the field (`data-field`).
    pub fn key(self) -> &'static str {
        match self {
            EnrolField::Site => "site",
            EnrolField::Pool => "pool",
            EnrolField::Hostname => "hostname",
            EnrolField::Address => "address",
            EnrolField::SystemId => "system-id",
            EnrolField::Username => "username",
            EnrolField::Password => "password",
            EnrolField::CaCertificate => "ca-certificate",
            EnrolField::Identifiers => "identifiers",
        }
    }
}

/// The input field a `BAD_USER_INPUT`'s `extensions.field` names (`input.bmc.address`), so
/// the form shows the refusal beside it.
pub fn field_of(path: &str) -> Option<EnrolField> {
    let path = path.strip_prefix("input.").unwrap_or(path);
    Some(match path {
        "siteId" => EnrolField::Site,
        "poolId" => EnrolField::Pool,
        "hostname" => EnrolField::Hostname,
        "bmc.address" => EnrolField::Address,
        "bmc.systemId" => EnrolField::SystemId,
        "bmc.username" => EnrolField::Username,
        "bmc.password" => EnrolField::Password,
        "bmc.caCertificate" => EnrolField::CaCertificate,
        p if p.starts_with("identifiers") => EnrolField::Identifiers,
        _ => return None,
    })
}

/// How the control plane is to check the BMC's certificate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsChoice {
    #[default]
    Verify,
    CustomCa,
    Off,
}

/// The TLS choices as the form lists them.
pub const TLS_CHOICES: [(TlsChoice, &str); 3] = [
    (
        TlsChoice::Verify,
        "Check against the platform's trusted roots",
    ),
    (TlsChoice::CustomCa, "Check against a CA certificate (PEM)"),
    (TlsChoice::Off, "Do not check (labs only)"),
];

/// What the enrol form's inputs say, before they are checked. It holds the BMC password while
/// the form is open and nowhere else (no store, no URL), and prints none of it.
#[derive(Clone, Default, PartialEq)]
pub struct EnrolForm {
    pub site: String,
    pub pool: String,
    pub hostname: String,
    pub address: String,
    pub system_id: String,
    pub username: String,
    pub password: String,
    pub tls: TlsChoice,
    pub ca_pem: String,
    /// MAC addresses, separated by commas, spaces or line breaks.
    pub macs: String,
    pub serial: String,
    pub system_uuid: String,
}

impl std::fmt::Debug for EnrolForm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnrolForm")
            .field("hostname", &self.hostname)
            .field("address", &self.address)
            .field("password", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// The machine identifier kinds the server's hardware key counts (`bc_core::hardware`); it
/// trusts a key made of at least two of them.
const MIN_IDENTIFIER_KINDS: usize = 2;

impl EnrolForm {
    /// Checks what the server would refuse for sure (blanks, a lone identifier) and builds
    /// the input; the address and the certificate are the server's to judge, and its
    /// refusal is shown beside the field it names.
    pub fn check(
        &self,
    ) -> Result<enroll_bare_metal_node::EnrollBareMetalNodeInput, (EnrolField, String)> {
        use enroll_bare_metal_node::{BmcInput, EnrollBareMetalNodeInput, MachineIdentifierInput};
        let required = |value: &str, field: EnrolField, what: &str| {
            if value.trim().is_empty() {
                Err((field, what.to_owned()))
            } else {
                Ok(value.trim().to_owned())
            }
        };
        let site = required(&self.site, EnrolField::Site, "Choose the site.")?;
        let pool = required(&self.pool, EnrolField::Pool, "Choose a bare-metal pool.")?;
        let hostname = required(&self.hostname, EnrolField::Hostname, "Name the machine.")?;
        let address = required(
            &self.address,
            EnrolField::Address,
            "Give the BMC's Redfish address, https://host[:port].",
        )?;
        let username = required(&self.username, EnrolField::Username, "Give the BMC user.")?;
        // A password is sent exactly as typed: spaces may be part of it.
        if self.password.is_empty() {
            return Err((EnrolField::Password, "Give the BMC user's password.".into()));
        }
        let ca_certificate = match self.tls {
            TlsChoice::CustomCa => Some(required(
                &self.ca_pem,
                EnrolField::CaCertificate,
                "Paste the CA certificate (PEM) the BMC's certificate is checked against.",
            )?),
            TlsChoice::Verify | TlsChoice::Off => None,
        };
        let mut identifiers: Vec<MachineIdentifierInput> = self
            .macs
            .split([',', ' ', ';', '\n'])
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .map(|m| MachineIdentifierInput {
                name: "mac".into(),
                value: m.to_owned(),
            })
            .collect();
        for (name, value) in [
            ("system-serial", &self.serial),
            ("system-uuid", &self.system_uuid),
        ] {
            if !value.trim().is_empty() {
                identifiers.push(MachineIdentifierInput {
                    name: name.into(),
                    value: value.trim().to_owned(),
                });
            }
        }
        let mut kinds: Vec<&str> = identifiers.iter().map(|i| i.name.as_str()).collect();
        kinds.dedup();
        if !identifiers.is_empty() && kinds.len() < MIN_IDENTIFIER_KINDS {
            return Err((
                EnrolField::Identifiers,
                "Give at least two kinds of identifier (say a MAC and the serial), or none: one alone cannot tell this machine from another.".into(),
            ));
        }
        let system_id = Some(self.system_id.trim().to_owned()).filter(|s| !s.is_empty());
        Ok(EnrollBareMetalNodeInput {
            hostname,
            site_id: site,
            pool_id: pool,
            bmc: BmcInput {
                address,
                system_id,
                username,
                password: self.password.clone(),
                verify_tls: self.tls != TlsChoice::Off,
                ca_certificate,
            },
            identifiers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        parse(text).expect("a time")
    }

    fn view() -> BareMetal {
        serde_json::from_value(serde_json::json!({
            "node": { "id": "node_1", "hostname": "metal-0001", "version": 7,
                "provisionState": "COMMISSIONING" },
            "power": "ON", "powerDriver": "REDFISH", "bmcReachable": true,
            "bmc": { "address": "https://10.0.0.5", "systemId": null,
                "systemPath": "/redfish/v1/Systems/1", "tlsVerification": "OFF",
                "reachable": true, "lastError": null, "consecutiveFailures": 0,
                "lastPolledAt": "2026-12-04T02:00:00Z", "nextPollAt": "2026-12-04T02:01:00Z" },
            "workflows": [{ "id": "wf_2", "kind": "COMMISSION", "status": "RUNNING",
                "reason": null, "startedBy": "user:dev", "currentStep": 1,
                "createdAt": "2026-12-04T02:00:00Z", "updatedAt": "2026-12-04T02:00:30Z",
                "finishedAt": null, "steps": [
                    { "kind": "POWER_ON", "status": "SUCCEEDED", "attempts": 1, "maxAttempts": 3,
                      "timeoutSeconds": 300, "startedAt": "2026-12-04T02:00:00Z",
                      "finishedAt": "2026-12-04T02:00:04Z", "deadline": null, "commandId": null,
                      "log": [{ "at": "2026-12-04T02:00:01Z", "message": "asked the BMC: On" }] },
                    { "kind": "BURN_IN", "status": "RUNNING", "attempts": 1, "maxAttempts": 2,
                      "timeoutSeconds": 1800, "startedAt": "2026-12-04T02:00:04Z",
                      "finishedAt": null, "deadline": "2026-12-04T02:30:04Z", "commandId": "cmd_9",
                      "log": [] },
                    { "kind": "POWER_OFF", "status": "PENDING", "attempts": 0, "maxAttempts": 3,
                      "timeoutSeconds": 300, "startedAt": null, "finishedAt": null,
                      "deadline": null, "commandId": null, "log": [] }
                ] }]
        }))
        .expect("a bare-metal view")
    }

    #[test]
    fn a_view_reads_and_says_what_it_is() {
        let v = view();
        assert!(v.is_bare_metal());
        assert_eq!(v.running().map(|w| w.id.as_str()), Some("wf_2"));
        assert_eq!(v.reachability(), ("good", "reachable".to_owned()));
        assert_eq!(power_text(&v.power), "on");

        // An ordinary node: no driver, no BMC, no panel.
        let plain = BareMetal {
            power_driver: "NONE".into(),
            power: "UNKNOWN".into(),
            ..BareMetal::default()
        };
        assert!(!plain.is_bare_metal());
        assert_eq!(plain.reachability().1, "no BMC enrolled");
        // A node of a Redfish pool that joined by its daemon has a driver but no BMC.
        let joined = BareMetal {
            power_driver: "REDFISH".into(),
            ..plain.clone()
        };
        assert!(joined.is_bare_metal());
    }

    #[test]
    fn reachability_names_the_failures_and_the_error() {
        let mut v = view();
        let bmc = v.bmc.as_mut().expect("a BMC");
        bmc.reachable = None;
        v.bmc_reachable = None;
        assert_eq!(v.reachability(), ("muted", "not polled yet".to_owned()));
        let bmc = v.bmc.as_mut().expect("a BMC");
        bmc.reachable = Some(false);
        bmc.consecutive_failures = 1;
        bmc.last_error = Some("connection refused".into());
        v.bmc_reachable = Some(false);
        assert_eq!(
            v.reachability(),
            (
                "bad",
                "unreachable (1 failed poll): connection refused".to_owned()
            )
        );
        // Reachable at the last poll while `BmcUnreachable` still holds reads as unreachable,
        // as `bmcReachable` says.
        let bmc = v.bmc.as_mut().expect("a BMC");
        bmc.reachable = Some(true);
        bmc.consecutive_failures = 3;
        bmc.last_error = None;
        assert_eq!(v.reachability().1, "unreachable (3 failed polls in a row)");
    }

    #[test]
    fn the_page_polls_while_something_moves_without_events() {
        let now = at("2026-12-04T02:10:00Z");
        let running = view();
        assert!(running.wants_polling(now, None));

        let mut idle = view();
        idle.workflows[0].status = "SUCCEEDED".into();
        assert!(!idle.wants_polling(now, None));
        // A power action is watched until the controller has read the BMC again.
        assert!(idle.wants_polling(now, Some(at("2026-12-04T02:10:20Z"))));
        assert!(!idle.wants_polling(now, Some(at("2026-12-04T02:09:59Z"))));
        // A BMC never polled yet: its first answer writes no event when it fails.
        idle.bmc.as_mut().expect("a BMC").reachable = None;
        assert!(idle.wants_polling(now, None));
    }

    #[test]
    fn workflows_and_steps_read_as_sentences() {
        let now = at("2026-12-04T02:03:00Z");
        let mut w = view().workflows[0].clone();
        assert_eq!(
            workflow_summary(&w, now),
            "commission: step 2 of 3, Burn in (diag.nvml), running for 3 min (started by user:dev)"
        );
        assert_eq!(attempts_text(&w.steps[1]), "1 of 2");
        assert_eq!(step_duration(&w.steps[0], now), "4 s");
        assert_eq!(step_duration(&w.steps[1], now), "2 min");
        assert_eq!(step_duration(&w.steps[2], now), "");
        assert_eq!(deadline_text(&w.steps[1], now), "in 27 min");
        assert_eq!(
            deadline_text(&w.steps[1], at("2026-12-04T02:30:24Z")),
            "passed 20 s ago"
        );
        assert_eq!(deadline_text(&w.steps[0], now), "");

        w.status = "SUCCEEDED".into();
        w.finished_at = Some("2026-12-04T02:05:30Z".into());
        assert_eq!(workflow_summary(&w, now), "commission succeeded in 5 min");
        w.status = "ABORTED".into();
        w.reason = Some("wrong rack".into());
        assert_eq!(
            workflow_summary(&w, now),
            "commission aborted at step 2 of 3 (Burn in (diag.nvml)): wrong rack"
        );
        assert_eq!(step_name("CHECK_IDENTIFIERS"), "Check the identifiers");
        assert_eq!(step_name("SOMETHING_NEW"), "something-new");
    }

    #[test]
    fn only_a_refusal_for_work_on_the_node_asks_for_force() {
        let work = ApiError::local(
            "BAD_USER_INPUT",
            "node `node_1` holds 1 active allocation(s); powering it off loses their work: drain it first, or have an admin force it",
        );
        assert!(needs_force(&work, PowerChoice::Off));
        assert!(needs_force(&work, PowerChoice::Cycle));
        assert!(!needs_force(&work, PowerChoice::On));
        let other = ApiError::local("BMC_ERROR", "the BMC refused: 401");
        assert!(!needs_force(&other, PowerChoice::Off));
        assert!(PowerChoice::ALL.iter().all(|c| !c.title().is_empty()));
    }

    #[test]
    fn the_panel_offers_the_moves_the_table_allows() {
        let edge = |step: &str, from: &[&str]| Edge {
            step: step.into(),
            from: from.iter().map(|f| (*f).to_owned()).collect(),
        };
        let table = [
            edge("INSPECT", &["ENROLLING"]),
            edge("COMMISSION", &["INSPECTING"]),
            edge("DEPLOY", &["READY"]),
            edge("RETIRE", &["ADOPTED", "READY", "FAILED"]),
            edge("RECOVER", &["FAILED"]),
            edge("FAIL", &["INSPECTING", "COMMISSIONING"]),
        ];
        let names = |state: &str| {
            moves_from(&table, state)
                .into_iter()
                .map(|(m, _, _)| m)
                .collect::<Vec<_>>()
        };
        assert_eq!(names("ENROLLING"), ["INSPECT"]);
        assert_eq!(names("READY"), ["DEPLOY", "RETIRE"]);
        assert_eq!(names("FAILED"), ["RETIRE", "RECOVER"]);
        // A workflow's own moves and the abort are not the panel's.
        assert!(names("INSPECTING").is_empty());
        assert!(
            moves_from(&table, "READY").iter().any(|m| m.2),
            "retire wipes"
        );
    }

    fn filled() -> EnrolForm {
        EnrolForm {
            site: "site_1".into(),
            pool: "pool_1".into(),
            hostname: " metal-9 ".into(),
            address: "https://10.0.0.9".into(),
            username: "admin".into(),
            password: " pass word ".into(),
            ..EnrolForm::default()
        }
    }

    #[test]
    fn the_enrol_form_builds_the_input() {
        let input = filled().check().expect("valid");
        assert_eq!(input.hostname, "metal-9");
        assert_eq!(input.bmc.password, " pass word ", "sent as typed");
        assert!(input.bmc.verify_tls);
        assert_eq!(input.bmc.ca_certificate, None);
        assert_eq!(input.bmc.system_id, None);
        assert!(input.identifiers.is_empty());

        let input = EnrolForm {
            tls: TlsChoice::Off,
            system_id: "System.Embedded.1".into(),
            macs: "aa:bb:cc:00:11:22, aa:bb:cc:00:11:23\n".into(),
            serial: "SN123".into(),
            ..filled()
        }
        .check()
        .expect("valid");
        assert!(!input.bmc.verify_tls);
        assert_eq!(input.bmc.system_id.as_deref(), Some("System.Embedded.1"));
        let ids: Vec<(&str, &str)> = input
            .identifiers
            .iter()
            .map(|i| (i.name.as_str(), i.value.as_str()))
            .collect();
        assert_eq!(
            ids,
            [
                ("mac", "aa:bb:cc:00:11:22"),
                ("mac", "aa:bb:cc:00:11:23"),
                ("system-serial", "SN123")
            ]
        );

        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----";
        let input = EnrolForm {
            tls: TlsChoice::CustomCa,
            ca_pem: pem.into(),
            ..filled()
        }
        .check()
        .expect("valid");
        assert!(input.bmc.verify_tls);
        assert_eq!(input.bmc.ca_certificate.as_deref(), Some(pem));
    }

    #[test]
    fn the_enrol_form_names_what_is_missing() {
        let refused = |form: EnrolForm| form.check().expect_err("refused").0;
        assert_eq!(
            refused(EnrolForm {
                site: String::new(),
                ..filled()
            }),
            EnrolField::Site
        );
        assert_eq!(
            refused(EnrolForm {
                address: "  ".into(),
                ..filled()
            }),
            EnrolField::Address
        );
        assert_eq!(
            refused(EnrolForm {
                password: String::new(),
                ..filled()
            }),
            EnrolField::Password
        );
        assert_eq!(
            refused(EnrolForm {
                tls: TlsChoice::CustomCa,
                ..filled()
            }),
            EnrolField::CaCertificate
        );
        // MACs are one kind of evidence however many there are.
        assert_eq!(
            refused(EnrolForm {
                macs: "aa:bb:cc:00:11:22 aa:bb:cc:00:11:23".into(),
                ..filled()
            }),
            EnrolField::Identifiers
        );
        // The address is the server's to judge: plain http may be allowed there, for tests.
        assert!(
            EnrolForm {
                address: "http://10.0.0.9".into(),
                ..filled()
            }
            .check()
            .is_ok()
        );
        // Printing the form never prints the password.
        assert!(!format!("{:?}", filled()).contains("pass word"));
    }

    #[test]
    fn refusals_find_their_field() {
        assert_eq!(field_of("input.bmc.address"), Some(EnrolField::Address));
        assert_eq!(
            field_of("input.bmc.caCertificate"),
            Some(EnrolField::CaCertificate)
        );
        assert_eq!(field_of("input.hostname"), Some(EnrolField::Hostname));
        assert_eq!(
            field_of("input.identifiers[1].name"),
            Some(EnrolField::Identifiers)
        );
        assert_eq!(field_of("input.somethingElse"), None);
    }
}
