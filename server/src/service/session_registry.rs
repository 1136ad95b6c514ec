//! The sessions this process holds: one per node at most, the newest epoch wins.

use bc_core::ids::NodeId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// What a session task is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSignal {
    /// End the session, with the reason to send the daemon.
    Close(&'static str),
    /// The node's commands changed (queued, cancelled, timed out): look again.
    CommandsChanged,
}

/// A new session task's inbox, and the handle the registry tells it through.
pub fn session_inbox() -> (Kick, Inbox) {
    let shared = Arc::new(Shared::default());
    (Kick(shared.clone()), Inbox(shared))
}

/// What the registry holds of one session task, to tell it things. Dropping it without a
/// `Close` (the registry let go: the process is stopping) ends the session too.
pub struct Kick(Arc<Shared>);

/// One session task's signals, as its loop waits for them ([`Inbox::recv`]).
///
/// Signals coalesce: a session told that its commands changed looks at all of them, so two
/// such signals are one, and once it is told to close, the first reason is the one it
/// sends. This replaced an unbounded channel per session, whose state (two fields padded to
/// cache lines) and first block of 32 slots held about a kilobyte for every open session
/// (issue 16: 10,000 sessions per process); this holds about a hundred bytes.
pub struct Inbox(Arc<Shared>);

#[derive(Default)]
struct Shared {
    pending: Mutex<Pending>,
    /// Wakes the session's loop. `notify_one` keeps a permit when the loop is not waiting,
    /// so a signal posted between its look at `pending` and its wait is not missed.
    wake: Notify,
}

#[derive(Default)]
struct Pending {
    close: Option<&'static str>,
    commands_changed: bool,
    /// The registry dropped its [`Kick`].
    forgotten: bool,
}

/// What [`Inbox::take`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken {
    Signal(SessionSignal),
    /// The registry let go of this session without a `Close`.
    Forgotten,
    Nothing,
}

impl Kick {
    /// Posts `signal` to the session. A session that ended already has no one to read it,
    /// which is fine: the registry forgets it as it ends.
    pub fn send(&self, signal: SessionSignal) {
        self.0.post(|pending| match signal {
            SessionSignal::Close(reason) => {
                pending.close.get_or_insert(reason);
            }
            SessionSignal::CommandsChanged => pending.commands_changed = true,
        });
    }
}

impl Drop for Kick {
    fn drop(&mut self) {
        self.0.post(|pending| pending.forgotten = true);
    }
}

impl Shared {
    fn post(&self, change: impl FnOnce(&mut Pending)) {
        change(&mut self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        self.wake.notify_one();
    }
}

impl Inbox {
    /// The next signal, a close before anything else; `None` once the registry let go of the
    /// session without a close. Cancel-safe (the loop's `select!` drops it whenever another
    /// branch is ready first): it takes a signal only as it returns it.
    pub async fn recv(&self) -> Option<SessionSignal> {
        loop {
            match self.take() {
                Taken::Signal(signal) => return Some(signal),
                Taken::Forgotten => return None,
                Taken::Nothing => self.0.wake.notified().await,
            }
        }
    }

    /// The next signal if one is waiting, without waiting.
    pub fn take(&self) -> Taken {
        let mut pending = self.0.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = pending.close {
            Taken::Signal(SessionSignal::Close(reason))
        } else if std::mem::take(&mut pending.commands_changed) {
            Taken::Signal(SessionSignal::CommandsChanged)
        } else if pending.forgotten {
            Taken::Forgotten
        } else {
            Taken::Nothing
        }
    }
}

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
            older.send(SessionSignal::Close(bc_core::protocol::close::SUPERSEDED));
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
            kick.send(SessionSignal::Close(reason));
        }
    }

    /// Tells the node's session held here, if any, that its commands changed.
    pub fn poke(&self, node: &NodeId) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, kick)) = live.get(node) {
            kick.send(SessionSignal::CommandsChanged);
        }
    }

    /// Ends the session of `epoch` if it is the one held here.
    pub fn kick_epoch(&self, node: &NodeId, epoch: i64, reason: &'static str) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((e, kick)) = live.get(node)
            && *e == epoch
        {
            kick.send(SessionSignal::Close(reason));
        }
    }

    /// Tells every session held here to look at its commands again.
    pub fn poke_all(&self) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for (_, kick) in live.values() {
            kick.send(SessionSignal::CommandsChanged);
        }
    }

    /// Ends every session (shutdown).
    pub fn kick_all(&self, reason: &'static str) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for (_, kick) in live.values() {
            kick.send(SessionSignal::Close(reason));
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

    fn session() -> (Kick, Inbox) {
        session_inbox()
    }

    #[test]
    fn the_newer_epoch_stays_whichever_registers_last() {
        let node = NodeId::generate();
        let superseded = SessionSignal::Close(bc_core::protocol::close::SUPERSEDED);
        for newer_first in [false, true] {
            let registry = SessionRegistry::default();
            let (old_kick, old) = session();
            let (new_kick, new) = session();
            if newer_first {
                registry.register(&node, 2, new_kick);
                registry.register(&node, 1, old_kick);
            } else {
                registry.register(&node, 1, old_kick);
                registry.register(&node, 2, new_kick);
            }
            assert_eq!(
                old.take(),
                Taken::Signal(superseded),
                "newer first: {newer_first}"
            );
            assert_eq!(new.take(), Taken::Nothing, "newer first: {newer_first}");
            registry.poke(&node);
            assert_eq!(new.take(), Taken::Signal(SessionSignal::CommandsChanged));
        }
    }

    /// Signals coalesce: pokes are one, a close comes before a poke and stays (the first
    /// reason), and a session the registry let go of without a close is told so, after any
    /// close it was sent.
    #[test]
    fn an_inbox_gives_a_close_first_and_pokes_once() {
        let (kick, inbox) = session();
        kick.send(SessionSignal::CommandsChanged);
        kick.send(SessionSignal::CommandsChanged);
        assert_eq!(inbox.take(), Taken::Signal(SessionSignal::CommandsChanged));
        assert_eq!(inbox.take(), Taken::Nothing);
        kick.send(SessionSignal::CommandsChanged);
        kick.send(SessionSignal::Close("first"));
        kick.send(SessionSignal::Close("second"));
        assert_eq!(inbox.take(), Taken::Signal(SessionSignal::Close("first")));
        assert_eq!(inbox.take(), Taken::Signal(SessionSignal::Close("first")));
        let (kick, inbox) = session();
        drop(kick);
        assert_eq!(inbox.take(), Taken::Forgotten);
    }

    /// A signal posted while nothing waits wakes the next wait, and a wait dropped before it
    /// returned (a `select!` that took another branch) loses nothing.
    #[tokio::test]
    async fn a_signal_posted_before_the_wait_or_during_a_dropped_one_is_received() {
        let (kick, inbox) = session();
        kick.send(SessionSignal::CommandsChanged);
        assert_eq!(inbox.recv().await, Some(SessionSignal::CommandsChanged));
        {
            let waiting = inbox.recv();
            tokio::pin!(waiting);
            assert!(futures::poll!(waiting.as_mut()).is_pending());
            kick.send(SessionSignal::CommandsChanged);
        }
        let received = tokio::time::timeout(std::time::Duration::from_secs(5), inbox.recv()).await;
        assert_eq!(received, Ok(Some(SessionSignal::CommandsChanged)));
        drop(kick);
        assert_eq!(inbox.recv().await, None);
    }
}
