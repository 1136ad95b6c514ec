//! A small `graphql-transport-ws` client (the protocol of the `graphql-ws` library) for
//! tests and benchmarks: [`SubscriptionClient::connect`] sends `connection_init` with the
//! bearer token and waits for `connection_ack`; then [`SubscriptionClient::subscribe`] starts
//! operations by id, [`SubscriptionClient::next`] waits (bounded) for the next message of one
//! of them, and [`SubscriptionClient::complete`] stops one.
//!
//! Messages for other operations than the one being waited for are kept, in order, until
//! asked for. Plain TCP only (the test servers and the benchmark listen on 127.0.0.1).

use anyhow::{Context, anyhow, bail};
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Message, http};

/// The WebSocket subprotocol.
pub const PROTOCOL: &str = "graphql-transport-ws";
/// How long [`SubscriptionClient::connect`] waits for the upgrade and `connection_ack`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// The client's WebSocket read buffer: tungstenite's default (128 KiB, zero-filled on every
/// read) would cost the benchmark 1.3 GB for 10,000 subscribers.
const READ_BUFFER_BYTES: usize = 4096;
/// Client messages are tiny and written at once.
const WRITE_BUFFER_BYTES: usize = 0;
/// How long [`SubscriptionClient::close`] waits for the server's close frame.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// One message the server sent for one operation.
#[derive(Debug, Clone, PartialEq)]
pub enum SubMessage {
    /// `next`: one execution result, `{"data": …, "errors": […]}`.
    Next(Value),
    /// `error`: the operation was refused before it ran (`[GraphQLError]`).
    Error(Value),
    /// `complete`: the server ended the operation.
    Complete,
}

impl SubMessage {
    /// `payload.data` of a `next` without errors.
    pub fn data(&self) -> Option<&Value> {
        match self {
            SubMessage::Next(payload) if errors_of(payload).is_none() => payload.get("data"),
            _ => None,
        }
    }

    /// The first error: of a `next` that carries errors, or of an `error`.
    pub fn first_error(&self) -> Option<&Value> {
        match self {
            SubMessage::Next(payload) => errors_of(payload).and_then(|e| e.first()),
            SubMessage::Error(errors) => errors.as_array().and_then(|e| e.first()),
            SubMessage::Complete => None,
        }
    }

    /// `extensions.code` of [`SubMessage::first_error`].
    pub fn error_code(&self) -> Option<&str> {
        self.first_error()?.pointer("/extensions/code")?.as_str()
    }
}

fn errors_of(payload: &Value) -> Option<&Vec<Value>> {
    payload
        .get("errors")
        .and_then(Value::as_array)
        .filter(|e| !e.is_empty())
}

/// Why [`SubscriptionClient::connect_with`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The server closed the connection instead of acknowledging `connection_init`.
    #[error("the server refused the connection (close code {code}): {reason}")]
    Refused { code: u16, reason: String },
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The `connection_init` payload, e.g. `{"Authorization": "Bearer …"}`.
    pub init_payload: Value,
    /// Set the socket's receive buffer (`SO_RCVBUF`, which also turns off the kernel's
    /// autotuning): a client that stops reading then backs the server up after this much.
    pub recv_buffer_bytes: Option<u32>,
    /// How long the upgrade and `connection_ack` may take.
    pub timeout: Duration,
}

impl ConnectOptions {
    /// `connection_init` with `{"Authorization": "Bearer <token>"}`.
    pub fn bearer(token: &str) -> ConnectOptions {
        ConnectOptions::with_payload(json!({ "Authorization": format!("Bearer {token}") }))
    }

    pub fn with_payload(init_payload: Value) -> ConnectOptions {
        ConnectOptions {
            init_payload,
            recv_buffer_bytes: None,
            timeout: CONNECT_TIMEOUT,
        }
    }
}

/// One `graphql-transport-ws` connection.
pub struct SubscriptionClient {
    ws: WebSocketStream<TcpStream>,
    /// Messages that arrived for an operation other than the one being waited for.
    pending: HashMap<String, VecDeque<SubMessage>>,
    /// Set once the server closed the connection: its code and reason.
    closed: Option<(u16, String)>,
}

impl SubscriptionClient {
    /// Connects to `url` (`http://host:port` of a server, or a `ws://…` URL; without a path,
    /// `/graphql`) with `token` in `connection_init`, and waits for `connection_ack`.
    pub async fn connect(url: &str, token: &str) -> anyhow::Result<SubscriptionClient> {
        Ok(SubscriptionClient::connect_with(url, &ConnectOptions::bearer(token)).await?)
    }

    /// [`SubscriptionClient::connect`] with any `connection_init` payload and socket options.
    pub async fn connect_with(
        url: &str,
        options: &ConnectOptions,
    ) -> Result<SubscriptionClient, ConnectError> {
        let deadline = Instant::now() + options.timeout;
        let url = websocket_url(url)?;
        let mut request = url
            .as_str()
            .into_client_request()
            .with_context(|| format!("the WebSocket URL {url}"))?;
        request.headers_mut().insert(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            http::HeaderValue::from_static(PROTOCOL),
        );
        let authority = request
            .uri()
            .authority()
            .map(ToString::to_string)
            .context("the URL names no host")?;
        let tcp =
            tokio::time::timeout_at(deadline, open_tcp(&authority, options.recv_buffer_bytes))
                .await
                .map_err(|_| anyhow!("connecting to {authority} timed out"))??;
        let config = WebSocketConfig::default()
            .read_buffer_size(READ_BUFFER_BYTES)
            .write_buffer_size(WRITE_BUFFER_BYTES);
        let (ws, response) = tokio::time::timeout_at(
            deadline,
            tokio_tungstenite::client_async_with_config(request, tcp, Some(config)),
        )
        .await
        .map_err(|_| anyhow!("the WebSocket upgrade at {url} timed out"))?
        .with_context(|| format!("the WebSocket upgrade at {url}"))?;
        let agreed = response
            .headers()
            .get(http::header::SEC_WEBSOCKET_PROTOCOL)
            .and_then(|v| v.to_str().ok());
        if agreed != Some(PROTOCOL) {
            return Err(
                anyhow!("the server did not agree to {PROTOCOL} (it answered {agreed:?})").into(),
            );
        }
        let mut client = SubscriptionClient {
            ws,
            pending: HashMap::new(),
            closed: None,
        };
        client
            .send(json!({ "type": "connection_init", "payload": options.init_payload }))
            .await?;
        loop {
            let frame = match tokio::time::timeout_at(deadline, client.ws.next()).await {
                Err(_) => {
                    return Err(anyhow!("no connection_ack within {:?}", options.timeout).into());
                }
                Ok(frame) => frame,
            };
            match frame {
                None => {
                    return Err(ConnectError::Refused {
                        code: 1006,
                        reason: "the connection ended without a close frame".into(),
                    });
                }
                Some(Err(err)) => return Err(anyhow!("reading connection_ack: {err}").into()),
                Some(Ok(Message::Close(frame))) => {
                    let (code, reason) = frame.map_or((1005, String::new()), |f| {
                        (u16::from(f.code), f.reason.to_string())
                    });
                    return Err(ConnectError::Refused { code, reason });
                }
                Some(Ok(Message::Text(text))) => {
                    let message: Value = serde_json::from_str(text.as_str())
                        .with_context(|| format!("a message that is not JSON: {text}"))?;
                    match message["type"].as_str() {
                        Some("connection_ack") => return Ok(client),
                        Some("ping") => client.send(json!({ "type": "pong" })).await?,
                        _ => return Err(anyhow!("expected connection_ack, got {message}").into()),
                    }
                }
                Some(Ok(_)) => {}
            }
        }
    }

    /// Starts operation `id`: a GraphQL subscription (`query`) with `variables`.
    pub async fn subscribe(
        &mut self,
        id: &str,
        query: &str,
        variables: Value,
    ) -> anyhow::Result<()> {
        self.send(json!({
            "type": "subscribe",
            "id": id,
            "payload": { "query": query, "variables": variables },
        }))
        .await
    }

    /// Stops operation `id` (the server stops sending for it).
    pub async fn complete(&mut self, id: &str) -> anyhow::Result<()> {
        self.send(json!({ "type": "complete", "id": id })).await
    }

    /// The next message for operation `id`, waiting at most `timeout`.
    pub async fn next(&mut self, id: &str, timeout: Duration) -> anyhow::Result<SubMessage> {
        if let Some(message) = self.pending.get_mut(id).and_then(VecDeque::pop_front) {
            return Ok(message);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let (for_id, message) = self
                .read(deadline)
                .await
                .with_context(|| format!("waiting for a message of subscription `{id}`"))?;
            if for_id == id {
                return Ok(message);
            }
            self.pending.entry(for_id).or_default().push_back(message);
        }
    }

    /// The next message for any operation, with its id, waiting at most `timeout`.
    pub async fn next_any(&mut self, timeout: Duration) -> anyhow::Result<(String, SubMessage)> {
        let buffered = self
            .pending
            .iter_mut()
            .find_map(|(id, queue)| Some((id.clone(), queue.pop_front()?)));
        if let Some(found) = buffered {
            return Ok(found);
        }
        self.read(Instant::now() + timeout).await
    }

    /// `payload.data.<field>` of the next message for `id`, which must be a `next` without
    /// errors (anything else is an error that shows it).
    pub async fn next_data(
        &mut self,
        id: &str,
        field: &str,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        match self.next(id, timeout).await? {
            message @ SubMessage::Next(_) => match message.data() {
                Some(data) => Ok(data[field].clone()),
                None => bail!("subscription `{id}` sent errors: {message:?}"),
            },
            other => bail!("subscription `{id}` sent {other:?} where data was expected"),
        }
    }

    /// The close code and reason, once the server closed the connection.
    pub fn closed(&self) -> Option<&(u16, String)> {
        self.closed.as_ref()
    }

    /// Closes the connection (a close frame, then waiting briefly for the server's).
    pub async fn close(mut self) {
        if self.closed.is_some() {
            return;
        }
        let _ = self.ws.close(None).await;
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        while let Ok(Some(Ok(_))) = tokio::time::timeout_at(deadline, self.ws.next()).await {}
    }

    async fn send(&mut self, message: Value) -> anyhow::Result<()> {
        self.ws
            .send(Message::text(message.to_string()))
            .await
            .context("sending to the server")
    }

    /// Reads frames until one is a message for an operation.
    async fn read(&mut self, deadline: Instant) -> anyhow::Result<(String, SubMessage)> {
        loop {
            if let Some((code, reason)) = &self.closed {
                bail!("the server closed the connection (code {code}): {reason}");
            }
            let frame = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| anyhow!("nothing arrived in time"))?;
            let text = match frame {
                None => {
                    self.closed = Some((1006, "the connection ended".into()));
                    continue;
                }
                Some(Err(err)) => {
                    self.closed = Some((1006, format!("the connection failed: {err}")));
                    continue;
                }
                Some(Ok(Message::Close(frame))) => {
                    self.closed = Some(frame.map_or((1005, String::new()), |f| {
                        (u16::from(f.code), f.reason.to_string())
                    }));
                    continue;
                }
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(_)) => continue,
            };
            let mut message: Value = serde_json::from_str(text.as_str())
                .with_context(|| format!("a message that is not JSON: {text}"))?;
            let id = message["id"].as_str().map(str::to_owned);
            let parsed = match (message["type"].as_str(), id) {
                (Some("next"), Some(id)) => (id, SubMessage::Next(message["payload"].take())),
                (Some("error"), Some(id)) => (id, SubMessage::Error(message["payload"].take())),
                (Some("complete"), Some(id)) => (id, SubMessage::Complete),
                (Some("ping"), _) => {
                    self.send(json!({ "type": "pong" })).await?;
                    continue;
                }
                (Some("pong"), _) => continue,
                _ => bail!("an unexpected message: {message}"),
            };
            return Ok(parsed);
        }
    }
}

/// `ws://host:port/path` for `http://…`, `ws://…` or a bare `host:port`; `/graphql` when
/// no path is given.
fn websocket_url(url: &str) -> anyhow::Result<String> {
    let rest = if let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("ws://"))
    {
        rest
    } else if url.starts_with("https://") || url.starts_with("wss://") {
        bail!("this client speaks plain WebSocket only, not {url}");
    } else {
        url
    };
    let (authority, path) = match rest.find('/') {
        Some(slash) if slash + 1 < rest.len() => (&rest[..slash], &rest[slash..]),
        Some(slash) => (&rest[..slash], "/graphql"),
        None => (rest, "/graphql"),
    };
    Ok(format!("ws://{authority}{path}"))
}

async fn open_tcp(authority: &str, recv_buffer: Option<u32>) -> anyhow::Result<TcpStream> {
    let addr = tokio::net::lookup_host(authority)
        .await
        .with_context(|| format!("resolving {authority}"))?
        .next()
        .with_context(|| format!("{authority} resolves to no address"))?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    if let Some(bytes) = recv_buffer {
        socket.set_recv_buffer_size(bytes)?;
    }
    let stream = socket
        .connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_websocket_urls() {
        let cases = [
            ("http://127.0.0.1:8080", "ws://127.0.0.1:8080/graphql"),
            ("http://127.0.0.1:8080/", "ws://127.0.0.1:8080/graphql"),
            ("ws://127.0.0.1:8080/graphql", "ws://127.0.0.1:8080/graphql"),
            ("127.0.0.1:9", "ws://127.0.0.1:9/graphql"),
        ];
        for (given, expected) in cases {
            assert_eq!(websocket_url(given).expect("a URL"), expected);
        }
        assert!(websocket_url("https://example.com").is_err());
    }

    #[test]
    fn errors_are_read_from_next_and_error_messages() {
        let next = SubMessage::Next(
            json!({ "data": null, "errors": [{ "message": "m", "extensions": { "code": "RESUME_REQUIRED" } }] }),
        );
        assert_eq!(next.error_code(), Some("RESUME_REQUIRED"));
        assert_eq!(next.data(), None);
        let ok = SubMessage::Next(json!({ "data": { "events": { "id": "evt_1" } } }));
        assert_eq!(ok.error_code(), None);
        assert_eq!(
            ok.data().map(|d| d["events"]["id"].clone()),
            Some(json!("evt_1"))
        );
        let error = SubMessage::Error(
            json!([{ "message": "bad", "extensions": { "code": "BAD_USER_INPUT" } }]),
        );
        assert_eq!(error.error_code(), Some("BAD_USER_INPUT"));
        assert_eq!(SubMessage::Complete.first_error(), None);
    }
}
