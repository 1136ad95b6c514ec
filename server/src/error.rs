//! The one error type of the API, with its stable wire form.
//!
//! Every resolver returns [`ApiError`]; its [`ApiError::code`] is the `extensions.code` a
//! client sees. Internal details are logged here and never returned.

use bc_core::DomainError;

/// Deliberately not `Display`: async-graphql converts any `Display` error into a GraphQL
/// error without extensions, which would silently drop the code. The only way out of this
/// type is [`From<ApiError> for async_graphql::Error`], which sets it.
#[derive(Debug)]
pub enum ApiError {
    InvalidState {
        message: String,
        current: String,
        attempted: String,
        allowed: Vec<String>,
    },
    Conflict {
        expected: i64,
        current: i64,
    },
    NotFound(String),
    Unauthenticated(String),
    Forbidden(String),
    BadUserInput(String),
    /// `BAD_USER_INPUT` about one field of the input, named in `extensions.field`
    /// (`input.reason`, `filter.labels[0].key`); see `graphql::limits`.
    InvalidField {
        field: String,
        message: String,
    },
    /// A node's BMC failed a request (`BMC_ERROR`); `kind` (`extensions.bmcError`) says how:
    /// `Unreachable`, `Timeout`, `Unauthorized`, `UnexpectedAnswer` or `Unsupported`.
    Bmc {
        kind: &'static str,
        message: String,
    },
    /// A label that a controller owns (`RESERVED_LABEL`): `extensions.label` is the key and
    /// `extensions.owner` the owner (`inventory` for `inventory.bettercompute.io/…`).
    ReservedLabel {
        key: String,
        owner: &'static str,
        message: String,
    },
    /// A subscriber fell too far behind the live feed; it resumes from `cursor`.
    ResumeRequired {
        cursor: String,
    },
    /// A node cannot be rebuilt at a past version: that part of its history was written
    /// before events carried rebuild data (`nodeAsOf`). Never a guess at the node.
    HistoryNotRecorded {
        message: String,
        version: i64,
    },
    /// The database gave no connection within `[database] acquire_timeout_secs`: the server
    /// or the database is overloaded, or the database is down (`UNAVAILABLE`). The caller may
    /// retry; a mutation retried with the version it read answers `CONFLICT` if the first try
    /// was applied after all.
    Unavailable(String),
    /// Never shown to the caller: the source is logged and the message is generic.
    Internal(anyhow::Error),
}

impl ApiError {
    /// `RESUME_REQUIRED` for a subscriber whose last event delivered was `seq`.
    pub fn resume_after(seq: i64) -> ApiError {
        ApiError::ResumeRequired {
            cursor: bc_core::ids::EventId(seq).to_string(),
        }
    }

    /// Whether the fault is ours (a bug, or a database too busy or down), not the caller's:
    /// a daemon's session that meets one ends as an error it may reconnect from, never as a
    /// protocol violation.
    pub fn is_server_fault(&self) -> bool {
        matches!(self, ApiError::Internal(_) | ApiError::Unavailable(_))
    }

    /// The stable `extensions.code`.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidState { .. } => "INVALID_STATE",
            ApiError::Conflict { .. } => "CONFLICT",
            ApiError::NotFound(_) => "NOT_FOUND",
            ApiError::Unauthenticated(_) => "UNAUTHENTICATED",
            ApiError::Forbidden(_) => "FORBIDDEN",
            ApiError::BadUserInput(_) | ApiError::InvalidField { .. } => "BAD_USER_INPUT",
            ApiError::ResumeRequired { .. } => "RESUME_REQUIRED",
            ApiError::HistoryNotRecorded { .. } => "HISTORY_NOT_RECORDED",
            ApiError::Bmc { .. } => "BMC_ERROR",
            ApiError::ReservedLabel { .. } => "RESERVED_LABEL",
            ApiError::Unavailable(_) => "UNAVAILABLE",
            ApiError::Internal(_) => "INTERNAL",
        }
    }

    /// The message a client sees.
    pub fn message(&self) -> String {
        match self {
            ApiError::InvalidState { message, .. } => message.clone(),
            ApiError::Conflict { expected, current } => {
                format!(
                    "it changed since version {expected} (read it again); its current version is {current}"
                )
            }
            ApiError::NotFound(m)
            | ApiError::Unauthenticated(m)
            | ApiError::Forbidden(m)
            | ApiError::BadUserInput(m)
            | ApiError::InvalidField { message: m, .. }
            | ApiError::HistoryNotRecorded { message: m, .. }
            | ApiError::Unavailable(m) => m.clone(),
            ApiError::Bmc { message: m, .. } | ApiError::ReservedLabel { message: m, .. } => {
                m.clone()
            }
            ApiError::ResumeRequired { cursor } => {
                format!(
                    "the subscription fell too far behind; resubscribe with after: \"{cursor}\""
                )
            }
            ApiError::Internal(_) => "internal error".to_owned(),
        }
    }

    /// An internal error, counted for `/metrics` as `bc_internal_errors_total`, whose `cause`
    /// is `deadlock` for a PostgreSQL deadlock (SQLSTATE `40P01`: a lock-order bug, see
    /// ARCHITECTURE.md's Invariants) and `other` for anything else. A pool that gave no
    /// connection in time is no bug but a load the caller can wait out: that is
    /// [`ApiError::Unavailable`], counted as `bc_unavailable_errors_total`.
    pub fn internal(err: impl Into<anyhow::Error>) -> Self {
        let err = err.into();
        if err.chain().any(is_pool_timeout) {
            metrics::counter!("bc_unavailable_errors_total").increment(1);
            warn_pool_timeout(&err);
            return ApiError::Unavailable(
                "the database is busy: no connection was free in time; try again shortly".into(),
            );
        }
        let cause = if is_deadlock(&err) {
            "deadlock"
        } else {
            "other"
        };
        metrics::counter!("bc_internal_errors_total", "cause" => cause).increment(1);
        ApiError::Internal(err)
    }
}

/// The fewest seconds between two warnings that the pool gave no connection in time: an
/// overload can refuse thousands of requests a second, and a line for each would bury the
/// log (and cost the CPU the overload lacks); `bc_unavailable_errors_total` counts them all.
const POOL_TIMEOUT_WARNING_EVERY_SECS: u64 = 10;

/// Logs a pool timeout, at most once every [`POOL_TIMEOUT_WARNING_EVERY_SECS`], saying how
/// many went unlogged since the last warning.
fn warn_pool_timeout(err: &anyhow::Error) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    // Seconds since START, plus one, of the last warning; 0 before the first.
    static LAST_WARNED: AtomicU64 = AtomicU64::new(0);
    static UNLOGGED: AtomicU64 = AtomicU64::new(0);
    let now = START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs()
        + 1;
    let last = LAST_WARNED.load(Ordering::Relaxed);
    let due = last == 0 || now.saturating_sub(last) >= POOL_TIMEOUT_WARNING_EVERY_SECS;
    if due
        && LAST_WARNED
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let unlogged = UNLOGGED.swap(0, Ordering::Relaxed);
        tracing::warn!(error = %format!("{err:#}"), unlogged, "no database connection in time (unlogged: how many more since the last such warning)");
    } else {
        UNLOGGED.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether `cause` is the pool giving up on a connection (`[database] acquire_timeout_secs`),
/// as sea-orm wraps it or as sqlx reports it.
pub(crate) fn is_pool_timeout(cause: &(dyn std::error::Error + 'static)) -> bool {
    use sea_orm::{ConnAcquireErr, DbErr, RuntimeErr, sqlx};
    match cause.downcast_ref::<DbErr>() {
        Some(DbErr::ConnectionAcquire(ConnAcquireErr::Timeout)) => true,
        Some(DbErr::Conn(RuntimeErr::SqlxError(e))) => matches!(**e, sqlx::Error::PoolTimedOut),
        _ => matches!(
            cause.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::PoolTimedOut)
        ),
    }
}

/// Whether `err` is PostgreSQL's `deadlock detected`.
fn is_deadlock(err: &anyhow::Error) -> bool {
    use sea_orm::{DbErr, RuntimeErr};
    err.chain()
        .any(|cause| match cause.downcast_ref::<DbErr>() {
            Some(
                DbErr::Exec(RuntimeErr::SqlxError(sqlx))
                | DbErr::Query(RuntimeErr::SqlxError(sqlx)),
            ) => sqlx
                .as_database_error()
                .and_then(|db| db.code())
                .is_some_and(|code| code == "40P01"),
            _ => false,
        })
}

impl From<DomainError> for ApiError {
    fn from(err: DomainError) -> Self {
        let message = err.to_string();
        match err {
            DomainError::InvalidState {
                current,
                attempted,
                allowed,
            } => invalid_move(&current, &attempted, &allowed),
            DomainError::CommandState {
                id,
                current,
                attempted,
                finished,
            } => invalid_command_status(&id, &current, &attempted, finished),
            DomainError::ReservationState {
                current, attempted, ..
            } => ApiError::InvalidState {
                message,
                current: api_enum(&current),
                attempted: format!("{attempted}Reservation"),
                allowed: Vec::new(),
            },
            DomainError::Conflict { expected, current } => ApiError::Conflict { expected, current },
            DomainError::NotFound { .. } => ApiError::NotFound(message),
            DomainError::BadInput(_) => ApiError::BadUserInput(message),
            DomainError::Forbidden(_) => ApiError::Forbidden(message),
            DomainError::ReservedLabel { key, owner } => ApiError::ReservedLabel {
                key,
                owner,
                message,
            },
        }
    }
}

/// The API's spelling of a domain enum value: `finish-deploy` is `FINISH_DEPLOY`, as
/// async-graphql names the variants of the GraphQL enums (pinned by a test below).
fn api_enum(domain: &str) -> String {
    domain.replace('-', "_").to_ascii_uppercase()
}

/// The API's spelling of a `provisionState` move, if `domain` is one: only moves the GraphQL
/// `ProvisionMove` enum can express (`delete` is `deleteNode`, not a move).
fn api_move(domain: &str) -> Option<String> {
    domain
        .parse::<bc_core::provision::ProvisionMove>()
        .ok()
        .map(|m| api_enum(m.as_ref()))
}

/// `UnexpectedAnswer` as the API spells enum values: `UNEXPECTED_ANSWER`.
fn api_enum_pascal(pascal: &str) -> String {
    let mut out = String::with_capacity(pascal.len() + 4);
    for (i, c) in pascal.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Joins `items` as prose: `A`, `A or B`, `A, B or C`.
fn alternatives(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [only] => only.clone(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// `INVALID_STATE` for a `provisionState` move or a deletion, in the API's words: the state and
/// the moves as the GraphQL enums spell them, and only moves `transitionNode` takes in
/// `allowed`, so a client can send any of them back as it is.
fn invalid_move(current: &str, attempted: &str, allowed: &[String]) -> ApiError {
    let state = current
        .parse::<bc_core::axes::ProvisionState>()
        .map_or_else(|_| current.to_owned(), |s| api_enum(s.as_ref()));
    let moves: Vec<String> = allowed.iter().filter_map(|m| api_move(m)).collect();
    let deletable = allowed.iter().any(|m| m == "delete");
    let what_is_allowed = match (moves.is_empty(), deletable) {
        (false, false) => format!("the moves allowed from {state} are {}", moves.join(", ")),
        (false, true) => format!(
            "the moves allowed from {state} are {} (and deleteNode)",
            moves.join(", ")
        ),
        (true, true) => format!("no move is allowed from {state} (but deleteNode is)"),
        (true, false) => format!("no move is allowed from {state}"),
    };
    let (attempted, message) = match api_move(attempted) {
        Some(action) => {
            let message = format!("cannot {action} a node that is {state}; {what_is_allowed}");
            (action, message)
        }
        None => {
            let deletable: Vec<String> = bc_core::provision::DELETABLE_STATES
                .iter()
                .map(|s| api_enum(s.as_ref()))
                .collect();
            let message = format!(
                "cannot delete a node that is {state} (only {} nodes can be); {what_is_allowed}",
                alternatives(&deletable)
            );
            ("deleteNode".to_owned(), message)
        }
    };
    ApiError::InvalidState {
        message,
        current: state,
        attempted,
        allowed: moves,
    }
}

/// `INVALID_STATE` for a command: a sentence about the command, its status as the API spells
/// it, and no moves (`cancelCommand` is the only one a client makes, and it is what failed).
fn invalid_command_status(id: &str, current: &str, attempted: &str, finished: bool) -> ApiError {
    use bc_core::command::CommandStatus;
    let status = |s: &str| {
        s.parse::<CommandStatus>()
            .map_or_else(|_| s.to_owned(), |s| api_enum(s.as_ref()))
    };
    let current = status(current);
    let cancel = attempted.parse::<CommandStatus>() == Ok(CommandStatus::Cancelled);
    let (attempted, message) = if cancel {
        let cancellable: Vec<String> = CommandStatus::ALL
            .iter()
            .filter(|s| s.can_move_to(CommandStatus::Cancelled))
            .map(|s| api_enum(s.as_ref()))
            .collect();
        let state = if finished {
            format!("already finished ({current})")
        } else {
            format!("is {current}")
        };
        (
            "cancelCommand".to_owned(),
            format!(
                "command {id} {state}: only a {} command can be cancelled",
                alternatives(&cancellable)
            ),
        )
    } else {
        let attempted = status(attempted);
        let message = format!("command {id} is {current} and cannot become {attempted}");
        (attempted, message)
    };
    ApiError::InvalidState {
        message,
        current,
        attempted,
        allowed: Vec::new(),
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(err: anyhow::Error) -> Self {
        ApiError::internal(err)
    }
}

impl From<sea_orm::DbErr> for ApiError {
    fn from(err: sea_orm::DbErr) -> Self {
        ApiError::internal(err)
    }
}

impl From<ApiError> for async_graphql::Error {
    fn from(err: ApiError) -> Self {
        use async_graphql::ErrorExtensions;
        if let ApiError::Internal(source) = &err {
            tracing::error!(error = ?source, "internal error while serving a request");
        }
        async_graphql::Error::new(err.message()).extend_with(|_, ext| {
            ext.set("code", err.code());
            match &err {
                ApiError::Conflict { current, .. } => ext.set("currentVersion", *current),
                ApiError::InvalidField { field, .. } => ext.set("field", field.as_str()),
                ApiError::ResumeRequired { cursor } => ext.set("cursor", cursor.as_str()),
                ApiError::HistoryNotRecorded { version, .. } => ext.set("version", *version),
                ApiError::Bmc { kind, .. } => ext.set("bmcError", api_enum_pascal(kind)),
                ApiError::ReservedLabel { key, owner, .. } => {
                    ext.set("label", key.as_str());
                    ext.set("owner", *owner);
                }
                ApiError::InvalidState {
                    current,
                    attempted,
                    allowed,
                    ..
                } => {
                    ext.set("current", current.as_str());
                    ext.set("attempted", attempted.as_str());
                    ext.set("allowed", allowed.clone());
                }
                _ => {}
            }
        })
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// For callers outside the API (the CLI): the code and message as an `anyhow` error.
impl From<ApiError> for anyhow::Error {
    fn from(err: ApiError) -> Self {
        match err {
            ApiError::Internal(source) => source,
            other => anyhow::anyhow!("{}: {}", other.code(), other.message()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire form is a contract: these codes never change.
    #[test]
    fn codes_are_pinned() {
        let cases = [
            (
                ApiError::InvalidState {
                    message: String::new(),
                    current: String::new(),
                    attempted: String::new(),
                    allowed: vec![],
                },
                "INVALID_STATE",
            ),
            (
                ApiError::Conflict {
                    expected: 1,
                    current: 2,
                },
                "CONFLICT",
            ),
            (ApiError::NotFound(String::new()), "NOT_FOUND"),
            (ApiError::Unauthenticated(String::new()), "UNAUTHENTICATED"),
            (ApiError::Forbidden(String::new()), "FORBIDDEN"),
            (ApiError::BadUserInput(String::new()), "BAD_USER_INPUT"),
            (
                ApiError::InvalidField {
                    field: "input.reason".into(),
                    message: String::new(),
                },
                "BAD_USER_INPUT",
            ),
            (
                ApiError::HistoryNotRecorded {
                    message: String::new(),
                    version: 1,
                },
                "HISTORY_NOT_RECORDED",
            ),
            (
                ApiError::ResumeRequired {
                    cursor: "evt_1".into(),
                },
                "RESUME_REQUIRED",
            ),
            (
                ApiError::ReservedLabel {
                    key: "inventory.bettercompute.io/gpu-model".into(),
                    owner: "inventory",
                    message: String::new(),
                },
                "RESERVED_LABEL",
            ),
            (
                ApiError::internal(anyhow::anyhow!("secret detail")),
                "INTERNAL",
            ),
            (ApiError::Unavailable(String::new()), "UNAVAILABLE"),
        ];
        for (err, code) in cases {
            assert_eq!(err.code(), code);
            assert!(!err.message().contains("secret detail"));
            let gql = async_graphql::Error::from(err);
            let ext = serde_json::to_value(&gql.extensions).expect("serialises");
            assert_eq!(ext["code"], code);
            assert!(!gql.message.contains("secret detail"));
        }
    }

    /// A pool that gave no connection in time is `UNAVAILABLE` however it arrives (from
    /// sea-orm, from sqlx, under a context); a database's own error stays `INTERNAL`.
    #[test]
    fn a_pool_timeout_is_unavailable_and_other_database_errors_are_internal() {
        use sea_orm::{ConnAcquireErr, DbErr, RuntimeErr, sqlx};
        let timeouts = [
            anyhow::Error::new(DbErr::ConnectionAcquire(ConnAcquireErr::Timeout)),
            anyhow::Error::new(DbErr::Conn(RuntimeErr::SqlxError(
                sqlx::Error::PoolTimedOut.into(),
            ))),
            anyhow::Error::new(sqlx::Error::PoolTimedOut),
            anyhow::Error::new(DbErr::ConnectionAcquire(ConnAcquireErr::Timeout))
                .context("opening a session"),
        ];
        for err in timeouts {
            let shown = format!("{err:#}");
            let api = ApiError::internal(err);
            assert_eq!(api.code(), "UNAVAILABLE", "{shown}");
            assert!(api.message().contains("try again"), "{}", api.message());
        }
        for err in [
            anyhow::Error::new(DbErr::ConnectionAcquire(ConnAcquireErr::ConnectionClosed)),
            anyhow::Error::new(DbErr::Custom("constraint".into())),
            anyhow::anyhow!("anything else"),
        ] {
            assert_eq!(ApiError::internal(err).code(), "INTERNAL");
        }
    }

    /// `api_enum` spells every move, state and command status exactly as the GraphQL enums do,
    /// so `INVALID_STATE`'s values can be sent back as they are.
    #[test]
    fn api_spelling_is_the_graphql_enums() {
        use crate::graphql::types;
        use async_graphql::InputType;
        use strum::IntoEnumIterator;
        let name = |value: async_graphql::Value| match value {
            async_graphql::Value::Enum(name) => name.to_string(),
            other => panic!("not an enum value: {other}"),
        };
        for m in bc_core::provision::ProvisionMove::iter() {
            assert_eq!(
                api_enum(m.as_ref()),
                name(types::ProvisionMove::from(m).to_value())
            );
            assert_eq!(api_move(m.as_ref()), Some(api_enum(m.as_ref())));
        }
        assert_eq!(api_move("delete"), None);
        for s in bc_core::axes::ProvisionState::ALL {
            let spelled = api_enum(s.as_ref());
            assert_eq!(spelled, name(types::ProvisionState::from(*s).to_value()));
        }
        for s in bc_core::command::CommandStatus::ALL {
            let spelled = api_enum(s.as_ref());
            assert_eq!(spelled, name(types::CommandStatus::from(*s).to_value()));
        }
    }

    /// From every state, every move: `allowed` holds only moves of the API's enum, in its
    /// spelling, exactly those of the table; `attempted` is the move as sent.
    #[test]
    fn invalid_state_speaks_the_api() {
        use bc_core::axes::ProvisionState;
        use bc_core::provision::{self, ProvisionMove};
        use strum::IntoEnumIterator;
        for state in ProvisionState::ALL {
            let table: Vec<String> = provision::allowed_moves(*state)
                .iter()
                .map(|m| api_enum(m.as_ref()))
                .collect();
            for action in ProvisionMove::iter() {
                let err = ApiError::from(provision::invalid_state(*state, action.as_ref()));
                let ApiError::InvalidState {
                    message,
                    current,
                    attempted,
                    allowed,
                } = err
                else {
                    panic!("INVALID_STATE expected");
                };
                assert_eq!(current, api_enum(state.as_ref()));
                assert_eq!(attempted, api_enum(action.as_ref()));
                assert_eq!(allowed, table, "{state} {action}");
                assert!(
                    allowed
                        .iter()
                        .all(|m| api_move(&m.to_lowercase().replace('_', "-")).is_some())
                );
                assert!(
                    message.starts_with(&format!("cannot {attempted} a node that is {current}; ")),
                    "{message}"
                );
                assert_eq!(
                    message.contains("deleteNode"),
                    provision::DELETABLE_STATES.contains(state),
                    "{message}"
                );
            }
        }
        let err = ApiError::from(provision::invalid_state(ProvisionState::Deployed, "delete"));
        assert_eq!(
            err.message(),
            "cannot delete a node that is DEPLOYED (only ADOPTING, ENROLLING, FAILED or RETIRED nodes can be); the moves allowed from DEPLOYED are RELEASE, RESCUE"
        );
        let err = ApiError::from(provision::invalid_state(ProvisionState::Retired, "fail"));
        assert_eq!(
            err.message(),
            "cannot FAIL a node that is RETIRED; no move is allowed from RETIRED (but deleteNode is)"
        );
    }

    #[test]
    fn a_finished_command_is_named_as_a_command() {
        let err = ApiError::from(DomainError::CommandState {
            id: "cmd_1".into(),
            current: "timed_out".into(),
            attempted: "cancelled".into(),
            finished: true,
        });
        assert_eq!(err.code(), "INVALID_STATE");
        assert_eq!(
            err.message(),
            "command cmd_1 already finished (TIMED_OUT): only a QUEUED, DISPATCHED or RUNNING command can be cancelled"
        );
        let gql = async_graphql::Error::from(err);
        let ext = serde_json::to_value(&gql.extensions).expect("serialises");
        assert_eq!(ext["current"], "TIMED_OUT");
        assert_eq!(ext["attempted"], "cancelCommand");
        assert_eq!(ext["allowed"], serde_json::json!([]));
    }

    #[test]
    fn an_invalid_field_is_bad_user_input_naming_it() {
        let gql = async_graphql::Error::from(ApiError::InvalidField {
            field: "input.reason".into(),
            message: "`input.reason` is longer than 1024 bytes".into(),
        });
        let ext = serde_json::to_value(&gql.extensions).expect("serialises");
        assert_eq!(ext["code"], "BAD_USER_INPUT");
        assert_eq!(ext["field"], "input.reason");
    }

    #[test]
    fn conflict_carries_the_current_version() {
        let gql = async_graphql::Error::from(ApiError::Conflict {
            expected: 3,
            current: 5,
        });
        let ext = serde_json::to_value(&gql.extensions).expect("serialises");
        assert_eq!(ext["currentVersion"], 5);
    }
}
