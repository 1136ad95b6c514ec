//! The HTTP surface: `/graphql` (POST for operations, GET for GraphiQL), `/healthz`,
//! `/readyz` and `/metrics`.

use async_graphql::http::GraphiQLSource;
use async_graphql_axum::{GraphQLRequest, GraphQLResponse};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use std::sync::Arc;
use tower_http::trace::TraceLayer;

use crate::auth::TokenKeys;
use crate::error::ApiError;
use crate::graphql::AppSchema;
use crate::service::Services;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub schema: AppSchema,
    pub keys: Arc<TokenKeys>,
    pub services: Services,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/graphql", get(graphiql).post(graphql))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Runs one GraphQL operation for the caller named by the bearer token. A request without a
/// valid token is answered 401 with the same error shape as any GraphQL error.
async fn graphql(
    State(state): State<AppState>,
    headers: HeaderMap,
    request: GraphQLRequest,
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

async fn graphiql() -> Html<String> {
    Html(
        GraphiQLSource::build()
            .endpoint("/graphql")
            .title("Better Compute GraphQL")
            .finish(),
    )
}

async fn healthz() -> &'static str {
    "ok"
}

/// Ready when the database answers.
async fn readyz(State(state): State<AppState>) -> Response {
    if state.services.store.ping().await {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "database unreachable").into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let (size, idle) = state.services.store.pool_stats();
    metrics::gauge!("bc_db_pool_connections").set(f64::from(size));
    metrics::gauge!("bc_db_pool_idle_connections").set(idle as f64);
    let handle = crate::telemetry::metrics_handle();
    handle.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response()
}
