//! The independent state axes of a node and the other enumerated fields of the seed.
//!
//! Each enum's string form (`Display`/`FromStr`, via strum) is its storage and wire spelling,
//! exactly as the seed writes it (`tenant-owned`, `metal-host`, `bcd/v1`).

/// Declares a closed set whose every value has exactly one storage and wire spelling: the
/// enum with its derives (`Display`/`FromStr`/`AsRefStr`/`IntoStaticStr` via strum, serde),
/// `ALL` in declaration order, and `as_static_str`. Every such enum in `bc-core` is declared
/// through it, so the spellings sit next to the variants and cannot drift between strum and
/// serde. Usable from every module of the crate (`crate::axes::axis_enum!`).
macro_rules! axis_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
            ::serde::Serialize, ::serde::Deserialize,
            ::strum::Display, ::strum::EnumString, ::strum::EnumIter, ::strum::AsRefStr,
            ::strum::IntoStaticStr,
        )]
        pub enum $name {
            $($(#[$vdoc])* #[strum(serialize = $text)] #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The storage and wire spelling.
            pub fn as_static_str(self) -> &'static str {
                self.into()
            }
        }
    };
}
pub(crate) use axis_enum;

axis_enum!(
    /// Where a node is in its life, from join or enrolment to retirement. Moves only along
    /// [`crate::provision::PROVISION_STATE_TABLE`].
    ProvisionState {
        Adopting = "adopting",
        Adopted = "adopted",
        Enrolling = "enrolling",
        Inspecting = "inspecting",
        Commissioning = "commissioning",
        Ready = "ready",
        Deploying = "deploying",
        Deployed = "deployed",
        Releasing = "releasing",
        Rescue = "rescue",
        Failed = "failed",
        Retiring = "retiring",
        Retired = "retired",
    }
);

axis_enum!(
    /// Whether the control plane can talk to the node's daemon. Owned by the gateway (session
    /// open and close) and the Liveness controller.
    Connectivity {
        Connected = "connected",
        Disconnected = "disconnected",
        Unreachable = "unreachable",
        Lost = "lost",
    }
);

axis_enum!(
    /// Power as last seen through the BMC. Not part of the API view (`NodeDetail`).
    Power {
        On = "on",
        Off = "off",
        Unknown = "unknown",
    }
);

axis_enum!(
    /// What the node is for; decided by the kind of pool it joined.
    Role {
        Host = "host",
        Dedicated = "dedicated",
        Site = "site",
        Unassigned = "unassigned",
    }
);

axis_enum!(
    /// What the node's hardware may be used for.
    Trust {
        Platform = "platform",
        TenantOwned = "tenant-owned",
        TenantControlled = "tenant-controlled",
    }
);

axis_enum!(
    /// How the control plane reaches the node.
    Adapter {
        BcdV1 = "bcd/v1",
        ProviderApiV1 = "provider-api/v1",
    }
);

axis_enum!(
    /// The value of one typed condition.
    ConditionStatus {
        True = "true",
        False = "false",
        Unknown = "unknown",
    }
);

axis_enum!(
    /// The kind of a pool, which decides the role of the nodes that join it.
    PoolKind {
        MetalHost = "metal-host",
        VpsHost = "vps-host",
        Provider = "provider",
        MetalDedicated = "metal-dedicated",
    }
);

axis_enum!(
    /// Whether a pool's machines run the daemon (`bcd`) or are reached through a provider API.
    PoolAgent {
        Bcd = "bcd",
        None = "none",
    }
);

axis_enum!(
    /// Whether a site is the platform's or a tenant's own (`custom`) site.
    SiteKind {
        Platform = "platform",
        Custom = "custom",
    }
);

axis_enum!(
    /// What an operator taint does to scheduling, as in Kubernetes.
    TaintEffect {
        /// No new work lands on the node: adds `taint:<key>` to `noScheduleReasons`.
        NoSchedule = "NoSchedule",
        /// A hint for the placer to prefer other nodes; does not block scheduling.
        PreferNoSchedule = "PreferNoSchedule",
        /// Like `NoSchedule`, and work already on the node that does not tolerate the taint is
        /// evicted: its allocations are released and its reservations placed elsewhere.
        NoExecute = "NoExecute",
    }
);

impl PoolKind {
    /// The seed: a node that joins a `metal-host`, `vps-host` or `provider` pool becomes
    /// `host`, one that joins a `metal-dedicated` pool becomes `dedicated`.
    pub fn node_role(self) -> Role {
        match self {
            PoolKind::MetalHost | PoolKind::VpsHost | PoolKind::Provider => Role::Host,
            PoolKind::MetalDedicated => Role::Dedicated,
        }
    }
}

impl PoolAgent {
    /// Pools with `agent: 'none'` are reached through the provider API; every other node
    /// runs the daemon.
    pub fn adapter(self) -> Adapter {
        match self {
            PoolAgent::Bcd => Adapter::BcdV1,
            PoolAgent::None => Adapter::ProviderApiV1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    #[test]
    fn spellings_round_trip() {
        for s in ProvisionState::ALL {
            assert_eq!(ProvisionState::from_str(s.as_static_str()).ok(), Some(*s));
        }
        assert_eq!(Trust::TenantOwned.to_string(), "tenant-owned");
        assert_eq!(Adapter::BcdV1.as_static_str(), "bcd/v1");
        assert_eq!(
            PoolKind::from_str("metal-dedicated").ok(),
            Some(PoolKind::MetalDedicated)
        );
        assert_eq!(
            serde_json::to_string(&Trust::TenantControlled)
                .ok()
                .as_deref(),
            Some("\"tenant-controlled\"")
        );
    }

    /// The enums of other modules declared through `axis_enum!` keep the spellings their
    /// hand-written derives gave them (storage, wire and GraphQL inputs depend on them).
    #[test]
    fn enums_declared_elsewhere_keep_their_spellings() {
        fn spellings<T: Copy + Into<&'static str>>(all: &[T]) -> Vec<&'static str> {
            all.iter().map(|v| (*v).into()).collect()
        }
        use crate::command::{CommandKind, CommandStatus, Lane};
        use crate::provision::ProvisionMove;
        use crate::schedule::{CapacityBucket, Check};
        assert_eq!(
            spellings(CommandKind::ALL),
            [
                "inventory.refresh",
                "diag.nvml",
                "logs.collect",
                "gpu.reset",
                "node.reboot",
                "disk.wipe"
            ]
        );
        assert_eq!(spellings(Lane::ALL), ["gpu", "inventory", "logs"]);
        assert_eq!(
            spellings(CommandStatus::ALL),
            [
                "queued",
                "dispatched",
                "running",
                "succeeded",
                "failed",
                "timed_out",
                "cancelled",
                "expired"
            ]
        );
        assert_eq!(
            spellings(ProvisionMove::ALL),
            [
                "adopt",
                "inspect",
                "commission",
                "provide",
                "deploy",
                "finish-deploy",
                "release",
                "finish-release",
                "rescue",
                "unrescue",
                "retire",
                "finish-retire",
                "fail",
                "recover"
            ]
        );
        assert_eq!(
            spellings(CapacityBucket::ALL),
            [
                "schedulable",
                "excluded",
                "maintenance",
                "provisioning",
                "unreachable",
                "unhealthy"
            ]
        );
        assert_eq!(
            spellings(Check::ALL),
            [
                "role-is-host",
                "trust-allows-pool",
                "in-service",
                "provisioned",
                "converged-first-spec",
                "connected",
                "no-reasons"
            ]
        );
        assert_eq!(
            serde_json::to_string(&CommandStatus::TimedOut)
                .ok()
                .as_deref(),
            Some("\"timed_out\"")
        );
        assert_eq!(
            "finish-deploy".parse::<ProvisionMove>().ok(),
            Some(ProvisionMove::FinishDeploy)
        );
    }

    #[test]
    fn pool_kind_decides_role() {
        assert_eq!(PoolKind::Provider.node_role(), Role::Host);
        assert_eq!(PoolKind::MetalDedicated.node_role(), Role::Dedicated);
        assert_eq!(PoolAgent::None.adapter(), Adapter::ProviderApiV1);
    }
}
