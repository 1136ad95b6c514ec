//! Shared subscription streams: subscribers who ask for the same thing share one execution.
//!
//! A live `events` subscription depends only on its document, its variables besides `after`,
//! and what its token may see (the role and the tenant), so every subscriber with the same of
//! those receives the same payloads from where it starts. Resolving and serializing each
//! event once per subscriber was most of the fan-out's own cost (issue 16: 10,000
//! subscribers at 10 events a second each). A hub resolves and serializes each event once
//! per shape and hands every subscriber the same payload, which each socket wraps in its own
//! `next` frame (`graphql_ws`).
//!
//! A subscriber joins the hub of its shape when it starts at or after the hub's cursor (the
//! last event the hub processed): from now (no `after`), or from a cursor the hub has not
//! passed; the hub's payloads up to its own cursor are skipped for it. One that starts
//! before the hub's cursor needs a replay the hub has already sent, and runs on the engine
//! as its own stream. With no hub for its shape, it creates one starting where it starts.
//!
//! A hub ends when its last subscriber leaves or its stream ends (the server stops, or it
//! fell behind the feed and ends with `RESUME_REQUIRED`, which all its subscribers then
//! receive). A subscriber that falls more than [`HUB_BUFFER`] payloads behind its hub gets
//! `RESUME_REQUIRED` with the cursor of the last event it was sent, as a subscriber of the
//! feed itself does.
//!
//! Everything else (`last`, `nodeChanges` with its snapshot, queries over the socket) runs on
//! async-graphql's engine, one execution per subscriber.

use async_graphql::parser::types::{DocumentOperations, OperationType, Selection};
use async_graphql::{PathSegment, Pos, Request, Response, ServerError};
use bc_core::ids::{EventId, TenantId};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

use crate::auth::{Principal, Role};
use crate::error::ApiError;
use crate::feed::Feed;
use crate::graphql::AppSchema;

/// Payloads a hub holds for a subscriber that is slow to take them, before it must resume:
/// as many events as the feed holds for its own subscribers.
pub const HUB_BUFFER: usize = crate::feed::FEED_BUFFER;

/// The subscription root field whose live stream is shared.
const SHARED_FIELD: &str = "events";
/// The argument a subscriber starts after; shared streams differ only in where they start.
const CURSOR_ARGUMENT: &str = "after";
/// The argument that makes a stream the subscriber's own (a backlog of its newest events).
const BACKLOG_ARGUMENT: &str = "last";

/// What makes two subscriptions' payloads the same.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Shape {
    query: String,
    operation_name: Option<String>,
    /// The variables but the cursor, as JSON.
    variables: String,
    role: Role,
    tenant: Option<TenantId>,
}

/// One payload of a hub: a serialized GraphQL response, and the sequence number of the last
/// event its stream had yielded when it was resolved (the subscriber's cursor after it).
#[derive(Debug)]
pub struct HubItem {
    pub cursor: i64,
    pub payload: Box<str>,
}

/// The cursor of a hub's stream: the `events` resolver starts after it and moves it to each
/// event it receives, matching or not, before a matching event's payload is resolved and
/// sent; the hub reads it into each payload. See `joined` for why that order loses nothing.
#[derive(Debug, Clone)]
pub struct HubCursor(Arc<AtomicI64>);

impl HubCursor {
    fn starting_after(seq: i64) -> HubCursor {
        HubCursor(Arc::new(AtomicI64::new(seq)))
    }

    /// The sequence number of the last event yielded (or the hub's start).
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }

    /// Records that the event `seq` was received.
    pub fn advance(&self, seq: i64) {
        self.0.store(seq, Ordering::Release);
    }
}

struct Hub {
    payloads: broadcast::Sender<Arc<HubItem>>,
    cursor: HubCursor,
}

/// A subscriber's place in a hub.
pub struct Joined {
    pub payloads: broadcast::Receiver<Arc<HubItem>>,
    /// Where a subscriber that falls behind before its first payload resumes.
    pub cursor: i64,
    /// Payloads up to this cursor are not for it (it started after them).
    pub skip_through: i64,
    pub field: SharedField,
}

/// The live hubs, by shape.
pub struct SubscriptionHubs {
    schema: AppSchema,
    feed: Arc<Feed>,
    /// The query size limit (`graphql.max_query_bytes`): nothing larger is parsed here.
    max_query_bytes: usize,
    hubs: Mutex<HashMap<Shape, Arc<Hub>>>,
}

/// A subscription a hub can serve, as [`SubscriptionHubs::shareable`] found it.
pub struct SharedRequest {
    request: Request,
    /// The variables but the cursor, as JSON.
    variables: String,
    /// The cursor it starts after (`None`: from now).
    after: Option<i64>,
    field: SharedField,
}

/// Where the shared field is in the subscriber's document: errors a socket sends for it say
/// so, as the engine's do.
#[derive(Debug, Clone)]
pub struct SharedField {
    pos: Pos,
    /// The alias or the name.
    key: String,
}

impl SharedField {
    /// The payload of an error that ends the subscription (`RESUME_REQUIRED`,
    /// `UNAUTHENTICATED`), as the engine would send it.
    pub fn error_payload(&self, err: ApiError) -> String {
        let mut error: ServerError = async_graphql::Error::from(err).into_server_error(self.pos);
        error.path = vec![PathSegment::Field(self.key.clone())];
        serde_json::to_string(&Response::from_errors(vec![error]))
            .expect("a GraphQL response of one error serializes")
    }
}

impl SubscriptionHubs {
    pub fn new(
        schema: AppSchema,
        feed: Arc<Feed>,
        max_query_bytes: usize,
    ) -> Arc<SubscriptionHubs> {
        Arc::new(SubscriptionHubs {
            schema,
            feed,
            max_query_bytes,
            hubs: Mutex::default(),
        })
    }

    /// `request` as a hub could serve it: one subscription operation (the one named, or the
    /// only one) whose one root field is `events`, without `last`, and with `after` absent,
    /// null or a variable holding a valid cursor. `None` for anything else, including a
    /// document that does not parse or is over the query size limit: the engine answers it
    /// as before.
    pub fn shareable(&self, request: Request) -> Option<SharedRequest> {
        let (field, cursor_variable, after) = self.parse(&request)?;
        let mut variables = request.variables.clone();
        if let Some(name) = &cursor_variable {
            variables.remove(name);
        }
        Some(SharedRequest {
            variables: serde_json::to_string(&variables).ok()?,
            after,
            field,
            request,
        })
    }

    /// The shared field's position and response key, the name of the variable holding the
    /// cursor and the cursor, if `request` is shareable.
    fn parse(
        &self,
        request: &Request,
    ) -> Option<(SharedField, Option<async_graphql::Name>, Option<i64>)> {
        if request.query.len() > self.max_query_bytes {
            return None;
        }
        let document = async_graphql::parser::parse_query(&request.query).ok()?;
        let operation = match (&document.operations, request.operation_name.as_deref()) {
            (DocumentOperations::Single(operation), None) => operation,
            (DocumentOperations::Multiple(operations), Some(name)) => operations.get(name)?,
            (DocumentOperations::Multiple(operations), None) if operations.len() == 1 => {
                operations.values().next()?
            }
            _ => return None,
        };
        let operation = &operation.node;
        if operation.ty != OperationType::Subscription {
            return None;
        }
        let [selection] = operation.selection_set.node.items.as_slice() else {
            return None;
        };
        let Selection::Field(field) = &selection.node else {
            return None;
        };
        if field.node.name.node != SHARED_FIELD {
            return None;
        }
        let mut cursor_variable = None;
        let mut after = None;
        for (name, value) in &field.node.arguments {
            let mut used = Vec::new();
            let given = value.node.clone().into_const_with(|name| {
                let value = variable(&name, operation, request);
                used.push(name);
                Ok::<_, std::convert::Infallible>(value)
            });
            let Ok(given) = given;
            match name.node.as_str() {
                BACKLOG_ARGUMENT if given != async_graphql::Value::Null => return None,
                CURSOR_ARGUMENT => match (given, used.as_slice()) {
                    (async_graphql::Value::Null, _) => {}
                    // A literal cursor is part of the document: only a variable is set apart.
                    (async_graphql::Value::String(cursor), [variable]) => {
                        after = Some(EventId::parse(&cursor).ok()?.0);
                        cursor_variable = Some(variable.clone());
                    }
                    _ => return None,
                },
                _ => {}
            }
        }
        let field = SharedField {
            pos: field.pos,
            key: field
                .node
                .alias
                .as_ref()
                .unwrap_or(&field.node.name)
                .node
                .to_string(),
        };
        Some((field, cursor_variable, after))
    }

    /// Joins the hub of `shared`'s shape for `principal`, creating it if there is none
    /// (starting where the subscriber starts). `None` when the hub has passed the
    /// subscriber's cursor: it needs a replay of its own.
    pub fn join(self: &Arc<Self>, shared: SharedRequest, principal: &Principal) -> Option<Joined> {
        let shape = Shape {
            query: shared.request.query.clone(),
            operation_name: shared.request.operation_name.clone(),
            variables: shared.variables,
            role: principal.role,
            tenant: principal.tenant.clone(),
        };
        let mut hubs = self.lock();
        if let Some(hub) = hubs.get(&shape) {
            return joined(hub, shared.after, shared.field.clone());
        }
        // From now: the feed's head (never ahead of the table's; a few events committed just
        // before may be sent too). Read here, the socket never waits for the database.
        let start = shared.after.unwrap_or_else(|| self.feed.head());
        let (payloads, _) = broadcast::channel(HUB_BUFFER);
        let hub = Arc::new(Hub {
            payloads,
            cursor: HubCursor::starting_after(start),
        });
        let joined =
            joined(&hub, shared.after, shared.field).expect("a new hub starts at the cursor");
        hubs.insert(shape.clone(), hub.clone());
        drop(hubs);
        metrics::gauge!("bc_subscription_hubs").increment(1.0);
        // The hub sees what its subscribers' tokens see, but outlives any one of them: each
        // socket ends its own subscriptions when its token expires (`graphql_ws`).
        let hub_principal = Principal {
            subject: format!("subscription-hub:{}", principal.role),
            role: principal.role,
            tenant: principal.tenant.clone(),
            expires_at: chrono::DateTime::<chrono::Utc>::MAX_UTC,
        };
        let stream = self
            .schema
            .execute_stream(shared.request.data(hub_principal).data(hub.cursor.clone()));
        tokio::spawn(self.clone().run(shape, hub, stream));
        Some(joined)
    }

    /// Resolves the hub's stream once per event and sends the payload to every subscriber,
    /// until the stream ends or the last subscriber leaves.
    async fn run(
        self: Arc<Self>,
        shape: Shape,
        hub: Arc<Hub>,
        mut stream: futures::stream::BoxStream<'static, Response>,
    ) {
        loop {
            tokio::select! {
                response = stream.next() => match response {
                    Some(response) => {
                        // An error ends the stream (in this schema every error is a
                        // stream's last item): the hub is forgotten before it is sent, so
                        // no subscriber joins after its end and is left without it.
                        let last = response.is_err();
                        if last {
                            self.remove(&shape, &hub, false);
                        }
                        let payload = match serde_json::to_string(&response) {
                            Ok(payload) => payload.into_boxed_str(),
                            Err(err) => {
                                tracing::error!(%err, "a subscription payload could not be serialized");
                                break;
                            }
                        };
                        let item = HubItem { cursor: hub.cursor.get(), payload };
                        // No receiver left: `closed` below ends the hub.
                        let _ = hub.payloads.send(Arc::new(item));
                    }
                    None => break,
                },
                () = hub.payloads.closed() => {
                    if self.remove(&shape, &hub, true) {
                        return;
                    }
                }
            }
        }
        self.remove(&shape, &hub, false);
    }

    /// Forgets `hub` (only if no subscriber joined since, when `if_unused`); returns whether
    /// it did. Joining holds the same lock, so a hub that is forgotten has nobody to serve.
    fn remove(&self, shape: &Shape, hub: &Arc<Hub>, if_unused: bool) -> bool {
        let mut hubs = self.lock();
        if if_unused && hub.payloads.receiver_count() > 0 {
            return false;
        }
        if hubs.get(shape).is_some_and(|live| Arc::ptr_eq(live, hub)) {
            hubs.remove(shape);
            metrics::gauge!("bc_subscription_hubs").decrement(1.0);
        }
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Shape, Arc<Hub>>> {
        self.hubs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many hubs are live (for tests and the gauge's readers).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many subscriptions the live hubs serve (for tests).
    pub fn subscribers(&self) -> usize {
        self.lock()
            .values()
            .map(|hub| hub.payloads.receiver_count())
            .sum()
    }
}

/// The value of variable `name` in `request`: given, else its default, else null.
fn variable(
    name: &async_graphql::Name,
    operation: &async_graphql::parser::types::OperationDefinition,
    request: &Request,
) -> async_graphql::Value {
    match request.variables.get(name) {
        Some(given) => given.clone(),
        None => operation
            .variable_definitions
            .iter()
            .find(|definition| definition.node.name.node == *name)
            .and_then(|definition| definition.node.default_value.as_ref())
            .map(|default| default.node.clone())
            .unwrap_or_default(),
    }
}

/// `hub` joined by a subscriber starting after `after` (`None`: from now); `None` if the
/// hub has passed that cursor.
///
/// The cursor moves before the payload of its event is sent, so it is read twice. Read
/// after subscribing, it is the admission test: every event after it is sent after the
/// subscription, so a subscriber whose own cursor is at or after it receives every event it
/// asked for. Read before subscribing, it is where a subscriber from now resumes if it falls
/// behind before its first payload: events after it were either received or sent before it
/// joined (before "now"), and a resume replays them rather than losing one yielded but not
/// yet sent, as the later reading could name.
fn joined(hub: &Hub, after: Option<i64>, field: SharedField) -> Option<Joined> {
    let before = hub.cursor.get();
    let payloads = hub.payloads.subscribe();
    if after.is_some_and(|after| after < hub.cursor.get()) {
        return None;
    }
    Some(Joined {
        payloads,
        cursor: after.unwrap_or(before),
        skip_through: after.unwrap_or(i64::MIN),
        field,
    })
}
