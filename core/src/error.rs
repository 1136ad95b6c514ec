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
    /// The caller's `version` is stale: the node changed since it was read.
    #[error("the node changed since version {expected}; its current version is {current}")]
    Conflict { expected: i64, current: i64 },
    #[error("{kind} `{id}` does not exist")]
    NotFound { kind: &'static str, id: String },
    #[error("{0}")]
    BadInput(String),
    /// A rule of the model forbids the change whoever asks (trust rules, for instance).
    #[error("{0}")]
    Forbidden(String),
}
