//! The workload of `better-compute dev --sim N --workload R` (`bc_testing::workload`) on a
//! small simulated fleet: once the fleet is schedulable, its reservations are placed and
//! released, and the pool's GPUs are booked and freed. Both databases.

use bc_core::ids::PoolId;
use bc_testing::daemon::CaTrust;
use bc_testing::each_backend;
use bc_testing::sim::{Fleet, SimOptions};
use bc_testing::workload::{WORKLOAD_TENANT, WorkloadOptions, WorkloadReport, run_workload};
use better_compute::controllers::LifecycleController;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Three nodes through TLS joins, acceptance and convergence on a loaded 2-core machine; and
/// the workload's first placements and releases after that.
const SETTLE: Duration = Duration::from_secs(120);
const NODES: usize = 3;
/// What the workload must have done before the test stops it.
const ENOUGH: u64 = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workload_places_and_releases_reservations_on_a_simulated_fleet() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), NODES as i64).await;
        let fleet = Fleet::start(
            &[s.gateway_url()],
            &secret,
            CaTrust::Pem(s.ca_pem()),
            NODES,
            &SimOptions {
                seed: Some(13),
                ..SimOptions::default()
            },
        )
        .await
        .expect("the fleet starts");
        // The test server runs no controller loop: acceptance and the first spec advance on
        // the lifecycle controller's ticks.
        let mut lifecycle = LifecycleController::new(s.server.services.clone());
        let deadline = tokio::time::Instant::now() + SETTLE;
        loop {
            lifecycle.tick().await.expect("a lifecycle pass");
            let schedulable = s
                .admin("{ nodes(filter: {schedulable: true}) { totalCount } }", json!({}))
                .await["nodes"]["totalCount"]
                .as_u64();
            if schedulable == Some(NODES as u64) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the fleet did not become schedulable: {:?}",
                fleet.progress()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // Short lives and frequent reports: the test stops the workload once a report shows
        // enough placed and released.
        let options = WorkloadOptions {
            lifetime: Duration::from_millis(100)..=Duration::from_millis(500),
            report_every: Duration::from_millis(200),
            seed: Some(13),
            ..WorkloadOptions::new(20.0, 8).expect("valid options")
        };
        let enough = Arc::new(Notify::new());
        let reports: Arc<Mutex<Vec<WorkloadReport>>> = Arc::default();
        let report = {
            let enough = enough.clone();
            let reports = reports.clone();
            move |report: WorkloadReport| {
                if report.totals.placed_at_once >= ENOUGH && report.totals.released >= ENOUGH {
                    enough.notify_one();
                }
                reports.lock().expect("the reports").push(report);
            }
        };
        let counts = tokio::time::timeout(
            SETTLE,
            run_workload(
                s.server.services.clone(),
                PoolId::parse(&pool).expect("a pool id"),
                options,
                report,
                enough.notified(),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("the workload did not get going: {:?}", reports.lock().expect("the reports").last()))
        .expect("the workload runs");
        assert!(counts.placed_at_once >= ENOUGH && counts.released >= ENOUGH, "{counts:?}");
        assert_eq!(counts.errors, 0, "{counts:?}");
        let reports = reports.lock().expect("the reports").clone();
        assert!(
            reports.iter().any(|r| r.allocated_gpus > 0),
            "the pool's GPUs were booked: {reports:#?}"
        );
        assert!(
            reports.iter().all(|r| r.allocated_gpus + r.free_gpus == 8 * NODES as i64),
            "{reports:#?}"
        );
        // The reservations are the workload tenant's, in the simulated fleet's pool.
        let listed = s
            .admin(
                "{ reservations(first: 1) { totalCount nodes { poolId tenantId } } tenants(first: 1000) { nodes { id name } } }",
                json!({}),
            )
            .await;
        assert!(
            listed["reservations"]["totalCount"].as_u64() >= Some(counts.created),
            "{listed:#}"
        );
        let tenant = listed["tenants"]["nodes"]
            .as_array()
            .expect("tenants")
            .iter()
            .find(|t| t["name"] == WORKLOAD_TENANT)
            .expect("the workload's tenant");
        assert_eq!(listed["reservations"]["nodes"][0]["tenantId"], tenant["id"]);
        assert_eq!(listed["reservations"]["nodes"][0]["poolId"], pool.as_str());
        fleet.shutdown().await;
    })
    .await;
}
