//! The sessions this process holds: one per node at most, the newest epoch wins.

use bc_core::ids::NodeId;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::mpsc;

/// What a session task is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSignal {
    /// End the session, with the reason to send the daemon.
    Close(&'static str),
    /// The node's commands changed (queued, cancelled, timed out): look again.
    CommandsChanged,
}

/// The channel to one session task.
pub type Kick = mpsc::UnboundedSender<SessionSignal>;

#[derive(Default)]
pub struct SessionRegistry {
    live: Mutex<HashMap<NodeId, (i64, Kick)>>,
}

impl SessionRegistry {
    /// Registers the session of `epoch`; of two sessions of one node held here, the newer
    /// epoch stays and the older is told to close, whichever registers last (two hellos can
    /// race between opening their epoch and registering).
    pub fn register(&self, node: &NodeId, epoch: i64, kick: Kick) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let superseded = match live.get(node) {
            Some((held, _)) if *held > epoch => Some(kick),
            _ => live.insert(node.clone(), (epoch, kick)).map(|(_, old)| old),
        };
        if let Some(older) = superseded {
            let _ = older.send(SessionSignal::Close(bc_core::protocol::close::SUPERSEDED));
        }
        metrics::gauge!("bc_gateway_sessions").set(live.len() as f64);
    }

    /// Forgets the session of `epoch` if it is still the registered one.
    pub fn unregister(&self, node: &NodeId, epoch: i64) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if live.get(node).is_some_and(|(e, _)| *e == epoch) {
            live.remove(node);
        }
        metrics::gauge!("bc_gateway_sessions").set(live.len() as f64);
    }

    /// Ends the node's session held here, if any.
    pub fn kick(&self, node: &NodeId, reason: &'static str) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, kick)) = live.get(node) {
            let _ = kick.send(SessionSignal::Close(reason));
        }
    }

    /// Tells the node's session held here, if any, that its commands changed.
    pub fn poke(&self, node: &NodeId) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, kick)) = live.get(node) {
            let _ = kick.send(SessionSignal::CommandsChanged);
        }
    }

    /// Ends the session of `epoch` if it is the one held here.
    pub fn kick_epoch(&self, node: &NodeId, epoch: i64, reason: &'static str) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((e, kick)) = live.get(node)
            && *e == epoch
        {
            let _ = kick.send(SessionSignal::Close(reason));
        }
    }

    /// Tells every session held here to look at its commands again.
    pub fn poke_all(&self) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for (_, kick) in live.values() {
            let _ = kick.send(SessionSignal::CommandsChanged);
        }
    }

    /// Ends every session (shutdown).
    pub fn kick_all(&self, reason: &'static str) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for (_, kick) in live.values() {
            let _ = kick.send(SessionSignal::Close(reason));
        }
    }

    pub fn len(&self) -> usize {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> (Kick, mpsc::UnboundedReceiver<SessionSignal>) {
        mpsc::unbounded_channel()
    }

    #[test]
    fn the_newer_epoch_stays_whichever_registers_last() {
        let node = NodeId::generate();
        let superseded = SessionSignal::Close(bc_core::protocol::close::SUPERSEDED);
        for newer_first in [false, true] {
            let registry = SessionRegistry::default();
            let (old_kick, mut old) = session();
            let (new_kick, mut new) = session();
            if newer_first {
                registry.register(&node, 2, new_kick);
                registry.register(&node, 1, old_kick);
            } else {
                registry.register(&node, 1, old_kick);
                registry.register(&node, 2, new_kick);
            }
            assert_eq!(
                old.try_recv().ok(),
                Some(superseded),
                "newer first: {newer_first}"
            );
            assert!(new.try_recv().is_err(), "newer first: {newer_first}");
            registry.poke(&node);
            assert_eq!(new.try_recv().ok(), Some(SessionSignal::CommandsChanged));
        }
    }
}
