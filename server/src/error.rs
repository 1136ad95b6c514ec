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
    /// A subscriber fell too far behind the live feed; it resumes from `cursor`.
    ResumeRequired {
        cursor: String,
    },
    /// Never shown to the caller: the source is logged and the message is generic.
    Internal(anyhow::Error),
}

impl ApiError {
    /// The stable `extensions.code`.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidState { .. } => "INVALID_STATE",
            ApiError::Conflict { .. } => "CONFLICT",
            ApiError::NotFound(_) => "NOT_FOUND",
            ApiError::Unauthenticated(_) => "UNAUTHENTICATED",
            ApiError::Forbidden(_) => "FORBIDDEN",
            ApiError::BadUserInput(_) => "BAD_USER_INPUT",
            ApiError::ResumeRequired { .. } => "RESUME_REQUIRED",
            ApiError::Internal(_) => "INTERNAL",
        }
    }

    /// The message a client sees.
    pub fn message(&self) -> String {
        match self {
            ApiError::InvalidState { message, .. } => message.clone(),
            ApiError::Conflict { expected, current } => {
                format!(
                    "the node changed since version {expected}; its current version is {current}"
                )
            }
            ApiError::NotFound(m)
            | ApiError::Unauthenticated(m)
            | ApiError::Forbidden(m)
            | ApiError::BadUserInput(m) => m.clone(),
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
    /// ARCHITECTURE.md's Invariants) and `other` for anything else.
    pub fn internal(err: impl Into<anyhow::Error>) -> Self {
        let err = err.into();
        let cause = if is_deadlock(&err) {
            "deadlock"
        } else {
            "other"
        };
        metrics::counter!("bc_internal_errors_total", "cause" => cause).increment(1);
        ApiError::Internal(err)
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
            } => ApiError::InvalidState {
                message,
                current,
                attempted,
                allowed,
            },
            DomainError::Conflict { expected, current } => ApiError::Conflict { expected, current },
            DomainError::NotFound { .. } => ApiError::NotFound(message),
            DomainError::BadInput(_) => ApiError::BadUserInput(message),
            DomainError::Forbidden(_) => ApiError::Forbidden(message),
        }
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
                ApiError::ResumeRequired { cursor } => ext.set("cursor", cursor.as_str()),
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
                ApiError::ResumeRequired {
                    cursor: "evt_1".into(),
                },
                "RESUME_REQUIRED",
            ),
            (
                ApiError::internal(anyhow::anyhow!("secret detail")),
                "INTERNAL",
            ),
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
