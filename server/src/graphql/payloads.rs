//! What mutations answer. Every mutation returns an object of its own (`CordonNodePayload`,
//! `CreateTenantPayload`, …) that holds the API's existing views (`NodeDetail`, `Command`,
//! `Tenant`, …) rather than one of those views itself, so a mutation can later answer more
//! (a warning, a second object) without breaking the clients that read what it answers today.

use async_graphql::SimpleObject;

use super::types::{Command, JoinToken, NodeDetail, Pool, Site, Tenant};

/// Declares the payload of a node mutation: the node as the mutation left it.
macro_rules! node_payload {
    ($($(#[doc = $doc:literal])+ $name:ident;)+) => {$(
        $(#[doc = $doc])+
        #[derive(SimpleObject)]
        pub struct $name {
            /// The node as the mutation left it, with its new `version` (the same one when
            /// nothing had to change).
            pub node: NodeDetail,
        }
    )+};
}

node_payload! {
    /// What `cordonNode` answers.
    CordonNodePayload;
    /// What `uncordonNode` answers.
    UncordonNodePayload;
    /// What `drainNode` answers.
    DrainNodePayload;
    /// What `taintNode` answers.
    TaintNodePayload;
    /// What `untaintNode` answers.
    UntaintNodePayload;
    /// What `labelNode` answers.
    LabelNodePayload;
    /// What `adoptNode` answers.
    AdoptNodePayload;
    /// What `retireNode` answers.
    RetireNodePayload;
    /// What `transitionNode` answers.
    TransitionNodePayload;
    /// What `revokeNodeIdentity` answers.
    RevokeNodeIdentityPayload;
    /// What `deleteNode` answers: the node as deleted (it stays readable with its history).
    DeleteNodePayload;
    /// What `enrollNode` answers: the new node, `ENROLLING`.
    EnrollNodePayload;
    /// What `clearNodeCondition` answers: the node with the condition `FALSE` (reason
    /// `ClearedByOperator`) and its reason gone from `noScheduleReasons`.
    ClearNodeConditionPayload;
}

/// What `sendCommand` answers.
#[derive(SimpleObject)]
pub struct SendCommandPayload {
    /// The commands queued, one per target node, in node id order. At most 10,000: a
    /// `sendCommand` that would reach more is refused before any is queued.
    pub commands: Vec<Command>,
}

/// What `cancelCommand` answers.
#[derive(SimpleObject)]
pub struct CancelCommandPayload {
    /// The command, `CANCELLED`. (One that had already finished is refused with
    /// `INVALID_STATE`.)
    pub command: Command,
}

/// What `createJoinToken` answers: the token and its secret, shown this once.
#[derive(SimpleObject)]
pub struct CreateJoinTokenPayload {
    /// The token as listed from now on (without its secret).
    pub join_token: JoinToken,
    /// `<jt_…>.<secret>`: what the daemon presents to `/v1/join`. Only its hash is stored, so
    /// it cannot be read again.
    pub secret: String,
    /// SHA-256 (hex) of the CA certificate's DER, for the daemon to pin.
    pub ca_certificate_sha256: String,
}

/// What `revokeJoinToken` answers.
#[derive(SimpleObject)]
pub struct RevokeJoinTokenPayload {
    /// The token, with `revokedAt` set.
    pub join_token: JoinToken,
}

/// What `createTenant` answers.
#[derive(SimpleObject)]
pub struct CreateTenantPayload {
    /// The new tenant.
    pub tenant: Tenant,
}

/// What `createSite` answers.
#[derive(SimpleObject)]
pub struct CreateSitePayload {
    /// The new site.
    pub site: Site,
}

/// What `updatePool` answers.
#[derive(SimpleObject)]
pub struct UpdatePoolPayload {
    /// The pool as changed.
    pub pool: Pool,
}

/// What `createPool` answers.
#[derive(SimpleObject)]
pub struct CreatePoolPayload {
    /// The new pool.
    pub pool: Pool,
}
