//! Tenants, sites and pools.

use bc_core::catalog::{Pool, Site, Tenant};
use bc_core::ids::{PoolId, SiteId, TenantId};
use bc_entity::{pool, site, tenant};
use sea_orm::ActiveValue::Set;
use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, EntityTrait, PaginatorTrait, QueryFilter, QueryOrder,
    QuerySelect, Select,
};

use super::rows;

pub async fn insert_tenant(conn: &impl ConnectionTrait, t: &Tenant) -> anyhow::Result<()> {
    let row = tenant::ActiveModel {
        id: Set(t.id.to_string()),
        name: Set(t.name.clone()),
        created_at: Set(t.created_at),
    };
    tenant::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

pub async fn insert_site(conn: &impl ConnectionTrait, s: &Site) -> anyhow::Result<()> {
    let row = site::ActiveModel {
        id: Set(s.id.to_string()),
        name: Set(s.name.clone()),
        kind: Set(s.kind.to_string()),
        owner_tenant_id: Set(s.owner_tenant_id.as_ref().map(ToString::to_string)),
        created_at: Set(s.created_at),
    };
    site::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

pub async fn insert_pool(conn: &impl ConnectionTrait, p: &Pool) -> anyhow::Result<()> {
    let row = pool::ActiveModel {
        id: Set(p.id.to_string()),
        site_id: Set(p.site_id.to_string()),
        name: Set(p.name.clone()),
        kind: Set(p.kind.to_string()),
        agent: Set(p.agent.to_string()),
        owner_tenant_id: Set(p.owner_tenant_id.as_ref().map(ToString::to_string)),
        hardware_profile: Set(serde_json::to_value(&p.hardware_profile)?),
        drivers: Set(serde_json::to_value(&p.drivers)?),
        remediation: Set(Some(serde_json::to_value(&p.remediation)?)),
        acceptance: Set(Some(serde_json::to_value(&p.acceptance)?)),
        created_at: Set(p.created_at),
    };
    pool::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// Replaces a pool's hardware profile and acceptance policy. Returns whether the pool exists.
pub async fn set_pool_expectations(
    conn: &impl ConnectionTrait,
    id: &PoolId,
    profile: &bc_core::catalog::HardwareProfile,
    acceptance: &bc_core::acceptance::AcceptancePolicy,
) -> anyhow::Result<bool> {
    let row = pool::ActiveModel {
        hardware_profile: Set(serde_json::to_value(profile)?),
        acceptance: Set(Some(serde_json::to_value(acceptance)?)),
        ..Default::default()
    };
    let result = pool::Entity::update_many()
        .set(row)
        .filter(pool::Column::Id.eq(id.to_string()))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// Replaces a pool's remediation policy. Returns whether the pool exists.
pub async fn set_pool_remediation(
    conn: &impl ConnectionTrait,
    id: &PoolId,
    policy: &bc_core::remediation::RemediationPolicy,
) -> anyhow::Result<bool> {
    let row = pool::ActiveModel {
        remediation: Set(Some(serde_json::to_value(policy)?)),
        ..Default::default()
    };
    let result = pool::Entity::update_many()
        .set(row)
        .filter(pool::Column::Id.eq(id.to_string()))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

pub async fn tenant(conn: &impl ConnectionTrait, id: &TenantId) -> anyhow::Result<Option<Tenant>> {
    tenant::Entity::find_by_id(id.to_string())
        .one(conn)
        .await?
        .map(rows::tenant)
        .transpose()
}

pub async fn tenant_by_name(
    conn: &impl ConnectionTrait,
    name: &str,
) -> anyhow::Result<Option<Tenant>> {
    tenant::Entity::find()
        .filter(tenant::Column::Name.eq(name))
        .one(conn)
        .await?
        .map(rows::tenant)
        .transpose()
}

pub async fn site(conn: &impl ConnectionTrait, id: &SiteId) -> anyhow::Result<Option<Site>> {
    site::Entity::find_by_id(id.to_string())
        .one(conn)
        .await?
        .map(rows::site)
        .transpose()
}

pub async fn site_by_name(conn: &impl ConnectionTrait, name: &str) -> anyhow::Result<Option<Site>> {
    site::Entity::find()
        .filter(site::Column::Name.eq(name))
        .one(conn)
        .await?
        .map(rows::site)
        .transpose()
}

pub async fn pool(conn: &impl ConnectionTrait, id: &PoolId) -> anyhow::Result<Option<Pool>> {
    pool::Entity::find_by_id(id.to_string())
        .one(conn)
        .await?
        .map(rows::pool)
        .transpose()
}

pub async fn pool_by_name(
    conn: &impl ConnectionTrait,
    site_id: &SiteId,
    name: &str,
) -> anyhow::Result<Option<Pool>> {
    pool::Entity::find()
        .filter(pool::Column::SiteId.eq(site_id.to_string()))
        .filter(pool::Column::Name.eq(name))
        .one(conn)
        .await?
        .map(rows::pool)
        .transpose()
}

/// Where a page of a list ordered by name starts: after the row with this name and id (the
/// id orders rows of the same name, as pools of different sites may share one).
#[derive(Debug, Clone)]
pub struct AfterName {
    pub name: String,
    pub id: String,
}

/// Rows after `after` in `(name, id)` order.
fn after_name<C: ColumnTrait>(name: C, id: C, after: &AfterName) -> Condition {
    Condition::any().add(name.gt(after.name.as_str())).add(
        Condition::all()
            .add(name.eq(after.name.as_str()))
            .add(id.gt(after.id.as_str())),
    )
}

/// Tenants `visible_to` sees: itself only, or (`None`) every tenant.
fn tenants_of(visible_to: Option<&TenantId>) -> Select<tenant::Entity> {
    let select = tenant::Entity::find();
    match visible_to {
        Some(own) => select.filter(tenant::Column::Id.eq(own.to_string())),
        None => select,
    }
}

/// At most `limit` tenants `visible_to` sees, by name, after `after`.
pub async fn tenants(
    conn: &impl ConnectionTrait,
    visible_to: Option<&TenantId>,
    after: Option<&AfterName>,
    limit: u64,
) -> anyhow::Result<Vec<Tenant>> {
    let mut select = tenants_of(visible_to);
    if let Some(after) = after {
        select = select.filter(after_name(tenant::Column::Name, tenant::Column::Id, after));
    }
    select
        .order_by_asc(tenant::Column::Name)
        .order_by_asc(tenant::Column::Id)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(rows::tenant)
        .collect()
}

pub async fn count_tenants(
    conn: &impl ConnectionTrait,
    visible_to: Option<&TenantId>,
) -> anyhow::Result<u64> {
    Ok(tenants_of(visible_to).count(conn).await?)
}

/// Sites visible to `owner` (`None`: all of them).
fn sites_of(owner: Option<&TenantId>) -> Select<site::Entity> {
    let select = site::Entity::find();
    match owner {
        Some(owner) => select.filter(site::Column::OwnerTenantId.eq(owner.to_string())),
        None => select,
    }
}

/// At most `limit` sites visible to `owner`, by name, after `after`.
pub async fn sites(
    conn: &impl ConnectionTrait,
    owner: Option<&TenantId>,
    after: Option<&AfterName>,
    limit: u64,
) -> anyhow::Result<Vec<Site>> {
    let mut select = sites_of(owner);
    if let Some(after) = after {
        select = select.filter(after_name(site::Column::Name, site::Column::Id, after));
    }
    select
        .order_by_asc(site::Column::Name)
        .order_by_asc(site::Column::Id)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(rows::site)
        .collect()
}

pub async fn count_sites(
    conn: &impl ConnectionTrait,
    owner: Option<&TenantId>,
) -> anyhow::Result<u64> {
    Ok(sites_of(owner).count(conn).await?)
}

/// Which pools a list holds: those visible to `owner` (`None`: all), of one site, or named.
#[derive(Debug, Clone, Default)]
pub struct PoolScope {
    pub owner: Option<TenantId>,
    pub site_id: Option<SiteId>,
    /// Only these pools (empty: no such restriction).
    pub ids: Vec<PoolId>,
}

fn pools_of(scope: &PoolScope) -> Select<pool::Entity> {
    let mut select = pool::Entity::find();
    if let Some(owner) = &scope.owner {
        select = select.filter(pool::Column::OwnerTenantId.eq(owner.to_string()));
    }
    if let Some(site_id) = &scope.site_id {
        select = select.filter(pool::Column::SiteId.eq(site_id.to_string()));
    }
    if !scope.ids.is_empty() {
        select = select.filter(pool::Column::Id.is_in(scope.ids.iter().map(ToString::to_string)));
    }
    select
}

/// At most `limit` pools in `scope`, by name, after `after`.
pub async fn pools(
    conn: &impl ConnectionTrait,
    scope: &PoolScope,
    after: Option<&AfterName>,
    limit: u64,
) -> anyhow::Result<Vec<Pool>> {
    let mut select = pools_of(scope);
    if let Some(after) = after {
        select = select.filter(after_name(pool::Column::Name, pool::Column::Id, after));
    }
    select
        .order_by_asc(pool::Column::Name)
        .order_by_asc(pool::Column::Id)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(rows::pool)
        .collect()
}

pub async fn count_pools(conn: &impl ConnectionTrait, scope: &PoolScope) -> anyhow::Result<u64> {
    Ok(pools_of(scope).count(conn).await?)
}

/// The owners of several pools, for the schedulability explanation.
pub async fn pool_owners(
    conn: &impl ConnectionTrait,
    ids: &[String],
) -> anyhow::Result<std::collections::HashMap<String, Option<TenantId>>> {
    if ids.is_empty() {
        return Ok(Default::default());
    }
    pool::Entity::find()
        .filter(pool::Column::Id.is_in(ids.to_vec()))
        .all(conn)
        .await?
        .into_iter()
        .map(|row| {
            let p = rows::pool(row)?;
            Ok((p.id.to_string(), p.owner_tenant_id))
        })
        .collect()
}
