//! `provisionStateTable`: the only legal moves of `provisionState`.
//!
//! The table is data, not code spread over handlers: every move names the states it may start
//! from and where it leads, so "what can I do from here?" is one lookup, and an illegal move's
//! error can list the moves that are allowed.

use crate::axes::ProvisionState::{self, *};
use crate::axes::axis_enum;
use crate::error::DomainError;

axis_enum!(
    /// A named move of the provision state machine.
    ProvisionMove {
        /// `adopting` → `adopted`: acceptance passed, or an operator's `nodes.adopt`.
        Adopt = "adopt",
        /// `enrolling` → `inspecting`: the BMC answered; inspect the hardware.
        Inspect = "inspect",
        /// `inspecting` → `commissioning`: inventory taken; burn in and configure.
        Commission = "commission",
        /// `commissioning` → `ready`: commissioning passed; the machine waits for a deployment.
        Provide = "provide",
        /// `ready` → `deploying`.
        Deploy = "deploy",
        /// `deploying` → `deployed`: the image booted and the daemon reported in.
        FinishDeploy = "finish-deploy",
        /// `deployed` → `releasing`: tear the deployment down and wipe.
        Release = "release",
        /// `releasing` → `ready`: the machine is clean again.
        FinishRelease = "finish-release",
        /// `deployed` → `rescue`: boot a rescue image.
        Rescue = "rescue",
        /// `rescue` → `deployed`.
        Unrescue = "unrescue",
        /// `adopted`, `ready` or `failed` → `retiring`.
        Retire = "retire",
        /// `retiring` → `retired`.
        FinishRetire = "finish-retire",
        /// Any workflow state → `failed`; records `failedFrom` and turns maintenance on.
        Fail = "fail",
        /// `failed` → the state it failed from (`failedFrom`); turns maintenance off.
        Recover = "recover",
    }
);

/// Where a move leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    State(ProvisionState),
    /// Back to the state recorded in `failedFrom`.
    FailedFrom,
}

/// One row of the table: a move, the states it may start from, and where it leads.
#[derive(Debug, Clone, Copy)]
pub struct Edge {
    pub action: ProvisionMove,
    pub from: &'static [ProvisionState],
    pub to: Target,
}

/// The states in which a workflow is under way. The seed: every workflow state can fail.
/// `rescue` is one: booting the rescue ramdisk is a workflow that can fail (and `recover`
/// starts it over); a node left in `rescue` after it succeeded can be failed by hand too.
pub const WORKFLOW_STATES: &[ProvisionState] = &[
    Adopting,
    Enrolling,
    Inspecting,
    Commissioning,
    Deploying,
    Releasing,
    Rescue,
    Retiring,
];

/// The state a joining daemon's node starts in (JoinService).
pub const JOIN_STATE: ProvisionState = Adopting;
/// The state a node enrolled through its BMC starts in (`metal.enroll`).
pub const ENROLL_STATE: ProvisionState = Enrolling;

/// `provisionStateTable`.
pub const PROVISION_STATE_TABLE: &[Edge] = &[
    Edge {
        action: ProvisionMove::Adopt,
        from: &[Adopting],
        to: Target::State(Adopted),
    },
    Edge {
        action: ProvisionMove::Inspect,
        from: &[Enrolling],
        to: Target::State(Inspecting),
    },
    Edge {
        action: ProvisionMove::Commission,
        from: &[Inspecting],
        to: Target::State(Commissioning),
    },
    Edge {
        action: ProvisionMove::Provide,
        from: &[Commissioning],
        to: Target::State(Ready),
    },
    Edge {
        action: ProvisionMove::Deploy,
        from: &[Ready],
        to: Target::State(Deploying),
    },
    Edge {
        action: ProvisionMove::FinishDeploy,
        from: &[Deploying],
        to: Target::State(Deployed),
    },
    Edge {
        action: ProvisionMove::Release,
        from: &[Deployed],
        to: Target::State(Releasing),
    },
    Edge {
        action: ProvisionMove::FinishRelease,
        from: &[Releasing],
        to: Target::State(Ready),
    },
    Edge {
        action: ProvisionMove::Rescue,
        from: &[Deployed],
        to: Target::State(Rescue),
    },
    Edge {
        action: ProvisionMove::Unrescue,
        from: &[Rescue],
        to: Target::State(Deployed),
    },
    Edge {
        action: ProvisionMove::Retire,
        from: &[Adopted, Ready, Failed],
        to: Target::State(Retiring),
    },
    Edge {
        action: ProvisionMove::FinishRetire,
        from: &[Retiring],
        to: Target::State(Retired),
    },
    Edge {
        action: ProvisionMove::Fail,
        from: WORKFLOW_STATES,
        to: Target::State(Failed),
    },
    Edge {
        action: ProvisionMove::Recover,
        from: &[Failed],
        to: Target::FailedFrom,
    },
];

/// The states a node may be deleted in: before it ever held work (`adopting`, `enrolling`),
/// after it failed, or once retired. Everything else must be retired first, so deleting a node
/// can never pull capacity out from under a workload.
pub const DELETABLE_STATES: &[ProvisionState] = &[Adopting, Enrolling, Failed, Retired];

/// The edge for `action`. Every move has exactly one edge (checked by a test).
pub fn edge(action: ProvisionMove) -> &'static Edge {
    PROVISION_STATE_TABLE
        .iter()
        .find(|e| e.action == action)
        .unwrap_or_else(|| unreachable!("every ProvisionMove has an edge in the table"))
}

/// The moves allowed from `state`, in table order.
pub fn allowed_moves(state: ProvisionState) -> Vec<ProvisionMove> {
    PROVISION_STATE_TABLE
        .iter()
        .filter(|e| e.from.contains(&state))
        .map(|e| e.action)
        .collect()
}

/// Where `action` leads from `current`, or `INVALID_STATE` naming the current state, the
/// move and the moves allowed from there. `failed_from` resolves [`Target::FailedFrom`].
pub fn next_state(
    current: ProvisionState,
    action: ProvisionMove,
    failed_from: Option<ProvisionState>,
) -> Result<ProvisionState, DomainError> {
    let edge = edge(action);
    if !edge.from.contains(&current) {
        return Err(invalid_state(current, action.as_ref()));
    }
    match edge.to {
        Target::State(state) => Ok(state),
        Target::FailedFrom => failed_from.ok_or_else(|| {
            DomainError::BadInput(format!(
                "the node is {current} but has no recorded failedFrom state to recover to"
            ))
        }),
    }
}

/// The `INVALID_STATE` error for `attempted` from `current`.
pub fn invalid_state(current: ProvisionState, attempted: &str) -> DomainError {
    let mut allowed: Vec<String> = allowed_moves(current)
        .into_iter()
        .map(|m| m.as_ref().to_owned())
        .collect();
    if DELETABLE_STATES.contains(&current) {
        allowed.push("delete".to_owned());
    }
    DomainError::InvalidState {
        current: current.to_string(),
        attempted: attempted.to_owned(),
        allowed,
    }
}

/// Whether a node in `state` may be deleted.
pub fn check_deletable(state: ProvisionState) -> Result<(), DomainError> {
    if DELETABLE_STATES.contains(&state) {
        Ok(())
    } else {
        Err(invalid_state(state, "delete"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strum::IntoEnumIterator;

    #[test]
    fn every_move_has_exactly_one_edge() {
        for action in ProvisionMove::iter() {
            let count = PROVISION_STATE_TABLE
                .iter()
                .filter(|e| e.action == action)
                .count();
            assert_eq!(count, 1, "{action} has {count} edges");
        }
    }

    /// The edges the seed and the foundation issue name, as (from, move, to).
    const EXPECTED: &[(ProvisionState, ProvisionMove, ProvisionState)] = &[
        (Adopting, ProvisionMove::Adopt, Adopted),
        (Enrolling, ProvisionMove::Inspect, Inspecting),
        (Inspecting, ProvisionMove::Commission, Commissioning),
        (Commissioning, ProvisionMove::Provide, Ready),
        (Ready, ProvisionMove::Deploy, Deploying),
        (Deploying, ProvisionMove::FinishDeploy, Deployed),
        (Deployed, ProvisionMove::Release, Releasing),
        (Releasing, ProvisionMove::FinishRelease, Ready),
        (Deployed, ProvisionMove::Rescue, Rescue),
        (Rescue, ProvisionMove::Unrescue, Deployed),
        (Adopted, ProvisionMove::Retire, Retiring),
        (Ready, ProvisionMove::Retire, Retiring),
        (Failed, ProvisionMove::Retire, Retiring),
        (Retiring, ProvisionMove::FinishRetire, Retired),
        (Adopting, ProvisionMove::Fail, Failed),
        (Enrolling, ProvisionMove::Fail, Failed),
        (Inspecting, ProvisionMove::Fail, Failed),
        (Commissioning, ProvisionMove::Fail, Failed),
        (Deploying, ProvisionMove::Fail, Failed),
        (Releasing, ProvisionMove::Fail, Failed),
        (Rescue, ProvisionMove::Fail, Failed),
        (Retiring, ProvisionMove::Fail, Failed),
    ];

    #[test]
    fn table_is_exactly_the_expected_edges_for_every_state_and_move() {
        for from in ProvisionState::iter() {
            for action in ProvisionMove::iter() {
                if action == ProvisionMove::Recover {
                    continue;
                }
                let expected = EXPECTED
                    .iter()
                    .find(|(f, m, _)| *f == from && *m == action)
                    .map(|(_, _, to)| *to);
                match (next_state(from, action, None), expected) {
                    (Ok(to), Some(want)) => assert_eq!(to, want, "{from} --{action}-->"),
                    (
                        Err(DomainError::InvalidState {
                            current,
                            attempted,
                            allowed,
                        }),
                        None,
                    ) => {
                        assert_eq!(current, from.to_string());
                        assert_eq!(attempted, action.to_string());
                        let listed: Vec<String> =
                            allowed_moves(from).iter().map(|m| m.to_string()).collect();
                        assert!(listed.iter().all(|m| allowed.contains(m)));
                    }
                    (got, want) => panic!("{from} --{action}--> gave {got:?}, expected {want:?}"),
                }
            }
        }
    }

    #[test]
    fn recover_returns_to_failed_from() {
        for &origin in WORKFLOW_STATES {
            assert_eq!(
                next_state(Failed, ProvisionMove::Recover, Some(origin)),
                Ok(origin)
            );
        }
        assert!(matches!(
            next_state(Failed, ProvisionMove::Recover, None),
            Err(DomainError::BadInput(_))
        ));
        assert!(matches!(
            next_state(Adopted, ProvisionMove::Recover, Some(Adopting)),
            Err(DomainError::InvalidState { .. })
        ));
    }

    #[test]
    fn invalid_state_names_current_move_and_allowed_moves() {
        let err = next_state(Deployed, ProvisionMove::Adopt, None).expect_err("illegal");
        assert_eq!(
            err,
            DomainError::InvalidState {
                current: "deployed".into(),
                attempted: "adopt".into(),
                allowed: vec!["release".into(), "rescue".into()],
            }
        );
        assert_eq!(
            err.to_string(),
            "cannot adopt a node that is deployed; allowed from deployed: release, rescue"
        );
    }

    #[test]
    fn only_idle_states_are_deletable() {
        assert!(check_deletable(Retired).is_ok());
        let err = check_deletable(Deployed).expect_err("deployed nodes must be retired first");
        assert!(
            matches!(err, DomainError::InvalidState { attempted, .. } if attempted == "delete")
        );
    }

    #[test]
    fn every_state_is_reachable_from_join_or_enrolment() {
        let mut seen = vec![JOIN_STATE, ENROLL_STATE];
        let mut frontier = seen.clone();
        while let Some(state) = frontier.pop() {
            for action in allowed_moves(state) {
                let to = match edge(action).to {
                    Target::State(s) => s,
                    Target::FailedFrom => continue,
                };
                if !seen.contains(&to) {
                    seen.push(to);
                    frontier.push(to);
                }
            }
        }
        for state in ProvisionState::iter() {
            assert!(seen.contains(&state), "{state} is unreachable");
        }
    }
}
