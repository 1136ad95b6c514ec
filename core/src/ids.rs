//! Prefixed string identifiers (`node_…`, `site_…`, …).
//!
//! Every id the API hands out carries a prefix naming its kind, so an id pasted into the wrong
//! field is refused with a clear error instead of silently matching nothing.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::error::DomainError;

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The prefix every id of this kind starts with, underscore included.
            pub const PREFIX: &'static str = $prefix;

            /// A new, random id (UUIDv7, so ids sort roughly by creation time).
            pub fn generate() -> Self {
                Self(format!("{}{}", $prefix, uuid::Uuid::now_v7().simple()))
            }

            /// Parses an id, refusing one with the wrong prefix or characters.
            pub fn parse(raw: &str) -> Result<Self, DomainError> {
                let rest = raw.strip_prefix($prefix).ok_or_else(|| {
                    DomainError::BadInput(format!(
                        "`{raw}` is not a valid {} id: it must start with `{}`",
                        stringify!($name),
                        $prefix
                    ))
                })?;
                let valid = !rest.is_empty()
                    && rest.len() <= 64
                    && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
                if !valid {
                    return Err(DomainError::BadInput(format!(
                        "`{raw}` is not a valid {} id",
                        stringify!($name)
                    )));
                }
                Ok(Self(raw.to_owned()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl TryFrom<String> for $name {
            type Error = DomainError;
            fn try_from(raw: String) -> Result<Self, Self::Error> {
                Self::parse(&raw)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

prefixed_id!(
    /// A node: assigned by JoinService or by `metal.enroll`.
    NodeId,
    "node_"
);
prefixed_id!(
    /// A site: where nodes live.
    SiteId,
    "site_"
);
prefixed_id!(
    /// A pool of nodes within a site.
    PoolId,
    "pool_"
);
prefixed_id!(
    /// A tenant: owns sites, pools and nodes.
    TenantId,
    "ten_"
);
prefixed_id!(
    /// A command sent to a node.
    CommandId,
    "cmd_"
);
prefixed_id!(
    /// A join token.
    JoinTokenId,
    "jt_"
);
prefixed_id!(
    /// A reservation: a request for GPUs that the placer books.
    ReservationId,
    "rsv_"
);
prefixed_id!(
    /// An allocation: atoms of one node booked for one reservation.
    AllocationId,
    "alloc_"
);
prefixed_id!(
    /// One try of health remediation on a node (an action and its verification).
    RemediationId,
    "rem_"
);

prefixed_id!(
    /// A bare-metal workflow (inspect, release, retire) run on one node.
    WorkflowId,
    "wf_"
);

/// An event's public id, `evt_<seq>`: the sequence number is the resume cursor, so ids of
/// events compare in the order they were committed to the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EventId(pub i64);

impl EventId {
    pub const PREFIX: &'static str = "evt_";

    pub fn parse(raw: &str) -> Result<Self, DomainError> {
        raw.strip_prefix(Self::PREFIX)
            .and_then(|n| n.parse::<i64>().ok())
            .filter(|n| *n >= 0)
            .map(EventId)
            .ok_or_else(|| DomainError::BadInput(format!("`{raw}` is not a valid event id")))
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", Self::PREFIX, self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_refuse_wrong_prefixes() {
        let id = NodeId::generate();
        assert!(id.as_str().starts_with("node_"));
        assert_eq!(NodeId::parse(id.as_str()).ok(), Some(id));
        for bad in ["", "node_", "site_abc", "node_a b", "node_ä"] {
            assert!(NodeId::parse(bad).is_err(), "{bad} should be refused");
        }
        assert_eq!(EventId::parse("evt_42").ok(), Some(EventId(42)));
        assert!(EventId::parse("evt_-1").is_err());
        assert_eq!(EventId(7).to_string(), "evt_7");
    }
}
