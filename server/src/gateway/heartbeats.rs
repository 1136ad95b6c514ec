//! Heartbeats are the gateway's most frequent write (one per node every 10 s: 1,000/s per
//! 10,000 nodes). They are batched: collected for a moment and written in one transaction,
//! which costs the database one commit instead of hundreds.

use bc_core::ids::NodeId;
use chrono::{DateTime, Utc};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

use crate::service::Services;

/// How long heartbeats gather before they are written. Well under the heartbeat interval,
/// so `lastSeen` is never staler than a fraction of a second beyond what the daemon sent.
const FLUSH_INTERVAL: Duration = Duration::from_millis(250);
/// The most heartbeats written in one transaction.
const MAX_BATCH: usize = 5_000;
/// Heartbeats waiting to be written before sessions wait to hand theirs over (backpressure
/// instead of unbounded memory when the database falls behind).
const QUEUE_CAPACITY: usize = 50_000;

type Beat = (NodeId, i64, DateTime<Utc>);

#[derive(Clone)]
pub struct HeartbeatWriter {
    tx: mpsc::Sender<Beat>,
}

impl HeartbeatWriter {
    /// Starts the writer; the task ends after `shutdown` with a last flush.
    pub fn start(
        services: Services,
        shutdown: watch::Receiver<bool>,
    ) -> (HeartbeatWriter, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let task = tokio::spawn(crate::service::attributed(
            "gateway.heartbeats",
            run(services, rx, shutdown),
        ));
        (HeartbeatWriter { tx }, task)
    }

    /// Queues one heartbeat of the session `epoch` of `node`.
    pub async fn beat(&self, node: NodeId, epoch: i64, at: DateTime<Utc>) {
        metrics::counter!("bc_heartbeats_received_total").increment(1);
        let _ = self.tx.send((node, epoch, at)).await;
    }
}

async fn run(
    services: Services,
    mut rx: mpsc::Receiver<Beat>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut batch: Vec<Beat> = Vec::new();
    let mut ticker = tokio::time::interval(FLUSH_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            received = rx.recv() => match received {
                Some(beat) => {
                    batch.push(beat);
                    if batch.len() >= MAX_BATCH {
                        flush(&services, &mut batch).await;
                    }
                }
                None => break,
            },
            _ = ticker.tick() => flush(&services, &mut batch).await,
            _ = shutdown.changed() => break,
        }
    }
    while let Ok(beat) = rx.try_recv() {
        batch.push(beat);
    }
    flush(&services, &mut batch).await;
}

async fn flush(services: &Services, batch: &mut Vec<Beat>) {
    if batch.is_empty() {
        return;
    }
    let started = std::time::Instant::now();
    match services.record_heartbeats(batch).await {
        Ok(stale) => {
            metrics::counter!("bc_heartbeats_total").increment(batch.len() as u64);
            for (node, epoch) in stale {
                // The session row moved on (a newer session, or the identity was replaced):
                // end this one wherever it is held here.
                services
                    .sessions
                    .kick_epoch(&node, epoch, bc_core::protocol::close::SUPERSEDED);
            }
        }
        Err(err) => {
            metrics::counter!("bc_heartbeat_write_failures_total").increment(1);
            tracing::warn!(error = ?err, beats = batch.len(), "writing heartbeats failed; liveness will see them as missed");
        }
    }
    metrics::histogram!("bc_heartbeat_flush_duration_seconds")
        .record(started.elapsed().as_secs_f64());
    batch.clear();
}
