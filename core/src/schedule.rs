//! When a node is schedulable: the seed's seven ordered checks, the capacity bucket of the
//! first that fails, and an explanation listing every check that fails.
//!
//! The server has the same predicate in SQL (`schedulableSql`); a property test over generated
//! nodes keeps the two in agreement on both databases.

use serde::{Deserialize, Serialize};

use crate::axes::{Connectivity, ProvisionState, Role, Trust, axis_enum};
use crate::ids::TenantId;
use crate::node::NodeRecord;
use crate::reason::NoScheduleReason;

axis_enum!(
    /// The bucket of a pool's capacity a node's GPUs are reported in.
    CapacityBucket {
        /// Every check passes: placement may book the node's atoms.
        Schedulable = "schedulable",
        Excluded = "excluded",
        Maintenance = "maintenance",
        Provisioning = "provisioning",
        Unreachable = "unreachable",
        Unhealthy = "unhealthy",
    }
);

axis_enum!(
    /// One of the seven checks, in the order the capacity module runs them.
    Check {
        /// 1. `role` is `host`.
        RoleIsHost = "role-is-host",
        /// 2. `trust` is `platform`, or `tenant-owned` in its owner's pool.
        TrustAllowsPool = "trust-allows-pool",
        /// 3. Not in `maintenance` and not `cordoned`.
        InService = "in-service",
        /// 4. `provisionState` is `adopted` or `deployed`.
        Provisioned = "provisioned",
        /// 5. `observedGeneration` is at least 1.
        ConvergedFirstSpec = "converged-first-spec",
        /// 6. `connectivity` is `connected`.
        Connected = "connected",
        /// 7. `noScheduleReasons` is empty.
        NoReasons = "no-reasons",
    }
);

/// The provision states in which a node may take work.
pub const SCHEDULABLE_PROVISION_STATES: &[ProvisionState] =
    &[ProvisionState::Adopted, ProvisionState::Deployed];

impl Check {
    /// All seven, in order.
    pub const ORDER: [Check; 7] = [
        Check::RoleIsHost,
        Check::TrustAllowsPool,
        Check::InService,
        Check::Provisioned,
        Check::ConvergedFirstSpec,
        Check::Connected,
        Check::NoReasons,
    ];

    /// The bucket a node lands in when this is the first check it fails.
    pub fn bucket(self) -> CapacityBucket {
        match self {
            Check::RoleIsHost | Check::TrustAllowsPool => CapacityBucket::Excluded,
            Check::InService => CapacityBucket::Maintenance,
            Check::Provisioned | Check::ConvergedFirstSpec => CapacityBucket::Provisioning,
            Check::Connected => CapacityBucket::Unreachable,
            Check::NoReasons => CapacityBucket::Unhealthy,
        }
    }
}

/// The facts the checks read: the node's fields plus the owner of the pool it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulingFacts<'a> {
    pub role: Role,
    pub trust: Trust,
    pub owner_tenant_id: Option<&'a TenantId>,
    pub pool_owner_tenant_id: Option<&'a TenantId>,
    pub maintenance: bool,
    pub cordoned: bool,
    pub provision_state: ProvisionState,
    pub observed_generation: i64,
    pub connectivity: Connectivity,
    pub no_schedule_reasons: &'a [NoScheduleReason],
}

impl<'a> SchedulingFacts<'a> {
    pub fn of(node: &'a NodeRecord, pool_owner_tenant_id: Option<&'a TenantId>) -> Self {
        SchedulingFacts {
            role: node.role,
            trust: node.trust,
            owner_tenant_id: node.owner_tenant_id.as_ref(),
            pool_owner_tenant_id,
            maintenance: node.maintenance,
            cordoned: node.cordoned(),
            provision_state: node.provision_state,
            observed_generation: node.observed_generation,
            connectivity: node.connectivity,
            no_schedule_reasons: &node.no_schedule_reasons,
        }
    }

    /// Whether `check` passes.
    pub fn passes(&self, check: Check) -> bool {
        match check {
            Check::RoleIsHost => self.role == Role::Host,
            Check::TrustAllowsPool => match self.trust {
                Trust::Platform => true,
                Trust::TenantOwned => {
                    self.owner_tenant_id.is_some()
                        && self.owner_tenant_id == self.pool_owner_tenant_id
                }
                Trust::TenantControlled => false,
            },
            Check::InService => !self.maintenance && !self.cordoned,
            Check::Provisioned => SCHEDULABLE_PROVISION_STATES.contains(&self.provision_state),
            Check::ConvergedFirstSpec => self.observed_generation >= 1,
            Check::Connected => self.connectivity == Connectivity::Connected,
            Check::NoReasons => self.no_schedule_reasons.is_empty(),
        }
    }

    /// The bucket of the first failing check, or `schedulable`.
    pub fn bucket(&self) -> CapacityBucket {
        Check::ORDER
            .into_iter()
            .find(|c| !self.passes(*c))
            .map_or(CapacityBucket::Schedulable, Check::bucket)
    }

    /// The answer to "why not schedulable?": every failing check, not only the first.
    pub fn explain(&self) -> Explanation {
        let failing: Vec<FailedCheck> = Check::ORDER
            .into_iter()
            .filter(|c| !self.passes(*c))
            .map(|check| FailedCheck {
                check,
                bucket: check.bucket(),
                message: self.message(check),
            })
            .collect();
        Explanation {
            schedulable: failing.is_empty(),
            bucket: failing
                .first()
                .map_or(CapacityBucket::Schedulable, |f| f.bucket),
            failing,
        }
    }

    fn message(&self, check: Check) -> String {
        match check {
            Check::RoleIsHost => format!(
                "role is {}; only host nodes take work (set by the kind of pool the node joined)",
                self.role
            ),
            Check::TrustAllowsPool => match self.trust {
                Trust::TenantControlled => {
                    "trust is tenant-controlled: a node under a dedicated-root lease adds no capacity".to_owned()
                }
                _ => "trust is tenant-owned but the node is not in its owner's pool".to_owned(),
            },
            Check::InService => match (self.maintenance, self.cordoned) {
                (true, true) => "in maintenance and cordoned".to_owned(),
                (true, false) => "in maintenance (cleared by recovering the failed workflow)".to_owned(),
                _ => "cordoned (cleared by uncordonNode)".to_owned(),
            },
            Check::Provisioned => format!(
                "provisionState is {}; work lands only on adopted or deployed nodes",
                self.provision_state
            ),
            Check::ConvergedFirstSpec => format!(
                "observedGeneration is {}: the node has not converged its first spec yet",
                self.observed_generation
            ),
            Check::Connected => format!(
                "connectivity is {} (cleared when the daemon holds a session to a gateway)",
                self.connectivity
            ),
            Check::NoReasons => {
                // Each reason with what clears it (its clear rule), so the explanation says
                // what to do or wait for.
                let keys: Vec<String> = self
                    .no_schedule_reasons
                    .iter()
                    .map(|r| format!("{} ({})", r.key, crate::clear::ClearRule::for_reason(&r.key).describe()))
                    .collect();
                format!("noScheduleReasons: {}", keys.join("; "))
            }
        }
    }
}

/// One failing check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCheck {
    pub check: Check,
    pub bucket: CapacityBucket,
    pub message: String,
}

/// Why a node is or is not schedulable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Explanation {
    pub schedulable: bool,
    pub bucket: CapacityBucket,
    pub failing: Vec<FailedCheck>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::Actor;
    use crate::node::tests::{node, t0};
    use crate::reason::ReasonKey;
    use proptest::prelude::*;

    fn schedulable_node() -> NodeRecord {
        let mut n = node(ProvisionState::Adopted);
        n.observed_generation = 1;
        n.connectivity = Connectivity::Connected;
        n
    }

    #[test]
    fn a_healthy_adopted_connected_converged_host_is_schedulable() {
        let n = schedulable_node();
        let facts = SchedulingFacts::of(&n, None);
        assert_eq!(facts.bucket(), CapacityBucket::Schedulable);
        assert_eq!(
            facts.explain(),
            Explanation {
                schedulable: true,
                bucket: CapacityBucket::Schedulable,
                failing: vec![]
            }
        );
    }

    #[test]
    fn each_check_alone_puts_the_node_in_its_bucket() {
        let owner = TenantId::parse("ten_a").expect("id");
        let other = TenantId::parse("ten_b").expect("id");
        type Breaker = fn(&mut NodeRecord);
        let cases: [(Breaker, Check); 9] = [
            (|n| n.role = Role::Dedicated, Check::RoleIsHost),
            (
                |n| n.trust = Trust::TenantControlled,
                Check::TrustAllowsPool,
            ),
            (|n| n.maintenance = true, Check::InService),
            (
                |n| {
                    n.cordon("x", &Actor::System, t0()).expect("valid");
                },
                Check::InService,
            ),
            (
                |n| n.provision_state = ProvisionState::Ready,
                Check::Provisioned,
            ),
            (|n| n.observed_generation = 0, Check::ConvergedFirstSpec),
            (
                |n| n.connectivity = Connectivity::Disconnected,
                Check::Connected,
            ),
            (
                |n| {
                    n.taint(
                        "k",
                        "",
                        crate::axes::TaintEffect::NoSchedule,
                        &Actor::System,
                        t0(),
                    )
                    .expect("valid");
                },
                Check::NoReasons,
            ),
            (|n| n.trust = Trust::TenantOwned, Check::TrustAllowsPool),
        ];
        for (breaker, check) in cases {
            let mut n = schedulable_node();
            n.owner_tenant_id = Some(owner.clone());
            breaker(&mut n);
            let facts = SchedulingFacts::of(&n, Some(&other));
            let explanation = facts.explain();
            assert_eq!(explanation.bucket, check.bucket(), "{check}");
            assert_eq!(
                explanation
                    .failing
                    .iter()
                    .map(|f| f.check)
                    .collect::<Vec<_>>(),
                vec![check]
            );
        }
        let mut n = schedulable_node();
        n.trust = Trust::TenantOwned;
        n.owner_tenant_id = Some(owner.clone());
        assert_eq!(
            SchedulingFacts::of(&n, Some(&owner)).bucket(),
            CapacityBucket::Schedulable
        );
    }

    #[test]
    fn the_explanation_lists_every_failing_check_and_the_bucket_of_the_first() {
        let mut n = node(ProvisionState::Adopting);
        n.set_connectivity(
            Connectivity::Unreachable,
            &Actor::Controller("liveness".into()),
            t0(),
        );
        let explanation = SchedulingFacts::of(&n, None).explain();
        assert_eq!(explanation.bucket, CapacityBucket::Provisioning);
        assert_eq!(
            explanation
                .failing
                .iter()
                .map(|f| f.check)
                .collect::<Vec<_>>(),
            vec![
                Check::Provisioned,
                Check::ConvergedFirstSpec,
                Check::Connected,
                Check::NoReasons
            ]
        );
        assert!(explanation.failing[3].message.contains("unreachable"));
    }

    fn arb_reasons() -> impl Strategy<Value = Vec<NoScheduleReason>> {
        proptest::collection::vec(
            Just(NoScheduleReason {
                key: ReasonKey::Draining,
                set_by: Actor::System,
                since: t0(),
                detail: None,
            }),
            0..2,
        )
    }

    proptest! {
        /// The bucket is always the bucket of the first failing check, and `schedulable`
        /// exactly when nothing fails.
        #[test]
        fn bucket_is_the_first_failure(
            role in proptest::sample::select(Role::ALL),
            trust in proptest::sample::select(Trust::ALL),
            maintenance: bool,
            cordoned: bool,
            provision_state in proptest::sample::select(ProvisionState::ALL),
            observed_generation in 0i64..3,
            connectivity in proptest::sample::select(Connectivity::ALL),
            reasons in arb_reasons(),
        ) {
            let facts = SchedulingFacts {
                role, trust, owner_tenant_id: None, pool_owner_tenant_id: None,
                maintenance, cordoned, provision_state, observed_generation, connectivity,
                no_schedule_reasons: &reasons,
            };
            let explanation = facts.explain();
            prop_assert_eq!(explanation.bucket, facts.bucket());
            prop_assert_eq!(explanation.schedulable, explanation.failing.is_empty());
            prop_assert_eq!(explanation.schedulable, explanation.bucket == CapacityBucket::Schedulable);
        }
    }
}
