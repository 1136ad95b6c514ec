//! One server runs the controllers: replicas on one database elect a leader through a lease
//! (`controller_leases`), so each pass runs once per tick across the deployment, not once per
//! replica. Running a pass twice would be safe (every change is version-checked) but would do
//! every query N times and turn most writes into conflicts.
//!
//! A server asks for the lease when its loop starts. The leader renews it at the start of
//! every tick, and before each Lifecycle pass an event wakes between ticks; the others try
//! to take it at the start of their ticks and succeed once it has lapsed. A lease lasts [`LEASE_TICKS`] ticks, so a
//! leader whose pass overran one tick keeps it, and a dead leader is replaced within
//! `LEASE_TICKS + 1` ticks (15 s with the default 5 s tick). A server that stops gives its
//! lease up, so a rolling restart hands over at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::service::Services;

/// The controllers' lease.
pub const CONTROLLERS_LEASE: &str = "controllers";
/// How many ticks a lease lasts without renewal.
pub const LEASE_TICKS: u32 = 2;

/// This server's part in the election.
pub struct Leadership {
    services: Services,
    /// This server's identity in the lease table: unique per process start.
    holder: String,
    ttl: chrono::Duration,
    /// Whether this server led after its last check; shared with what follows the main
    /// loop's verdict between ticks (the Power controller's loop, the Lifecycle wakes).
    leading: Arc<AtomicBool>,
}

impl Leadership {
    /// A candidate that ticks every `tick`.
    pub fn new(services: Services, tick: Duration) -> Leadership {
        let ttl = chrono::Duration::from_std(tick * LEASE_TICKS)
            .unwrap_or_else(|_| chrono::Duration::seconds(10));
        Leadership {
            services,
            holder: format!("ctl-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            ttl,
            leading: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Whether this server led at its last [`Leadership::check`], for other loops.
    pub fn leading(&self) -> Arc<AtomicBool> {
        self.leading.clone()
    }

    /// Takes or renews the lease: whether this server leads for the coming tick. A database
    /// that does not answer means not leading (another server may well be).
    pub async fn check(&self) -> bool {
        let now_leading = match self
            .services
            .hold_lease(CONTROLLERS_LEASE, &self.holder, self.ttl)
            .await
        {
            Ok(held) => held,
            Err(err) => {
                tracing::warn!(code = err.code(), reason = %err.message(), "could not renew the controllers' lease");
                false
            }
        };
        let was_leading = self.leading.swap(now_leading, Ordering::Relaxed);
        if now_leading != was_leading {
            if now_leading {
                tracing::info!(holder = %self.holder, "this server now runs the controllers");
            } else {
                tracing::info!(holder = %self.holder, "another server runs the controllers now");
            }
        }
        metrics::gauge!("bc_controller_leader").set(if now_leading { 1.0 } else { 0.0 });
        now_leading
    }

    /// Gives the lease up (the server is stopping).
    pub async fn resign(&self) {
        self.leading.store(false, Ordering::Relaxed);
        metrics::gauge!("bc_controller_leader").set(0.0);
        if let Err(err) = self
            .services
            .release_lease(CONTROLLERS_LEASE, &self.holder)
            .await
        {
            tracing::warn!(code = err.code(), reason = %err.message(), "could not give up the controllers' lease");
        }
    }
}
