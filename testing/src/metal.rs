//! Simulated bare metal (`better-compute dev --sim-metal N`): machines that arrive with
//! nothing but a BMC, enrolled through the server's own use case and walked to `ready` by
//! the server's Workflow and Power controllers.
//!
//! Three parts:
//! - [`SimMachine`]: the machine's side of a boot. Booting it starts a [`FakeDaemon`] with
//!   the machine's identifiers (its previous daemon stops first), as a ramdisk or an
//!   installed system would; powering it off stops the daemon. The Redfish workflow tests
//!   drive it from the emulator's power state, [`SimBmcs`] from its own.
//! - [`SimBmcs`]: the machines' BMCs, an in-process Redfish service over HTTPS on loopback,
//!   with a CA of its own that the enrolment passes as the BMC's CA. Each machine is one
//!   `ComputerSystem` (addressed by its system UUID, as `systemId`) with its own
//!   credentials; it serves what the server's Redfish driver uses: the service root,
//!   `ComputerSystem` with its power, `#ComputerSystem.Reset`, the `Boot` override (PATCH)
//!   and a virtual CD (`#VirtualMedia.InsertMedia`, `EjectMedia`). A reset that boots the
//!   machine boots what the boot override says: the network (the ramdisk's daemon joins),
//!   the virtual CD (the deploy image installs a system, whose daemon joins), else the
//!   disk, which boots a daemon only once a system was installed.
//! - [`MetalFleet`]: enrols the machines (`enrollBareMetalNode`'s use case, reusing the
//!   nodes a previous run enrolled), starts each enrolled machine's inspection with the
//!   operator's `inspect` move, and counts how far the fleet is.
//!
//! `dev` keeps the BMCs' port, certificates and the machines' power in a state file of its
//! data directory, so a second run answers at the addresses the first enrolled, and a
//! machine that was on comes back running what it ran.

use crate::bmc::TestCertificates;
use crate::daemon::{DaemonKnobs, FakeDaemon, FleetCounters, GatewayContext};
use crate::inventory::{self, SYSTEM_UUID};
use anyhow::{Context, anyhow};
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bc_core::axes::{PoolKind, Power, ProvisionState};
use bc_core::bare_metal::POWER_DRIVER_KEY;
use bc_core::catalog::HardwareProfile;
use bc_core::ids::{NodeId, PoolId, SiteId};
use bc_core::provision::ProvisionMove;
use better_compute::auth::Principal;
use better_compute::credentials::BmcCredentials;
use better_compute::service::bare_metal::NewBmc;
use better_compute::service::catalog::NewPool;
use better_compute::service::join::{MAX_JOIN_TOKEN_LIFETIME, MAX_JOIN_TOKEN_USES, NewJoinToken};
use better_compute::service::{NodeFilter, Services};
use rustls_pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The hostname of machine `index` (from 0): `metal-0001`, `metal-0002`, …
pub fn hostname(index: usize) -> String {
    format!("metal-{:04}", index + 1)
}

/// The user every simulated BMC knows (each machine has its own password).
pub const BMC_USERNAME: &str = "admin";
/// How many nodes one read of the pool's nodes takes.
const NODE_PAGE: u64 = 500;
/// What the BMCs offer for `#ComputerSystem.Reset`, as a BMC of a current GPU server does.
const RESET_TYPES: &[&str] = &[
    "On",
    "ForceOff",
    "GracefulShutdown",
    "ForceRestart",
    "GracefulRestart",
    "PowerCycle",
];
/// The boot override targets the BMCs take.
const BOOT_TARGETS: &[&str] = &["None", "Pxe", "Cd", "Hdd"];
const BOOT_ENABLED: &[&str] = &["Disabled", "Once", "Continuous"];

/// What a boot started on a machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BootSource {
    /// A network boot: the ramdisk the boot server hands out.
    Network,
    /// The image in the BMC's virtual CD, which installs a system.
    VirtualCd,
    /// The machine's own disk: the installed system.
    Disk,
}

/// The machine's side of a boot: the daemon it runs now, if any.
pub struct SimMachine {
    /// The machine's daemon knobs; `identifiers` (or the seed they derive from) make it
    /// this machine.
    pub knobs: DaemonKnobs,
    daemon: Option<FakeDaemon>,
    /// `disk.wipe`s of the daemons it stopped.
    wipes: u64,
}

impl SimMachine {
    pub fn new(knobs: DaemonKnobs) -> SimMachine {
        SimMachine {
            knobs,
            daemon: None,
            wipes: 0,
        }
    }

    /// Boots it: the daemon it ran stops, and `start` builds the new one from the machine's
    /// knobs (with the join token and gateway of the caller's choice), which starts.
    pub fn boot(&mut self, start: impl FnOnce(DaemonKnobs) -> FakeDaemon) -> &FakeDaemon {
        self.power_off();
        let daemon = start(self.knobs.clone());
        daemon.start();
        self.daemon.insert(daemon)
    }

    /// Powers it off: its daemon stops (its session closes).
    pub fn power_off(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            self.wipes += daemon.status().disk_wipes;
            daemon.stop();
        }
    }

    /// The daemon it runs now.
    pub fn daemon(&self) -> Option<&FakeDaemon> {
        self.daemon.as_ref()
    }

    /// `disk.wipe`s its daemons carried out, the stopped ones included.
    pub fn wipes(&self) -> u64 {
        self.wipes + self.daemon.as_ref().map_or(0, |d| d.status().disk_wipes)
    }
}

impl Drop for SimMachine {
    fn drop(&mut self) {
        self.power_off();
    }
}

/// Starts a machine's daemons: the gateway (resolved once), a join token admitting every
/// boot, and the counters the machines' daemons share.
#[derive(Clone)]
pub struct DaemonStarter {
    pub context: Arc<GatewayContext>,
    pub join_secret: String,
    pub counters: Arc<FleetCounters>,
}

impl DaemonStarter {
    fn start(&self, knobs: DaemonKnobs) -> FakeDaemon {
        FakeDaemon::with_context(
            self.context.clone(),
            self.join_secret.clone(),
            knobs,
            self.counters.clone(),
        )
    }
}

/// One machine behind a simulated BMC.
#[derive(Debug, Clone)]
pub struct MachineSpec {
    pub hostname: String,
    /// The `ComputerSystem`'s id and `UUID`: the machine's system UUID.
    pub system_id: String,
    pub password: String,
    pub knobs: DaemonKnobs,
}

/// A machine's power and boot, as its BMC keeps them (and the state file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Firmware {
    power_on: bool,
    boot_target: String,
    boot_enabled: String,
    cd_image: Option<String>,
    cd_inserted: bool,
    /// A deploy image installed a system on the disk (a wipe erases it).
    installed: bool,
    /// What the machine runs now.
    running: Option<BootSource>,
}

impl Default for Firmware {
    fn default() -> Self {
        Firmware {
            power_on: false,
            boot_target: "None".into(),
            boot_enabled: "Disabled".into(),
            cd_image: None,
            cd_inserted: false,
            installed: false,
            running: None,
        }
    }
}

struct System {
    spec: MachineSpec,
    firmware: Firmware,
    machine: SimMachine,
    /// The machine's wipes already taken into account (`installed`).
    wipes_seen: u64,
    /// Boots so far, in order.
    boots: Vec<BootSource>,
    /// A fault for tests: ejecting the virtual CD answers 500.
    eject_fails: bool,
}

impl System {
    /// Powers the machine on (or through a restart when `restart`): it boots.
    fn power_on(&mut self, restart: bool, starter: &DaemonStarter) {
        if self.firmware.power_on && !restart {
            return;
        }
        self.power_off();
        self.firmware.power_on = true;
        let f = &mut self.firmware;
        let overridden = f.boot_enabled != "Disabled";
        let source = match f.boot_target.as_str() {
            "Pxe" if overridden => BootSource::Network,
            "Cd" if overridden && f.cd_inserted => BootSource::VirtualCd,
            _ => BootSource::Disk,
        };
        if f.boot_enabled == "Once" {
            f.boot_enabled = "Disabled".into();
        }
        self.boot(source, starter);
    }

    /// Runs what `source` holds: a daemon, unless it is a disk with nothing installed.
    fn boot(&mut self, source: BootSource, starter: &DaemonStarter) {
        if source == BootSource::VirtualCd {
            self.firmware.installed = true;
        }
        let runs = source != BootSource::Disk || self.firmware.installed;
        self.firmware.running = runs.then_some(source);
        self.boots.push(source);
        if runs {
            self.machine.boot(|knobs| starter.start(knobs));
            tracing::debug!(hostname = %self.spec.hostname, ?source, "a simulated machine booted");
        }
    }

    fn power_off(&mut self) {
        self.machine.power_off();
        self.firmware.power_on = false;
        self.firmware.running = None;
        let wipes = self.machine.wipes();
        if wipes > self.wipes_seen {
            self.wipes_seen = wipes;
            self.firmware.installed = false;
        }
    }

    fn resource(&self) -> Value {
        let id = &self.spec.system_id;
        let base = format!("/redfish/v1/Systems/{id}");
        json!({
            "@odata.id": base,
            "@odata.type": "#ComputerSystem.v1_20_0.ComputerSystem",
            "Id": id,
            "Name": self.spec.hostname,
            "UUID": id,
            "SystemType": "Physical",
            "PowerState": if self.firmware.power_on { "On" } else { "Off" },
            "Boot": {
                "BootSourceOverrideTarget": self.firmware.boot_target,
                "BootSourceOverrideEnabled": self.firmware.boot_enabled,
                "BootSourceOverrideTarget@Redfish.AllowableValues": BOOT_TARGETS,
            },
            "VirtualMedia": { "@odata.id": format!("{base}/VirtualMedia") },
            "Actions": { "#ComputerSystem.Reset": {
                "target": format!("{base}/Actions/ComputerSystem.Reset"),
                "ResetType@Redfish.AllowableValues": RESET_TYPES,
            } },
        })
    }

    fn virtual_cd(&self) -> Value {
        let base = format!(
            "/redfish/v1/Systems/{}/VirtualMedia/Cd",
            self.spec.system_id
        );
        json!({
            "@odata.id": base,
            "@odata.type": "#VirtualMedia.v1_6_0.VirtualMedia",
            "Id": "Cd",
            "Name": "Virtual CD",
            "MediaTypes": ["CD", "DVD"],
            "Image": self.firmware.cd_image,
            "Inserted": self.firmware.cd_inserted,
            "WriteProtected": true,
            "Actions": {
                "#VirtualMedia.InsertMedia": { "target": format!("{base}/Actions/VirtualMedia.InsertMedia") },
                "#VirtualMedia.EjectMedia": { "target": format!("{base}/Actions/VirtualMedia.EjectMedia") },
            },
        })
    }
}

/// What the state file keeps between runs of `dev`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Saved {
    port: u16,
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
    /// Each machine's power and boot, by system id.
    machines: BTreeMap<String, Firmware>,
}

struct Rack {
    systems: HashMap<String, System>,
    starter: DaemonStarter,
    state_file: Option<PathBuf>,
    saved: Saved,
}

impl Rack {
    /// Writes the state file (owner-only: it holds the BMCs' key), if there is one.
    fn save(&mut self) {
        let Some(path) = self.state_file.clone() else {
            return;
        };
        self.saved.machines = self
            .systems
            .iter()
            .map(|(id, s)| (id.clone(), s.firmware.clone()))
            .collect();
        if let Err(err) = write_owner_only(&path, &self.saved) {
            tracing::warn!(path = %path.display(), error = %err, "could not save the simulated BMCs' state");
        }
    }
}

fn write_owner_only(path: &Path, saved: &Saved) -> anyhow::Result<()> {
    use std::io::Write;
    let text = serde_json::to_vec_pretty(saved)?;
    let temporary = path.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(&temporary)?.write_all(&text)?;
    std::fs::rename(&temporary, path)?;
    Ok(())
}

type Shared = Arc<Mutex<Rack>>;

fn lock(rack: &Shared) -> std::sync::MutexGuard<'_, Rack> {
    rack.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The simulated BMCs of a set of machines: one HTTPS Redfish service on loopback, each
/// machine a `ComputerSystem` with its own credentials. Stopped when dropped (the
/// machines' daemons stop with it).
pub struct SimBmcs {
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// The CA that signed the service's certificate (PEM): the BMC's CA at enrolment.
    pub ca_pem: String,
    rack: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl SimBmcs {
    /// Starts the BMCs of `machines`, their machines off. With a `state_file`, the port,
    /// certificates and the machines' power of the run that wrote it are taken up again
    /// (a machine that was on boots what it ran), and kept there as they change.
    pub async fn start(
        machines: Vec<MachineSpec>,
        starter: DaemonStarter,
        state_file: Option<PathBuf>,
    ) -> anyhow::Result<SimBmcs> {
        let previous: Option<Saved> = match &state_file {
            Some(path) if path.exists() => Some(
                serde_json::from_slice(&std::fs::read(path)?)
                    .with_context(|| format!("reading {}", path.display()))?,
            ),
            _ => None,
        };
        let (listener, saved) = match previous {
            Some(saved) => {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", saved.port))
                    .await
                    .with_context(|| {
                        format!(
                            "the simulated BMCs of the machines enrolled before answer at 127.0.0.1:{}, which is taken now; free it (or start over with a new data directory)",
                            saved.port
                        )
                    })?;
                (listener, saved)
            }
            None => {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let certs = TestCertificates::generate()?;
                let saved = Saved {
                    port: listener.local_addr()?.port(),
                    ca_pem: certs.ca_pem,
                    cert_pem: certs.cert_pem,
                    key_pem: certs.key_pem,
                    machines: BTreeMap::new(),
                };
                (listener, saved)
            }
        };
        let tls = tls_config(&saved.cert_pem, &saved.key_pem)?;
        let mut systems = HashMap::new();
        for spec in machines {
            let firmware = saved
                .machines
                .get(&spec.system_id)
                .cloned()
                .unwrap_or_default();
            let mut system = System {
                machine: SimMachine::new(spec.knobs.clone()),
                spec,
                firmware: Firmware {
                    running: None,
                    ..firmware.clone()
                },
                wipes_seen: 0,
                boots: Vec::new(),
                eject_fails: false,
            };
            // Power came back: what ran boots again.
            if firmware.power_on
                && let Some(source) = firmware.running
            {
                system.boot(source, &starter);
            }
            systems.insert(system.spec.system_id.clone(), system);
        }
        let url = format!("https://127.0.0.1:{}", saved.port);
        let ca_pem = saved.ca_pem.clone();
        let rack = Arc::new(Mutex::new(Rack {
            systems,
            starter,
            state_file,
            saved,
        }));
        lock(&rack).save();
        let app = Router::new()
            .route("/redfish/v1", get(service_root))
            .route("/redfish/v1/", get(service_root))
            .route("/redfish/v1/Systems", get(systems_collection))
            .route(
                "/redfish/v1/Systems/{id}",
                get(system_get).patch(system_patch),
            )
            .route(
                "/redfish/v1/Systems/{id}/Actions/ComputerSystem.Reset",
                post(system_reset),
            )
            .route(
                "/redfish/v1/Systems/{id}/VirtualMedia",
                get(media_collection),
            )
            .route("/redfish/v1/Systems/{id}/VirtualMedia/Cd", get(media_get))
            .route(
                "/redfish/v1/Systems/{id}/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia",
                post(media_insert),
            )
            .route(
                "/redfish/v1/Systems/{id}/VirtualMedia/Cd/Actions/VirtualMedia.EjectMedia",
                post(media_eject),
            )
            .with_state(rack.clone());
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let app = app.clone();
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(socket).await else {
                        return;
                    };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(SimBmcs {
            url,
            ca_pem,
            rack,
            task,
        })
    }

    fn with<T>(&self, system_id: &str, read: impl FnOnce(&System) -> T) -> Option<T> {
        lock(&self.rack).systems.get(system_id).map(read)
    }

    /// Whether the machine is on.
    pub fn power_on(&self, system_id: &str) -> Option<bool> {
        self.with(system_id, |s| s.firmware.power_on)
    }

    /// What each boot of the machine started, in order.
    pub fn boots(&self, system_id: &str) -> Vec<BootSource> {
        self.with(system_id, |s| s.boots.clone())
            .unwrap_or_default()
    }

    /// The daemon the machine runs now.
    pub fn daemon(&self, system_id: &str) -> Option<FakeDaemon> {
        self.with(system_id, |s| s.machine.daemon().cloned())
            .flatten()
    }

    /// The image in the machine's virtual CD, if one is inserted.
    pub fn inserted_media(&self, system_id: &str) -> Option<String> {
        self.with(system_id, |s| {
            s.firmware
                .cd_inserted
                .then(|| s.firmware.cd_image.clone())
                .flatten()
        })
        .flatten()
    }

    /// A fault for tests: from now on, ejecting the machine's virtual CD fails (HTTP 500),
    /// or works again.
    pub fn fail_ejects(&self, system_id: &str, fail: bool) {
        if let Some(system) = lock(&self.rack).systems.get_mut(system_id) {
            system.eject_fails = fail;
        }
    }

    /// Stops every machine's daemon (they stay on, as the state file says) and the service.
    pub fn stop(&self) {
        let mut rack = lock(&self.rack);
        for system in rack.systems.values_mut() {
            system.machine.power_off();
        }
        self.task.abort();
    }

    /// [`SimBmcs::stop`], and waits until the service's port is free again (for a run that
    /// follows in the same process).
    pub async fn shutdown(mut self) {
        self.stop();
        let _ = (&mut self.task).await;
    }
}

impl Drop for SimBmcs {
    fn drop(&mut self) {
        self.stop();
    }
}

fn tls_config(cert_pem: &str, key_pem: &str) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()?;
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes())?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?,
    ))
}

/// A Redfish error answer.
fn redfish_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({ "error": {
            "code": "Base.1.0.GeneralError",
            "message": message,
            "@Message.ExtendedInfo": [{ "Message": message }],
        } })),
    )
        .into_response()
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(
            axum::http::header::WWW_AUTHENTICATE,
            "Basic realm=\"simulated BMC\"",
        )],
        Json(json!({ "error": { "code": "Base.1.0.InsufficientPrivilege", "message": "Authorization required" } })),
    )
        .into_response()
}

/// The Basic credentials of a request.
fn credentials(headers: &HeaderMap) -> Option<(String, String)> {
    use base64::Engine;
    let encoded = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    let (user, password) = std::str::from_utf8(&raw).ok()?.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

/// Runs `act` on system `id` when the request carries its credentials: 404 for a system
/// that does not exist, 401 for wrong credentials. The state file is written after.
fn on_system(
    rack: &Shared,
    headers: &HeaderMap,
    id: &str,
    act: impl FnOnce(&mut System, &DaemonStarter) -> Response,
) -> Response {
    let given = credentials(headers);
    let mut rack = lock(rack);
    let starter = rack.starter.clone();
    let Some(system) = rack.systems.get_mut(id) else {
        return redfish_error(StatusCode::NOT_FOUND, &format!("no system {id}"));
    };
    let authorized = given
        .is_some_and(|(user, password)| user == BMC_USERNAME && password == system.spec.password);
    if !authorized {
        return unauthorized();
    }
    let before = system.firmware.clone();
    let answer = act(system, &starter);
    if system.firmware != before {
        rack.save();
    }
    answer
}

async fn service_root() -> Response {
    Json(json!({
        "@odata.id": "/redfish/v1/",
        "@odata.type": "#ServiceRoot.v1_15_0.ServiceRoot",
        "Id": "RootService",
        "Name": "Better Compute simulated BMC",
        "RedfishVersion": "1.17.0",
        "Systems": { "@odata.id": "/redfish/v1/Systems" },
    }))
    .into_response()
}

async fn systems_collection(State(rack): State<Shared>, headers: HeaderMap) -> Response {
    let given = credentials(&headers);
    let rack = lock(&rack);
    let authorized = given.is_some_and(|(user, password)| {
        user == BMC_USERNAME && rack.systems.values().any(|s| s.spec.password == password)
    });
    if !authorized {
        return unauthorized();
    }
    let mut ids: Vec<&String> = rack.systems.keys().collect();
    ids.sort();
    let members: Vec<Value> = ids
        .iter()
        .map(|id| json!({ "@odata.id": format!("/redfish/v1/Systems/{id}") }))
        .collect();
    Json(json!({
        "@odata.id": "/redfish/v1/Systems",
        "Name": "Computer System Collection",
        "Members@odata.count": members.len(),
        "Members": members,
    }))
    .into_response()
}

async fn system_get(
    State(rack): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    on_system(&rack, &headers, &id, |s, _| {
        Json(s.resource()).into_response()
    })
}

async fn system_patch(
    State(rack): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    on_system(&rack, &headers, &id, |s, _| {
        let Some(boot) = body.get("Boot") else {
            return redfish_error(StatusCode::BAD_REQUEST, "only Boot can be changed");
        };
        let field = |name: &str, allowed: &[&str]| -> Result<Option<String>, String> {
            match boot.get(name) {
                None => Ok(None),
                Some(Value::String(v)) if allowed.contains(&v.as_str()) => Ok(Some(v.clone())),
                Some(other) => Err(format!(
                    "{name} {other} is not one of {}",
                    allowed.join(", ")
                )),
            }
        };
        let (target, enabled) = match (
            field("BootSourceOverrideTarget", BOOT_TARGETS),
            field("BootSourceOverrideEnabled", BOOT_ENABLED),
        ) {
            (Ok(target), Ok(enabled)) => (target, enabled),
            (Err(why), _) | (_, Err(why)) => {
                return redfish_error(StatusCode::BAD_REQUEST, &why);
            }
        };
        if let Some(target) = target {
            s.firmware.boot_target = target;
        }
        if let Some(enabled) = enabled {
            s.firmware.boot_enabled = enabled;
        }
        StatusCode::NO_CONTENT.into_response()
    })
}

async fn system_reset(
    State(rack): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    on_system(&rack, &headers, &id, |s, starter| {
        match body.get("ResetType").and_then(Value::as_str) {
            Some("On") => s.power_on(false, starter),
            Some("ForceOff" | "GracefulShutdown") => s.power_off(),
            Some("ForceRestart" | "GracefulRestart" | "PowerCycle") => s.power_on(true, starter),
            other => {
                return redfish_error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "ResetType {} is not one of {}",
                        other.unwrap_or("(none)"),
                        RESET_TYPES.join(", ")
                    ),
                );
            }
        }
        StatusCode::NO_CONTENT.into_response()
    })
}

async fn media_collection(
    State(rack): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    on_system(&rack, &headers, &id, |s, _| {
        let base = format!("/redfish/v1/Systems/{}/VirtualMedia", s.spec.system_id);
        Json(json!({
            "@odata.id": base,
            "Members@odata.count": 1,
            "Members": [{ "@odata.id": format!("{base}/Cd") }],
        }))
        .into_response()
    })
}

async fn media_get(
    State(rack): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    on_system(&rack, &headers, &id, |s, _| {
        Json(s.virtual_cd()).into_response()
    })
}

async fn media_insert(
    State(rack): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    on_system(&rack, &headers, &id, |s, _| {
        let Some(image) = body.get("Image").and_then(Value::as_str) else {
            return redfish_error(StatusCode::BAD_REQUEST, "Image is required");
        };
        if s.firmware.cd_inserted {
            return redfish_error(
                StatusCode::BAD_REQUEST,
                "an image is inserted already: eject it first",
            );
        }
        s.firmware.cd_image = Some(image.to_owned());
        s.firmware.cd_inserted = true;
        StatusCode::NO_CONTENT.into_response()
    })
}

async fn media_eject(
    State(rack): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    on_system(&rack, &headers, &id, |s, _| {
        if s.eject_fails {
            return redfish_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the virtual media service is not responding",
            );
        }
        s.firmware.cd_image = None;
        s.firmware.cd_inserted = false;
        StatusCode::NO_CONTENT.into_response()
    })
}

/// How a simulated bare-metal fleet is built.
#[derive(Debug, Clone)]
pub struct MetalOptions {
    pub machines: usize,
    /// The machines derive from it: the same seed is the same machines (identifiers and
    /// BMC passwords), so a second run finds the nodes the first enrolled.
    pub seed: u64,
    /// The knobs of every machine's daemons (`seed`, `hostname` and `identifiers` are the
    /// machine's own).
    pub knobs: DaemonKnobs,
    /// Where the BMCs keep their port, certificates and the machines' power between runs.
    pub state_file: Option<PathBuf>,
}

impl MetalOptions {
    /// Machine `index`: its hostname, system UUID, BMC password and daemon knobs.
    pub fn machine(&self, index: usize) -> MachineSpec {
        let derived = inventory::derive(self.seed, &format!("metal:{index}"));
        let mut seed = [0u8; 8];
        seed.copy_from_slice(&derived[..8]);
        let seed = u64::from_le_bytes(seed);
        let hostname = hostname(index);
        let machine = inventory::Machine::new(seed, Some(hostname.clone()), None);
        let system_id = machine.identifiers[SYSTEM_UUID].clone();
        let password =
            hex::encode(&inventory::derive(self.seed, &format!("bmc-password:{index}"))[..12]);
        MachineSpec {
            hostname: hostname.clone(),
            system_id,
            password,
            knobs: DaemonKnobs {
                seed: Some(seed),
                hostname: Some(hostname),
                identifiers: None,
                ..self.knobs.clone()
            },
        }
    }
}

/// The identifiers a BMC knows of its machine ([`inventory::Machine::bmc_identifiers`]).
fn bmc_identifiers(spec: &MachineSpec) -> Vec<(String, String)> {
    let seed = spec.knobs.seed.unwrap_or_default();
    inventory::Machine::new(seed, Some(spec.hostname.clone()), None).bmc_identifiers()
}

/// How far a simulated bare-metal fleet is: its machines' nodes by provision state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MetalProgress {
    pub machines: usize,
    /// Machines that are nodes (enrolled now or by an earlier run).
    pub enrolled: usize,
    pub inspecting: usize,
    pub commissioning: usize,
    pub ready: usize,
    pub failed: usize,
    /// Enrolments and moves the fleet could not make.
    pub errors: usize,
}

impl std::fmt::Display for MetalProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} enrolled, {} inspecting, {} commissioning, {} ready, {} failed",
            self.enrolled,
            self.machines,
            self.inspecting,
            self.commissioning,
            self.ready,
            self.failed
        )?;
        if self.errors > 0 {
            write!(f, ", {} errors", self.errors)?;
        }
        Ok(())
    }
}

/// Where the machines are enrolled, and as whom.
#[derive(Debug, Clone)]
pub struct MetalPlace {
    /// An admin: enrolment needs one.
    pub principal: Principal,
    pub site: SiteId,
    pub pool: PoolId,
}

impl MetalPlace {
    /// A join token for the machines' daemons, which join at every boot (inspection, deploy,
    /// rescue, release): it admits as many joins as the server allows, for as long as it
    /// allows. Returns its secret.
    pub async fn join_token(
        &self,
        services: &Services,
        description: &str,
    ) -> anyhow::Result<String> {
        let (_, secret) = services
            .create_join_token(
                &self.principal,
                NewJoinToken {
                    site_id: self.site.clone(),
                    pool_id: Some(self.pool.clone()),
                    lifetime: Some(MAX_JOIN_TOKEN_LIFETIME),
                    max_uses: Some(MAX_JOIN_TOKEN_USES),
                    description: description.to_owned(),
                },
            )
            .await?;
        Ok(secret)
    }
}

/// The bare-metal pool `name` of `site` (power through Redfish), created if it does not
/// exist: a pool of GPU servers that expects `gpus` GPUs on each.
pub async fn ensure_metal_pool(
    services: &Services,
    principal: &Principal,
    site: &SiteId,
    name: &str,
    gpus: u32,
) -> anyhow::Result<PoolId> {
    if let Some(pool) = services.pool_named(principal, site, name).await? {
        return Ok(pool.id);
    }
    let pool = services
        .create_pool(
            principal,
            NewPool {
                site_id: site.clone(),
                name: name.to_owned(),
                kind: PoolKind::MetalHost,
                agent: bc_core::axes::PoolAgent::Bcd,
                owner_tenant_id: None,
                hardware_profile: HardwareProfile {
                    gpu_count: Some(gpus),
                    ..HardwareProfile::default()
                },
                drivers: BTreeMap::from([(POWER_DRIVER_KEY.to_owned(), "redfish".to_owned())]),
                remediation: None,
                acceptance: None,
            },
        )
        .await?;
    Ok(pool.id)
}

/// A simulated bare-metal fleet: the machines, their BMCs and their nodes.
pub struct MetalFleet {
    services: Services,
    place: MetalPlace,
    specs: Vec<MachineSpec>,
    bmcs: SimBmcs,
    counters: Arc<FleetCounters>,
    errors: usize,
}

impl MetalFleet {
    /// Starts the machines' BMCs (the machines off, or as the state file left them),
    /// enrols every machine that is not a node of the pool yet by its BMC, with the BMC's CA
    /// and the identifiers the BMC knows, and starts the inspection of every one still
    /// `enrolling` with the operator's `inspect` move. From there the server's Workflow and
    /// Power controllers walk each to `ready`: its BMC boots it from the network, its
    /// ramdisk's daemon joins as the node, reports, runs the burn-in, and is powered off.
    pub async fn start(
        services: Services,
        place: MetalPlace,
        context: Arc<GatewayContext>,
        join_secret: String,
        options: &MetalOptions,
    ) -> anyhow::Result<MetalFleet> {
        let specs: Vec<MachineSpec> = (0..options.machines).map(|i| options.machine(i)).collect();
        let counters = Arc::new(FleetCounters::default());
        let starter = DaemonStarter {
            context,
            join_secret,
            counters: counters.clone(),
        };
        let bmcs = SimBmcs::start(specs.clone(), starter, options.state_file.clone()).await?;
        let mut fleet = MetalFleet {
            services,
            place,
            specs,
            bmcs,
            counters,
            errors: 0,
        };
        let known = fleet.nodes().await?;
        let mut errors = 0;
        for spec in &fleet.specs {
            if known.contains_key(&spec.hostname) {
                continue;
            }
            let enrolled = fleet
                .services
                .enroll_bare_metal_node(
                    &fleet.place.principal,
                    &spec.hostname,
                    &fleet.place.site,
                    &fleet.place.pool,
                    &bmc_identifiers(spec),
                    NewBmc {
                        address: fleet.bmcs.url.clone(),
                        system_id: Some(spec.system_id.clone()),
                        credentials: BmcCredentials {
                            username: BMC_USERNAME.to_owned(),
                            password: spec.password.clone(),
                        },
                        verify_tls: true,
                        ca_pem: Some(fleet.bmcs.ca_pem.clone()),
                    },
                )
                .await;
            if let Err(err) = enrolled {
                errors += 1;
                tracing::warn!(hostname = %spec.hostname, error = %err.message(), "a simulated machine could not be enrolled");
            }
        }
        for (hostname, (id, version, state)) in fleet.nodes().await? {
            if state != ProvisionState::Enrolling {
                continue;
            }
            let moved = fleet
                .services
                .move_node(
                    &fleet.place.principal,
                    &id,
                    version,
                    ProvisionMove::Inspect,
                    None,
                )
                .await;
            if let Err(err) = moved {
                errors += 1;
                tracing::warn!(%hostname, error = %err.message(), "a simulated machine's inspection could not start");
            }
        }
        fleet.errors = errors;
        Ok(fleet)
    }

    /// The fleet's machines' nodes, by hostname: id, version and provision state.
    async fn nodes(&self) -> anyhow::Result<BTreeMap<String, (NodeId, i64, ProvisionState)>> {
        let ours: std::collections::HashSet<&str> =
            self.specs.iter().map(|s| s.hostname.as_str()).collect();
        let filter = NodeFilter {
            pool_ids: vec![self.place.pool.clone()],
            ..NodeFilter::default()
        };
        let mut found = BTreeMap::new();
        let mut after: Option<String> = None;
        loop {
            let page = self
                .services
                .nodes(
                    &self.place.principal,
                    filter.clone(),
                    after.as_deref(),
                    NODE_PAGE,
                    better_compute::service::ChildSets::ALL,
                )
                .await
                .map_err(|err| anyhow!("listing the pool's nodes: {}", err.message()))?;
            after = page.nodes.last().map(|n| n.record.id.to_string());
            for node in page.nodes {
                let n = node.record;
                if ours.contains(n.hostname.as_str()) {
                    found.insert(n.hostname.clone(), (n.id, n.version, n.provision_state));
                }
            }
            if !page.has_next_page {
                return Ok(found);
            }
        }
    }

    /// The machines' nodes by provision state.
    pub async fn progress(&self) -> anyhow::Result<MetalProgress> {
        let nodes = self.nodes().await?;
        let count = |state: ProvisionState| nodes.values().filter(|n| n.2 == state).count();
        Ok(MetalProgress {
            machines: self.specs.len(),
            enrolled: nodes.len(),
            inspecting: count(ProvisionState::Inspecting),
            commissioning: count(ProvisionState::Commissioning),
            ready: count(ProvisionState::Ready),
            failed: count(ProvisionState::Failed),
            errors: self.errors
                + usize::try_from(self.counters.failed.load(Ordering::Relaxed)).unwrap_or(0),
        })
    }

    /// The machines, in order.
    pub fn machines(&self) -> &[MachineSpec] {
        &self.specs
    }

    pub fn bmcs(&self) -> &SimBmcs {
        &self.bmcs
    }

    /// The node of the machine `hostname`, if it is one.
    pub async fn node_id(&self, hostname: &str) -> anyhow::Result<Option<NodeId>> {
        Ok(self.nodes().await?.remove(hostname).map(|n| n.0))
    }

    /// The power the server's bare-metal view shows for the machine's node.
    pub async fn power_of(&self, id: &NodeId) -> anyhow::Result<Power> {
        Ok(self
            .services
            .bare_metal_node(&self.place.principal, id)
            .await
            .map_err(|err| anyhow!("{}", err.message()))?
            .power)
    }

    /// Stops the machines' daemons and their BMCs.
    pub async fn shutdown(self) {
        self.bmcs.shutdown().await;
    }
}

impl MetalFleet {
    /// Reports the fleet's progress every `every` until `shutdown` resolves, then stops the
    /// fleet (`dev --sim-metal N`); the last progress reported.
    pub async fn run_until<R, S>(self, every: Duration, report: R, shutdown: S) -> MetalProgress
    where
        R: Fn(MetalProgress),
        S: Future<Output = ()>,
    {
        let mut ticker = tokio::time::interval(every);
        tokio::pin!(shutdown);
        let mut last = MetalProgress::default();
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = ticker.tick() => match self.progress().await {
                    Ok(progress) => {
                        last = progress;
                        report(progress);
                    }
                    Err(err) => tracing::warn!(error = %err, "could not count the simulated bare-metal fleet"),
                },
            }
        }
        self.shutdown().await;
        last
    }
}
