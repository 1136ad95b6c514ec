//! The control plane under abuse: requests that once exhausted a resource, each checked on
//! both backends.

use bc_core::axes::ProvisionState;
use bc_testing::each_backend_with;
use better_compute::auth::Role;
use futures::future::join_all;
use serde_json::json;
use std::time::Instant;

use crate::common::{node_record, site_and_pool};

/// Concurrent reads, far more than the pool has connections.
const CONCURRENT_READS: usize = 500;
/// A small pool, so a request that held one connection while waiting for another would
/// starve the rest at once.
const POOL: u32 = 4;

/// Every read holds at most one pooled connection at a time: 500 concurrent `node` and
/// `nodes` reads through a pool of 4 all answer. (Before, `node` kept its read transaction
/// while building the view on two more connections: 15 concurrent reads stalled until the
/// acquire timeout and ended `INTERNAL`.)
#[tokio::test]
async fn concurrent_reads_never_deadlock_the_pool() {
    let small_pool = |config: &mut better_compute::config::Config| {
        config.database.max_connections = POOL;
        config.database.acquire_timeout_secs = 5;
    };
    each_backend_with(small_pool, async |s| {
        let sp = site_and_pool(s).await;
        let nodes: Vec<_> = (0..20)
            .map(|_| node_record(s, &sp, ProvisionState::Adopted))
            .collect();
        s.insert_nodes(&nodes).await;
        let token = s.token(Role::Viewer);
        let started = Instant::now();
        let answers = join_all((0..CONCURRENT_READS).map(|i| {
            let token = token.clone();
            let id = nodes[i % nodes.len()].id.to_string();
            async move {
                if i % 2 == 0 {
                    s.gql(
                        Some(&token),
                        "query($id: ID!) { node(id: $id) { id version session { epoch } } }",
                        json!({ "id": id }),
                    )
                    .await
                } else {
                    s.gql(
                        Some(&token),
                        "{ nodes(first: 10) { totalCount nodes { id session { epoch } } } }",
                        json!({}),
                    )
                    .await
                }
            }
        }))
        .await;
        let failed: Vec<_> = answers
            .iter()
            .filter(|a| a.code().is_some())
            .map(|a| a.error().to_string())
            .collect();
        eprintln!(
            "{:?}: {CONCURRENT_READS} concurrent reads through a pool of {POOL}: {} failed, {:?}",
            s.backend,
            failed.len(),
            started.elapsed()
        );
        assert!(
            failed.is_empty(),
            "{} reads failed, first: {}",
            failed.len(),
            failed[0]
        );
    })
    .await;
}
