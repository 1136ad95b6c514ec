//! Use cases: one function per thing a caller can do. Each runs in one transaction, checks
//! who may do it, calls the domain, and writes the result with its events. Resolvers,
//! controllers, the gateway and the feed call these; nothing else in the server touches
//! storage.
//!
//! The modules are cut by subject, the same way as [`store`]'s: a question such as "where
//! are sessions stored?" is answered by `store/sessions.rs`, and "what happens when a daemon
//! says hello?" by `sessions.rs` here.
//!
//! **The boundary is enforced by the compiler**: [`store`] is a private child module and
//! [`Services`]'s store a private field, so code outside `service` cannot reach a table.

pub mod bare_metal;
pub mod catalog;
pub mod commands;
pub mod events;
pub mod history;
pub mod inventory;
pub mod join;
pub mod leases;
pub mod lifecycle;
pub mod liveness;
pub mod node_changes;
pub mod nodes;
pub mod placement;
pub mod remediation;
pub mod session_registry;
pub mod sessions;
mod store;
#[cfg(feature = "test-support")]
pub mod test_support;
pub mod workflows;

use bc_core::clock::Clock;
use std::sync::Arc;

use crate::config::DatabaseConfig;
use crate::error::ApiResult;
use crate::pki::Ca;
use session_registry::SessionRegistry;
use store::Store;

pub use store::attributed;
pub use store::capacity::CapacityRow;
pub use store::commands::CommandFilter;
pub use store::events::EventFilter;
pub use store::node_filter::{LabelSelector, NodeFilter};
pub use store::nodes::ChildSets;
pub use store::placement::{ModelCapacity, ReservationFilter};

/// What every use case needs: storage, time, the CA, and this process's sessions.
#[derive(Clone)]
pub struct Services {
    store: Store,
    pub clock: Arc<dyn Clock>,
    pub ca: Arc<Ca>,
    pub sessions: Arc<SessionRegistry>,
    /// Pools whose pending reservations wait for a retry (see [`placement`]).
    pub placement_retry: Arc<placement::PlacementRetry>,
    /// The BMC credential key and `[bare_metal]` (see [`bare_metal`]).
    pub bare_metal: Arc<bare_metal::BareMetal>,
}

impl Services {
    /// Connects to the database at `url` (`sqlite://…` or `postgres://…`) and runs pending
    /// migrations.
    pub async fn connect(
        url: &str,
        database: &DatabaseConfig,
        clock: Arc<dyn Clock>,
        ca: Arc<Ca>,
    ) -> anyhow::Result<Self> {
        let store = Store::connect(url, database).await?;
        store.migrate().await?;
        Ok(Services {
            store,
            clock,
            ca,
            sessions: Arc::default(),
            placement_retry: Arc::default(),
            bare_metal: Arc::new(bare_metal::BareMetal::ephemeral()),
        })
    }

    /// These services with the configured credential key and `[bare_metal]` settings
    /// (`app::start` sets them; without, a throwaway key that dies with the process).
    pub fn with_bare_metal(mut self, bare_metal: bare_metal::BareMetal) -> Self {
        self.bare_metal = Arc::new(bare_metal);
        self
    }

    /// Whether the database answers (`/readyz`).
    pub async fn database_ready(&self) -> bool {
        self.store.ping().await
    }

    /// Connections open and idle in the database pool, for `/metrics`.
    pub fn database_pool_stats(&self) -> (u32, usize) {
        self.store.pool_stats()
    }

    /// Brings PostgreSQL's planner statistics up to date for the tables whose size moved
    /// past autovacuum's analyse threshold ([`store::planner_statistics`]): the tables
    /// analysed.
    pub async fn refresh_planner_statistics(&self) -> ApiResult<Vec<String>> {
        Ok(store::planner_statistics::analyse_tables_due(self.store.db()).await?)
    }

    /// Closes the database pool; the last thing a stopping server does.
    pub async fn close(&self) {
        self.store.clone().close().await;
    }
}
