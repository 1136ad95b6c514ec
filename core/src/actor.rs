//! Who made a change: a person or agent through the API, a controller, or a node's daemon.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The author of a change, recorded on every event and on every `noScheduleReasons` entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Actor {
    /// A person or agent, by the `sub` of their token.
    User(String),
    /// A control-plane controller such as `liveness` or `node-lifecycle`.
    Controller(String),
    /// A node's daemon, by node id.
    Node(String),
    /// The control plane itself (join, migrations).
    System,
}

impl fmt::Display for Actor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Actor::User(sub) => write!(f, "user:{sub}"),
            Actor::Controller(name) => write!(f, "controller:{name}"),
            Actor::Node(id) => write!(f, "node:{id}"),
            Actor::System => f.write_str("system"),
        }
    }
}

impl From<Actor> for String {
    fn from(actor: Actor) -> String {
        actor.to_string()
    }
}

impl TryFrom<String> for Actor {
    type Error = String;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        Actor::parse(&raw).ok_or_else(|| format!("`{raw}` is not an actor"))
    }
}

impl Actor {
    /// Parses the stored form written by `Display`.
    pub fn parse(raw: &str) -> Option<Actor> {
        if raw == "system" {
            return Some(Actor::System);
        }
        let (kind, name) = raw.split_once(':')?;
        let name = name.to_owned();
        match kind {
            "user" => Some(Actor::User(name)),
            "controller" => Some(Actor::Controller(name)),
            "node" => Some(Actor::Node(name)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actors_round_trip() {
        for actor in [
            Actor::User("alice@example.com".into()),
            Actor::Controller("liveness".into()),
            Actor::Node("node_1".into()),
            Actor::System,
        ] {
            assert_eq!(Actor::parse(&actor.to_string()), Some(actor));
        }
        assert_eq!(Actor::parse("robot:x"), None);
    }
}
