//! The controllers' leadership between replicas on one database (issue 16, item 2): one
//! server holds the lease and runs the passes; another takes over when the leader stops
//! renewing (it died) or gives the lease up (it stopped).

use bc_testing::each_backend;
use better_compute::controllers::Leadership;
use better_compute::controllers::leadership::{CONTROLLERS_LEASE, LEASE_TICKS};
use std::time::Duration;

/// The tick the candidates run at (the default).
const TICK: Duration = Duration::from_secs(5);

fn seconds(s: i64) -> chrono::Duration {
    chrono::Duration::seconds(s)
}

#[tokio::test]
async fn one_replica_leads_and_another_takes_over_when_it_dies_or_stops() {
    each_backend(async |a| {
        let b = a.replica().await.expect("starting a replica");
        let first = Leadership::new(a.server.services.clone(), TICK);
        let second = Leadership::new(b.server.services.clone(), TICK);
        let lease_of = async || {
            a.server
                .services
                .lease(CONTROLLERS_LEASE)
                .await
                .expect("reading the lease")
                .expect("a lease was taken")
        };

        assert!(first.check().await, "the first to ask leads");
        assert!(
            !second.check().await,
            "a lease that has not lapsed is not taken over"
        );
        let taken = lease_of().await;
        assert_eq!(taken.holder, first.holder());

        // The leader renews every tick; the lease keeps the time it was taken.
        a.clock.advance(seconds(5));
        assert!(first.check().await);
        assert!(!second.check().await);
        let renewed = lease_of().await;
        assert_eq!(renewed.since, taken.since);
        assert!(renewed.expires_at > taken.expires_at);

        // The leader dies: nobody renews, and the lease lapses LEASE_TICKS ticks after the
        // last renewal, not before.
        let lasts = seconds(TICK.as_secs() as i64 * i64::from(LEASE_TICKS));
        a.clock.advance(lasts - seconds(1));
        assert!(!second.check().await, "taken over before the lease lapsed");
        a.clock.advance(seconds(2));
        assert!(
            second.check().await,
            "not taken over after the lease lapsed"
        );
        assert_eq!(lease_of().await.holder, second.holder());
        assert!(!first.check().await, "a leader that comes back follows");

        // A leader that stops gives the lease up: the other takes it at once.
        second.resign().await;
        assert!(first.check().await, "a resigned lease is free at once");
        assert_eq!(lease_of().await.holder, first.holder());
        let leading = first.leading();
        assert!(leading.load(std::sync::atomic::Ordering::Relaxed));

        b.stop().await;
    })
    .await;
}
