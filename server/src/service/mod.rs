//! Use cases: one function per thing a caller can do. Each runs in one transaction, checks
//! who may do it, calls the domain, and writes the result with its events. Resolvers call
//! exactly one of these.

pub mod catalog;
pub mod commands;
pub mod join;
pub mod nodes;
pub mod sessions;

use bc_core::clock::Clock;
use std::sync::Arc;

use crate::pki::Ca;
use crate::store::Store;
use sessions::SessionRegistry;

/// What every use case needs: storage, time, the CA, and this process's sessions.
#[derive(Clone)]
pub struct Services {
    pub store: Store,
    pub clock: Arc<dyn Clock>,
    pub ca: Arc<Ca>,
    pub sessions: Arc<SessionRegistry>,
}

impl Services {
    pub fn new(store: Store, clock: Arc<dyn Clock>, ca: Arc<Ca>) -> Self {
        Services {
            store,
            clock,
            ca,
            sessions: Arc::default(),
        }
    }
}
