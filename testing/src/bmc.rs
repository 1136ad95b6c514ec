//! BMCs for tests: OpenStack's Redfish emulator (`sushy-emulator` from `sushy-tools`, with
//! its fake systems driver) run for real, and a small in-process stub for the faults the
//! emulator cannot produce (a BMC that hangs, answers 500, refuses every password, or lies).
//!
//! The emulator runs from a Python venv (`BC_TEST_SUSHY_VENV`, by default
//! `/var/tmp/bc-sushy-venv`) that `scripts/ensure-sushy` creates (`scripts/test` and
//! `.ci/run` call it). A test that needs it and does not find it fails, naming the script: CI
//! must never pass by testing nothing. What it takes (README, "Testing"): a config file (its
//! environment variables are mostly ignored), TLS 1.2 only, bcrypt-only basic auth checked on
//! every request (so cost 4 here), power changes applied lazily on the next read of the
//! system 1 to 11 s later (unless started with [`SushyOptions::instant_power`]), a state
//! directory per run (it keeps systems across restarts otherwise), and the port it chose on
//! stderr.

use anyhow::{Context, anyhow};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Where the emulator's venv is, unless `BC_TEST_SUSHY_VENV` says otherwise.
pub const DEFAULT_SUSHY_VENV: &str = "/var/tmp/bc-sushy-venv";
/// How long the emulator may take to start (0.6 s seen).
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The emulator's venv.
pub fn sushy_venv() -> PathBuf {
    std::env::var_os("BC_TEST_SUSHY_VENV")
        .map_or_else(|| PathBuf::from(DEFAULT_SUSHY_VENV), PathBuf::from)
}

/// One fake system of the emulator.
#[derive(Debug, Clone)]
pub struct SushySystem {
    /// Its id in `/redfish/v1/Systems/<uuid>` and its `UUID`.
    pub uuid: String,
    pub name: String,
    pub power_on: bool,
}

impl SushySystem {
    /// A system `n` (UUID `11111111-1111-4111-8111-<n as 12 digits>`), off.
    pub fn numbered(n: u32) -> SushySystem {
        SushySystem {
            uuid: format!("11111111-1111-4111-8111-{n:012}"),
            name: format!("gpu-node-{n}"),
            power_on: false,
        }
    }
}

/// How to start the emulator.
#[derive(Debug, Clone)]
pub struct SushyOptions {
    pub systems: Vec<SushySystem>,
    pub username: String,
    pub password: String,
    /// Apply power changes on the next read of the system instead of 1 to 11 s later (the
    /// emulator's `random.randint` patched to 0). Keep at least one test without it.
    pub instant_power: bool,
}

impl Default for SushyOptions {
    fn default() -> Self {
        SushyOptions {
            systems: vec![SushySystem::numbered(1), SushySystem::numbered(2)],
            username: "admin".into(),
            password: "bmc-secret-1".into(),
            instant_power: true,
        }
    }
}

/// A test CA and a server certificate it signed for `127.0.0.1` and `localhost`.
pub struct TestCertificates {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCertificates {
    pub fn generate() -> anyhow::Result<TestCertificates> {
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "Better Compute test BMC CA");
        let ca = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate()?;
        let params = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok(TestCertificates {
            ca_pem: ca.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A running `sushy-emulator`; stopped when dropped.
pub struct SushyEmulator {
    child: Child,
    _dir: tempfile::TempDir,
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// The CA that signed its certificate (PEM).
    pub ca_pem: String,
    pub options: SushyOptions,
}

impl SushyEmulator {
    /// Starts the emulator with `options` on a free port, in a fresh state directory, and
    /// waits until its service root answers.
    pub async fn start(options: SushyOptions) -> anyhow::Result<SushyEmulator> {
        let venv = sushy_venv();
        let python = venv.join("bin/python");
        let emulator = venv.join("bin/sushy-emulator");
        anyhow::ensure!(
            emulator.exists(),
            "the Redfish emulator is not installed at {} (run scripts/ensure-sushy, or set BC_TEST_SUSHY_VENV)",
            emulator.display()
        );
        let dir = tempfile::tempdir()?;
        let certs = TestCertificates::generate()?;
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        std::fs::write(&cert, &certs.cert_pem)?;
        std::fs::write(&key, &certs.key_pem)?;
        // bcrypt at cost 4: the emulator checks it on every request (cost 12 is 0.37 s each).
        let hash = Command::new(&python)
            .arg("-c")
            .arg("import bcrypt, sys; print(bcrypt.hashpw(sys.argv[1].encode(), bcrypt.gensalt(rounds=4)).decode())")
            .arg(&options.password)
            .output()
            .await
            .context("hashing the emulator's password with the venv's bcrypt")?;
        anyhow::ensure!(
            hash.status.success(),
            "bcrypt failed: {}",
            String::from_utf8_lossy(&hash.stderr)
        );
        let htpasswd = dir.path().join("htpasswd");
        std::fs::write(
            &htpasswd,
            format!(
                "{}:{}\n",
                options.username,
                String::from_utf8_lossy(&hash.stdout).trim()
            ),
        )?;
        let systems: Vec<String> = options
            .systems
            .iter()
            .enumerate()
            .map(|(i, s)| {
                format!(
                    "{{'uuid': '{}', 'name': '{}', 'power_state': '{}', 'nics': [{{'mac': '00:1b:21:00:{:02x}:{:02x}', 'ip': '10.0.{}.{}'}}]}}",
                    s.uuid,
                    s.name,
                    if s.power_on { "On" } else { "Off" },
                    i / 256,
                    i % 256,
                    i / 250,
                    1 + i % 250
                )
            })
            .collect();
        let config = dir.path().join("emulator.conf");
        std::fs::write(
            &config,
            format!(
                "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\n\
                 SUSHY_EMULATOR_LISTEN_PORT = 0\n\
                 SUSHY_EMULATOR_SSL_CERT = '{}'\n\
                 SUSHY_EMULATOR_SSL_KEY = '{}'\n\
                 SUSHY_EMULATOR_AUTH_FILE = '{}'\n\
                 SUSHY_EMULATOR_FAKE_DRIVER = True\n\
                 SUSHY_EMULATOR_STATE_DIR = '{}'\n\
                 SUSHY_EMULATOR_FAKE_SYSTEMS = [{}]\n",
                cert.display(),
                key.display(),
                htpasswd.display(),
                dir.path().join("state").display(),
                systems.join(", ")
            ),
        )?;
        let mut command = if options.instant_power {
            let mut c = Command::new(&python);
            c.arg("-c").arg(
                "import sys, types\n\
                 from sushy_tools.emulator.resources.systems import fakedriver\n\
                 fakedriver.random = types.SimpleNamespace(randint=lambda a, b: 0)\n\
                 from sushy_tools.emulator.main import main\n\
                 sys.argv[0] = 'sushy-emulator'\n\
                 sys.exit(main())",
            );
            c
        } else {
            Command::new(&emulator)
        };
        command
            .arg("--config")
            .arg(&config)
            .env("SUSHY_EMULATOR_CONFIG", &config)
            .env("TMPDIR", dir.path())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().context("starting sushy-emulator")?;
        let stderr = child.stderr.take().ok_or_else(|| anyhow!("no stderr"))?;
        let (port_tx, port_rx) = tokio::sync::oneshot::channel::<u16>();
        // Reads stderr for the port, then keeps draining it so the pipe never fills.
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            let mut port_tx = Some(port_tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(port) = running_on_port(&line)
                    && let Some(tx) = port_tx.take()
                {
                    let _ = tx.send(port);
                }
                if std::env::var_os("BC_TEST_SUSHY_LOG").is_some() {
                    eprintln!("sushy-emulator: {line}");
                }
            }
        });
        let port = tokio::time::timeout(START_TIMEOUT, port_rx)
            .await
            .context("sushy-emulator did not say where it listens in time")?
            .context("sushy-emulator exited before it listened (BC_TEST_SUSHY_LOG=1 shows why)")?;
        let url = format!("https://127.0.0.1:{port}");
        let emulator = SushyEmulator {
            child,
            _dir: dir,
            url,
            ca_pem: certs.ca_pem,
            options,
        };
        emulator.wait_ready().await?;
        Ok(emulator)
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        let client = self.client()?;
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            match client.get(format!("{}/redfish/v1/", self.url)).send().await {
                Ok(r) if r.status().is_success() => return Ok(()),
                _ if tokio::time::Instant::now() > deadline => {
                    return Err(anyhow!("sushy-emulator at {} never answered", self.url));
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// An HTTP client trusting the emulator's CA (for a test's own look at it).
    pub fn client(&self) -> anyhow::Result<reqwest::Client> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pki_types::CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(cert?)?;
        }
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(reqwest::Client::builder()
            .tls_backend_preconfigured(config)
            .timeout(Duration::from_secs(10))
            .build()?)
    }

    /// A resource of the emulator (`/redfish/v1/…`), read straight from it.
    pub async fn get(&self, path: &str) -> anyhow::Result<Value> {
        Ok(self
            .client()?
            .get(format!("{}{path}", self.url))
            .basic_auth(&self.options.username, Some(&self.options.password))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// A system's `PowerState` read straight from the emulator (which applies a pending
    /// change on this read).
    pub async fn power_state(&self, uuid: &str) -> anyhow::Result<String> {
        let system = self.get(&format!("/redfish/v1/Systems/{uuid}")).await?;
        system["PowerState"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("no PowerState in {system}"))
    }

    /// The emulator's process id (to stop it, or check it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

impl Drop for SushyEmulator {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// The port of Flask's "Running on https://127.0.0.1:<port>" line (it carries colour codes).
fn running_on_port(line: &str) -> Option<u16> {
    let line = without_ansi_escapes(line);
    let at = line.find("Running on http")?;
    let rest = &line[at..];
    let after_host = rest.find("127.0.0.1:")? + "127.0.0.1:".len();
    let digits: String = rest[after_host..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// `line` without its terminal colour codes (`ESC [ … letter`), which Flask's banner puts
/// around the address.
fn without_ansi_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // Skip up to and including the sequence's final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// What the stub BMC does with every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StubMode {
    /// A well-behaved Redfish service with one system.
    Normal,
    /// Accepts the connection and never answers.
    Hang,
    /// Answers 500 with an HTML page.
    ServerError,
    /// Refuses every credential (401).
    Unauthorized,
    /// Answers 200 with a `PowerState` no Redfish service has.
    Lie,
}

#[derive(Debug)]
struct StubState {
    mode: StubMode,
    power_on: bool,
    username: String,
    password: String,
    requests: u64,
    resets: Vec<String>,
}

/// A minimal Redfish service over plain HTTP (the server must allow it:
/// `bare_metal.allow_insecure_http`): service root, one system at `/redfish/v1/Systems/1`,
/// its reset action and boot PATCH, and the faults of [`StubMode`].
pub struct BmcStub {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    state: Arc<Mutex<StubState>>,
    task: tokio::task::JoinHandle<()>,
}

impl BmcStub {
    pub async fn start(username: &str, password: &str) -> anyhow::Result<BmcStub> {
        let state = Arc::new(Mutex::new(StubState {
            mode: StubMode::Normal,
            power_on: false,
            username: username.to_owned(),
            password: password.to_owned(),
            requests: 0,
            resets: Vec::new(),
        }));
        let app = Router::new()
            .route("/redfish/v1/", get(stub_root))
            .route("/redfish/v1/Systems", get(stub_systems))
            .route("/redfish/v1/Systems/1", get(stub_system).patch(stub_patch))
            .route(
                "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset",
                post(stub_reset),
            )
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(BmcStub { url, state, task })
    }

    fn with<T>(&self, f: impl FnOnce(&mut StubState) -> T) -> T {
        f(&mut self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    pub fn set_mode(&self, mode: StubMode) {
        self.with(|s| s.mode = mode);
    }

    pub fn set_power(&self, on: bool) {
        self.with(|s| s.power_on = on);
    }

    pub fn power_on(&self) -> bool {
        self.with(|s| s.power_on)
    }

    /// Requests answered (or hung) so far.
    pub fn requests(&self) -> u64 {
        self.with(|s| s.requests)
    }

    /// The `ResetType`s received, in order.
    pub fn resets(&self) -> Vec<String> {
        self.with(|s| s.resets.clone())
    }
}

impl Drop for BmcStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Shared = Arc<Mutex<StubState>>;

/// The mode's answer, if it is a fault; `None` to answer normally.
async fn fault(state: &Shared, headers: &HeaderMap) -> Option<Response> {
    let (mode, authorized) = {
        let mut s = state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.requests += 1;
        let expected = format!("{}:{}", s.username, s.password);
        let authorized = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Basic "))
            .and_then(|b| {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD.decode(b).ok()
            })
            .is_some_and(|raw| raw == expected.as_bytes());
        (s.mode, authorized)
    };
    match mode {
        StubMode::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            None
        }
        StubMode::ServerError => Some(
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "<html>Internal Server Error</html>",
            )
                .into_response(),
        ),
        StubMode::Unauthorized => Some(unauthorized()),
        _ if !authorized => Some(unauthorized()),
        StubMode::Normal | StubMode::Lie => None,
    }
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(axum::http::header::WWW_AUTHENTICATE, "Basic realm=\"stub\"")],
        Json(json!({ "error": { "code": "Base.1.0.GeneralError", "message": "Authorization required" } })),
    )
        .into_response()
}

async fn stub_root(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(fault) = fault(&state, &headers).await {
        return fault;
    }
    Json(json!({ "@odata.id": "/redfish/v1/", "Systems": { "@odata.id": "/redfish/v1/Systems" } }))
        .into_response()
}

async fn stub_systems(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(fault) = fault(&state, &headers).await {
        return fault;
    }
    Json(json!({ "Members": [{ "@odata.id": "/redfish/v1/Systems/1" }], "Members@odata.count": 1 }))
        .into_response()
}

async fn stub_system(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(fault) = fault(&state, &headers).await {
        return fault;
    }
    let (mode, on) = {
        let s = state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (s.mode, s.power_on)
    };
    let power = match (mode, on) {
        (StubMode::Lie, _) => "Sideways",
        (_, true) => "On",
        (_, false) => "Off",
    };
    Json(json!({
        "@odata.id": "/redfish/v1/Systems/1",
        "Id": "1",
        "UUID": "22222222-2222-4222-8222-000000000001",
        "PowerState": power,
        "Actions": { "#ComputerSystem.Reset": {
            "target": "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset",
            "ResetType@Redfish.AllowableValues": ["On", "ForceOff", "ForceRestart"],
        } },
    }))
    .into_response()
}

async fn stub_reset(
    State(state): State<Shared>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    if let Some(fault) = fault(&state, &headers).await {
        return fault;
    }
    let reset = body["ResetType"].as_str().unwrap_or_default().to_owned();
    let mut s = state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match reset.as_str() {
        "On" | "ForceRestart" => s.power_on = true,
        "ForceOff" => s.power_on = false,
        _ => return StatusCode::BAD_REQUEST.into_response(),
    }
    s.resets.push(reset);
    StatusCode::NO_CONTENT.into_response()
}

async fn stub_patch(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(fault) = fault(&state, &headers).await {
        return fault;
    }
    StatusCode::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_port_is_read_from_flask_s_banner() {
        assert_eq!(
            super::running_on_port(" * Running on \u{1b}[1mhttps://127.0.0.1:41234\u{1b}[0m"),
            Some(41234)
        );
        assert_eq!(super::running_on_port("Press CTRL+C to quit"), None);
    }
}
