//! The domain's error type. The API maps each variant to one stable `extensions.code`.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DomainError {
    /// A move that the state table does not allow from the node's current state.
    #[error(
        "cannot {attempted} a node that is {current}; allowed from {current}: {}",
        if allowed.is_empty() { "nothing".to_owned() } else { allowed.join(", ") }
    )]
    InvalidState {
        current: String,
        attempted: String,
        allowed: Vec<String>,
    },
    /// A command asked to become `attempted` from a status that does not allow it (a finished
    /// command cannot be cancelled, started or finished again).
    #[error(
        "command {id} is {current}{}; it cannot become {attempted}",
        if *finished { " (finished)" } else { "" }
    )]
    CommandState {
        id: String,
        current: String,
        attempted: String,
        finished: bool,
    },
    /// A reservation asked to move from a state that does not allow it (a released one cannot
    /// be released again or placed).
    #[error("reservation {id} is {current}; it cannot {attempted}")]
    ReservationState {
        id: String,
        current: String,
        attempted: String,
    },
    /// The caller's `version` is stale: the node or reservation changed since it was read.
    #[error(
        "it changed since version {expected} (read it again); its current version is {current}"
    )]
    Conflict { expected: i64, current: i64 },
    #[error("{kind} `{id}` does not exist")]
    NotFound { kind: &'static str, id: String },
    #[error("{0}")]
    BadInput(String),
    /// A label key that belongs to a controller (`owner`, e.g. `inventory`): only it sets
    /// and removes labels under its prefix.
    #[error(
        "label `{key}` is owned by {owner}, which sets it from the node's reports; labels under \
         its prefix cannot be set or removed by hand (use another key)"
    )]
    ReservedLabel { key: String, owner: &'static str },
    /// A rule of the model forbids the change whoever asks (trust rules, for instance).
    #[error("{0}")]
    Forbidden(String),
}
