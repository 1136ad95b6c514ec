//! The gateway's HTTPS routes.

use axum::extract::{DefaultBodyLimit, FromRequest, State, WebSocketUpgrade};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bc_core::protocol::{ErrorBody, JoinRequest, MAX_FRAME_BYTES, PROTOCOL, RenewRequest};

use super::GatewayState;
use crate::error::ApiError;
use crate::pki::NodeIdentity;
use crate::service::attributed;

/// The identity in the client certificate of this connection, if it presented one.
#[derive(Clone)]
pub struct PeerIdentity(pub Option<NodeIdentity>);

/// Read buffer per session socket. tungstenite's default (128 KiB, zero-filled on every read)
/// costs a lot of CPU and memory with thousands of idle sessions; bcd/v1 frames are small.
/// tungstenite grows the buffer to hold the largest frame read and never shrinks it, and
/// reads at most this much at a time: with 4 KiB, the inventory's `gpus` frame (about 3 KB
/// for eight GPUs, arriving behind other bytes) doubled it to 8 KiB for the rest of the
/// session; with 512 bytes it grows to about the largest frame, and a heartbeat (a few dozen
/// bytes) is still one read, with less of the buffer zero-filled per read. Whatever this is,
/// one large frame (a command's result of up to 1 MiB) keeps its size for the rest of its
/// session; such frames are rare, and read 512 bytes at a time.
const SESSION_READ_BUFFER_BYTES: usize = 512;

/// The routes. Join and renewal bodies are bounded in size (`gateway.max_body_bytes`,
/// enforced while reading) and in time (`gateway.body_timeout_secs`).
pub fn router(state: GatewayState, config: &crate::config::GatewayConfig) -> Router {
    Router::new()
        .route("/v1/join", post(join))
        .route("/v1/renew", post(renew))
        .route("/v1/session", get(session))
        .route("/v1/ca.pem", get(ca_pem))
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .layer(tower_http::timeout::RequestBodyDeadlineLayer::new(
            config.body_timeout(),
        ))
        .with_state(state)
}

/// The JSON body of a join or renewal: 413 when it is larger than `gateway.max_body_bytes`
/// (reading stops there), 400 when it is not the request.
async fn json_body<T: serde::de::DeserializeOwned>(
    request: axum::extract::Request,
    state: &GatewayState,
    what: &str,
) -> Result<T, Response> {
    match Json::<T>::from_request(request, state).await {
        Ok(Json(body)) => Ok(body),
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            let mut response = error(ApiError::BadUserInput(format!(
                "the {what} body is too large"
            )));
            *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
            Err(response)
        }
        Err(rejection) => Err(error(ApiError::BadUserInput(format!(
            "malformed {what} request: {}",
            rejection.body_text()
        )))),
    }
}

/// An error answer: the same codes as the GraphQL API, with an HTTP status, and a message
/// held to the same rule as the API's (it never repeats a large value from the request:
/// serde quotes whole strings of the wrong type, the hostname check quotes the hostname).
fn error(err: ApiError) -> Response {
    let status = match &err {
        ApiError::BadUserInput(_) | ApiError::InvalidField { .. } => StatusCode::BAD_REQUEST,
        ApiError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
        ApiError::Forbidden(_) | ApiError::ReservedLabel { .. } => StatusCode::FORBIDDEN,
        ApiError::NotFound(_) | ApiError::HistoryNotRecorded { .. } => StatusCode::NOT_FOUND,
        ApiError::Conflict { .. }
        | ApiError::InvalidState { .. }
        | ApiError::ResumeRequired { .. } => StatusCode::CONFLICT,
        ApiError::Bmc { .. } => StatusCode::BAD_GATEWAY,
        // Retried by the daemon like any 5xx, with its backoff.
        ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        ApiError::Internal(source) => {
            tracing::error!(error = ?source, "internal error in the gateway");
            StatusCode::INTERNAL_SERVER_ERROR
        }
    };
    let mut message = err.message();
    crate::graphql::input_limits::bound_message(&mut message);
    let body = ErrorBody {
        code: err.code().to_owned(),
        message,
    };
    (status, Json(body)).into_response()
}

fn require_identity(peer: &PeerIdentity) -> Result<&NodeIdentity, ApiError> {
    peer.0
        .as_ref()
        .ok_or_else(|| ApiError::Unauthenticated("this needs a node client certificate".into()))
}

/// A join, written with the others that arrive meanwhile ([`crate::service::Services::join_many`]).
async fn join(State(state): State<GatewayState>, request: axum::extract::Request) -> Response {
    let request: JoinRequest = match json_body(request, &state, "join").await {
        Ok(request) => request,
        Err(response) => return response,
    };
    let hostname = request.hostname.clone();
    let answer = state
        .joins
        .submit(request)
        .await
        .unwrap_or_else(|| Err(unanswered("write the join")));
    match answer {
        Ok(identity) => Json(identity).into_response(),
        Err(err) => {
            metrics::counter!("bc_joins_refused_total", "code" => err.code()).increment(1);
            tracing::info!(code = err.code(), reason = %err.message(), %hostname, "join refused");
            error(err)
        }
    }
}

/// Renewal: the client certificate is checked before the body is read.
async fn renew(
    State(state): State<GatewayState>,
    Extension(peer): Extension<PeerIdentity>,
    request: axum::extract::Request,
) -> Response {
    let identity = match require_identity(&peer) {
        Ok(identity) => identity,
        Err(err) => return error(err),
    };
    let request: RenewRequest = match json_body(request, &state, "renew").await {
        Ok(request) => request,
        Err(response) => return response,
    };
    match attributed("gateway.renew", state.services.renew(identity, &request)).await {
        Ok(issued) => Json(issued).into_response(),
        Err(err) => error(err),
    }
}

async fn ca_pem(State(state): State<GatewayState>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/x-pem-file")],
        state.services.ca.cert_pem().to_owned(),
    )
        .into_response()
}

/// What a request is answered when its batch gave no answer ([`super::Batches::submit`]):
/// the gateway is stopping, or the batch panicked (logged). The daemon tries again.
fn unanswered(what: &str) -> ApiError {
    ApiError::Unavailable(format!(
        "the gateway is stopping or could not {what}; try again"
    ))
}

/// Upgrades to a bcd/v1 session after checking the certificate is of the node's current
/// identity generation (with other connections' checks, `gateway.identity`).
async fn session(
    State(state): State<GatewayState>,
    Extension(peer): Extension<PeerIdentity>,
    upgrade: WebSocketUpgrade,
) -> Response {
    let identity = match require_identity(&peer) {
        Ok(identity) => identity.clone(),
        Err(err) => return error(err),
    };
    let checked = state
        .identities
        .submit(identity.clone())
        .await
        .unwrap_or_else(|| Err(unanswered("check the certificate")));
    if let Err(err) = checked {
        metrics::counter!("bc_gateway_sessions_refused_total", "code" => err.code()).increment(1);
        return error(err);
    }
    // Counted from here to the session's last write, for a clean shutdown.
    let task = state.session_tasks.enter();
    upgrade
        .protocols([PROTOCOL])
        .max_message_size(MAX_FRAME_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .read_buffer_size(SESSION_READ_BUFFER_BYTES)
        .on_upgrade(move |socket| async move {
            // Boxed: allocated once, at its size, and axum's task around it holds a pointer.
            attributed(
                "gateway.session",
                Box::pin(super::session::run(state, identity, socket)),
            )
            .await;
            drop(task);
        })
}
