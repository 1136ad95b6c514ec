//! What a transition changed. Each [`Change`] becomes one row of the event log, written in the
//! same transaction as the change itself.

use serde::{Deserialize, Serialize};

/// The node field a change touched. Axes are the seed's; the others are fields an operator
/// changes (labels, taints) and the bookkeeping fields that must be auditable.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, strum::Display, strum::AsRefStr,
)]
#[strum(serialize_all = "camelCase")]
#[serde(rename_all = "camelCase")]
pub enum Axis {
    ProvisionState,
    Maintenance,
    Cordoned,
    Power,
    Connectivity,
    Conditions,
    NoScheduleReasons,
    Labels,
    Taints,
    IdentityGeneration,
    Generation,
    ObservedGeneration,
    Lifecycle,
    /// Facts from the node's inventory (GPU count, hardware key).
    Inventory,
}

/// One change a transition made: which axis, from what to what, and the event type that
/// describes it (`node.cordoned`, `node.provision_state_changed`, …).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub event_type: &'static str,
    pub axis: Axis,
    pub from: Option<String>,
    pub to: Option<String>,
    /// Free-form detail worth keeping with the event (a reason text, a deadline).
    pub detail: Option<String>,
}

impl Change {
    pub fn new(
        event_type: &'static str,
        axis: Axis,
        from: Option<impl Into<String>>,
        to: Option<impl Into<String>>,
    ) -> Self {
        Change {
            event_type,
            axis,
            from: from.map(Into::into),
            to: to.map(Into::into),
            detail: None,
        }
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }
}
