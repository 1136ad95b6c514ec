//! The API view of a node ([`NodeDetail`]): a [`NodeRecord`] plus what the API adds to it,
//! the current session and why the node is or is not schedulable.
//!
//! It lives apart from [`crate::node`] so the dependencies run one way: `schedule` reads
//! records, and this module composes a record with a schedule explanation.

use crate::ids::TenantId;
use crate::node::{NodeRecord, Session};
use crate::schedule::{Explanation, SchedulingFacts};

/// The API view of a node, the seed's `NodeDetail`: the record, the current (or last) gateway
/// session, and the schedulability explanation computed when the view was built.
///
/// It holds the whole record, so a new node field is added in one place. What the seed keeps
/// out of the view (`power`, `adapter`, `drivers` and the hardware key itself, of which only
/// `hardwareKeyTrusted` is shown) is hidden by the GraphQL layer: its `NodeDetail` output type
/// has no field for them, and `server/tests/schema.rs` checks that it stays so. This type is
/// therefore not `Serialize`: hand it to the GraphQL layer, never to a serialiser.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeDetail {
    /// Everything the control plane knows about the node.
    pub record: NodeRecord,
    /// The current (or last) session; `None` for a node that never connected.
    pub session: Option<Session>,
    /// Why the node is or is not schedulable: every failing check and the capacity bucket of
    /// the first.
    pub schedulability: Explanation,
}

impl NodeDetail {
    /// The API view of `record`. `pool_owner_tenant_id` is the owner of the node's pool,
    /// which the trust check of schedulability needs.
    pub fn new(
        record: NodeRecord,
        session: Option<Session>,
        pool_owner_tenant_id: Option<&TenantId>,
    ) -> NodeDetail {
        let schedulability = SchedulingFacts::of(&record, pool_owner_tenant_id).explain();
        NodeDetail {
            record,
            session,
            schedulability,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::axes::{ProvisionState, Trust};
    use crate::node::tests::node;
    use crate::schedule::{CapacityBucket, Check};

    #[test]
    fn the_view_keeps_the_record_and_explains_it_with_the_pool_owner() {
        let owner = TenantId::parse("ten_a").expect("id");
        let mut record = node(ProvisionState::Adopted);
        record.trust = Trust::TenantOwned;
        record.owner_tenant_id = Some(owner.clone());

        let in_own_pool = NodeDetail::new(record.clone(), None, Some(&owner));
        assert_eq!(in_own_pool.record, record);
        assert!(
            !in_own_pool
                .schedulability
                .failing
                .iter()
                .any(|f| f.check == Check::TrustAllowsPool)
        );

        let elsewhere = NodeDetail::new(record, None, None);
        assert_eq!(elsewhere.schedulability.bucket, CapacityBucket::Excluded);
        assert_eq!(
            elsewhere.schedulability.failing.first().map(|f| f.check),
            Some(Check::TrustAllowsPool)
        );
    }
}
