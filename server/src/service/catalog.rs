//! Tenants, sites and pools: created by platform admins, read by everyone within scope.

use bc_core::axes::{PoolAgent, PoolKind, SiteKind};
use bc_core::catalog::{HardwareProfile, Pool, Site, Tenant, validate_name};
use bc_core::event::EventType;
use bc_core::ids::{PoolId, SiteId, TenantId};
use std::collections::BTreeMap;

use super::Services;
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

    pub async fn tenants(&self, principal: &Principal) -> ApiResult<Vec<Tenant>> {
        let all = catalog::tenants(self.store.db()).await?;
        Ok(all
            .into_iter()
            .filter(|t| principal.can_see(Some(&t.id)))
            .collect())
    }

    pub async fn sites(&self, principal: &Principal) -> ApiResult<Vec<Site>> {
        Ok(catalog::sites(self.store.db(), principal.tenant.as_ref()).await?)
    }

    pub async fn pools(
        &self,
        principal: &Principal,
        site_id: Option<&SiteId>,
    ) -> ApiResult<Vec<Pool>> {
        Ok(catalog::pools(self.store.db(), principal.tenant.as_ref(), site_id).await?)
    }
}
