//! Tenants, sites and pools.

use bc_core::catalog::{Pool, Site, Tenant};
use bc_core::ids::{PoolId, SiteId, TenantId};
use bc_entity::{pool, site, tenant};
use sea_orm::ActiveValue::Set;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder};

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
        created_at: Set(p.created_at),
    };
    pool::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(())
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

pub async fn tenants(conn: &impl ConnectionTrait) -> anyhow::Result<Vec<Tenant>> {
    tenant::Entity::find()
        .order_by_asc(tenant::Column::Name)
        .all(conn)
        .await?
        .into_iter()
        .map(rows::tenant)
        .collect()
}

/// Sites visible to `owner` (`None`: all of them).
pub async fn sites(
    conn: &impl ConnectionTrait,
    owner: Option<&TenantId>,
) -> anyhow::Result<Vec<Site>> {
    let mut select = site::Entity::find().order_by_asc(site::Column::Name);
    if let Some(owner) = owner {
        select = select.filter(site::Column::OwnerTenantId.eq(owner.to_string()));
    }
    select
        .all(conn)
        .await?
        .into_iter()
        .map(rows::site)
        .collect()
}

/// Pools visible to `owner` (`None`: all of them), optionally of one site.
pub async fn pools(
    conn: &impl ConnectionTrait,
    owner: Option<&TenantId>,
    site_id: Option<&SiteId>,
) -> anyhow::Result<Vec<Pool>> {
    let mut select = pool::Entity::find().order_by_asc(pool::Column::Name);
    if let Some(owner) = owner {
        select = select.filter(pool::Column::OwnerTenantId.eq(owner.to_string()));
    }
    if let Some(site_id) = site_id {
        select = select.filter(pool::Column::SiteId.eq(site_id.to_string()));
    }
    select
        .all(conn)
        .await?
        .into_iter()
        .map(rows::pool)
        .collect()
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
