//! A raw bcd/v1 client for tests that must send exactly the bytes they mean: join over
//! HTTPS, a session over WebSocket over TLS with a client certificate, and the gateway's
//! answers frame by frame. The FakeDaemon in `bc-testing` is the well-behaved daemon.

#![allow(dead_code, clippy::unwrap_used)]

use bc_core::protocol::{DaemonMessage, GatewayMessage, IssuedIdentity, section_hash};
use bc_testing::TestServer;
use futures::{SinkExt, StreamExt};
use rustls::pki_types::{
    CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, pem::PemObject,
};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

/// How long a test waits for the gateway to answer before it calls the test failed.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

/// A machine: its key and identifiers.
pub struct Machine {
    pub key: rcgen::KeyPair,
    pub identifiers: BTreeMap<String, String>,
}

impl Machine {
    pub fn new() -> Machine {
        let id = uuid::Uuid::new_v4();
        Machine {
            key: rcgen::KeyPair::generate().unwrap(),
            identifiers: BTreeMap::from([
                ("system-uuid".to_owned(), id.to_string()),
                (
                    "board-serial".to_owned(),
                    format!("SN{}", &id.simple().to_string()[..10]),
                ),
            ]),
        }
    }

    pub fn csr(&self) -> String {
        rcgen::CertificateParams::new(Vec::<String>::new())
            .unwrap()
            .serialize_request(&self.key)
            .unwrap()
            .pem()
            .unwrap()
    }

    pub fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.serialize_der()))
    }
}

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub fn tls_config(
    ca_pem: &str,
    client: Option<(&str, PrivateKeyDer<'static>)>,
) -> Arc<rustls::ClientConfig> {
    tls_config_of_versions(ca_pem, client, rustls::DEFAULT_VERSIONS)
}

/// [`tls_config`] speaking only the TLS `versions` given.
pub fn tls_config_of_versions(
    ca_pem: &str,
    client: Option<(&str, PrivateKeyDer<'static>)>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(roots);
    Arc::new(match client {
        Some((cert_pem, key)) => {
            let chain: Vec<CertificateDer<'static>> =
                CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                    .collect::<Result<_, _>>()
                    .unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    })
}

pub fn http(ca_pem: &str, client: Option<(&str, PrivateKeyDer<'static>)>) -> reqwest::Client {
    let config = Arc::unwrap_or_clone(tls_config(ca_pem, client));
    reqwest::Client::builder()
        .tls_backend_preconfigured(config)
        .build()
        .unwrap()
}

/// POSTs `/v1/join`; returns the status and the JSON body.
pub async fn post_join(s: &TestServer, body: Value) -> (u16, Value) {
    let response = http(&s.ca_pem(), None)
        .post(format!("{}/v1/join", s.gateway_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    (
        response.status().as_u16(),
        response.json().await.unwrap_or(Value::Null),
    )
}

pub async fn join(
    s: &TestServer,
    machine: &Machine,
    secret: &str,
    hostname: &str,
) -> IssuedIdentity {
    let (status, body) = post_join(s, json!({
        "token": secret, "csrPem": machine.csr(), "hostname": hostname, "identifiers": machine.identifiers,
    }))
    .await;
    assert_eq!(status, 200, "{body:#}");
    serde_json::from_value(body).unwrap()
}

/// Opens a session's WebSocket with `cert_pem` as the client certificate.
pub async fn connect(
    s: &TestServer,
    cert_pem: &str,
    key: PrivateKeyDer<'static>,
) -> Result<Ws, String> {
    let config = tls_config(&s.ca_pem(), Some((cert_pem, key)));
    let address = s.gateway_url().trim_start_matches("https://").to_owned();
    let tcp = tokio::net::TcpStream::connect(&address)
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| format!("tls: {e}"))?;
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(format!(
            "wss://{address}/v1/session"
        ))
        .unwrap();
    request
        .headers_mut()
        .insert("Sec-WebSocket-Protocol", "bcd.v1".parse().unwrap());
    let (ws, _) = tokio_tungstenite::client_async(request, tls)
        .await
        .map_err(|e| format!("upgrade: {e}"))?;
    Ok(ws)
}

/// Connects over TLS with `config`, asks for the CA over HTTP/1.1 and reads the answer to the
/// end (so a session ticket the gateway sends after the handshake would be read and kept in
/// `config`'s store too), and says what kind of handshake it was.
pub async fn handshake_kind(
    s: &TestServer,
    config: Arc<rustls::ClientConfig>,
) -> Option<rustls::HandshakeKind> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = s.gateway_url().trim_start_matches("https://").to_owned();
    let tcp = tokio::net::TcpStream::connect(&address).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    tls.write_all(b"GET /v1/ca.pem HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    // The gateway may close without TLS's close_notify; what was read is what counts.
    let _ = tls.read_to_end(&mut answer).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    tls.get_ref().1.handshake_kind()
}

pub async fn send(ws: &mut Ws, message: &DaemonMessage) {
    ws.send(Message::Text(
        serde_json::to_string(message).unwrap().into(),
    ))
    .await
    .unwrap();
}

/// The next gateway message, or the close frame (code, reason) that ended the session.
pub async fn next(ws: &mut Ws) -> Result<GatewayMessage, (Option<CloseCode>, String)> {
    loop {
        let frame = tokio::time::timeout(ANSWER_TIMEOUT, ws.next())
            .await
            .expect("the gateway answers in time");
        match frame {
            Some(Ok(Message::Text(text))) => return Ok(serde_json::from_str(&text).unwrap()),
            Some(Ok(Message::Close(frame))) => {
                return Err((
                    frame.as_ref().map(|f| f.code),
                    frame.map(|f| f.reason.to_string()).unwrap_or_default(),
                ));
            }
            Some(Ok(_)) => continue,
            Some(Err(err)) => return Err((None, err.to_string())),
            None => return Err((None, "closed".into())),
        }
    }
}

pub fn hello(observed_generation: i64) -> DaemonMessage {
    DaemonMessage::Hello {
        daemon_version: "test".into(),
        inventory_hashes: BTreeMap::from([("cpu".into(), section_hash(&json!({"count": 8})))]),
        observed_generation,
    }
}

pub async fn node(s: &TestServer, id: &str) -> Value {
    s.admin(
        "query($id: ID!) { node(id: $id) { id version provisionState connectivity identityGeneration role trust hardwareKeyTrusted session { epoch gatewayId lastSeen disconnectedAt } } }",
        json!({ "id": id }),
    )
    .await["node"]
    .clone()
}

pub async fn node_count(s: &TestServer) -> u64 {
    s.admin("{ nodes { totalCount } }", json!({})).await["nodes"]["totalCount"]
        .as_u64()
        .unwrap()
}

pub fn parse_time(raw: &str) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::parse_from_rfc3339(raw)
        .unwrap()
        .with_timezone(&chrono::Utc)
}

/// Polls `condition` until it holds (the gateway writes heartbeats and closes asynchronously).
pub async fn wait_until(mut condition: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + ANSWER_TIMEOUT;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached in time"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
