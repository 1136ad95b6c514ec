//! Tenants, sites and pools: created by platform admins, read by everyone within scope.

use bc_core::acceptance::AcceptancePolicy;
use bc_core::axes::{PoolAgent, PoolKind, SiteKind};
use bc_core::catalog::{HardwareProfile, Pool, Site, Tenant, validate_name};
use bc_core::event::EventType;
use bc_core::ids::{PoolId, SiteId, TenantId};
use bc_core::remediation::RemediationPolicy;
use std::collections::BTreeMap;

use super::Services;
use super::store::catalog::{AfterName, PoolScope};
use super::store::{catalog, events};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};

pub struct NewPool {
    pub site_id: SiteId,
    pub name: String,
    pub kind: PoolKind,
    pub agent: PoolAgent,
    pub owner_tenant_id: Option<TenantId>,
    pub hardware_profile: HardwareProfile,
    pub drivers: BTreeMap<String, String>,
    /// `None`: the defaults ([`RemediationPolicy::default`]).
    pub remediation: Option<RemediationPolicy>,
    /// `None`: the defaults ([`AcceptancePolicy::default`]).
    pub acceptance: Option<AcceptancePolicy>,
}

/// What `updatePool` changes; `None` leaves a setting as it is, and for an expectation
/// `Some(None)` removes it.
#[derive(Debug, Default)]
pub struct PoolUpdate {
    pub remediation: Option<RemediationPolicy>,
    pub acceptance: Option<AcceptancePolicy>,
    pub gpu_count: Option<Option<u32>>,
    pub gpu_model: Option<Option<String>>,
    pub driver_version: Option<Option<String>>,
}

impl Services {
    pub async fn create_tenant(&self, principal: &Principal, name: &str) -> ApiResult<Tenant> {
        principal.require_platform_admin()?;
        validate_name("tenant", name)?;
        let txn = self.store.write().await?;
        if catalog::tenant_by_name(&*txn, name).await?.is_some() {
            return Err(ApiError::BadUserInput(format!(
                "a tenant named `{name}` already exists"
            )));
        }
        let now = self.clock.now();
        let tenant = Tenant {
            id: TenantId::generate(),
            name: name.to_owned(),
            created_at: now,
        };
        catalog::insert_tenant(&*txn, &tenant).await?;
        let data = serde_json::json!({ "tenantId": tenant.id, "name": name });
        events::append_other(
            &txn,
            EventType::TenantCreated,
            Some(tenant.id.as_str()),
            &principal.actor(),
            data,
            now,
        );
        txn.commit().await?;
        Ok(tenant)
    }

    pub async fn create_site(
        &self,
        principal: &Principal,
        name: &str,
        kind: SiteKind,
        owner: Option<&TenantId>,
    ) -> ApiResult<Site> {
        principal.require_platform_admin()?;
        validate_name("site", name)?;
        match (kind, owner) {
            (SiteKind::Custom, None) => {
                return Err(ApiError::BadUserInput(
                    "a custom site needs an owner tenant".into(),
                ));
            }
            (SiteKind::Platform, Some(_)) => {
                return Err(ApiError::BadUserInput(
                    "a platform site has no owner tenant".into(),
                ));
            }
            _ => {}
        }
        let txn = self.store.write().await?;
        if let Some(owner) = owner
            && catalog::tenant(&*txn, owner).await?.is_none()
        {
            return Err(ApiError::NotFound(format!(
                "tenant `{owner}` does not exist"
            )));
        }
        if catalog::site_by_name(&*txn, name).await?.is_some() {
            return Err(ApiError::BadUserInput(format!(
                "a site named `{name}` already exists"
            )));
        }
        let now = self.clock.now();
        let site = Site {
            id: SiteId::generate(),
            name: name.to_owned(),
            kind,
            owner_tenant_id: owner.cloned(),
            created_at: now,
        };
        catalog::insert_site(&*txn, &site).await?;
        let data = serde_json::json!({ "siteId": site.id, "name": name, "kind": kind });
        events::append_other(
            &txn,
            EventType::SiteCreated,
            owner.map(TenantId::as_str),
            &principal.actor(),
            data,
            now,
        );
        txn.commit().await?;
        Ok(site)
    }

    pub async fn create_pool(&self, principal: &Principal, new: NewPool) -> ApiResult<Pool> {
        principal.require_platform_admin()?;
        validate_name("pool", &new.name)?;
        let remediation = new.remediation.unwrap_or_default();
        remediation.validate()?;
        let acceptance = new.acceptance.unwrap_or_default();
        acceptance.validate()?;
        new.hardware_profile.validate()?;
        let txn = self.store.write().await?;
        let site = catalog::site(&*txn, &new.site_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("site `{}` does not exist", new.site_id)))?;
        if let Some(owner) = &new.owner_tenant_id {
            if catalog::tenant(&*txn, owner).await?.is_none() {
                return Err(ApiError::NotFound(format!(
                    "tenant `{owner}` does not exist"
                )));
            }
            if site
                .owner_tenant_id
                .as_ref()
                .is_some_and(|site_owner| site_owner != owner)
            {
                return Err(ApiError::BadUserInput(
                    "a pool on a tenant's site must belong to that tenant".into(),
                ));
            }
        }
        if catalog::pool_by_name(&*txn, &site.id, &new.name)
            .await?
            .is_some()
        {
            return Err(ApiError::BadUserInput(format!(
                "site `{}` already has a pool named `{}`",
                site.id, new.name
            )));
        }
        let now = self.clock.now();
        let pool = Pool {
            id: PoolId::generate(),
            site_id: site.id,
            name: new.name,
            kind: new.kind,
            agent: new.agent,
            owner_tenant_id: new.owner_tenant_id.or(site.owner_tenant_id),
            hardware_profile: new.hardware_profile,
            drivers: new.drivers,
            remediation,
            acceptance,
            created_at: now,
        };
        catalog::insert_pool(&*txn, &pool).await?;
        let data = serde_json::json!({ "poolId": pool.id, "siteId": pool.site_id, "name": pool.name, "kind": pool.kind });
        events::append_other(
            &txn,
            EventType::PoolCreated,
            pool.owner_tenant_id.as_ref().map(TenantId::as_str),
            &principal.actor(),
            data,
            now,
        );
        txn.commit().await?;
        Ok(pool)
    }

    /// `updatePool` (platform admins only): replaces what the update names and leaves the
    /// rest. A remediation run under way keeps the ladder it started with; a node in
    /// acceptance is judged by the new checks at the next Lifecycle pass (which its
    /// `pool.updated` event wakes). When the hardware profile
    /// changes, the Inventory controller re-reads every node of the pool against it, so its
    /// mismatch conditions (and `noScheduleReasons`) follow at once, one node per
    /// transaction after the pool's own.
    pub async fn update_pool(
        &self,
        principal: &Principal,
        id: &PoolId,
        update: PoolUpdate,
    ) -> ApiResult<Pool> {
        principal.require_platform_admin()?;
        let txn = self.store.write().await?;
        let mut pool = catalog::pool(&*txn, id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("pool `{id}` does not exist")))?;
        let mut data = serde_json::Map::new();
        if let Some(policy) = update.remediation
            && policy != pool.remediation
        {
            policy.validate()?;
            catalog::set_pool_remediation(&*txn, id, &policy).await?;
            pool.remediation = policy;
            data.insert("remediation".into(), serde_json::json!(pool.remediation));
        }
        let mut profile = pool.hardware_profile.clone();
        if let Some(count) = update.gpu_count {
            profile.gpu_count = count;
        }
        if let Some(model) = update.gpu_model {
            profile.gpu_model = model;
        }
        if let Some(driver) = update.driver_version {
            profile.driver_version = driver;
        }
        profile.validate()?;
        let acceptance = update.acceptance.unwrap_or_else(|| pool.acceptance.clone());
        acceptance.validate()?;
        let profile_changed = profile != pool.hardware_profile;
        if profile_changed || acceptance != pool.acceptance {
            catalog::set_pool_expectations(&*txn, id, &profile, &acceptance).await?;
            if profile_changed {
                data.insert("hardwareProfile".into(), serde_json::json!(profile));
            }
            if acceptance != pool.acceptance {
                data.insert("acceptance".into(), serde_json::json!(acceptance));
            }
            pool.hardware_profile = profile;
            pool.acceptance = acceptance;
        }
        if !data.is_empty() {
            data.insert("poolId".into(), serde_json::json!(pool.id));
            events::append_other(
                &txn,
                EventType::PoolUpdated,
                pool.owner_tenant_id.as_ref().map(TenantId::as_str),
                &principal.actor(),
                serde_json::Value::Object(data),
                self.clock.now(),
            );
        }
        txn.commit().await?;
        if profile_changed {
            self.reevaluate_pool_inventory(&pool.id).await?;
        }
        Ok(pool)
    }

    /// `tenants(first, after)`: by name; a tenant's principal sees only its own.
    pub async fn tenants(
        &self,
        principal: &Principal,
        after: Option<&TenantId>,
        first: u64,
    ) -> ApiResult<Page<Tenant>> {
        let db = self.store.db();
        let after = match after {
            Some(id) => Some(
                catalog::tenant(db, id)
                    .await?
                    .filter(|t| principal.can_see(Some(&t.id)))
                    .map(|t| AfterName {
                        name: t.name,
                        id: t.id.to_string(),
                    })
                    .ok_or_else(|| unknown_cursor(id))?,
            ),
            None => None,
        };
        let list =
            catalog::tenants(db, principal.tenant.as_ref(), after.as_ref(), first + 1).await?;
        Ok(Page::of(list, first))
    }

    pub async fn count_tenants(&self, principal: &Principal) -> ApiResult<u64> {
        Ok(catalog::count_tenants(self.store.db(), principal.tenant.as_ref()).await?)
    }

    /// `sites(first, after)`: by name; a tenant's principal sees only its own sites.
    pub async fn sites(
        &self,
        principal: &Principal,
        after: Option<&SiteId>,
        first: u64,
    ) -> ApiResult<Page<Site>> {
        let db = self.store.db();
        let after = match after {
            Some(id) => Some(
                catalog::site(db, id)
                    .await?
                    .filter(|s| principal.can_see(s.owner_tenant_id.as_ref()))
                    .map(|s| AfterName {
                        name: s.name,
                        id: s.id.to_string(),
                    })
                    .ok_or_else(|| unknown_cursor(id))?,
            ),
            None => None,
        };
        let list = catalog::sites(db, principal.tenant.as_ref(), after.as_ref(), first + 1).await?;
        Ok(Page::of(list, first))
    }

    pub async fn count_sites(&self, principal: &Principal) -> ApiResult<u64> {
        Ok(catalog::count_sites(self.store.db(), principal.tenant.as_ref()).await?)
    }

    /// `pools(first, after)` within `filter`: by name; a tenant's principal sees only its own
    /// pools.
    pub async fn pools(
        &self,
        principal: &Principal,
        filter: &PoolFilter,
        after: Option<&PoolId>,
        first: u64,
    ) -> ApiResult<Page<Pool>> {
        let db = self.store.db();
        let after = match after {
            Some(id) => Some(
                catalog::pool(db, id)
                    .await?
                    .filter(|p| principal.can_see(p.owner_tenant_id.as_ref()))
                    .map(|p| AfterName {
                        name: p.name,
                        id: p.id.to_string(),
                    })
                    .ok_or_else(|| unknown_cursor(id))?,
            ),
            None => None,
        };
        let scope = pool_scope(principal, filter);
        let list = catalog::pools(db, &scope, after.as_ref(), first + 1).await?;
        Ok(Page::of(list, first))
    }

    pub async fn count_pools(&self, principal: &Principal, filter: &PoolFilter) -> ApiResult<u64> {
        Ok(catalog::count_pools(self.store.db(), &pool_scope(principal, filter)).await?)
    }

    /// The site named `name`, if the principal may see it.
    pub async fn site_named(&self, principal: &Principal, name: &str) -> ApiResult<Option<Site>> {
        Ok(catalog::site_by_name(self.store.db(), name)
            .await?
            .filter(|s| principal.can_see(s.owner_tenant_id.as_ref())))
    }

    /// The pool of `site` named `name`, if the principal may see it.
    pub async fn pool_named(
        &self,
        principal: &Principal,
        site: &SiteId,
        name: &str,
    ) -> ApiResult<Option<Pool>> {
        Ok(catalog::pool_by_name(self.store.db(), site, name)
            .await?
            .filter(|p| principal.can_see(p.owner_tenant_id.as_ref())))
    }
}

/// One page of a list, as the API's connections page it: the items, and whether more follow.
pub struct Page<T> {
    pub items: Vec<T>,
    pub has_next_page: bool,
}

impl<T> Page<T> {
    /// The page from a read of `first + 1` rows: the extra row only says that more follow.
    pub(super) fn of(mut items: Vec<T>, first: u64) -> Page<T> {
        let has_next_page = items.len() as u64 > first;
        items.truncate(usize::try_from(first).unwrap_or(usize::MAX));
        Page {
            items,
            has_next_page,
        }
    }

    pub fn map<U>(self, f: impl FnMut(T) -> U) -> Page<U> {
        Page {
            items: self.items.into_iter().map(f).collect(),
            has_next_page: self.has_next_page,
        }
    }
}

/// Which pools a list holds, besides what the principal may see.
#[derive(Debug, Clone, Default)]
pub struct PoolFilter {
    /// Only the pools of this site.
    pub site_id: Option<SiteId>,
    /// Only these pools (empty: every pool).
    pub ids: Vec<PoolId>,
}

fn pool_scope(principal: &Principal, filter: &PoolFilter) -> PoolScope {
    PoolScope {
        owner: principal.tenant.clone(),
        site_id: filter.site_id.clone(),
        ids: filter.ids.clone(),
    }
}

/// An `after` cursor that names nothing the list holds.
pub(super) fn unknown_cursor(id: &impl std::fmt::Display) -> ApiError {
    ApiError::BadUserInput(format!(
        "`after`: `{id}` is not an item of this list; pass the `endCursor` of the previous page"
    ))
}
