//! The HTTP surface: `/graphql` (POST for operations, GET for GraphiQL), `/healthz`,
//! `/readyz` and `/metrics`, and behind them the dashboard's files at `/` ([`Dashboard`]).

use async_graphql_axum::{GraphQLRequest, GraphQLResponse};
use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tower::ServiceExt;
use tower_http::services::{ServeDir, ServeFile};
use tower_http::timeout::RequestBodyDeadlineLayer;
use tower_http::trace::TraceLayer;

use crate::auth::TokenKeys;
use crate::config::ApiConfig;
use crate::error::ApiError;
use crate::graphql::AppSchema;
use crate::service::Services;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub schema: AppSchema,
    /// The shared streams of live subscriptions (`subscription_hubs`).
    pub hubs: Arc<crate::subscription_hubs::SubscriptionHubs>,
    /// Fires when the server stops: open subscription sockets close then.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    pub keys: Arc<TokenKeys>,
    pub services: Services,
    pub dashboard: Dashboard,
    pub graphql: GraphqlExecutor,
    /// The listener's limits (`[api]`): body size and time, subscription socket timers.
    pub limits: Arc<ApiConfig>,
}

/// The API routes, and the dashboard for every path they do not claim. Bodies are bounded
/// in size (`api.max_body_bytes`, enforced while reading) and in time
/// (`api.body_timeout_secs`); a request on a connection from the admin reserve is served
/// only for a platform admin ([`reserve_guard`]).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/graphql", get(graphql_get).post(graphql))
        .route("/graphql/assets/{file}", get(crate::graphiql::asset))
        // Browsers ask for it on every page without an icon of its own (GraphiQL's); an empty
        // answer keeps a 404 out of their consoles.
        .route(
            "/favicon.ico",
            get(|| async { axum::http::StatusCode::NO_CONTENT }),
        )
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(dashboard)
        .layer(DefaultBodyLimit::max(state.limits.max_body_bytes))
        .layer(RequestBodyDeadlineLayer::new(state.limits.body_timeout()))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            reserve_guard,
        ))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Set on the requests of a connection that holds one of the API listener's reserved
/// slots (`api.admin_reserved_connections`, see `listener::ConnectionGate`).
#[derive(Debug, Clone, Copy)]
pub struct ReservedConnection;

/// On a reserved connection, serves only requests that bear a platform admin's token: the
/// reserve exists so that an operator gets in while the listener is full, and anyone else
/// is told to come back (503, and the connection is closed to free the slot).
async fn reserve_guard(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if request.extensions().get::<ReservedConnection>().is_none() {
        return next.run(request).await;
    }
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let admitted = state
        .keys
        .from_header(header, state.services.clock.now())
        .and_then(|principal| principal.require_platform_admin());
    match admitted {
        Ok(()) => {
            metrics::counter!("bc_admin_reserve_requests_total", "outcome" => "served")
                .increment(1);
            next.run(request).await
        }
        Err(err) => {
            metrics::counter!("bc_admin_reserve_requests_total", "outcome" => "refused")
                .increment(1);
            let err = match err {
                ApiError::Unauthenticated(_) => ApiError::Unauthenticated(
                    "the server is at its connection limit: only platform admins are served \
                     until connections free up; retry shortly"
                        .into(),
                ),
                _ => ApiError::Forbidden(
                    "the server is at its connection limit: only platform admins are served \
                     until connections free up; retry shortly"
                        .into(),
                ),
            };
            let mut response = error_response(StatusCode::SERVICE_UNAVAILABLE, &err);
            let headers = response.headers_mut();
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            response
        }
    }
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

/// Runs one GraphQL operation for the caller named by the bearer token. The token is
/// checked before a byte of the body is read: a request without a valid one is answered 401
/// (the same error shape as any GraphQL error) whatever it carries. A body larger than
/// `api.max_body_bytes` is refused with 413, from its `Content-Length` before reading or
/// while reading one without.
async fn graphql(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let principal = match state.keys.from_header(header, state.services.clock.now()) {
        Ok(principal) => principal,
        Err(err) => return unauthenticated(&err),
    };
    let limit = state.limits.max_body_bytes;
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return body_too_large(limit);
    }
    let (parts, body) = request.into_parts();
    let body = axum::extract::Request::from_parts(parts.clone(), body);
    let bytes = match axum::body::Bytes::from_request(body, &state).await {
        Ok(bytes) => bytes,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return body_too_large(limit);
        }
        Err(rejection) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                &ApiError::BadUserInput(format!(
                    "the request body could not be read: {}",
                    rejection.body_text()
                )),
            );
        }
    };
    let request = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
    let request = match GraphQLRequest::<crate::graphql::input_limits::BodyRejection>::from_request(
        request, &state,
    )
    .await
    {
        Ok(request) => request,
        Err(rejection) => return rejection.into_response(),
    };
    let response: GraphQLResponse = state
        .graphql
        .execute(state.schema.clone(), request.into_inner().data(principal))
        .await
        .into();
    response.into_response()
}

fn body_too_large(limit: usize) -> Response {
    error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        &ApiError::BadUserInput(format!("the request body is larger than {limit} bytes")),
    )
}

/// Runs GraphQL operations over HTTP on threads of their own, at most
/// `graphql.max_concurrent_requests` at a time.
///
/// async-graphql computes an answer in as few polls of its future as it can: the whole
/// introspection answer (114 KB) is one poll, a page of 1,000 nodes another. On the runtime's
/// workers, which also answer `/healthz`, `/readyz` and the gateway's daemons, each such poll
/// held a worker; with two workers (the machines have two cores) four clients repeating
/// graphql-js's introspection query stalled `/healthz` for 180 to 310 ms (debug build, on a
/// machine loaded 9 deep), and the limits (`graphql::limits`) bound the cost of one query,
/// not how many run. On blocking threads the same measured 33 to 80 ms. So each
/// operation runs on a blocking-pool thread, driven by `Handle::block_on`: the kernel
/// shares the cores between those threads and the workers, and the workers stay free.
/// Its sockets and timers still belong to the one runtime, whose free workers drive them,
/// so nothing waits on a busy thread of another runtime (a dedicated runtime for GraphQL
/// would register database connections it opens with its own I/O driver, which the
/// gateway's later use of the same pooled connection would then wait on).
#[derive(Clone)]
pub struct GraphqlExecutor {
    permits: Arc<tokio::sync::Semaphore>,
}

impl GraphqlExecutor {
    pub fn new(max_concurrent_requests: usize) -> GraphqlExecutor {
        GraphqlExecutor {
            permits: Arc::new(tokio::sync::Semaphore::new(max_concurrent_requests.max(1))),
        }
    }

    /// Runs `request` once a permit is free. If the caller stops waiting (the client went
    /// away), the operation is dropped at its next await.
    pub async fn execute(
        &self,
        schema: AppSchema,
        request: async_graphql::Request,
    ) -> async_graphql::Response {
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return internal_response(anyhow::anyhow!("the GraphQL permits were closed"));
        };
        let runtime = tokio::runtime::Handle::current();
        // Dropped with this future: the operation then stops too.
        let (_running, abandoned) = tokio::sync::oneshot::channel::<()>();
        let operation = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            runtime.block_on(async move {
                tokio::select! {
                    response = crate::service::attributed("api", schema.execute(request)) => response,
                    _ = abandoned => async_graphql::Response::default(),
                }
            })
        });
        match operation.await {
            Ok(response) => response,
            Err(err) => internal_response(anyhow::anyhow!("a GraphQL operation failed: {err}")),
        }
    }
}

/// `INTERNAL`, with the cause logged.
fn internal_response(err: anyhow::Error) -> async_graphql::Response {
    let err = async_graphql::Error::from(ApiError::internal(err));
    let mut server_error = async_graphql::ServerError::new(err.message, None);
    server_error.extensions = err.extensions;
    async_graphql::Response::from_errors(vec![server_error])
}

fn unauthenticated(err: &ApiError) -> Response {
    metrics::counter!("bc_graphql_requests_total", "operation" => "unauthenticated", "outcome" => "error").increment(1);
    let mut response = error_response(StatusCode::UNAUTHORIZED, err);
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// `err` in the shape of a GraphQL error, with `status`.
fn error_response(status: StatusCode, err: &ApiError) -> Response {
    let body = serde_json::json!({
        "data": null,
        "errors": [{ "message": err.message(), "extensions": { "code": err.code() } }],
    });
    (status, axum::Json(body)).into_response()
}

/// Read buffer per subscription socket: tungstenite's default (128 KiB, zero-filled on every
/// read) costs ~4x the CPU per delivered event and ~20x the memory per connection (see
/// shared/notes/performance.md). What a client sends is small and rare (`connection_init`
/// with its token, a `subscribe` with its document, pings), so 1 KiB holds most of it: a
/// larger message is read in several reads, and grows only its own socket's buffer. Each KiB
/// here is 10 MB at 10,000 subscribers (issue 16: at most 10 KB per subscriber).
const SUBSCRIPTION_READ_BUFFER_BYTES: usize = 1024;

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
        return crate::graphiql::page().into_response();
    }
    // The first subprotocol offered that async-graphql speaks (as its `GraphQLProtocol`
    // extractor picks it, whose value is not public).
    let Some(protocol) = parts
        .headers
        .get(header::SEC_WEBSOCKET_PROTOCOL)
        .and_then(|value| value.to_str().ok())
        .and_then(|offered| {
            offered.split(',').find_map(|p| {
                p.trim()
                    .parse::<async_graphql::http::WebSocketProtocols>()
                    .ok()
            })
        })
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let upgrade =
        match axum::extract::WebSocketUpgrade::from_request_parts(&mut parts, &state).await {
            Ok(upgrade) => upgrade,
            Err(rejection) => return rejection.into_response(),
        };
    let schema = state.schema.clone();
    let hubs = state.hubs.clone();
    let keys = state.keys.clone();
    let clock = state.services.clock.clone();
    let limits = crate::graphql_ws::SocketLimits::from_config(&state.limits);
    let shutdown = state.shutdown.clone();
    upgrade
        .read_buffer_size(SUBSCRIPTION_READ_BUFFER_BYTES)
        // A client message is an operation: bounded like a request body.
        .max_message_size(state.limits.max_body_bytes)
        .max_frame_size(state.limits.max_body_bytes)
        .protocols(async_graphql::http::ALL_WEBSOCKET_PROTOCOLS)
        .on_upgrade(move |socket| {
            crate::graphql_ws::serve(
                socket, schema, hubs, protocol, keys, clock, limits, shutdown,
            )
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
