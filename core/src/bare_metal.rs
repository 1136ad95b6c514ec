//! Bare metal: what the control plane knows about reaching a machine through its BMC, as
//! pure rules. The drivers that speak to BMCs (Redfish) live in the server; here are the
//! names they are chosen by, the power actions, and the `power` axis's transition.

use chrono::{DateTime, Utc};

use crate::actor::Actor;
use crate::axes::{ConditionStatus, Power, axis_enum};
use crate::error::DomainError;
use crate::event::{Axis, Change, EventType};
use crate::node::NodeRecord;

/// The key of a pool's (and so its nodes') `drivers` that chooses the power driver.
pub const POWER_DRIVER_KEY: &str = "power";
/// The key of a pool's `drivers` that names the image the deploy workflow boots (an entry
/// of the server's `bare_metal.images`); absent, the deploy boots from the network.
pub const DEPLOY_DRIVER_KEY: &str = "deploy";

/// The condition the Power controller sets while a node's BMC does not answer (or refuses
/// its credentials, or answers nonsense), and clears when it answers again. It does not keep
/// work off the node: the host's own daemon may be perfectly well while its BMC is not.
pub const BMC_UNREACHABLE: &str = "BmcUnreachable";

axis_enum!(
    /// Which power driver a node's `drivers.power` names. A node without the key has none.
    PowerDriverKind {
        /// DMTF Redfish over HTTPS: the BMC's `ComputerSystem`.
        Redfish = "redfish",
        /// No BMC: power is not managed (and stays `unknown`).
        None = "none",
    }
);

axis_enum!(
    /// What an operator asks of a machine's power (`powerNode`).
    PowerAction {
        /// Power on (Redfish `On`).
        On = "on",
        /// Power off at once (Redfish `ForceOff`), like holding the button.
        Off = "off",
        /// Off and on again (Redfish `PowerCycle` where the BMC offers it, else
        /// `ForceRestart`). A machine that was off comes on.
        Cycle = "cycle",
    }
);

impl PowerAction {
    /// Whether the action takes the running host down, so that work on it is lost: those
    /// need `force` on a node that holds allocations.
    pub fn interrupts_work(self) -> bool {
        matches!(self, PowerAction::Off | PowerAction::Cycle)
    }
}

axis_enum!(
    /// How the control plane checks a BMC's TLS certificate.
    BmcTlsVerification {
        /// Against the platform's trusted roots.
        Verify = "verify",
        /// Against the CA certificate given at enrolment (BMCs with self-made certificates).
        CustomCa = "custom-ca",
        /// Not at all. For labs only: anyone on the path can read the credentials.
        Off = "off",
    }
);

/// The power driver `record`'s drivers choose (`drivers.power`; absent is `none`).
pub fn power_driver_of(record: &NodeRecord) -> Result<PowerDriverKind, DomainError> {
    power_driver_of_drivers(&record.drivers)
}

/// The power driver a set of driver bindings chooses (`power`; absent is `none`).
pub fn power_driver_of_drivers(
    drivers: &std::collections::BTreeMap<String, String>,
) -> Result<PowerDriverKind, DomainError> {
    match drivers.get(POWER_DRIVER_KEY) {
        None => Ok(PowerDriverKind::None),
        Some(name) => name.parse().map_err(|_| {
            DomainError::BadInput(format!(
                "the power driver `{name}` is unknown (known: {})",
                PowerDriverKind::ALL
                    .iter()
                    .map(|k| k.as_static_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }),
    }
}

impl NodeRecord {
    /// The Power controller's reading of the BMC: the `power` axis. Owned by bare-metal power
    /// control alone (the seed's table).
    pub fn set_power(&mut self, to: Power) -> Vec<Change> {
        let from = self.power;
        if from == to {
            return Vec::new();
        }
        self.power = to;
        vec![Change::new(
            EventType::NodePowerChanged,
            Axis::Power,
            Some(from.as_static_str()),
            Some(to.as_static_str()),
        )]
    }

    /// The BMC answered (`None`) or did not (`Some(why)`, a reason word such as `Timeout`
    /// and a message): sets or clears [`BMC_UNREACHABLE`]. A BMC that does not answer leaves
    /// power `unknown`.
    pub fn set_bmc_reachability(
        &mut self,
        failure: Option<(&str, &str)>,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        let set = self
            .conditions
            .iter()
            .any(|c| c.kind == BMC_UNREACHABLE && c.status != ConditionStatus::False);
        match failure {
            Some((reason, message)) => {
                let mut changes = self.set_condition(
                    BMC_UNREACHABLE,
                    ConditionStatus::True,
                    reason,
                    message,
                    false,
                    by,
                    now,
                )?;
                changes.extend(self.set_power(Power::Unknown));
                Ok(changes)
            }
            // Answering BMCs that never failed carry no condition at all: nothing to clear.
            None if !set => Ok(Vec::new()),
            None => self.set_condition(
                BMC_UNREACHABLE,
                ConditionStatus::False,
                "Answering",
                "the BMC answers again",
                false,
                by,
                now,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::axes::ProvisionState;
    use crate::node::tests::{node, t0};

    fn power() -> Actor {
        Actor::Controller("power".into())
    }

    #[test]
    fn power_moves_with_one_event_and_only_when_it_changes() {
        let mut n = node(ProvisionState::Enrolling);
        assert_eq!(n.power, Power::Unknown);
        let changes = n.set_power(Power::On);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].event_type, EventType::NodePowerChanged);
        assert_eq!(changes[0].from.as_deref(), Some("unknown"));
        assert!(n.set_power(Power::On).is_empty());
    }

    #[test]
    fn an_unreachable_bmc_sets_the_condition_and_loses_power_then_clears() {
        let mut n = node(ProvisionState::Enrolling);
        assert!(
            n.set_bmc_reachability(None, &power(), t0())
                .expect("valid")
                .is_empty(),
            "a BMC that always answered carries no condition"
        );
        n.set_power(Power::On);
        let changes = n
            .set_bmc_reachability(Some(("Timeout", "no answer in 10 s")), &power(), t0())
            .expect("valid");
        assert_eq!(n.power, Power::Unknown);
        assert_eq!(changes.len(), 2);
        assert!(
            n.no_schedule_reasons.is_empty(),
            "work may stay on the host"
        );
        let again = n
            .set_bmc_reachability(Some(("Timeout", "still nothing")), &power(), t0())
            .expect("valid");
        assert!(again.is_empty(), "the same status is no transition");
        let cleared = n.set_bmc_reachability(None, &power(), t0()).expect("valid");
        assert_eq!(cleared.len(), 1);
        assert_eq!(n.conditions[0].status, ConditionStatus::False);
    }

    #[test]
    fn drivers_choose_the_power_driver() {
        let mut n = node(ProvisionState::Enrolling);
        assert_eq!(power_driver_of(&n).ok(), Some(PowerDriverKind::None));
        n.drivers.insert(POWER_DRIVER_KEY.into(), "redfish".into());
        assert_eq!(power_driver_of(&n).ok(), Some(PowerDriverKind::Redfish));
        n.drivers.insert(POWER_DRIVER_KEY.into(), "ipmi".into());
        assert!(power_driver_of(&n).is_err());
        assert!(PowerAction::Off.interrupts_work() && !PowerAction::On.interrupts_work());
    }
}
