//! Leases between the servers on one database (see `store/leases.rs`): which of them runs
//! the controllers. The controller loop decides when to take, renew and give up its lease;
//! this only reads and writes.

use chrono::{DateTime, Utc};

use super::Services;
use super::store::leases;
use crate::error::ApiResult;

/// Who holds a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    /// When this holder took it.
    pub since: DateTime<Utc>,
    /// When it lapses unless renewed.
    pub expires_at: DateTime<Utc>,
}

impl Services {
    /// Takes lease `name` for `holder` for `ttl` from now, or renews it: whether `holder`
    /// holds it now.
    pub async fn hold_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: chrono::Duration,
    ) -> ApiResult<bool> {
        let now = self.clock.now();
        let txn = self.store.write().await?;
        let held = leases::hold(&*txn, name, holder, now, now + ttl).await?;
        txn.commit().await?;
        Ok(held)
    }

    /// Gives lease `name` up, if `holder` has it.
    pub async fn release_lease(&self, name: &str, holder: &str) -> ApiResult<()> {
        let txn = self.store.write().await?;
        leases::release(&*txn, name, holder).await?;
        txn.commit().await?;
        Ok(())
    }

    /// Who holds lease `name`, if anyone took it (it may have expired).
    pub async fn lease(&self, name: &str) -> ApiResult<Option<Lease>> {
        Ok(leases::holder(self.store.db(), name)
            .await?
            .map(|row| Lease {
                name: row.name,
                holder: row.holder,
                since: row.since,
                expires_at: row.expires_at,
            }))
    }
}
