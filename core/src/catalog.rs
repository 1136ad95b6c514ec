//! Tenants, sites and pools: where nodes live and who owns them.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::axes::{Adapter, PoolAgent, PoolKind, ProvisionState, Role, SiteKind, Trust};
use crate::ids::{PoolId, SiteId, TenantId};
use crate::node::NewNode;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Site {
    pub id: SiteId,
    pub name: String,
    pub kind: SiteKind,
    /// The tenant of a `custom` site; `None` for the platform's sites.
    pub owner_tenant_id: Option<TenantId>,
    pub created_at: DateTime<Utc>,
}

/// What the machines of a pool are expected to have. Health compares inventory against it
/// (`GpuCountMismatch`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HardwareProfile {
    pub gpu_count: Option<u32>,
    pub gpu_model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    pub id: PoolId,
    pub site_id: SiteId,
    pub name: String,
    pub kind: PoolKind,
    pub agent: PoolAgent,
    /// The tenant that owns the pool; `None` for the platform's pools.
    pub owner_tenant_id: Option<TenantId>,
    pub hardware_profile: HardwareProfile,
    /// Driver bindings (`power`, `boot`, `deploy`, …) inherited by the pool's nodes.
    pub drivers: BTreeMap<String, String>,
    pub created_at: DateTime<Utc>,
}

/// Where a node is placed, which decides its role, trust, adapter and drivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub role: Role,
    pub trust: Trust,
    pub owner_tenant_id: Option<TenantId>,
}

impl Placement {
    /// The seed's rules: the pool's kind decides the role (no pool: `unassigned`); a node on
    /// a tenant's `custom` site is `tenant-owned` by that tenant; otherwise `platform`.
    /// (`tenant-controlled` comes only from a dedicated-root lease, never from placement.)
    pub fn of(site: &Site, pool: Option<&Pool>) -> Placement {
        let role = pool.map_or(Role::Unassigned, |p| p.kind.node_role());
        match (site.kind, &site.owner_tenant_id) {
            (SiteKind::Custom, Some(owner)) => Placement {
                role,
                trust: Trust::TenantOwned,
                owner_tenant_id: Some(owner.clone()),
            },
            _ => Placement {
                role,
                trust: Trust::Platform,
                owner_tenant_id: None,
            },
        }
    }

    /// The new node a machine in this site and pool becomes, entering at `provision_state`
    /// (a join's `adopting`, an enrolment's `enrolling`): role, trust and owner from
    /// [`Placement::of`], adapter and drivers from the pool (no pool: `bcd/v1`, no drivers).
    pub fn new_node(
        hostname: &str,
        site: &Site,
        pool: Option<&Pool>,
        provision_state: ProvisionState,
    ) -> NewNode {
        let placement = Placement::of(site, pool);
        NewNode {
            hostname: hostname.to_owned(),
            site_id: site.id.clone(),
            pool_id: pool.map(|p| p.id.clone()),
            owner_tenant_id: placement.owner_tenant_id,
            role: placement.role,
            trust: placement.trust,
            adapter: pool.map_or(Adapter::BcdV1, |p| p.agent.adapter()),
            drivers: pool.map(|p| p.drivers.clone()).unwrap_or_default(),
            provision_state,
        }
    }
}

/// The longest name of a tenant, site or pool (bytes).
pub const MAX_NAME_LEN: usize = 100;

/// Names of tenants, sites and pools: short, printable, no surrounding spaces.
pub fn validate_name(kind: &str, name: &str) -> Result<(), crate::DomainError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.trim() == name
        && name.chars().all(|c| !c.is_control());
    if valid {
        Ok(())
    } else {
        Err(crate::DomainError::BadInput(format!(
            "`{name}` is not a valid {kind} name (1-100 printable characters, no surrounding spaces)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(kind: SiteKind, owner: Option<&str>) -> Site {
        Site {
            id: SiteId::parse("site_a").expect("id"),
            name: "a".into(),
            kind,
            owner_tenant_id: owner.map(|o| TenantId::parse(o).expect("id")),
            created_at: Utc::now(),
        }
    }

    fn pool(kind: PoolKind) -> Pool {
        Pool {
            id: PoolId::parse("pool_a").expect("id"),
            site_id: SiteId::parse("site_a").expect("id"),
            name: "a".into(),
            kind,
            agent: PoolAgent::Bcd,
            owner_tenant_id: None,
            hardware_profile: HardwareProfile::default(),
            drivers: BTreeMap::new(),
            created_at: Utc::now(),
        }
    }

    #[test]
    fn placement_follows_the_seed() {
        let platform = site(SiteKind::Platform, None);
        assert_eq!(
            Placement::of(&platform, Some(&pool(PoolKind::VpsHost))).role,
            Role::Host
        );
        assert_eq!(
            Placement::of(&platform, Some(&pool(PoolKind::MetalDedicated))).role,
            Role::Dedicated
        );
        assert_eq!(Placement::of(&platform, None).role, Role::Unassigned);
        assert_eq!(Placement::of(&platform, None).trust, Trust::Platform);
        let custom = Placement::of(
            &site(SiteKind::Custom, Some("ten_x")),
            Some(&pool(PoolKind::Provider)),
        );
        assert_eq!(custom.trust, Trust::TenantOwned);
        assert_eq!(
            custom.owner_tenant_id.map(|t| t.to_string()).as_deref(),
            Some("ten_x")
        );
    }

    #[test]
    fn names_are_validated() {
        assert!(validate_name("site", "dc-1 Frankfurt").is_ok());
        assert!(validate_name("site", " dc").is_err());
        assert!(validate_name("site", "").is_err());
    }
}
