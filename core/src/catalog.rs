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

/// What the machines of a pool are expected to have. The Inventory controller compares every
/// report against it (`GpuCountMismatch`, `GpuModelMismatch`, `DriverVersionMismatch`, see
/// `health.rs`), and acceptance reads it to tell a CPU pool from a GPU pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HardwareProfile {
    /// GPUs per machine; `Some(0)` makes the pool a CPU pool.
    pub gpu_count: Option<u32>,
    /// The GPU model every GPU must be, compared as labels spell it
    /// ([`crate::health::model_matches`]).
    pub gpu_model: Option<String>,
    /// The NVIDIA driver the machines must run: a whole version (`550.54.15`) or a prefix of
    /// whole components (`550`, `550.54`), compared by [`crate::health::driver_matches`].
    #[serde(default)]
    pub driver_version: Option<String>,
}

/// The longest expected driver version (bytes).
pub const MAX_DRIVER_VERSION_LEN: usize = 64;

/// A driver version a pool expects: dot-separated components of `A-Za-z0-9_-`
/// (`550`, `550.54.15`, `535.161.08-1`), at most [`MAX_DRIVER_VERSION_LEN`] bytes.
pub fn validate_driver_version(version: &str) -> Result<(), crate::DomainError> {
    let valid = !version.is_empty()
        && version.len() <= MAX_DRIVER_VERSION_LEN
        && version.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
        });
    if valid {
        Ok(())
    } else {
        Err(crate::DomainError::BadInput(format!(
            "`{version}` is not a driver version (dot-separated parts of A-Za-z0-9-_, at most \
             {MAX_DRIVER_VERSION_LEN} bytes, e.g. `550` or `550.54.15`)"
        )))
    }
}

impl HardwareProfile {
    /// The profile's own rules: a driver version that can be compared.
    pub fn validate(&self) -> Result<(), crate::DomainError> {
        self.driver_version
            .as_deref()
            .map_or(Ok(()), validate_driver_version)
    }

    /// Whether the pool's machines are expected to have GPUs. Only an expected GPU count of 0
    /// makes a CPU pool: in a GPU fleet, a pool that says nothing holds GPU machines, and a
    /// GPU machine whose driver failed to load reports no GPUs at all, which must not pass
    /// for a CPU machine.
    pub fn expects_gpus(&self) -> bool {
        self.gpu_count != Some(0)
    }
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
    /// How the Remediation controller treats the pool's unhealthy nodes.
    pub remediation: crate::remediation::RemediationPolicy,
    /// Which checks acceptance runs on the pool's new nodes.
    pub acceptance: crate::acceptance::AcceptancePolicy,
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
            remediation: Default::default(),
            acceptance: Default::default(),
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
    fn driver_versions_are_validated_and_only_a_zero_count_is_a_cpu_pool() {
        assert!(validate_driver_version("550").is_ok());
        assert!(validate_driver_version("535.161.08-1").is_ok());
        assert!(validate_driver_version("").is_err());
        assert!(validate_driver_version("550.").is_err());
        assert!(validate_driver_version("550 54").is_err());
        assert!(HardwareProfile::default().expects_gpus());
        let cpu = HardwareProfile {
            gpu_count: Some(0),
            ..HardwareProfile::default()
        };
        assert!(!cpu.expects_gpus());
    }

    #[test]
    fn names_are_validated() {
        assert!(validate_name("site", "dc-1 Frankfurt").is_ok());
        assert!(validate_name("site", " dc").is_err());
        assert!(validate_name("site", "").is_err());
    }
}
