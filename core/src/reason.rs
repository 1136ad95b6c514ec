//! `noScheduleReasons`: every reason a node must not receive new work, with who set it.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::fmt;

use crate::actor::Actor;

/// The key of one reason, in the seed's spelling: `taint:<key>`, `draining`, `unreachable`,
/// or the type of a NoSchedule condition such as `GpuCountMismatch`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum ReasonKey {
    /// An operator taint with the NoSchedule effect.
    Taint(String),
    /// `nodes.drain`: no new work while the node's allocations are released.
    Draining,
    /// The Liveness controller stopped hearing heartbeats.
    Unreachable,
    /// A condition with the NoSchedule effect is `true`.
    Condition(String),
}

impl ReasonKey {
    pub const TAINT_PREFIX: &'static str = "taint:";

    pub fn parse(raw: &str) -> Option<ReasonKey> {
        if let Some(key) = raw.strip_prefix(Self::TAINT_PREFIX) {
            return (!key.is_empty()).then(|| ReasonKey::Taint(key.to_owned()));
        }
        match raw {
            "draining" => Some(ReasonKey::Draining),
            "unreachable" => Some(ReasonKey::Unreachable),
            _ if is_condition_type(raw) => Some(ReasonKey::Condition(raw.to_owned())),
            _ => None,
        }
    }

    /// What an operator does, or waits for, to clear this reason: its
    /// [`crate::clear::ClearRule`] in a sentence.
    pub fn cleared_by(&self) -> String {
        crate::clear::ClearRule::for_reason(self).describe()
    }
}

/// Condition types are PascalCase identifiers (`GpuCountMismatch`, `XidCritical`).
pub fn is_condition_type(raw: &str) -> bool {
    raw.len() <= 63
        && raw.chars().next().is_some_and(|c| c.is_ascii_uppercase())
        && raw.chars().all(|c| c.is_ascii_alphanumeric())
}

impl fmt::Display for ReasonKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReasonKey::Taint(key) => write!(f, "{}{key}", Self::TAINT_PREFIX),
            ReasonKey::Draining => f.write_str("draining"),
            ReasonKey::Unreachable => f.write_str("unreachable"),
            ReasonKey::Condition(kind) => f.write_str(kind),
        }
    }
}

impl From<ReasonKey> for String {
    fn from(key: ReasonKey) -> String {
        key.to_string()
    }
}

impl TryFrom<String> for ReasonKey {
    type Error = String;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        ReasonKey::parse(&raw).ok_or_else(|| format!("`{raw}` is not a noScheduleReason"))
    }
}

/// One entry of `noScheduleReasons`, with its provenance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NoScheduleReason {
    pub key: ReasonKey,
    pub set_by: Actor,
    pub since: DateTime<Utc>,
    pub detail: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_keys_round_trip() {
        for key in [
            ReasonKey::Taint("gpu-burn".into()),
            ReasonKey::Draining,
            ReasonKey::Unreachable,
            ReasonKey::Condition("GpuCountMismatch".into()),
        ] {
            assert_eq!(ReasonKey::parse(&key.to_string()), Some(key));
        }
        assert_eq!(ReasonKey::parse("taint:"), None);
        assert_eq!(ReasonKey::parse("lowercase"), None);
    }
}
