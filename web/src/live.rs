//! Live subscriptions over `graphql-transport-ws` that survive a dropped socket: each one
//! remembers the cursor of the last message it delivered and, after a reconnect, resumes from
//! there (`after`), so nothing is missed and nothing is replayed twice. A `RESUME_REQUIRED`
//! (the subscriber fell too far behind) resumes from the cursor the server names.

use std::time::Duration;

use futures::StreamExt;
use futures::future::{AbortHandle, Abortable};
use graphql_client::{GraphQLQuery, Response};
use leptos::prelude::*;
use serde::Serialize;

use crate::gql::{ApiError, GRAPHQL_PATH, WireRequest, into_result, wire_request};
use crate::session;

/// The first wait before reconnecting; doubled after each failure up to [`MAX_BACKOFF`], so
/// a restarting server is found within seconds without being hammered by every open tab.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What a live feed is doing, for the header's indicator.
#[derive(Clone, Debug, PartialEq)]
pub enum LiveState {
    Connecting,
    Live,
    /// The socket dropped; reconnecting, with the reason.
    Reconnecting(String),
    /// The server refused the token: no retry until the operator signs in again.
    Refused(ApiError),
}

/// A running subscription; dropping the handle does not stop it, [`LiveHandle::stop`] does
/// (a component stops its feeds in `on_cleanup`).
#[derive(Clone)]
pub struct LiveHandle(AbortHandle);

impl LiveHandle {
    pub fn stop(&self) {
        self.0.abort();
    }
}

/// A graphql_client operation as graphql-ws-client wants it.
struct Operation<Q: GraphQLQuery> {
    body: WireRequest<Q::Variables>,
    kind: std::marker::PhantomData<fn() -> Q>,
}

impl<Q: GraphQLQuery> Serialize for Operation<Q>
where
    Q::Variables: Serialize,
{
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.body.serialize(serializer)
    }
}

impl<Q: GraphQLQuery> graphql_ws_client::graphql::GraphqlOperation for Operation<Q>
where
    Q::Variables: Serialize,
{
    type Response = Response<Q::ResponseData>;
    type Error = serde_json::Error;

    fn decode(&self, data: serde_json::Value) -> Result<Self::Response, Self::Error> {
        serde_json::from_value(data)
    }
}

fn socket_url() -> Option<String> {
    let location = web_sys::window()?.location();
    let scheme = if location.protocol().ok()? == "https:" {
        "wss"
    } else {
        "ws"
    };
    Some(format!(
        "{scheme}://{}{GRAPHQL_PATH}",
        location.host().ok()?
    ))
}

/// Follows subscription `Q`. `variables` builds the variables from the cursor to resume
/// after (`None` the first time); `cursor` reads the cursor out of each message; `deliver`
/// gets every message's data in order.
pub fn follow<Q>(
    variables: impl Fn(Option<String>) -> Q::Variables + 'static,
    cursor: impl Fn(&Q::ResponseData) -> Option<String> + 'static,
    mut deliver: impl FnMut(Q::ResponseData) + 'static,
    state: RwSignal<LiveState>,
) -> LiveHandle
where
    Q: GraphQLQuery + 'static,
    Q::Variables: Serialize + Send + Unpin + 'static,
    Q::ResponseData: Unpin + Send + 'static,
{
    let (abort, registration) = AbortHandle::new_pair();
    let task = async move {
        let mut after: Option<String> = None;
        let mut backoff = FIRST_BACKOFF;
        loop {
            state.set(if after.is_none() {
                LiveState::Connecting
            } else {
                state.get_untracked()
            });
            match open::<Q>(variables(after.clone())).await {
                Ok(mut stream) => {
                    state.set(LiveState::Live);
                    backoff = FIRST_BACKOFF;
                    let mut why = "the server closed the feed".to_owned();
                    while let Some(message) = stream.next().await {
                        let data = message
                            .map_err(|e| ApiError::local("NETWORK", e.to_string()))
                            .and_then(into_result);
                        match data {
                            Ok(data) => {
                                if let Some(c) = cursor(&data) {
                                    after = Some(c);
                                }
                                deliver(data);
                            }
                            Err(err) if err.code == "RESUME_REQUIRED" => {
                                after = err.cursor.as_deref().map(str::to_owned).or(after);
                                why = "fell behind; resuming".to_owned();
                                break;
                            }
                            Err(err) if err.code == "UNAUTHENTICATED" => {
                                state.set(LiveState::Refused(err));
                                return;
                            }
                            Err(err) => {
                                why = err.to_string();
                                break;
                            }
                        }
                    }
                    state.set(LiveState::Reconnecting(why));
                }
                Err(err) if err.code == "UNAUTHENTICATED" => {
                    state.set(LiveState::Refused(err));
                    return;
                }
                Err(err) => state.set(LiveState::Reconnecting(err.message)),
            }
            gloo_timers::future::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    };
    leptos::task::spawn_local(async move {
        let _ = Abortable::new(task, registration).await;
    });
    LiveHandle(abort)
}

type Stream<Q> = graphql_ws_client::Subscription<Operation<Q>>;

async fn open<Q>(variables: Q::Variables) -> Result<Stream<Q>, ApiError>
where
    Q: GraphQLQuery + 'static,
    Q::Variables: Serialize + Send + Unpin + 'static,
    Q::ResponseData: Unpin + Send + 'static,
{
    let token =
        session::token().ok_or_else(|| ApiError::local("UNAUTHENTICATED", "not signed in"))?;
    let url = socket_url().ok_or_else(|| ApiError::local("NETWORK", "no page location"))?;
    let socket = ws_stream_wasm::WsMeta::connect(url, vec!["graphql-transport-ws"])
        .await
        .map_err(|e| ApiError::local("NETWORK", format!("cannot open the live feed: {e}")))?;
    let connection = graphql_ws_client::ws_stream_wasm::Connection::new(socket).await;
    let builder = graphql_ws_client::Client::build(connection)
        .payload(serde_json::json!({ "Authorization": format!("Bearer {token}") }))
        .map_err(|e| ApiError::local("BAD_REQUEST", e.to_string()))?;
    builder
        .subscribe(Operation::<Q> {
            body: wire_request::<Q>(variables),
            kind: std::marker::PhantomData,
        })
        .await
        .map_err(|e| {
            let text = e.to_string();
            // The server closes a connection_init with a bad token (4403 Forbidden).
            if text.contains("4403") || text.to_ascii_lowercase().contains("forbidden") {
                ApiError::local("UNAUTHENTICATED", text)
            } else {
                ApiError::local("NETWORK", text)
            }
        })
}
