//! One subscription socket on the API listener (`graphql-transport-ws`, and the older
//! `graphql-ws`), around async-graphql's protocol engine, which runs the operations. This
//! module holds the socket to its time limits, which the engine does not:
//!
//! - `connection_init` must arrive within `api.ws_init_timeout_secs` of the upgrade, or the
//!   socket is closed with 4408 (the `graphql-ws` code for it);
//! - a `connection_init` without a valid token closes it with 4403 (Forbidden), not the
//!   engine's 1002 (protocol error): the client did nothing wrong in the protocol;
//! - the token's expiry, on the server's clock: the socket is closed with 4403 when it
//!   passes, and a message that arrives after it closes the socket before it runs (every
//!   operation also checks it, see `graphql::principal`);
//! - keep-alive: a WebSocket ping every `api.ws_ping_interval_secs` (browsers and WebSocket
//!   libraries answer by themselves); a socket from which nothing arrives within
//!   `api.ws_pong_timeout_secs` of a ping, or that does not take a frame for as long as
//!   both together, is closed with 3008 (timeout);
//! - a `subscribe` (`graphql-transport-ws`) that reuses the id of an operation still running
//!   closes it with 4409, as that protocol says; the engine would replace the running one
//!   silently.
//!
//! Live `events` subscriptions a hub can serve (`subscription_hubs`) do not run on the
//! engine: the socket joins the hub of their shape, which resolves and serializes each event
//! once for all its subscribers, and sends its payloads in its own `next` frames, ending
//! them itself with `RESUME_REQUIRED` (fallen behind the hub) or `UNAUTHENTICATED` (the
//! token expired, by the wall clock, as the engine's own subscriptions end).
//!
//! Metric: `bc_subscription_sockets_closed_total{reason}` for the closes above.

use async_graphql::http::{ClientMessage, WebSocket as Engine, WebSocketProtocols, WsMessage};
use axum::body::Bytes;
use axum::extract::ws::{CloseFrame, Message, WebSocket};
use bc_core::clock::Clock;
use chrono::{DateTime, Utc};
use futures::{FutureExt, SinkExt, Stream, StreamExt};
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_stream::StreamMap;
use tokio_stream::wrappers::BroadcastStream;

use crate::auth::{Principal, TokenKeys};
use crate::config::ApiConfig;
use crate::error::ApiError;
use crate::graphql::AppSchema;
use crate::subscription_hubs::{HubItem, Joined, SharedField, SubscriptionHubs};

/// `graphql-ws`: the client did not send `connection_init` in time.
pub const CLOSE_INIT_TIMEOUT: u16 = 4408;
/// `graphql-ws`: Forbidden. No valid token at `connection_init`, or the token expired.
pub const CLOSE_FORBIDDEN: u16 = 4403;
/// IANA's "timeout" (also what async-graphql's keep-alive sends): the peer stopped answering.
pub const CLOSE_KEEPALIVE_TIMEOUT: u16 = 3008;
/// RFC 6455 "going away": the server is stopping.
pub const CLOSE_GOING_AWAY: u16 = 1001;
/// `graphql-transport-ws`: a `subscribe` reused the id of an operation still running.
pub const CLOSE_SUBSCRIBER_EXISTS: u16 = 4409;
/// Hub subscriptions one socket may hold; more run on the engine. Each new shape allocates a
/// hub's buffer ([`crate::subscription_hubs::HUB_BUFFER`] slots, about 160 KB), so one client
/// cannot make the server allocate them without bound; a dashboard holds a handful.
pub const MAX_HUB_SUBSCRIPTIONS_PER_SOCKET: usize = 64;

/// The time limits of a subscription socket (`[api]`).
#[derive(Debug, Clone, Copy)]
pub struct SocketLimits {
    pub init_timeout: Duration,
    pub ping_interval: Duration,
    pub pong_timeout: Duration,
}

impl SocketLimits {
    pub fn from_config(config: &ApiConfig) -> SocketLimits {
        SocketLimits {
            init_timeout: config.ws_init_timeout(),
            ping_interval: config.ws_ping_interval(),
            pong_timeout: config.ws_pong_timeout(),
        }
    }

    /// The longest one frame may take to go out: a peer that takes nothing for a ping
    /// interval and a pong timeout together is as gone as one that stopped answering.
    fn write_timeout(&self) -> Duration {
        self.ping_interval + self.pong_timeout
    }
}

/// What the socket's reading side and the connection callback tell the loop.
#[derive(Default)]
struct Shared {
    /// The token's expiry, once `connection_init` carried a valid one.
    expires_at: Option<DateTime<Utc>>,
    /// Who the token is, once `connection_init` carried a valid one.
    principal: Option<Principal>,
    /// The ids of the subscriptions served by hubs, not by the engine, each with the
    /// number the socket gave that subscription: the client may complete an id and reuse it
    /// before the socket's loop has handled the first, and whatever the loop then does for
    /// the first must not touch the second.
    hub_ids: HashMap<String, u64>,
    /// The number the next hub subscription gets.
    next_hub_subscription: u64,
    /// The ids of the client's operations still running, on hubs or the engine
    /// (`graphql-transport-ws` only: the older protocol lets an id be reused).
    running_ids: HashSet<String>,
    /// A `subscribe` reused this running operation's id; the reading side ended there.
    reused_id: Option<String>,
    /// What the client asked of its hub subscriptions, for the socket's loop.
    hub_requests: VecDeque<HubRequest>,
    /// `connection_init` carried no valid token.
    refused: bool,
    /// A message arrived after the token expired; the reading side ended there.
    arrived_expired: bool,
    /// When the last frame of any kind arrived.
    last_heard: Option<Instant>,
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The client's messages for the engine: text and binary frames, until the client closes,
/// fails, or sends a message after its token expired. Every frame, pings and pongs
/// included, counts as a sign of life. A subscription a hub serves is joined here, and it
/// and its `complete` go to the socket's loop (`Shared::hub_requests`) instead.
struct ClientMessages<S> {
    frames: S,
    shared: Arc<Mutex<Shared>>,
    clock: Arc<dyn Clock>,
    hubs: Arc<SubscriptionHubs>,
    protocol: WebSocketProtocols,
    /// Wakes the socket's loop when a hub request is queued.
    hub_wake: Arc<Notify>,
}

/// What the socket's loop is asked to do with a hub subscription.
enum HubRequest {
    /// Follow a hub the client's subscription joined.
    Follow {
        id: String,
        joined: Joined,
        /// Its number in `Shared::hub_ids`.
        number: u64,
    },
    /// Stop following it: the client completed it (`Complete`), or reused its id for a new
    /// subscription (`Forget`, silently, as the engine replaces one; only the older
    /// protocol allows that).
    Complete {
        id: String,
    },
    Forget {
        id: String,
    },
}

/// Routes one client message: `Some` for the engine, `None` when a hub took it or the
/// message reused a running operation's id (`Shared::reused_id`, which ends the socket).
fn route(
    data: Bytes,
    hubs: &Arc<SubscriptionHubs>,
    protocol: WebSocketProtocols,
    shared: &mut Shared,
) -> Option<Bytes> {
    match ClientMessage::from_bytes(&data) {
        Ok(ClientMessage::Start { id, payload }) => {
            if protocol == WebSocketProtocols::GraphQLWS {
                if !shared.running_ids.insert(id.clone()) {
                    shared.reused_id = Some(id);
                    return None;
                }
            } else if shared.hub_ids.remove(&id).is_some() {
                shared
                    .hub_requests
                    .push_back(HubRequest::Forget { id: id.clone() });
            }
            // Only once `connection_init` was accepted; before, the engine refuses it.
            let Some(principal) = shared.principal.clone() else {
                return Some(data);
            };
            if shared.hub_ids.len() >= MAX_HUB_SUBSCRIPTIONS_PER_SOCKET {
                return Some(data);
            }
            let joined = hubs
                .shareable(payload)
                .and_then(|shared_request| hubs.join(shared_request, &principal));
            match joined {
                Some(joined) => {
                    let number = shared.next_hub_subscription;
                    shared.next_hub_subscription += 1;
                    shared.hub_ids.insert(id.clone(), number);
                    shared
                        .hub_requests
                        .push_back(HubRequest::Follow { id, joined, number });
                    None
                }
                None => Some(data),
            }
        }
        Ok(ClientMessage::Stop { id }) => {
            shared.running_ids.remove(&id);
            if shared.hub_ids.remove(&id).is_some() {
                shared.hub_requests.push_back(HubRequest::Complete { id });
                None
            } else {
                Some(data)
            }
        }
        // Everything else, malformed messages included, is the engine's to answer.
        _ => Some(data),
    }
}

impl<S> Stream for ClientMessages<S>
where
    S: Stream<Item = Result<Message, axum::Error>> + Unpin,
{
    type Item = Bytes;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        loop {
            let frame = match self.frames.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None | Some(Err(_))) => return Poll::Ready(None),
                Poll::Ready(Some(Ok(frame))) => frame,
            };
            let now = self.clock.now();
            let shared_state = self.shared.clone();
            let mut shared = lock(&shared_state);
            shared.last_heard = Some(Instant::now());
            let data = match frame {
                Message::Text(text) => Bytes::from(text),
                Message::Binary(data) => data,
                Message::Ping(_) | Message::Pong(_) => continue,
                Message::Close(_) => return Poll::Ready(None),
            };
            if shared
                .expires_at
                .is_some_and(|expires_at| now >= expires_at)
            {
                shared.arrived_expired = true;
                return Poll::Ready(None);
            }
            let for_engine = route(data, &self.hubs, self.protocol, &mut shared);
            if shared.reused_id.is_some() {
                return Poll::Ready(None);
            }
            // A message the engine takes may also have queued a request (a reused id's hub
            // subscription to forget), so the loop is woken whenever one is queued.
            let queued = !shared.hub_requests.is_empty();
            drop(shared);
            if queued {
                self.hub_wake.notify_one();
            }
            if let Some(data) = for_engine {
                return Poll::Ready(Some(data));
            }
        }
    }
}

/// Why the server closes a socket itself.
struct Closing {
    code: u16,
    reason: String,
    /// The metric label; `None` for closes the engine decided (protocol errors).
    metric: Option<&'static str>,
}

impl Closing {
    fn ours(code: u16, reason: &str, metric: &'static str) -> Closing {
        Closing {
            code,
            reason: reason.to_owned(),
            metric: Some(metric),
        }
    }

    fn expired() -> Closing {
        Closing::ours(CLOSE_FORBIDDEN, "the token expired", "token_expired")
    }

    /// A frame did not go out within the write timeout.
    fn not_reading() -> Closing {
        Closing::ours(
            CLOSE_KEEPALIVE_TIMEOUT,
            "the client does not read",
            "write_timeout",
        )
    }
}

/// Serves one upgraded socket until either side ends it, the limits close it, or the
/// server stops (`shutdown`). The engine runs the client's operations here, on the request
/// runtime, and the socket's loop ([`SocketLoop`]) runs on the subscription runtime
/// ([`crate::subscription_runtime`]): nothing that touches storage runs there.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    socket: WebSocket,
    schema: AppSchema,
    hubs: Arc<SubscriptionHubs>,
    protocol: WebSocketProtocols,
    keys: Arc<TokenKeys>,
    clock: Arc<dyn Clock>,
    limits: SocketLimits,
    shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let _counted = OpenConnection::counted();
    let (sink, frames) = socket.split();
    let shared = Arc::new(Mutex::new(Shared::default()));
    let hub_wake = Arc::new(Notify::new());
    let messages = ClientMessages {
        frames,
        shared: shared.clone(),
        clock: clock.clone(),
        hubs,
        protocol,
        hub_wake: hub_wake.clone(),
    };
    let on_init = {
        let shared = shared.clone();
        let clock = clock.clone();
        move |payload: serde_json::Value| async move {
            let verified = keys.from_header(bearer_from_init(&payload).as_deref(), clock.now());
            let mut shared = lock(&shared);
            match verified {
                Ok(principal) => {
                    shared.expires_at = Some(principal.expires_at);
                    shared.principal = Some(principal.clone());
                    let mut data = async_graphql::Data::default();
                    data.insert(principal);
                    Ok(data)
                }
                Err(err) => {
                    shared.refused = true;
                    Err(async_graphql::Error::from(err))
                }
            }
        }
    };
    let engine = Engine::new(schema, messages, protocol).on_connection_init(on_init);
    // The engine's answers go to the loop through a channel, in order. An operation's id is
    // freed as its `complete` leaves the engine, before the engine reads the client's next
    // message, which may reuse it.
    let (answers, engine_answers) = futures::channel::mpsc::channel(ENGINE_ANSWERS_WAITING);
    let engine = {
        let shared = shared.clone();
        async move {
            tokio::pin!(engine);
            let mut answers = answers;
            while let Some(answer) = engine.next().await {
                if let WsMessage::Text(text) = &answer
                    && let Some(id) = completed_operation(text)
                {
                    lock(&shared).running_ids.remove(&id);
                }
                if answers.send(answer).await.is_err() {
                    break;
                }
            }
        }
    };
    let socket_loop = crate::subscription_runtime::run(async move {
        // The timer is made here, on the subscription runtime: a tokio timer belongs to the
        // runtime it was made on, whose timer wheel (behind one lock) then keeps it and
        // wakes the task.
        let deadlines = Deadlines::new(Instant::now(), limits);
        SocketLoop {
            sink,
            shared,
            hub_wake,
            engine_answers,
            hub_subscriptions: HubSubscriptions::new(protocol),
            clock,
            limits,
            shutdown,
            timer: Box::pin(tokio::time::sleep_until(deadlines.earliest())),
            deadlines,
        }
        .run()
        .await;
    });
    tokio::pin!(engine, socket_loop);
    // This task drives the engine until the loop ends (the engine, and the operations it
    // runs, are dropped then), or the engine ends first and the loop sends what it answered.
    tokio::select! {
        () = &mut socket_loop => {}
        () = &mut engine => socket_loop.await,
    }
}

/// The engine's answers the socket's loop has not yet taken, beyond which the engine waits.
/// An answer is one operation's result or `complete`; a client has few operations running.
const ENGINE_ANSWERS_WAITING: usize = 8;

/// About the most bytes of hub frames a socket's loop writes out with one flush
/// ([`SocketLoop::on_deliveries`]; the batch ends with the frame that reaches it). A socket
/// far behind then pays one system call for several frames of a few hundred bytes, rather
/// than one each. Not more: the socket's write buffer (a `Vec` tungstenite never shrinks)
/// keeps the capacity the largest batch it wrote out grew it to, up to twice the batch, for
/// as long as the socket lives, and a subscriber's memory has a goal of its own (issue 16:
/// 10 KB).
const MOST_BYTES_PER_FLUSH: usize = 2_048;

/// Counts a socket in `bc_subscription_connections` for as long as it is served, however its
/// task ends (a panic, or the server dropping it, included).
struct OpenConnection;

impl OpenConnection {
    fn counted() -> OpenConnection {
        metrics::gauge!("bc_subscription_connections").increment(1.0);
        OpenConnection
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        metrics::gauge!("bc_subscription_connections").decrement(1.0);
    }
}

/// The deadlines of a socket's loop. The loop keeps one timer, armed for the earliest of
/// them, rather than a timer each: its `select!` polls everything it waits on before each
/// delivery, and deliveries are the fan-out's hot path.
struct Deadlines {
    /// `connection_init` must have been accepted by then: a deadline only while `expiry` is
    /// not armed, which the loop does once it has seen the token accepted.
    init: Instant,
    /// When the next ping goes out (or, while the last one's answer is awaited, when the
    /// token's expiry is looked at again).
    ping: Instant,
    /// While a ping's answer is awaited: when the ping went out, and when the answer is due.
    pong: Option<(Instant, Instant)>,
    /// The token's expiry, by the timer's clock; armed once `connection_init` was accepted.
    expiry: Option<Instant>,
    /// The token's expiry, by the wall clock, which ends the hub subscriptions (as the
    /// engine's own end, `graphql::subscription::until_expiry`); armed by the first of them,
    /// and again by the first after it passed.
    hub_expiry: Option<Instant>,
}

impl Deadlines {
    fn new(started: Instant, limits: SocketLimits) -> Deadlines {
        Deadlines {
            init: started + limits.init_timeout,
            ping: started + limits.ping_interval,
            pong: None,
            expiry: None,
            hub_expiry: None,
        }
    }

    /// `connection_init`'s deadline, while it is one.
    fn init_due(&self) -> Option<Instant> {
        self.expiry.is_none().then_some(self.init)
    }

    /// The earliest deadline: there is always a next ping.
    fn earliest(&self) -> Instant {
        [
            self.init_due(),
            self.pong.map(|(_, due)| due),
            self.expiry,
            self.hub_expiry,
        ]
        .into_iter()
        .flatten()
        .fold(self.ping, Instant::min)
    }
}

/// What woke the socket's loop.
enum Turn {
    /// The server is stopping.
    Stop,
    /// The timer: a deadline is due.
    Due,
    /// The engine answered (`None`: it ended, and has nothing more to send).
    Answer(Option<WsMessage>),
    /// The reading side queued a hub request.
    HubRequest,
    /// A hub delivered for the subscription of this id.
    Delivery(String, HubDelivery),
}

/// What a turn of the loop leaves: go on, or end the socket (with the close frame, if any,
/// that the server sends).
type Step = ControlFlow<Option<Closing>>;

/// The step after a write to the socket: one that did not succeed within the write timeout
/// closes the socket.
fn written(ok: bool) -> Step {
    if ok {
        ControlFlow::Continue(())
    } else {
        ControlFlow::Break(Some(Closing::not_reading()))
    }
}

/// One socket's loop: it sends the engine's answers and the hubs' payloads, pings, and
/// closes the socket when a limit is reached or the server stops. It reads nothing from
/// storage, and runs on the subscription runtime. Its `run` waits for the next [`Turn`] and
/// hands it to the handler of its kind.
struct SocketLoop {
    sink: Sink,
    shared: Arc<Mutex<Shared>>,
    hub_wake: Arc<Notify>,
    engine_answers: futures::channel::mpsc::Receiver<WsMessage>,
    hub_subscriptions: HubSubscriptions,
    clock: Arc<dyn Clock>,
    limits: SocketLimits,
    shutdown: tokio::sync::watch::Receiver<bool>,
    deadlines: Deadlines,
    /// Armed for `deadlines.earliest()` (by [`SocketLoop::rearm`]).
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl SocketLoop {
    async fn run(mut self) {
        let closing = loop {
            let turn = tokio::select! {
                // In this order. The server's stop and the deadlines first: each is ready
                // only when it is due, and answers and payloads that are ready on every turn
                // must not keep a socket open past its token or the server's stop. Then what
                // the engine answered before a hub request was queued (its
                // `connection_ack`, a `complete`), before what the hubs send.
                biased;
                _ = self.shutdown.changed() => Turn::Stop,
                () = self.timer.as_mut() => Turn::Due,
                answer = self.engine_answers.next() => Turn::Answer(answer),
                () = self.hub_wake.notified() => Turn::HubRequest,
                Some((id, delivery)) = self.hub_subscriptions.streams.next(), if !self.hub_subscriptions.streams.is_empty() => {
                    Turn::Delivery(id, delivery)
                }
            };
            let step = match turn {
                // Closed so that clients reconnect elsewhere.
                Turn::Stop => ControlFlow::Break(Some(Closing::ours(
                    CLOSE_GOING_AWAY,
                    "the server is shutting down",
                    "shutdown",
                ))),
                Turn::Due => self.on_due().await,
                Turn::Answer(answer) => self.on_answer(answer).await,
                Turn::HubRequest => self.on_hub_request().await,
                Turn::Delivery(id, delivery) => self.on_deliveries(id, delivery).await,
            };
            if let ControlFlow::Break(closing) = step {
                break closing;
            }
        };
        if let Some(closing) = closing {
            if let Some(reason) = closing.metric {
                metrics::counter!("bc_subscription_sockets_closed_total", "reason" => reason)
                    .increment(1);
            }
            let frame = CloseFrame {
                code: closing.code,
                reason: close_reason(closing.reason).into(),
            };
            let _ = send(
                &mut self.sink,
                Message::Close(Some(frame)),
                self.limits.pong_timeout,
            )
            .await;
        }
    }

    /// The token's expiry, once `connection_init` carried a valid one.
    fn token_expiry(&self) -> Option<DateTime<Utc>> {
        lock(&self.shared).expires_at
    }

    /// Arms the token's deadline, once `connection_init` was accepted: that one replaces
    /// `connection_init`'s.
    fn arm_expiry(&mut self, expires_at: DateTime<Utc>) {
        self.deadlines.expiry = Some(Instant::now() + until(expires_at, self.clock.now()));
    }

    /// Arms the timer for the earliest deadline, if that changed.
    fn rearm(&mut self) {
        let earliest = self.deadlines.earliest();
        if self.timer.deadline() != earliest {
            self.timer.as_mut().reset(earliest);
        }
    }

    /// Handles the deadlines that are due, and arms the timer for the next. In this order:
    /// `connection_init`'s first (a socket that never started has nothing else to do); at
    /// the token's expiry, the hub subscriptions' end before the socket's, so that they are
    /// told `UNAUTHENTICATED` before the socket closes with 4403; the ping before its
    /// answer's deadline.
    async fn on_due(&mut self) -> Step {
        let now = Instant::now();
        let timeout = self.limits.write_timeout();
        if self.deadlines.init_due().is_some_and(|init| now >= init) {
            // Accepted, but its `connection_ack` is still on its way to this loop.
            let Some(expires_at) = self.token_expiry() else {
                return ControlFlow::Break(Some(Closing::ours(
                    CLOSE_INIT_TIMEOUT,
                    "Connection initialisation timeout",
                    "init_timeout",
                )));
            };
            self.arm_expiry(expires_at);
        }
        if self.deadlines.hub_expiry.is_some_and(|at| now >= at) {
            self.deadlines.hub_expiry = None;
            written(
                self.hub_subscriptions
                    .end_all(&self.shared, &mut self.sink, timeout)
                    .await,
            )?;
        }
        if self.deadlines.expiry.is_some_and(|at| now >= at) {
            match self.token_expiry() {
                // The clock is not the timer's (a test's manual clock): look again.
                Some(expires_at) if self.clock.now() < expires_at => {
                    self.deadlines.expiry =
                        Some(Instant::now() + until(expires_at, self.clock.now()));
                }
                _ => return ControlFlow::Break(Some(Closing::expired())),
            }
        }
        if now >= self.deadlines.ping {
            // Expiry is also checked here, so a clock that jumps is noticed within a ping.
            let expires_at = self.token_expiry();
            if expires_at.is_some_and(|e| self.clock.now() >= e) {
                return ControlFlow::Break(Some(Closing::expired()));
            }
            if self.deadlines.pong.is_none() {
                written(send(&mut self.sink, Message::Ping(Bytes::new()), timeout).await)?;
                let sent_at = Instant::now();
                self.deadlines.pong = Some((sent_at, sent_at + self.limits.pong_timeout));
            }
            self.deadlines.ping = Instant::now() + self.limits.ping_interval;
        }
        if let Some((ping_sent, due)) = self.deadlines.pong
            && now >= due
        {
            // Any frame since the ping will do, not only its pong.
            let heard_since = lock(&self.shared)
                .last_heard
                .is_some_and(|heard| heard >= ping_sent);
            if !heard_since {
                return ControlFlow::Break(Some(Closing::ours(
                    CLOSE_KEEPALIVE_TIMEOUT,
                    "keep-alive timeout: no pong",
                    "keepalive_timeout",
                )));
            }
            self.deadlines.pong = None;
        }
        self.rearm();
        ControlFlow::Continue(())
    }

    /// Sends what the engine answered, or ends the socket as the engine did.
    async fn on_answer(&mut self, answer: Option<WsMessage>) -> Step {
        match answer {
            Some(WsMessage::Text(text)) => {
                written(
                    send(
                        &mut self.sink,
                        Message::Text(text.into()),
                        self.limits.write_timeout(),
                    )
                    .await,
                )?;
                if self.deadlines.expiry.is_none()
                    && let Some(expires_at) = self.token_expiry()
                {
                    // `connection_init` was accepted (this was its `connection_ack`).
                    self.arm_expiry(expires_at);
                    self.rearm();
                }
                ControlFlow::Continue(())
            }
            Some(WsMessage::Close(code, reason)) => {
                ControlFlow::Break(Some(if lock(&self.shared).refused {
                    Closing::ours(CLOSE_FORBIDDEN, &reason, "unauthenticated")
                } else {
                    Closing {
                        code,
                        reason,
                        metric: None,
                    }
                }))
            }
            None => {
                let shared = lock(&self.shared);
                ControlFlow::Break(match &shared.reused_id {
                    Some(id) => Some(Closing::ours(
                        CLOSE_SUBSCRIBER_EXISTS,
                        &format!("Subscriber for {id} already exists"),
                        "subscriber_exists",
                    )),
                    None => shared.arrived_expired.then(Closing::expired),
                })
            }
        }
    }

    /// Sends what a hub delivered, and what the hubs have ready after it, up to about
    /// [`MOST_BYTES_PER_FLUSH`], then writes them out at once. A socket that fell behind (a
    /// burst of events, a busy machine) so catches up with a system call per batch of frames
    /// rather than per frame, where most of a delivery's CPU goes (BENCHMARKS.md,
    /// "Subscriptions"). The batch ends early at whatever the loop would otherwise have
    /// handled first: the server's stop, a deadline due, or a hub request (a subscription
    /// the client completed then gets nothing more, where the loop has seen its request).
    async fn on_deliveries(&mut self, id: String, delivery: HubDelivery) -> Step {
        let timeout = self.limits.write_timeout();
        let mut next = Some((id, delivery));
        let mut fed = 0;
        while let Some((id, delivery)) = next.take() {
            let Some(bytes) = self
                .hub_subscriptions
                .deliver(id, delivery, &self.shared, &mut self.sink, timeout)
                .await
            else {
                return ControlFlow::Break(Some(Closing::not_reading()));
            };
            fed += bytes;
            if fed >= MOST_BYTES_PER_FLUSH
                || self.shutdown.has_changed().unwrap_or(true)
                || self.timer.is_elapsed()
                || !lock(&self.shared).hub_requests.is_empty()
            {
                break;
            }
            next = self
                .hub_subscriptions
                .streams
                .next()
                .now_or_never()
                .flatten();
        }
        written(within(timeout, self.sink.flush()).await)
    }

    /// Handles the first hub request queued. One a turn, so that an answer the engine gave
    /// before the next request was queued still goes out before what that request sends.
    async fn on_hub_request(&mut self) -> Step {
        let (request, more) = {
            let mut shared = lock(&self.shared);
            let request = shared.hub_requests.pop_front();
            (request, !shared.hub_requests.is_empty())
        };
        if more {
            // Comes back for the next, after what is ahead of it.
            self.hub_wake.notify_one();
        }
        let Some(request) = request else {
            return ControlFlow::Continue(());
        };
        if let HubRequest::Follow { .. } = &request
            && self.deadlines.hub_expiry.is_none()
            && let Some(expires_at) = self.token_expiry()
        {
            self.deadlines.hub_expiry = Some(Instant::now() + until(expires_at, Utc::now()));
            self.rearm();
        }
        written(
            self.hub_subscriptions
                .handle(request, &mut self.sink, self.limits.write_timeout())
                .await,
        )
    }
}

/// What a hub subscription's stream yields to the socket's loop.
enum HubDelivery {
    Payload(Arc<HubItem>),
    /// The subscriber fell more than `HUB_BUFFER` payloads behind.
    FellBehind,
    /// The hub's stream ended.
    Ended,
}

type HubStream = Pin<Box<dyn Stream<Item = HubDelivery> + Send>>;

/// The socket's subscriptions served by hubs.
struct HubSubscriptions {
    /// `next` (graphql-transport-ws) or `data` (the older graphql-ws).
    next_type: &'static str,
    streams: StreamMap<String, HubStream>,
    subscriptions: HashMap<String, Following>,
}

/// One hub subscription of the socket.
struct Following {
    /// Its number in `Shared::hub_ids` while it is the client's subscription of its id.
    number: u64,
    /// Its id, as JSON.
    id_json: String,
    /// The cursor of the last event it was sent (or where it started).
    cursor: i64,
    /// Payloads up to this cursor are not for it.
    skip_through: i64,
    field: SharedField,
}

impl HubSubscriptions {
    fn new(protocol: WebSocketProtocols) -> HubSubscriptions {
        HubSubscriptions {
            next_type: match protocol {
                WebSocketProtocols::GraphQLWS => "next",
                WebSocketProtocols::SubscriptionsTransportWS => "data",
            },
            streams: StreamMap::new(),
            subscriptions: HashMap::new(),
        }
    }

    /// Follows or stops following a hub subscription, as the client asked. False if the
    /// socket failed.
    async fn handle(&mut self, request: HubRequest, sink: &mut Sink, timeout: Duration) -> bool {
        match request {
            HubRequest::Follow { id, joined, number } => {
                let stream = BroadcastStream::new(joined.payloads)
                    .map(|received| match received {
                        Ok(item) => HubDelivery::Payload(item),
                        Err(_lagged) => HubDelivery::FellBehind,
                    })
                    .chain(futures::stream::iter([HubDelivery::Ended]));
                self.streams.insert(id.clone(), Box::pin(stream));
                let following = Following {
                    number,
                    id_json: serde_json::Value::from(id.as_str()).to_string(),
                    cursor: joined.cursor,
                    skip_through: joined.skip_through,
                    field: joined.field,
                };
                self.subscriptions.insert(id, following);
                true
            }
            HubRequest::Complete { id } => match self.forget(&id) {
                Some(following) => send(sink, complete_frame(&following.id_json), timeout).await,
                None => true,
            },
            HubRequest::Forget { id } => {
                self.forget(&id);
                true
            }
        }
    }

    /// Sends what a hub delivered for subscription `id`: a payload is only fed to the socket
    /// (the caller flushes), the end of a subscription is sent at once. The bytes fed, or
    /// `None` if the socket failed.
    async fn deliver(
        &mut self,
        id: String,
        delivery: HubDelivery,
        shared: &Mutex<Shared>,
        sink: &mut Sink,
        timeout: Duration,
    ) -> Option<usize> {
        let Some(following) = self.subscriptions.get_mut(&id) else {
            return Some(0);
        };
        let sent = match delivery {
            HubDelivery::Payload(item) => {
                if item.cursor <= following.skip_through {
                    return Some(0);
                }
                following.cursor = item.cursor;
                let frame = next_frame(self.next_type, &following.id_json, &item.payload);
                let bytes = frame.len();
                return within(timeout, sink.feed(Message::Text(frame.into())))
                    .await
                    .then_some(bytes);
            }
            HubDelivery::FellBehind => {
                metrics::counter!("bc_feed_subscribers_lagged_total").increment(1);
                let payload = following
                    .field
                    .error_payload(ApiError::resume_after(following.cursor));
                self.end(&id, &payload, shared, sink, timeout).await
            }
            HubDelivery::Ended => match self.release(&id, shared) {
                Some(following) => send(sink, complete_frame(&following.id_json), timeout).await,
                None => true,
            },
        };
        sent.then_some(0)
    }

    /// Ends every hub subscription with `UNAUTHENTICATED`: the token expired. False if the
    /// socket failed.
    async fn end_all(
        &mut self,
        shared: &Mutex<Shared>,
        sink: &mut Sink,
        timeout: Duration,
    ) -> bool {
        let ids: Vec<String> = self.subscriptions.keys().cloned().collect();
        for id in ids {
            let Some(following) = self.subscriptions.get(&id) else {
                continue;
            };
            let payload = following
                .field
                .error_payload(crate::graphql::subscription::token_expired());
            if !self.end(&id, &payload, shared, sink, timeout).await {
                return false;
            }
        }
        true
    }

    /// Ends subscription `id` with the error `payload`, then `complete`. False if the socket
    /// failed.
    async fn end(
        &mut self,
        id: &str,
        payload: &str,
        shared: &Mutex<Shared>,
        sink: &mut Sink,
        timeout: Duration,
    ) -> bool {
        let Some(following) = self.release(id, shared) else {
            return true;
        };
        let frame = next_frame(self.next_type, &following.id_json, payload);
        send(sink, Message::Text(frame.into()), timeout).await
            && send(sink, complete_frame(&following.id_json), timeout).await
    }

    /// Stops following subscription `id`, which the client stopped or replaced: the reading
    /// side has already freed its id (`route`), and may since have given it to a new
    /// subscription, whose id this must not free.
    fn forget(&mut self, id: &str) -> Option<Following> {
        self.streams.remove(id);
        self.subscriptions.remove(id)
    }

    /// Stops following subscription `id`, which the server ends, and frees its id; `None`
    /// (and nothing done) when the client has already completed or replaced it, whose
    /// request, queued, ends it instead: the client is then told nothing more of it.
    fn release(&mut self, id: &str, shared: &Mutex<Shared>) -> Option<Following> {
        let number = self.subscriptions.get(id)?.number;
        let mut shared = lock(shared);
        if shared.hub_ids.get(id) != Some(&number) {
            return None;
        }
        shared.hub_ids.remove(id);
        shared.running_ids.remove(id);
        drop(shared);
        self.forget(id)
    }
}

/// The text of a `next` (or `data`) frame of the subscription `id_json` carrying `payload`.
fn next_frame(next_type: &str, id_json: &str, payload: &str) -> String {
    format!(r#"{{"type":"{next_type}","id":{id_json},"payload":{payload}}}"#)
}

/// The id of the operation an engine frame completes: its operations end with `complete`
/// (an error is a `next` before it), whether they finished or the client stopped them.
fn completed_operation(frame: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Complete {
        id: String,
    }
    if !frame.starts_with(r#"{"type":"complete""#) {
        return None;
    }
    serde_json::from_str::<Complete>(frame).ok().map(|c| c.id)
}

fn complete_frame(id_json: &str) -> Message {
    Message::Text(format!(r#"{{"type":"complete","id":{id_json}}}"#).into())
}

type Sink = futures::stream::SplitSink<WebSocket, Message>;

/// A close frame carries at most 123 bytes of reason (RFC 6455, 5.5): longer ones are cut
/// at a character boundary.
fn close_reason(mut reason: String) -> String {
    const MAX: usize = 123;
    if reason.len() > MAX {
        let mut end = MAX;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    reason
}

/// How long until `expires_at` on a clock that reads `now` (zero if it has passed).
fn until(expires_at: DateTime<Utc>, now: DateTime<Utc>) -> Duration {
    (expires_at - now).to_std().unwrap_or_default()
}

/// Sends one frame, and whatever was fed before it, within `timeout`; false if the socket
/// failed or the peer did not take it in time.
async fn send(sink: &mut Sink, message: Message, timeout: Duration) -> bool {
    within(timeout, sink.send(message)).await
}

/// Whether a write to the socket succeeded within `timeout`: a `send`, a `flush`, or a `feed`,
/// which leaves the frame in the sink's slot and tungstenite's write buffer until the next
/// flush (`http.rs` keeps tungstenite's default `write_buffer_size`, 128 KiB, below which it
/// writes nothing out by itself).
async fn within(timeout: Duration, write: impl Future<Output = Result<(), axum::Error>>) -> bool {
    matches!(tokio::time::timeout(timeout, write).await, Ok(Ok(())))
}

/// The `Authorization` value of a `connection_init` payload: `{"Authorization": "Bearer …"}`
/// (any case), or `{"token": "…"}`.
fn bearer_from_init(payload: &serde_json::Value) -> Option<String> {
    let object = payload.as_object()?;
    object
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case("authorization"))
        .and_then(|(_, value)| value.as_str().map(str::to_owned))
        .or_else(|| {
            object
                .get("token")
                .and_then(|t| t.as_str())
                .map(|t| format!("Bearer {t}"))
        })
}

#[cfg(test)]
mod tests {
    use super::{Deadlines, SocketLimits};
    use std::time::Duration;
    use tokio::time::Instant;

    /// The loop's one timer is armed for the first of the deadlines armed, whichever it is.
    #[test]
    fn the_timer_is_armed_for_the_first_deadline() {
        let limits = SocketLimits {
            init_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(20),
            pong_timeout: Duration::from_secs(5),
        };
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        assert_eq!(
            Deadlines::new(start, limits).earliest(),
            at(10),
            "a new socket: connection_init's deadline, before the first ping"
        );
        // Each case: connection_init's deadline, the deadlines armed (pong due, expiry, hub
        // expiry), with the next ping at 20 s, and the one the timer must be armed for.
        // connection_init's counts only until the token's expiry is armed.
        let cases = [
            ((at(10), None, None, None), at(10)),
            ((at(10), None, Some(at(30)), None), at(20)),
            ((at(30), Some(at(25)), None, None), at(20)),
            ((at(30), Some(at(15)), None, None), at(15)),
            ((at(1), None, Some(at(3)), Some(at(4))), at(3)),
            ((at(1), None, Some(at(30)), Some(at(2))), at(2)),
            ((at(10), Some(at(25)), Some(at(30)), None), at(20)),
            // Accepted, its connection_ack not yet seen by the loop, a hub subscription
            // already following a token that expires sooner.
            ((at(10), None, None, Some(at(5))), at(5)),
        ];
        for ((init, pong, expiry, hub_expiry), first) in cases {
            let deadlines = Deadlines {
                init,
                ping: at(20),
                pong: pong.map(|due| (start, due)),
                expiry,
                hub_expiry,
            };
            assert_eq!(
                deadlines.earliest(),
                first,
                "{init:?} {pong:?} {expiry:?} {hub_expiry:?}"
            );
        }
    }
}
