//! Use cases: one function per thing a caller can do. Each runs in one transaction, checks
//! who may do it, calls the domain, and writes the result with its events. Resolvers call
//! exactly one of these.

pub mod catalog;
pub mod nodes;

use bc_core::clock::Clock;
use std::sync::Arc;

use crate::store::Store;

/// What every use case needs: storage and time.
#[derive(Clone)]
pub struct Services {
    pub store: Store,
    pub clock: Arc<dyn Clock>,
}

impl Services {
    pub fn new(store: Store, clock: Arc<dyn Clock>) -> Self {
        Services { store, clock }
    }
}
