//! The HTTP surface: `/graphql` (POST for operations, GET for GraphiQL), `/healthz`,
//! `/readyz` and `/metrics`, and behind them the dashboard's files at `/` ([`Dashboard`]).

use async_graphql::http::GraphiQLSource;
use async_graphql_axum::{GraphQLRequest, GraphQLResponse};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tower::ServiceExt;
use tower_http::services::{ServeDir, ServeFile};
use tower_http::trace::TraceLayer;

use crate::auth::TokenKeys;
use crate::error::ApiError;
use crate::graphql::AppSchema;
use crate::service::Services;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub schema: AppSchema,
    /// Fires when the server stops: open subscription sockets close then.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    pub keys: Arc<TokenKeys>,
    pub services: Services,
    pub dashboard: Dashboard,
}

/// The API routes, and the dashboard for every path they do not claim.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/graphql", get(graphql_get).post(graphql))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(dashboard)
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// The dashboard: the files `scripts/build-web` writes into `dashboard_dir`, served with their
/// precompressed `.gz` copies to browsers that accept gzip, and `index.html` for client-side
/// routes (the dashboard routes with the browser's history, so `/nodes/node_…` is a page of
/// it that has no file).
#[derive(Clone, Debug)]
pub struct Dashboard {
    /// The page every client-side route loads; without it the dashboard is not built.
    index: PathBuf,
    /// The files alone: a missing one is 404, because a script or wasm request answered
    /// with HTML would fail in the browser with a confusing parse error instead of a 404.
    assets: ServeDir,
    /// The files, and `index.html` (200) for any path that is no file.
    pages: ServeDir<ServeFile>,
}

/// Every dashboard response is revalidated before use (`no-cache` still lets the browser keep
/// it and ask with `If-None-Match` or `If-Modified-Since`), so a rebuilt dashboard is never
/// served stale.
const DASHBOARD_CACHE_CONTROL: &str = "no-cache";

/// What `/` and client-side routes answer while `dashboard_dir` holds no `index.html`.
const DASHBOARD_NOT_BUILT_PAGE: &str = r#"<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Better Compute: the dashboard is not built</title></head>
<body>
<h1>The dashboard is not built</h1>
<p>This server found no <code>index.html</code> in its dashboard directory
(<code>dashboard_dir</code>, <code>web/dist</code> unless configured or set with
<code>BC_DASHBOARD_DIR</code>).</p>
<p>Build it with <code>scripts/build-web</code>, or run <code>scripts/dev --sim 20</code>,
which builds it and starts the server. Reload this page when the build is done; the server
needs no restart.</p>
<p>The API works meanwhile: <a href="/graphql">/graphql</a>.</p>
</body>
</html>
"#;

impl Dashboard {
    /// The dashboard in `dir`, which need not exist yet: every request looks again.
    pub fn new(dir: &Path) -> Dashboard {
        let index = dir.join("index.html");
        let assets = ServeDir::new(dir).precompressed_gzip();
        let pages = assets
            .clone()
            .fallback(ServeFile::new(&index).precompressed_gzip());
        Dashboard {
            index,
            assets,
            pages,
        }
    }

    /// Whether `dashboard_dir` holds an `index.html`. One metadata call, made per request so
    /// that a dashboard built while the server runs appears without a restart.
    pub async fn is_built(&self) -> bool {
        tokio::fs::metadata(&self.index)
            .await
            .is_ok_and(|metadata| metadata.is_file())
    }

    async fn serve(&self, request: axum::extract::Request) -> Response {
        let reads = matches!(*request.method(), Method::GET | Method::HEAD);
        // Other methods go on to `ServeDir`, which answers them 405 whether built or not.
        if reads && !self.is_built().await {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                Html(DASHBOARD_NOT_BUILT_PAGE),
            )
                .into_response();
        }
        let served = if names_a_file(request.uri().path()) {
            self.assets.clone().oneshot(request).await
        } else {
            self.pages.clone().oneshot(request).await
        };
        let Ok(response) = served;
        response.map(axum::body::Body::new)
    }
}

/// Whether `path` asks for a file (its last segment has an extension, as `app.wasm` does)
/// rather than a page of the dashboard. Client-side routes must therefore not end in a
/// segment with a dot.
fn names_a_file(path: &str) -> bool {
    path.rsplit('/')
        .next()
        .is_some_and(|last| last.contains('.'))
}

/// Every path no API route claims: a file of the dashboard, or one of its pages.
async fn dashboard(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    let mut response = state.dashboard.serve(request).await;
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static(DASHBOARD_CACHE_CONTROL),
    );
    response
}

/// Runs one GraphQL operation for the caller named by the bearer token. A request without a
/// valid token is answered 401 with the same error shape as any GraphQL error.
async fn graphql(
    State(state): State<AppState>,
    headers: HeaderMap,
    request: GraphQLRequest<crate::graphql::limits::BodyRejection>,
) -> Response {
    let header = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match state.keys.from_header(header) {
        Ok(principal) => {
            let response: GraphQLResponse = state
                .schema
                .execute(request.into_inner().data(principal))
                .await
                .into();
            response.into_response()
        }
        Err(err) => unauthenticated(&err),
    }
}

fn unauthenticated(err: &ApiError) -> Response {
    metrics::counter!("bc_graphql_requests_total", "operation" => "unauthenticated", "outcome" => "error").increment(1);
    let body = serde_json::json!({
        "data": null,
        "errors": [{ "message": err.message(), "extensions": { "code": err.code() } }],
    });
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        axum::Json(body),
    )
        .into_response()
}

/// Read buffer per subscription socket: tungstenite's default (128 KiB, zero-filled on every
/// read) costs ~4x the CPU per delivered event and ~20x the memory per connection, and
/// graphql-transport-ws messages from clients are tiny (see shared/notes/performance.md).
const SUBSCRIPTION_READ_BUFFER_BYTES: usize = 4096;

/// GET `/graphql`: a WebSocket upgrade starts a `graphql-transport-ws` subscription session
/// (the JWT travels in `connection_init`'s payload); anything else gets GraphiQL.
async fn graphql_get(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    use axum::extract::FromRequestParts;
    let (mut parts, _body) = request.into_parts();
    let wants_upgrade = parts
        .headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if !wants_upgrade {
        return Html(
            GraphiQLSource::build()
                .endpoint("/graphql")
                .subscription_endpoint("/graphql")
                .title("Better Compute GraphQL")
                .finish(),
        )
        .into_response();
    }
    let protocol =
        match async_graphql_axum::GraphQLProtocol::from_request_parts(&mut parts, &state).await {
            Ok(protocol) => protocol,
            Err(status) => return status.into_response(),
        };
    let upgrade =
        match axum::extract::WebSocketUpgrade::from_request_parts(&mut parts, &state).await {
            Ok(upgrade) => upgrade,
            Err(rejection) => return rejection.into_response(),
        };
    let schema = state.schema.clone();
    let keys = state.keys.clone();
    let mut shutdown = state.shutdown.clone();
    upgrade
        .read_buffer_size(SUBSCRIPTION_READ_BUFFER_BYTES)
        .protocols(async_graphql::http::ALL_WEBSOCKET_PROTOCOLS)
        .on_upgrade(move |socket| async move {
            metrics::gauge!("bc_subscription_connections").increment(1.0);
            let session = async_graphql_axum::GraphQLWebSocket::new(socket, schema, protocol)
                .on_connection_init(move |payload| async move {
                    let principal = keys
                        .from_header(bearer_from_init(&payload).as_deref())
                        .map_err(async_graphql::Error::from)?;
                    let mut data = async_graphql::Data::default();
                    data.insert(principal);
                    Ok(data)
                })
                .serve();

            tokio::select! {

                () = session => {}

                // The server is stopping: drop the socket so clients reconnect elsewhere.

                _ = shutdown.changed() => {}

            }
            metrics::gauge!("bc_subscription_connections").decrement(1.0);
        })
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

async fn healthz() -> &'static str {
    "ok"
}

/// Ready when the database answers.
async fn readyz(State(state): State<AppState>) -> Response {
    if state.services.database_ready().await {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "database unreachable").into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let (size, idle) = state.services.database_pool_stats();
    metrics::gauge!("bc_db_pool_connections").set(f64::from(size));
    metrics::gauge!("bc_db_pool_idle_connections").set(idle as f64);
    match state.services.command_queue_depths().await {
        Ok(depths) => {
            for (status, count) in depths {
                metrics::gauge!("bc_commands", "status" => status.to_string()).set(count as f64);
            }
        }
        Err(err) => {
            tracing::warn!(code = err.code(), reason = %err.message(), "counting the command queue for /metrics failed")
        }
    }
    let handle = crate::telemetry::metrics_handle();
    handle.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response()
}
