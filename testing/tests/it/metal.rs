//! The simulated bare metal of `better-compute dev --sim-metal N` (`bc_testing::metal`)
//! against a real server: machines behind simulated Redfish BMCs are enrolled by their BMCs
//! (https, the BMCs' own CA), inspected and commissioned to `ready` by the Workflow
//! controller (each BMC network-boots its machine, whose ramdisk daemon joins through the
//! gateway as the enrolled node and runs its burn-in), powered off; power actions reach the
//! BMCs and the Power controller sees them; a second run finds the same nodes at the same
//! BMCs and enrols nothing twice. Both databases; the controllers are ticked by hand.

use bc_core::axes::{Power, ProvisionState, SiteKind};
use bc_core::bare_metal::{BmcTlsVerification, PowerAction};
use bc_core::clock::Clock;
use bc_core::ids::NodeId;
use bc_core::workflow::{WorkflowKind, WorkflowStatus};
use bc_testing::daemon::{CaTrust, DaemonKnobs, GatewayContext};
use bc_testing::each_backend;
use bc_testing::metal::{
    BootSource, MetalFleet, MetalOptions, MetalPlace, ensure_metal_pool, hostname,
};
use better_compute::auth::{Principal, Role};
use better_compute::controllers::{PowerController, WorkflowController};
use better_compute::service::{NodeFilter, Services};
use std::sync::Arc;
use std::time::Duration;

const MACHINES: usize = 2;
/// Two machines through TLS joins, inventory, a 300 ms burn-in and a firmware refresh on
/// a loaded 2-core machine take seconds; this only bounds a broken run.
const SETTLE: Duration = Duration::from_secs(120);
/// Past the Power controller's poll interval and its jitter (60 s ± 6 s by default): every
/// BMC is due again.
const PAST_A_POLL: chrono::Duration = chrono::Duration::seconds(70);

fn admin(s: &bc_testing::TestServer) -> Principal {
    Principal {
        subject: "test-admin".to_owned(),
        role: Role::Admin,
        tenant: None,
        expires_at: s.clock.now() + chrono::Duration::days(1),
    }
}

async fn power_of(services: &Services, admin: &Principal, id: &NodeId) -> (Power, i64) {
    let view = services
        .bare_metal_node(admin, id)
        .await
        .unwrap_or_else(|err| panic!("the bare-metal view: {}", err.message()));
    (view.power, view.node.record.version)
}

/// One pass of the Power controller.
async fn poll(power: &mut PowerController) {
    power
        .tick()
        .await
        .unwrap_or_else(|err| panic!("a power pass: {}", err.message()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_bare_metal_machines_are_enrolled_by_their_bmcs_and_walk_to_ready() {
    each_backend(async |s| {
        let services = s.server.services.clone();
        let admin = admin(s);
        let site = services
            .create_site(&admin, "metal-lab", SiteKind::Platform, None)
            .await
            .expect("a site")
            .id;
        let pool = ensure_metal_pool(&services, &admin, &site, "dev-metal", 8)
            .await
            .expect("a pool");
        assert_eq!(
            ensure_metal_pool(&services, &admin, &site, "dev-metal", 8)
                .await
                .expect("the pool"),
            pool,
            "the pool is created once"
        );
        let context = Arc::new(
            GatewayContext::resolve(&s.gateway_url(), &CaTrust::Pem(s.ca_pem()))
                .await
                .expect("the gateway"),
        );
        let place = MetalPlace {
            principal: admin.clone(),
            site: site.clone(),
            pool: pool.clone(),
        };
        let secret = place
            .join_token(&services, "simulated bare metal")
            .await
            .expect("a join token");
        let state = tempfile::tempdir().expect("a directory");
        let options = MetalOptions {
            machines: MACHINES,
            seed: 7,
            knobs: DaemonKnobs::default(),
            state_file: Some(state.path().join("bmcs.json")),
        };
        let fleet = MetalFleet::start(
            services.clone(),
            place.clone(),
            context.clone(),
            secret.clone(),
            &options,
        )
        .await
        .expect("the fleet starts");
        let started = fleet.progress().await.expect("its progress");
        assert_eq!(
            started.to_string(),
            "2/2 enrolled, 2 inspecting, 0 commissioning, 0 ready, 0 failed",
            "every machine enrolled and its inspection started"
        );

        let mut workflows = WorkflowController::new(services.clone());
        let mut power = PowerController::new(services.clone());
        let mut nodes = Vec::new();
        for machine in fleet.machines() {
            nodes.push(
                fleet
                    .node_id(&machine.hostname)
                    .await
                    .expect("a read")
                    .expect("the machine is a node"),
            );
        }
        // The machines the Power controller saw on: a power step of a workflow makes the
        // BMC due at once, so the axis follows the inspection's power-on.
        let mut seen_on: Vec<NodeId> = Vec::new();
        let deadline = tokio::time::Instant::now() + SETTLE;
        let ready = loop {
            workflows
                .tick()
                .await
                .unwrap_or_else(|err| panic!("a workflow pass: {}", err.message()));
            poll(&mut power).await;
            for id in &nodes {
                if !seen_on.contains(id) && power_of(&services, &admin, id).await.0 == Power::On {
                    seen_on.push(id.clone());
                }
            }
            let progress = fleet.progress().await.expect("its progress");
            assert_eq!((progress.failed, progress.errors), (0, 0), "{progress}");
            if progress.ready == MACHINES {
                break progress;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "not ready in time: {progress}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            ready.to_string(),
            "2/2 enrolled, 0 inspecting, 0 commissioning, 2 ready, 0 failed"
        );
        assert_eq!(seen_on.len(), MACHINES, "the power axis followed the BMCs");
        for id in &nodes {
            assert_eq!(
                power_of(&services, &admin, id).await.0,
                Power::Off,
                "commissioning ends with the machine off"
            );
        }

        let mut ids = Vec::new();
        for (i, machine) in fleet.machines().iter().enumerate() {
            assert_eq!(machine.hostname, hostname(i));
            let id = fleet
                .node_id(&machine.hostname)
                .await
                .expect("a read")
                .expect("the machine is a node");
            let view = services
                .bare_metal_node(&admin, &id)
                .await
                .unwrap_or_else(|err| panic!("the bare-metal view: {}", err.message()));
            let node = &view.node.record;
            assert_eq!(node.provision_state, ProvisionState::Ready);
            assert!(!node.maintenance);
            assert_eq!(
                node.identity_generation, 2,
                "the ramdisk's daemon joined as the enrolled node, once"
            );
            let bmc = view.bmc.expect("a BMC");
            assert_eq!(bmc.tls_verification, BmcTlsVerification::CustomCa);
            assert_eq!(bmc.address, fleet.bmcs().url.clone() + "/");
            let kinds: Vec<(WorkflowKind, WorkflowStatus)> = view
                .workflows
                .iter()
                .rev()
                .map(|w| (w.kind, w.status))
                .collect();
            assert_eq!(
                kinds,
                [
                    (WorkflowKind::Inspect, WorkflowStatus::Succeeded),
                    (WorkflowKind::Commission, WorkflowStatus::Succeeded)
                ]
            );
            assert_eq!(
                fleet.bmcs().boots(&machine.system_id),
                [BootSource::Network],
                "the inspection booted the ramdisk from the network"
            );
            assert_eq!(
                fleet.bmcs().power_on(&machine.system_id),
                Some(false),
                "commissioning powered it off"
            );
            assert!(
                fleet.bmcs().daemon(&machine.system_id).is_none(),
                "its daemon stopped with it"
            );
            ids.push(id);
        }

        // The Power controller reads each BMC once a poll interval: a poll later it reads
        // every machine off, its BMC reachable.
        s.clock.advance(PAST_A_POLL);
        poll(&mut power).await;
        for id in &ids {
            assert_eq!(power_of(&services, &admin, id).await.0, Power::Off);
            let bmc = services
                .bare_metal_node(&admin, id)
                .await
                .unwrap_or_else(|err| panic!("{}", err.message()))
                .bmc
                .expect("a BMC");
            assert_eq!(bmc.reachable, Some(true), "{bmc:?}");
        }

        // An operator's power actions reach the machine's BMC; the Power controller reads
        // the change at once. Powered on without a boot override, a ready machine boots its
        // disk, which holds nothing yet: no daemon.
        let first = &fleet.machines()[0];
        for (action, on, boots) in [
            (PowerAction::On, true, 2),
            (PowerAction::Cycle, true, 3),
            (PowerAction::Off, false, 3),
        ] {
            let version = power_of(&services, &admin, &ids[0]).await.1;
            services
                .power_node(&admin, &ids[0], version, action, false)
                .await
                .unwrap_or_else(|err| panic!("{action}: {}", err.message()));
            assert_eq!(
                fleet.bmcs().power_on(&first.system_id),
                Some(on),
                "{action}"
            );
            let history = fleet.bmcs().boots(&first.system_id);
            assert_eq!(history.len(), boots, "{action}: {history:?}");
            assert!(history[1..].iter().all(|b| *b == BootSource::Disk));
            assert!(fleet.bmcs().daemon(&first.system_id).is_none());
            poll(&mut power).await;
            assert_eq!(
                power_of(&services, &admin, &ids[0]).await.0,
                if on { Power::On } else { Power::Off },
                "{action}"
            );
        }

        // `dev` again: the same machines at the same BMCs; nothing is enrolled twice and
        // no inspection starts over.
        fleet.shutdown().await;
        let again = MetalFleet::start(services.clone(), place, context, secret, &options)
            .await
            .expect("the fleet starts again");
        assert_eq!(
            again.progress().await.expect("its progress").to_string(),
            "2/2 enrolled, 0 inspecting, 0 commissioning, 2 ready, 0 failed"
        );
        let in_pool = services
            .count_nodes(
                &admin,
                NodeFilter {
                    pool_ids: vec![pool.clone()],
                    ..NodeFilter::default()
                },
            )
            .await
            .expect("a count");
        assert_eq!(in_pool, MACHINES as u64);
        s.clock.advance(PAST_A_POLL);
        poll(&mut power).await;
        for id in &ids {
            let view = services
                .bare_metal_node(&admin, id)
                .await
                .unwrap_or_else(|err| panic!("{}", err.message()));
            assert_eq!(
                view.bmc.expect("a BMC").reachable,
                Some(true),
                "the BMC answers where it was enrolled"
            );
            assert_eq!(view.power, Power::Off);
        }
        again.shutdown().await;
    })
    .await;
}
