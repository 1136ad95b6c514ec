//! [`Fleet`]: many [`FakeDaemon`]s against one gateway (or several replicas' gateways), for `better-compute dev --sim N`,
//! `better-compute sim`, tests and the `fleet-bench` benchmark.
//!
//! The fleet resolves the CA once, shares one join client, and bounds how many joins, and
//! apart from them how many session handshakes, run at once
//! ([`SimOptions::join_concurrency`]), so ten thousand
//! daemons come up steadily instead of all at once. Machines derive from the fleet's seed:
//! the same seed, node count and prefix give the same machines (and hostnames), so running
//! a simulation again re-joins the same nodes in place.

use crate::daemon::{
    CaTrust, DaemonError, DaemonKnobs, ErrorCounts, FakeDaemon, FleetCounters, GatewayContext,
};
use crate::inventory;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Joins and session handshakes in flight at once, by default.
pub const DEFAULT_JOIN_CONCURRENCY: usize = 64;
/// How often [`run_sim`] reports progress, by default.
pub const DEFAULT_REPORT_EVERY: Duration = Duration::from_secs(2);
/// When the GPUs of [`SimOptions::mixed`] fail in service: after the fleet is accepted.
pub const MIXED_FAULT_AFTER: Duration = Duration::from_secs(45);
/// How often [`Fleet::wait_for`] looks at the counters.
const PROGRESS_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long [`Fleet::shutdown`] waits for daemons to close their sessions before it aborts
/// the rest.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(15);

/// A change applied to the knobs of a share of the fleet.
#[derive(Clone)]
pub struct KnobOverride {
    pub name: String,
    /// Between 0 and 1: the share of nodes it applies to (rounded to whole nodes, spread
    /// evenly over the fleet).
    pub share: f64,
    apply: Arc<dyn Fn(&mut DaemonKnobs) + Send + Sync>,
}

impl std::fmt::Debug for KnobOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KnobOverride")
            .field("name", &self.name)
            .field("share", &self.share)
            .finish()
    }
}

impl KnobOverride {
    pub fn new(
        name: impl Into<String>,
        share: f64,
        apply: impl Fn(&mut DaemonKnobs) + Send + Sync + 'static,
    ) -> KnobOverride {
        KnobOverride {
            name: name.into(),
            share: share.clamp(0.0, 1.0),
            apply: Arc::new(apply),
        }
    }

    /// The GPU diagnostic fails.
    pub fn failing_diagnostics(share: f64) -> KnobOverride {
        KnobOverride::new("failing diagnostics", share, |k| k.fail_diagnostics = true)
    }

    /// One GPU fewer than the others (7 of 8).
    pub fn missing_gpu(share: f64) -> KnobOverride {
        KnobOverride::new("a missing GPU", share, |k| {
            k.gpu_count = k.gpu_count.saturating_sub(1)
        })
    }

    /// A machine without GPUs (a CPU machine, or a GPU machine whose driver did not load).
    pub fn no_gpus(share: f64) -> KnobOverride {
        KnobOverride::new("no GPUs", share, |k| k.gpu_count = 0)
    }

    /// The machine runs another NVIDIA driver than the fleet's default.
    pub fn driver_version(share: f64, version: impl Into<String>) -> KnobOverride {
        let version = version.into();
        KnobOverride::new(format!("NVIDIA driver {version}"), share, move |k| {
            k.driver_version.clone_from(&version)
        })
    }

    /// The GPUs report these XID errors.
    pub fn xid_errors(share: f64, xids: Vec<u32>) -> KnobOverride {
        KnobOverride::new(format!("XID {xids:?}"), share, move |k| {
            k.xid_errors.clone_from(&xids)
        })
    }

    /// A GPU fails in service: the machine reports `xids` from `after` the daemon starts
    /// (after acceptance, on a fleet that comes up in time). `fixable`: the remedy the XID
    /// table names works (a `gpu.reset` clears reset XIDs, a `node.reboot` reset and reboot
    /// XIDs); otherwise nothing clears them and health remediation gives up.
    pub fn gpu_fails_in_service(
        share: f64,
        xids: Vec<u32>,
        after: Duration,
        fixable: bool,
    ) -> KnobOverride {
        let name = format!(
            "XID {xids:?} after {after:?}, {}",
            if fixable { "fixable" } else { "never fixed" }
        );
        KnobOverride::new(name, share, move |k| {
            k.xid_errors.clone_from(&xids);
            k.xid_after = Some(after);
            k.reset_clears_faults = fixable;
            k.reboot_clears_faults = fixable;
        })
    }

    /// The session drops and comes back every `every`.
    pub fn flapping(share: f64, every: Duration) -> KnobOverride {
        KnobOverride::new(format!("flapping every {every:?}"), share, move |k| {
            k.flapping = Some(every)
        })
    }

    /// Every heartbeat comes `delay` late.
    pub fn slow_heartbeats(share: f64, delay: Duration) -> KnobOverride {
        KnobOverride::new(format!("heartbeats {delay:?} late"), share, move |k| {
            k.heartbeat_delay = delay
        })
    }

    /// No heartbeats at all.
    pub fn lost_heartbeats(share: f64) -> KnobOverride {
        KnobOverride::new("no heartbeats", share, |k| k.skip_heartbeats = true)
    }

    /// Whether node `index` of `nodes` gets override number `position` of the fleet: exactly
    /// `round(share × nodes)` nodes do, spread evenly, and each override starts at another
    /// place so two overrides of a small share rarely hit the same nodes.
    pub fn applies_to(&self, position: usize, index: usize, nodes: usize) -> bool {
        if nodes == 0 {
            return false;
        }
        let offset = position.wrapping_mul(nodes / 7 + 1) % nodes;
        let j = (index + offset) % nodes;
        let share = self.share;
        let before = ((j as f64) * share + 0.5).floor();
        let after = (((j + 1) as f64) * share + 0.5).floor();
        after > before
    }
}

/// How a fleet is built.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// The knobs of every node before overrides (its `seed` and `hostname` are ignored: each
    /// node gets its own from the fleet's seed).
    pub knobs: DaemonKnobs,
    pub overrides: Vec<KnobOverride>,
    /// Joins in flight at once, and (apart) session handshakes in flight at once.
    pub join_concurrency: usize,
    /// The fleet's seed (None: random). The same seed is the same machines.
    pub seed: Option<u64>,
    /// Hostnames are `<prefix><index, 5 digits>`; None: `sim-<4 hex digits of the seed>-`.
    pub hostname_prefix: Option<String>,
    /// How often [`run_sim`] reports.
    pub report_every: Duration,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            knobs: DaemonKnobs::default(),
            overrides: Vec::new(),
            join_concurrency: DEFAULT_JOIN_CONCURRENCY,
            seed: None,
            hostname_prefix: None,
            report_every: DEFAULT_REPORT_EVERY,
        }
    }
}

impl SimOptions {
    /// A fleet that looks like a real one on a dashboard: mostly healthy, with 5 % failing
    /// GPU diagnostics (they fail acceptance), 5 % missing a GPU, and GPUs failing in
    /// service [`MIXED_FAULT_AFTER`] after the fleet starts, for health remediation to
    /// treat: 5 % XID 48 that a `gpu.reset` fixes, 5 % XID 79 (fallen off the bus) that a
    /// `node.reboot` fixes, and 5 % XID 79 that nothing fixes, on which remediation climbs
    /// its whole ladder and gives up (maintenance on, `GpuNeedsPerson`).
    pub fn mixed() -> SimOptions {
        SimOptions::mixed_failing_after(MIXED_FAULT_AFTER)
    }

    /// [`SimOptions::mixed`] with its GPUs failing in service `after` the daemons start
    /// instead of [`MIXED_FAULT_AFTER`]: sooner to watch remediation, or never within a test
    /// that is about the fleet as it joins.
    pub fn mixed_failing_after(after: Duration) -> SimOptions {
        SimOptions {
            overrides: vec![
                KnobOverride::failing_diagnostics(0.05),
                KnobOverride::missing_gpu(0.05),
                KnobOverride::gpu_fails_in_service(0.05, vec![48], after, true),
                KnobOverride::gpu_fails_in_service(0.05, vec![79], after, true),
                KnobOverride::gpu_fails_in_service(0.05, vec![79], after, false),
            ],
            ..SimOptions::default()
        }
    }

    /// The knobs of node `index` of `nodes` under `seed`.
    pub fn knobs_for(&self, seed: u64, index: usize, nodes: usize) -> DaemonKnobs {
        let mut knobs = self.knobs.clone();
        for (position, change) in self.overrides.iter().enumerate() {
            if change.applies_to(position, index, nodes) {
                (change.apply)(&mut knobs);
            }
        }
        let derived = inventory::derive(seed, &format!("node:{index}"));
        let mut node_seed = [0u8; 8];
        node_seed.copy_from_slice(&derived[..8]);
        knobs.seed = Some(u64::from_le_bytes(node_seed));
        knobs.hostname = Some(format!("{}{index:05}", self.prefix(seed)));
        knobs.identifiers = None;
        knobs
    }

    fn prefix(&self, seed: u64) -> String {
        self.hostname_prefix.clone().unwrap_or_else(|| {
            format!(
                "sim-{}-",
                &hex::encode(inventory::derive(seed, "fleet"))[..4]
            )
        })
    }
}

/// How far a fleet is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    pub nodes: usize,
    /// Daemons that joined at least once.
    pub joined: u64,
    /// Daemons whose session is up now.
    pub connected: u64,
    /// Daemons that gave up (a refused token, a revoked identity, …).
    pub failed: u64,
    /// Errors so far (each failed try counts).
    pub errors: u64,
    /// `errors` by kind.
    #[serde(default)]
    pub errors_by_kind: ErrorCounts,
    /// Sessions opened so far (reconnects count again).
    pub sessions: u64,
    pub heartbeats_sent: u64,
    pub renewals: u64,
}

/// The progress of several fleets (simulator processes) as one.
impl std::iter::Sum for Progress {
    fn sum<I: Iterator<Item = Progress>>(all: I) -> Progress {
        all.fold(Progress::default(), |total, p| Progress {
            nodes: total.nodes + p.nodes,
            joined: total.joined + p.joined,
            connected: total.connected + p.connected,
            failed: total.failed + p.failed,
            errors: total.errors + p.errors,
            errors_by_kind: total.errors_by_kind + p.errors_by_kind,
            sessions: total.sessions + p.sessions,
            heartbeats_sent: total.heartbeats_sent + p.heartbeats_sent,
            renewals: total.renewals + p.renewals,
        })
    }
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} joined, {}/{} connected, {} failed, {} errors",
            self.joined, self.nodes, self.connected, self.nodes, self.failed, self.errors,
        )?;
        if self.errors > 0 {
            write!(f, " ({})", self.errors_by_kind)?;
        }
        write!(f, ", {} heartbeats", self.heartbeats_sent)
    }
}

/// A running simulated fleet.
pub struct Fleet {
    context: Arc<GatewayContext>,
    counters: Arc<FleetCounters>,
    daemons: Vec<FakeDaemon>,
    tasks: Vec<JoinHandle<Result<(), DaemonError>>>,
    seed: u64,
}

impl Fleet {
    /// Resolves the CA once and starts `nodes` daemons. They join and connect in the
    /// background, at most `options.join_concurrency` joins and as many session handshakes at a
    /// time.
    pub async fn start(
        gateway_urls: &[impl AsRef<str>],
        join_secret: &str,
        ca: CaTrust,
        nodes: usize,
        options: &SimOptions,
    ) -> Result<Fleet, DaemonError> {
        let context = Arc::new(
            GatewayContext::resolve_all(gateway_urls, &ca)
                .await?
                .with_handshake_limit(options.join_concurrency),
        );
        Ok(Fleet::start_with(context, join_secret, nodes, options))
    }

    /// [`Fleet::start`] with a resolved context.
    pub fn start_with(
        context: Arc<GatewayContext>,
        join_secret: &str,
        nodes: usize,
        options: &SimOptions,
    ) -> Fleet {
        let seed = options.seed.unwrap_or_else(rand::random);
        let counters = Arc::new(FleetCounters::default());
        let daemons: Vec<FakeDaemon> = (0..nodes)
            .map(|index| {
                FakeDaemon::with_context(
                    context.clone(),
                    join_secret,
                    options.knobs_for(seed, index, nodes),
                    counters.clone(),
                )
                .starting_at_gateway(index)
            })
            .collect();
        let tasks = daemons.iter().map(FakeDaemon::start).collect();
        tracing::info!(nodes, seed, gateway = %context.gateway_url(), gateways = context.gateways(), "fleet started");
        Fleet {
            context,
            counters,
            daemons,
            tasks,
            seed,
        }
    }

    pub fn len(&self) -> usize {
        self.daemons.len()
    }

    pub fn is_empty(&self) -> bool {
        self.daemons.is_empty()
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn context(&self) -> &GatewayContext {
        &self.context
    }

    pub fn daemons(&self) -> &[FakeDaemon] {
        &self.daemons
    }

    /// Node ids of the daemons that joined.
    pub fn node_ids(&self) -> Vec<String> {
        self.daemons
            .iter()
            .filter_map(|d| d.with_status(|s| s.node_id.clone()))
            .collect()
    }

    pub fn progress(&self) -> Progress {
        let c = &self.counters;
        Progress {
            nodes: self.daemons.len(),
            joined: c.joined.load(Ordering::Relaxed),
            connected: c.connected.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            errors_by_kind: *c
                .errors_by_kind
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            sessions: c.sessions.load(Ordering::Relaxed),
            heartbeats_sent: c.heartbeats_sent.load(Ordering::Relaxed),
            renewals: c.renewals.load(Ordering::Relaxed),
        }
    }

    /// Waits until `predicate` holds for the progress, at most `timeout`; the progress then,
    /// or the last one seen as the error.
    pub async fn wait_for(
        &self,
        mut predicate: impl FnMut(&Progress) -> bool,
        timeout: Duration,
    ) -> Result<Progress, Progress> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let progress = self.progress();
            if predicate(&progress) {
                return Ok(progress);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(progress);
            }
            tokio::time::sleep(PROGRESS_POLL_INTERVAL).await;
        }
    }

    /// The last error of some failed daemon, to explain a fleet that cannot join.
    pub fn sample_error(&self) -> Option<String> {
        self.daemons
            .iter()
            .find_map(|d| d.with_status(|s| s.last_error.clone()))
    }

    /// Asks every daemon to stop (they close their sessions).
    pub fn stop(&self) {
        for daemon in &self.daemons {
            daemon.stop();
        }
    }

    /// Stops every daemon and waits for them (aborting those that take longer than
    /// [`SHUTDOWN_TIMEOUT`]); the final progress.
    pub async fn shutdown(mut self) -> Progress {
        self.stop();
        let tasks = std::mem::take(&mut self.tasks);
        let aborts: Vec<_> = tasks.iter().map(JoinHandle::abort_handle).collect();
        if tokio::time::timeout(SHUTDOWN_TIMEOUT, futures::future::join_all(tasks))
            .await
            .is_err()
        {
            tracing::warn!("some daemons did not stop in time; aborting them");
            for abort in aborts {
                abort.abort();
            }
        }
        self.progress()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Runs `nodes` simulated daemons against the gateways at `gateway_urls` (replicas of one
/// control plane: the daemons are spread over them and fail over between them) until
/// `shutdown` resolves (or every daemon has given up), calling `report` every
/// `options.report_every` and once at the end. Returns the final progress; an error if the
/// CA could not be settled or every daemon failed (for instance with a used-up token).
pub async fn run_sim<R, S>(
    gateway_urls: &[String],
    join_secret: &str,
    ca: CaTrust,
    nodes: usize,
    options: SimOptions,
    report: R,
    shutdown: S,
) -> Result<Progress, DaemonError>
where
    R: Fn(Progress),
    S: Future<Output = ()>,
{
    let fleet = Fleet::start(gateway_urls, join_secret, ca, nodes, &options).await?;
    let mut ticker = tokio::time::interval(options.report_every.max(PROGRESS_POLL_INTERVAL));
    tokio::pin!(shutdown);
    let all_failed = loop {
        tokio::select! {
            () = &mut shutdown => break false,
            _ = ticker.tick() => {
                let progress = fleet.progress();
                report(progress);
                if nodes > 0 && progress.failed as usize == nodes {
                    break true;
                }
            }
        }
    };
    let sample = fleet.sample_error();
    let last = fleet.shutdown().await;
    report(last);
    if all_failed {
        return Err(DaemonError::Protocol(format!(
            "every simulated node gave up; for example: {}",
            sample.unwrap_or_else(|| "no error recorded".to_owned())
        )));
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulator process's progress line is read by another build of the benchmark, maybe
    /// older or newer: counts of error kinds it does not send are none, and they add up.
    #[test]
    fn progress_lines_carry_errors_by_kind_and_tolerate_missing_ones() {
        let old: Progress =
            serde_json::from_str(r#"{"nodes":2,"joined":2,"connected":1,"failed":0,"errors":1,"sessions":2,"heartbeatsSent":5,"renewals":0}"#)
                .expect("a line without errorsByKind");
        assert_eq!(old.errors_by_kind, ErrorCounts::default());
        let partial: Progress = serde_json::from_str(
            r#"{"nodes":2,"joined":2,"connected":1,"failed":0,"errors":3,"errorsByKind":{"unreachable":2,"timeout":1},"sessions":2,"heartbeatsSent":5,"renewals":0}"#,
        )
        .expect("a line with some kinds");
        let round_trip: Progress =
            serde_json::from_str(&serde_json::to_string(&partial).expect("serialize"))
                .expect("parse");
        assert_eq!(round_trip, partial);
        let total: Progress = [old, partial].into_iter().sum();
        assert_eq!(total.errors, 4);
        assert_eq!(total.errors_by_kind.to_string(), "unreachable 2, timeout 1");
        assert!(
            total
                .to_string()
                .contains("4 errors (unreachable 2, timeout 1)"),
            "{total}"
        );
    }

    #[test]
    fn overrides_hit_exactly_their_share_spread_over_the_fleet() {
        for nodes in [1, 7, 20, 100, 1000, 10_000] {
            for share in [0.0, 0.01, 0.05, 0.1, 0.5, 1.0] {
                let change = KnobOverride::failing_diagnostics(share);
                let hits: Vec<usize> = (0..nodes)
                    .filter(|&i| change.applies_to(0, i, nodes))
                    .collect();
                let expected = ((nodes as f64) * share + 0.5).floor() as usize;
                assert_eq!(hits.len(), expected, "{share} of {nodes}");
            }
        }
        // Spread: a tenth of a hundred nodes is one in every ten.
        let change = KnobOverride::missing_gpu(0.1);
        let hits: Vec<usize> = (0..100).filter(|&i| change.applies_to(0, i, 100)).collect();
        assert!(hits.windows(2).all(|w| w[1] - w[0] == 10), "{hits:?}");
    }

    #[test]
    fn nodes_get_stable_distinct_machines_and_their_overrides() {
        let options = SimOptions::mixed();
        let a = options.knobs_for(9, 3, 100);
        assert_eq!(a, options.knobs_for(9, 3, 100), "same seed, same machine");
        assert_ne!(a.seed, options.knobs_for(9, 4, 100).seed);
        assert_ne!(a.seed, options.knobs_for(10, 3, 100).seed);
        assert_eq!(a.hostname, Some(format!("{}00003", options.prefix(9))));
        let all: Vec<DaemonKnobs> = (0..100).map(|i| options.knobs_for(9, i, 100)).collect();
        assert_eq!(all.iter().filter(|k| k.fail_diagnostics).count(), 5);
        assert_eq!(all.iter().filter(|k| k.gpu_count == 7).count(), 5);
        // GPUs that fail in service, some fixable and some not (overrides may overlap).
        let in_service: Vec<&DaemonKnobs> = all.iter().filter(|k| k.xid_after.is_some()).collect();
        assert!(in_service.len() >= 5, "{}", in_service.len());
        assert!(in_service.iter().any(|k| k.reboot_clears_faults));
        assert!(in_service.iter().any(|k| !k.reboot_clears_faults));
        // A fleet of 20 (`dev --sim 20 --sim-mixed`) has one of each.
        let twenty: Vec<DaemonKnobs> = (0..20).map(|i| options.knobs_for(9, i, 20)).collect();
        for xids in [[48], [79]] {
            assert!(
                twenty
                    .iter()
                    .any(|k| k.xid_errors == xids && k.reboot_clears_faults)
            );
        }
        assert!(
            twenty
                .iter()
                .any(|k| k.xid_after.is_some() && !k.reboot_clears_faults)
        );
        let named = SimOptions {
            hostname_prefix: Some("gpu-".into()),
            ..SimOptions::default()
        };
        assert_eq!(
            named.knobs_for(1, 12, 20).hostname.as_deref(),
            Some("gpu-00012")
        );
    }
}
