//! What a transition changed, and the event log that records it.
//!
//! Each [`Change`] becomes one row of the event log, written in the same transaction as the
//! change itself. [`EventType`] is the closed set of event types the control plane writes;
//! [`RecordedEvent`] is a row of the log read back as domain types.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::actor::Actor;
use crate::axes::axis_enum;
use crate::command::CommandStatus;
use crate::ids::{EventId, NodeId, TenantId};

axis_enum!(
    /// The node field a change touched. Axes are the seed's; the others are fields an operator
    /// changes (labels, taints) and the bookkeeping fields that must be auditable.
    Axis {
        ProvisionState = "provisionState",
        Maintenance = "maintenance",
        Cordoned = "cordoned",
        Power = "power",
        Connectivity = "connectivity",
        Conditions = "conditions",
        NoScheduleReasons = "noScheduleReasons",
        Labels = "labels",
        Taints = "taints",
        IdentityGeneration = "identityGeneration",
        Generation = "generation",
        ObservedGeneration = "observedGeneration",
        Lifecycle = "lifecycle",
        /// Facts from the node's inventory (GPU count, hardware key).
        Inventory = "inventory",
        /// A command sent to the node changed status (the `command.*` events).
        Command = "command",
    }
);

axis_enum!(
    /// Every event type the control plane writes, spelled as stored in the event log and shown
    /// by the API (`Event.type`, `AxisChange.type`). The spellings are a contract: clients
    /// filter on them (`events(types: …)`), so a variant is never renamed, only added.
    EventType {
        // Nodes: membership.
        /// JoinService admitted a new node (a node row in `adopting`).
        NodeJoined = "node.joined",
        /// A machine whose trusted hardware key belongs to an existing node joined again: that
        /// node was reclaimed in place and its identity replaced.
        NodeRejoined = "node.rejoined",
        /// An operator enrolled a bare-metal node through its BMC (`enrollNode`).
        NodeEnrolled = "node.enrolled",
        /// The node was soft-deleted (`deleteNode`).
        NodeDeleted = "node.deleted",

        // Nodes: the state axes.
        /// `provisionState` moved along the state table (a workflow step, `adopt`, `fail`,
        /// `recover`, …).
        NodeProvisionStateChanged = "node.provision_state_changed",
        /// Maintenance turned on (a workflow failed).
        NodeMaintenanceOn = "node.maintenance_on",
        /// Maintenance turned off (the failed workflow was recovered).
        NodeMaintenanceOff = "node.maintenance_off",
        /// An operator cordoned the node (`cordonNode`, or the start of `drainNode`).
        NodeCordoned = "node.cordoned",
        /// An operator uncordoned the node (which also ends a drain).
        NodeUncordoned = "node.uncordoned",
        /// A drain started, or an operator drained again with a different deadline.
        NodeDrainStarted = "node.drain_started",
        /// A drain ended by its deadline, written before placement existed; drains now end
        /// with `node.drained`. Kept so old rows still read.
        NodeDrainFinished = "node.drain_finished",
        /// A draining node holds no allocations any more (released, or evicted at the
        /// deadline): `draining` is cleared, the cordon stays.
        NodeDrained = "node.drained",
        /// The gateway or Liveness moved `connectivity`.
        NodeConnectivityChanged = "node.connectivity_changed",
        /// Inventory, Health, Liveness or NodeLifecycle set a condition to a new status.
        NodeConditionChanged = "node.condition_changed",
        /// A reason entered `noScheduleReasons` (with the change that caused it).
        NodeNoScheduleReasonAdded = "node.no_schedule_reason_added",
        /// A reason left `noScheduleReasons` (with the change that caused it).
        NodeNoScheduleReasonRemoved = "node.no_schedule_reason_removed",
        /// A step of a condition's proof was satisfied: a command its clear rule names
        /// succeeded on the node (from and to are the steps done, `GpuNeedsReset 0/2` →
        /// `GpuNeedsReset 1/2`; the detail names the step and the command).
        NodeConditionProofStep = "node.condition_proof_step",
        /// A condition's proof started over: a verification failed, or a report showed the
        /// evidence again after a step or after it was gone.
        NodeConditionProofRestarted = "node.condition_proof_restarted",
        /// A report no longer shows a condition's evidence; the condition stays `true` until
        /// its proof (or an operator) clears it.
        NodeConditionEvidenceGone = "node.condition_evidence_gone",

        // Nodes: operator fields.
        /// An operator taint was added or replaced.
        NodeTainted = "node.tainted",
        /// An operator taint was removed.
        NodeUntainted = "node.untainted",
        /// An operator's label was set (`labelNode`; one event per key). Inventory labels
        /// written before `node.inventory_labels_changed` existed were recorded this way too.
        NodeLabelSet = "node.label_set",
        /// An operator's label was removed (one event per key; older inventory removals too).
        NodeLabelRemoved = "node.label_removed",

        // Nodes: inventory and bookkeeping.
        /// A report changed the node's inventory labels (the set under
        /// `inventory.bettercompute.io/`, replaced wholesale on every report): one event for
        /// all of them, `from` and `to` listing the keys that changed as `key=value`, the
        /// data each key's value and previous value.
        NodeInventoryLabelsChanged = "node.inventory_labels_changed",
        /// The node's inventory reported a different number of GPUs.
        NodeGpuCountChanged = "node.gpu_count_changed",
        /// The hardware key computed from the node's identifiers changed (or its trust).
        NodeHardwareKeyChanged = "node.hardware_key_changed",
        /// The NodeSpec controller wrote a new desired-state generation.
        NodeSpecGeneration = "node.spec_generation",
        /// The daemon reported converging a newer spec generation.
        NodeObservedGeneration = "node.observed_generation",
        /// `identityGeneration` was bumped: `revokeNodeIdentity`, a re-join in place, or a
        /// deletion. Certificates of the old generation stop working.
        NodeIdentityRevoked = "node.identity_revoked",

        // Nodes: bare metal.
        /// The Power controller read a different power state through the node's BMC (or lost
        /// it: `unknown`).
        NodePowerChanged = "node.power_changed",
        /// The node's BMC accepted an operator's power action (`powerNode`: on, off, cycle).
        /// The `power` axis follows when the Power controller next reads the BMC.
        NodePowerAction = "node.power_action",

        // Bare-metal workflows (about a node, not a change of its record: the node's own
        // moves are `node.*` events of the same transaction). The workflow's id is the cause.
        /// A workflow started: the node entered a state whose workflow runs (`inspecting`,
        /// `releasing`, `retiring`).
        WorkflowStarted = "workflow.started",
        /// A step of a workflow changed status (from and to are the statuses; the data
        /// names the step, its attempts and its last log line).
        WorkflowStepChanged = "workflow.step_changed",
        /// A workflow ended: succeeded, failed or aborted (the data carries the reason).
        WorkflowFinished = "workflow.finished",

        // Commands: one event per status a command enters (`command.<status>`).
        /// A command was queued for a node.
        CommandQueued = "command.queued",
        /// A command was sent to the node's session.
        CommandDispatched = "command.dispatched",
        /// The daemon reported the command started.
        CommandRunning = "command.running",
        /// The command ended successfully.
        CommandSucceeded = "command.succeeded",
        /// The command failed (on the node, or because it could not be redelivered).
        CommandFailed = "command.failed",
        /// The command ran past its timeout.
        CommandTimedOut = "command.timed_out",
        /// The command was cancelled.
        CommandCancelled = "command.cancelled",
        /// The command waited in the queue past its TTL.
        CommandExpired = "command.expired",

        // Health remediation (about a node; one event per status an attempt enters,
        // `remediation.<status>`, with the attempt in `data` and its id as the cause).
        /// A remediation try was scheduled: it waits for its time (backoff), for the node's
        /// allocations to be released, or for the node to connect.
        RemediationWaiting = "remediation.waiting",
        /// A remediation try queued its action (`gpu.reset`, `node.reboot`).
        RemediationActing = "remediation.acting",
        /// A remediation try's action succeeded; its verification (`diag.nvml`) is queued.
        RemediationVerifying = "remediation.verifying",
        /// A remediation try's verification passed and the condition cleared.
        RemediationSucceeded = "remediation.succeeded",
        /// A remediation try failed; the next try (or step) waits for its backoff.
        RemediationFailed = "remediation.failed",
        /// Every step of the pool's remediation policy failed: maintenance on, `GpuNeedsPerson`.
        RemediationGaveUp = "remediation.gave_up",
        /// A remediation ended without a verdict: the condition cleared otherwise, or the node
        /// left service.
        RemediationCancelled = "remediation.cancelled",

        // Catalog and join tokens (no node).
        /// A tenant was created.
        TenantCreated = "tenant.created",
        /// A site was created.
        SiteCreated = "site.created",
        /// A pool was created.
        PoolCreated = "pool.created",
        /// A pool's settings changed (`updatePool`: its remediation policy).
        PoolUpdated = "pool.updated",
        /// A pool was offered to a tenant (`offerPool`): the tenant may reserve in it.
        PoolOffered = "pool.offered",
        /// A join token was created.
        JoinTokenCreated = "join_token.created",
        /// A join token was revoked.
        JoinTokenRevoked = "join_token.revoked",

        // Placement.
        /// A reservation was created (`createReservation`), PENDING.
        ReservationCreated = "reservation.created",
        /// The placer booked every node of a reservation: PENDING → PLACED.
        ReservationPlaced = "reservation.placed",
        /// A placed reservation's allocations were evicted (drain deadline, lost node,
        /// `NoExecute` taint): PLACED → PENDING, to be placed elsewhere.
        ReservationEvicted = "reservation.evicted",
        /// A reservation was released by its owner or expired once placed: → RELEASED.
        ReservationReleased = "reservation.released",
        /// A reservation can never be placed, or expired while pending: → FAILED.
        ReservationFailed = "reservation.failed",
        /// Atoms of a node were booked for a reservation (one event per node).
        AllocationBooked = "allocation.booked",
        /// An allocation ended: its reservation was released, or it was evicted.
        AllocationReleased = "allocation.released",

        // Liveness (no node).
        /// Liveness paused for a site: too many of its nodes went silent at once (the fleet
        /// brake), so they are not marked unreachable.
        SiteLivenessPaused = "site.liveness_paused",
        /// Liveness resumed for a site the brake had paused.
        SiteLivenessResumed = "site.liveness_resumed",
        /// An admin released a site's brake: its silent nodes are marked down after all.
        SiteLivenessReleased = "site.liveness_released",
    }
);

impl EventType {
    /// Whether events of this type record a change of a node's record (`node.*`): each
    /// carries the node's version after the change, and the version's first event carries
    /// what rebuilds it ([`crate::history`]).
    pub fn is_node_change(self) -> bool {
        self.as_static_str().starts_with("node.")
    }

    /// The event of a command entering `status` (`command.<status>`).
    pub fn command(status: CommandStatus) -> EventType {
        match status {
            CommandStatus::Queued => EventType::CommandQueued,
            CommandStatus::Dispatched => EventType::CommandDispatched,
            CommandStatus::Running => EventType::CommandRunning,
            CommandStatus::Succeeded => EventType::CommandSucceeded,
            CommandStatus::Failed => EventType::CommandFailed,
            CommandStatus::TimedOut => EventType::CommandTimedOut,
            CommandStatus::Cancelled => EventType::CommandCancelled,
            CommandStatus::Expired => EventType::CommandExpired,
        }
    }

    /// The event of a remediation attempt entering `status` (`remediation.<status>`).
    pub fn remediation(status: crate::remediation::AttemptStatus) -> EventType {
        use crate::remediation::AttemptStatus;
        match status {
            AttemptStatus::Waiting => EventType::RemediationWaiting,
            AttemptStatus::Acting => EventType::RemediationActing,
            AttemptStatus::Verifying => EventType::RemediationVerifying,
            AttemptStatus::Succeeded => EventType::RemediationSucceeded,
            AttemptStatus::Failed => EventType::RemediationFailed,
            AttemptStatus::GaveUp => EventType::RemediationGaveUp,
            AttemptStatus::Cancelled => EventType::RemediationCancelled,
        }
    }
}

/// One change a transition made: which axis, from what to what, and the event type that
/// describes it (`node.cordoned`, `node.provision_state_changed`, …).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub event_type: EventType,
    pub axis: Axis,
    pub from: Option<String>,
    pub to: Option<String>,
    /// Free-form detail worth keeping with the event (a reason text, a deadline).
    pub detail: Option<String>,
    /// The element of a keyed field the change is about: the label or taint key, the
    /// condition type, the `noScheduleReasons` key. `None` for the scalar axes, and for a
    /// report's inventory labels (`node.inventory_labels_changed`), which are several. The
    /// event's structured detail ([`crate::history::change_detail`]) looks the element up by
    /// it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl Change {
    pub fn new(
        event_type: EventType,
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
            key: None,
        }
    }

    /// The element of a keyed field (label, taint, condition, reason) the change is about.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }
}

/// An entry of the event log, read back: what happened, to which node (if any), who did it
/// and why. The storage layer maps each row to this explicitly; a row that does not map (an
/// unknown type, axis or actor) is a corrupt row, never guessed at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedEvent {
    /// The sequence number: commit order, and the resume cursor.
    pub id: EventId,
    /// The node it is about; `None` for catalog, join-token and site events.
    pub node_id: Option<NodeId>,
    /// The tenant that may see it (the node's, site's or pool's owner); `None` for platform
    /// events, which only platform principals see.
    pub tenant_id: Option<TenantId>,
    pub event_type: EventType,
    /// The axis or field changed; `None` for events not about a node field.
    pub axis: Option<Axis>,
    pub from: Option<String>,
    pub to: Option<String>,
    pub actor: Actor,
    /// What caused it: the mutation, controller step, session or command id.
    pub cause: Option<String>,
    /// Event-specific data: for node changes `{ detail, version }` (the node's version after
    /// the change), for commands the command's status fields, for the others what was created.
    pub data: serde_json::Value,
    pub at: DateTime<Utc>,
}

impl RecordedEvent {
    /// The node's version after the change, for node changes (`node.*` events). Other events
    /// about a node (commands, allocations) carry no node version.
    pub fn node_version(&self) -> Option<i64> {
        if !self.event_type.is_node_change() {
            return None;
        }
        self.data.get("version").and_then(serde_json::Value::as_i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    /// The stored and wire spelling of every event type. A contract (the log keeps old rows,
    /// clients filter on types): these never change. The `match` is exhaustive, so a new
    /// variant does not compile until its spelling is pinned here.
    fn pinned(t: EventType) -> &'static str {
        match t {
            EventType::NodeJoined => "node.joined",
            EventType::NodeRejoined => "node.rejoined",
            EventType::NodeEnrolled => "node.enrolled",
            EventType::NodeDeleted => "node.deleted",
            EventType::NodeProvisionStateChanged => "node.provision_state_changed",
            EventType::NodeMaintenanceOn => "node.maintenance_on",
            EventType::NodeMaintenanceOff => "node.maintenance_off",
            EventType::NodeCordoned => "node.cordoned",
            EventType::NodeUncordoned => "node.uncordoned",
            EventType::NodeDrainStarted => "node.drain_started",
            EventType::NodeDrainFinished => "node.drain_finished",
            EventType::NodeDrained => "node.drained",
            EventType::NodeConnectivityChanged => "node.connectivity_changed",
            EventType::NodeConditionChanged => "node.condition_changed",
            EventType::NodeNoScheduleReasonAdded => "node.no_schedule_reason_added",
            EventType::NodeNoScheduleReasonRemoved => "node.no_schedule_reason_removed",
            EventType::NodeConditionProofStep => "node.condition_proof_step",
            EventType::NodeConditionProofRestarted => "node.condition_proof_restarted",
            EventType::NodeConditionEvidenceGone => "node.condition_evidence_gone",
            EventType::RemediationWaiting => "remediation.waiting",
            EventType::RemediationActing => "remediation.acting",
            EventType::RemediationVerifying => "remediation.verifying",
            EventType::RemediationSucceeded => "remediation.succeeded",
            EventType::RemediationFailed => "remediation.failed",
            EventType::RemediationGaveUp => "remediation.gave_up",
            EventType::RemediationCancelled => "remediation.cancelled",
            EventType::NodeTainted => "node.tainted",
            EventType::NodeUntainted => "node.untainted",
            EventType::NodeLabelSet => "node.label_set",
            EventType::NodeLabelRemoved => "node.label_removed",
            EventType::NodeInventoryLabelsChanged => "node.inventory_labels_changed",
            EventType::NodeGpuCountChanged => "node.gpu_count_changed",
            EventType::NodeHardwareKeyChanged => "node.hardware_key_changed",
            EventType::NodeSpecGeneration => "node.spec_generation",
            EventType::NodeObservedGeneration => "node.observed_generation",
            EventType::NodeIdentityRevoked => "node.identity_revoked",
            EventType::NodePowerChanged => "node.power_changed",
            EventType::NodePowerAction => "node.power_action",
            EventType::WorkflowStarted => "workflow.started",
            EventType::WorkflowStepChanged => "workflow.step_changed",
            EventType::WorkflowFinished => "workflow.finished",
            EventType::CommandQueued => "command.queued",
            EventType::CommandDispatched => "command.dispatched",
            EventType::CommandRunning => "command.running",
            EventType::CommandSucceeded => "command.succeeded",
            EventType::CommandFailed => "command.failed",
            EventType::CommandTimedOut => "command.timed_out",
            EventType::CommandCancelled => "command.cancelled",
            EventType::CommandExpired => "command.expired",
            EventType::TenantCreated => "tenant.created",
            EventType::SiteCreated => "site.created",
            EventType::PoolCreated => "pool.created",
            EventType::PoolOffered => "pool.offered",
            EventType::PoolUpdated => "pool.updated",
            EventType::JoinTokenCreated => "join_token.created",
            EventType::JoinTokenRevoked => "join_token.revoked",
            EventType::SiteLivenessPaused => "site.liveness_paused",
            EventType::SiteLivenessResumed => "site.liveness_resumed",
            EventType::SiteLivenessReleased => "site.liveness_released",
            EventType::ReservationCreated => "reservation.created",
            EventType::ReservationPlaced => "reservation.placed",
            EventType::ReservationEvicted => "reservation.evicted",
            EventType::ReservationReleased => "reservation.released",
            EventType::ReservationFailed => "reservation.failed",
            EventType::AllocationBooked => "allocation.booked",
            EventType::AllocationReleased => "allocation.released",
        }
    }

    #[test]
    fn event_types_are_pinned_and_round_trip() {
        assert_eq!(EventType::ALL.len(), 66);
        let mut seen = std::collections::BTreeSet::new();
        for t in EventType::ALL.iter().copied() {
            let spelling = pinned(t);
            assert!(seen.insert(spelling), "`{spelling}` is spelled twice");
            assert_eq!(t.as_static_str(), spelling);
            assert_eq!(t.to_string(), spelling);
            assert_eq!(EventType::from_str(spelling).ok(), Some(t));
            let json = serde_json::to_string(&t).expect("serialises");
            assert_eq!(json, format!("\"{spelling}\""));
            assert_eq!(serde_json::from_str::<EventType>(&json).ok(), Some(t));
        }
        assert!(EventType::from_str("test.filler").is_err());
    }

    #[test]
    fn remediation_events_are_remediation_dot_status() {
        for status in crate::remediation::AttemptStatus::ALL.iter().copied() {
            assert_eq!(
                EventType::remediation(status).as_static_str(),
                format!("remediation.{status}")
            );
        }
    }

    #[test]
    fn command_events_are_command_dot_status() {
        for status in CommandStatus::ALL.iter().copied() {
            assert_eq!(
                EventType::command(status).as_static_str(),
                format!("command.{status}")
            );
        }
    }

    /// Axes are stored in the event log too.
    #[test]
    fn axes_are_pinned() {
        let spellings: Vec<&str> = Axis::ALL.iter().map(|a| a.as_static_str()).collect();
        assert_eq!(
            spellings,
            [
                "provisionState",
                "maintenance",
                "cordoned",
                "power",
                "connectivity",
                "conditions",
                "noScheduleReasons",
                "labels",
                "taints",
                "identityGeneration",
                "generation",
                "observedGeneration",
                "lifecycle",
                "inventory",
                "command",
            ]
        );
        for axis in Axis::ALL.iter().copied() {
            assert_eq!(Axis::from_str(axis.as_static_str()).ok(), Some(axis));
        }
    }
}
