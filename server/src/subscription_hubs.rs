//! Shared subscription streams: subscribers who ask for the same thing share one execution.
//!
//! A live `events` subscription without `after` or `last` depends only on its document, its
//! variables and what its token may see (the role and the tenant), so every subscriber with
//! the same of those receives the same payloads. Resolving and serializing each event once
//! per subscriber was most of the fan-out's own cost (issue 16: 10,000 subscribers at 10
//! events a second each). A hub resolves and serializes each event once per shape and hands
//! every subscriber the same payload, which each socket wraps in its own `next` frame
//! (`graphql_ws`).
//!
//! A hub is created by its first subscriber and ends when its last one leaves, or when its
//! stream ends (the server stops, or the hub fell behind the feed and ends with
//! `RESUME_REQUIRED`, which all its subscribers then receive). A subscriber that falls more
//! than [`HUB_BUFFER`] payloads behind its hub gets `RESUME_REQUIRED` with the cursor of the
//! last event it was sent, as a subscriber of the feed itself does; resuming from it
//! (`after`) replays from the log on a stream of its own.
//!
//! Everything else (subscriptions with a cursor, `nodeChanges` with its snapshot, queries
//! over the socket) runs on async-graphql's engine, one execution per subscriber.

use async_graphql::parser::types::{DocumentOperations, OperationType, Selection};
use async_graphql::{Request, Response, ServerError};
use bc_core::ids::{EventId, TenantId};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

use crate::auth::{Principal, Role};
use crate::error::ApiError;
use crate::graphql::AppSchema;
use crate::service::Services;

/// Payloads a hub holds for a subscriber that is slow to take them, before it must resume:
/// as many events as the feed holds for its own subscribers.
pub const HUB_BUFFER: usize = crate::feed::FEED_BUFFER;

/// The subscription root field whose live stream is shared.
const SHARED_FIELD: &str = "events";
/// Arguments that make a stream the subscriber's own (a replay from its cursor, a backlog).
const OWN_STREAM_ARGUMENTS: [&str; 2] = ["after", "last"];

/// What makes two subscriptions' payloads the same.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Shape {
    query: String,
    operation_name: Option<String>,
    /// The variables, as JSON.
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
/// event it yields, before the event's payload is resolved and sent; the hub reads it into
/// each payload. See `joined` for why that order loses nothing.
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

    /// Records that the event `seq` is being yielded.
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
}

/// The live hubs, by shape.
pub struct SubscriptionHubs {
    schema: AppSchema,
    services: Services,
    hubs: Mutex<HashMap<Shape, Arc<Hub>>>,
}

impl SubscriptionHubs {
    pub fn new(schema: AppSchema, services: Services) -> Arc<SubscriptionHubs> {
        Arc::new(SubscriptionHubs {
            schema,
            services,
            hubs: Mutex::default(),
        })
    }

    /// Whether `request` is a live `events` subscription a hub can serve: one subscription
    /// operation (the one named, or the only one) whose one root field is `events`, without
    /// `after` or `last`. Anything else, including a document that does not parse, is left to
    /// the engine, which answers it as before.
    pub fn shareable(request: &Request) -> bool {
        let Ok(document) = async_graphql::parser::parse_query(&request.query) else {
            return false;
        };
        let operation = match (&document.operations, request.operation_name.as_deref()) {
            (DocumentOperations::Single(operation), None) => operation,
            (DocumentOperations::Multiple(operations), Some(name)) => match operations.get(name) {
                Some(operation) => operation,
                None => return false,
            },
            _ => return false,
        };
        let operation = &operation.node;
        if operation.ty != OperationType::Subscription {
            return false;
        }
        let [selection] = operation.selection_set.node.items.as_slice() else {
            return false;
        };
        let Selection::Field(field) = &selection.node else {
            return false;
        };
        // `after` and `last` may be declared and left out (`$after` not given, or null).
        field.node.name.node == SHARED_FIELD
            && field.node.arguments.iter().all(|(name, value)| {
                !OWN_STREAM_ARGUMENTS.contains(&name.node.as_str())
                    || value
                        .node
                        .clone()
                        .into_const_with(|name| {
                            Ok::<_, std::convert::Infallible>(variable(&name, operation, request))
                        })
                        .is_ok_and(|value| value == async_graphql::Value::Null)
            })
    }

    /// Joins the hub of `request`'s shape for `principal`, creating it if there is none.
    /// The caller checked [`SubscriptionHubs::shareable`].
    pub async fn join(
        self: &Arc<Self>,
        request: Request,
        principal: &Principal,
    ) -> Result<Joined, ApiError> {
        let shape = Shape {
            query: request.query.clone(),
            operation_name: request.operation_name.clone(),
            variables: serde_json::to_string(&request.variables).unwrap_or_default(),
            role: principal.role,
            tenant: principal.tenant.clone(),
        };
        if let Some(joined) = self.join_existing(&shape) {
            return Ok(joined);
        }
        // From now, as an unshared subscription starts: the table's head, read before the
        // registry is locked again.
        let head = self.services.event_head().await?;
        let mut hubs = self.lock();
        if let Some(hub) = hubs.get(&shape) {
            return Ok(joined(hub));
        }
        let (payloads, _) = broadcast::channel(HUB_BUFFER);
        let hub = Arc::new(Hub {
            payloads,
            cursor: HubCursor::starting_after(head),
        });
        let joined = joined(&hub);
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
            .execute_stream(request.data(hub_principal).data(hub.cursor.clone()));
        tokio::spawn(self.clone().run(shape, hub, stream));
        Ok(joined)
    }

    fn join_existing(&self, shape: &Shape) -> Option<Joined> {
        self.lock().get(shape).map(|hub| joined(hub))
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

fn joined(hub: &Hub) -> Joined {
    // The cursor is read before subscribing. Every event after it is then either received or
    // was sent before the subscriber joined (and so is not "from now"), so resuming from it
    // or from any later payload's cursor loses nothing. Read after, it could name an event
    // yielded but not yet sent, which a subscriber that fell behind would never receive.
    let cursor = hub.cursor.get();
    Joined {
        payloads: hub.payloads.subscribe(),
        cursor,
    }
}

/// The payload of an error that ends a subscription (`RESUME_REQUIRED`, `UNAUTHENTICATED`),
/// as the engine would send it.
pub fn error_payload(err: ApiError) -> String {
    let error: ServerError =
        async_graphql::Error::from(err).into_server_error(async_graphql::Pos::default());
    serde_json::to_string(&Response::from_errors(vec![error])).unwrap_or_default()
}

/// `RESUME_REQUIRED` for a subscriber whose last event was `cursor`.
pub fn resume_required(cursor: i64) -> ApiError {
    ApiError::ResumeRequired {
        cursor: EventId(cursor).to_string(),
    }
}
