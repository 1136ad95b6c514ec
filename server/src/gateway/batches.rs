//! The gateway's per-node requests that a fleet coming up, or a failover's reconnecting
//! daemons, send by the hundred a second (every connection's certificate check before its
//! upgrade, every daemon's join, `hello`, `converged`, inventory report, command start and
//! result, every session's look at its commands, and every session's end) are handled in
//! batches: whatever arrived while the last batch was being handled goes into the next, in a
//! few statements that do not grow with it (`Services::check_identities`, a read) or one
//! transaction (`Services::join_many`, `Services::open_sessions`,
//! `Services::report_converged_many`, `Services::store_inventory_reports`,
//! `Services::report_commands`, `Services::dispatch_many`, `Services::end_sessions`), whose
//! contended locks (a join token's row, the event order) are taken once for the batch. On
//! SQLite every write is a round trip to the one writer that everything else waits on, and
//! every statement one to the database's threads. On PostgreSQL, in the failover of
//! BENCHMARKS.md's session 29, the certificate checks, a statement per connection, were about
//! half of the 12,082 reads of `nodes`. A request that finds its task idle is handled at
//! once, alone, so batching adds no wait of its own.

use bc_core::ids::NodeId;
use futures::FutureExt;
use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use tokio::sync::{mpsc, oneshot, watch};

/// The most requests handled in one batch (one transaction, for the writes): enough that a
/// burst of a thousand connecting daemons costs a handful of batches, few enough that one
/// transaction holds SQLite's writer (which operators' mutations wait on) for tens of
/// milliseconds, not seconds.
const MAX_BATCH: usize = 256;
/// Requests waiting to be handled before connections and sessions wait to hand theirs over.
const QUEUE_CAPACITY: usize = 4_096;

type Pending<T, R> = (T, oneshot::Sender<R>);

/// A task that handles requests of type `T` in batches and answers each with an `R`.
pub struct Batches<T, R> {
    tx: mpsc::Sender<Pending<T, R>>,
}

impl<T, R> Clone for Batches<T, R> {
    fn clone(&self) -> Self {
        Batches {
            tx: self.tx.clone(),
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> Batches<T, R> {
    /// Starts the task. `handle` handles one batch and answers every request of it, in the
    /// order given; a batch holds each node (`node_of`) once, so a node's second request
    /// waits for the next batch and is handled after its first (a request for which `node_of`
    /// names no node, a join or a certificate check, is never held back). Statements are
    /// counted under `caller` (README: "Profiling"). After `shutdown` the task handles what
    /// is already queued, then ends.
    pub fn start<W, Fut>(
        caller: &'static str,
        node_of: fn(&T) -> Option<&NodeId>,
        handle: W,
        shutdown: watch::Receiver<bool>,
    ) -> (Batches<T, R>, tokio::task::JoinHandle<()>)
    where
        W: FnMut(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<R>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let task = tokio::spawn(crate::service::attributed(
            caller,
            run(caller, node_of, handle, rx, shutdown),
        ));
        (Batches { tx }, task)
    }

    /// Handles `request` with whatever else is waiting. `None`: the gateway is shutting down
    /// and did nothing with it, or the batch panicked (logged); either way the connection or
    /// session ends (a connection not yet upgraded is answered `UNAVAILABLE`) and the daemon
    /// comes back.
    pub async fn submit(&self, request: T) -> Option<R> {
        let (answer, answered) = oneshot::channel();
        self.tx.send((request, answer)).await.ok()?;
        answered.await.ok()
    }
}

async fn run<T, R, W, Fut>(
    caller: &'static str,
    node_of: fn(&T) -> Option<&NodeId>,
    mut handle: W,
    mut rx: mpsc::Receiver<Pending<T, R>>,
    mut shutdown: watch::Receiver<bool>,
) where
    W: FnMut(Vec<T>) -> Fut,
    Fut: Future<Output = Vec<R>>,
{
    let mut held_over: Option<Pending<T, R>> = None;
    let mut stopping = false;
    loop {
        let first = match held_over.take() {
            Some(pending) => pending,
            // Stopping: what sessions handed over before the gateway stopped is handled (a
            // session's last inventory report, say); then the task ends.
            None if stopping => match rx.try_recv() {
                Ok(pending) => pending,
                Err(_) => return,
            },
            None => tokio::select! {
                received = rx.recv() => match received {
                    Some(pending) => pending,
                    None => return,
                },
                _ = shutdown.changed() => {
                    stopping = true;
                    continue;
                }
            },
        };
        let mut nodes: HashSet<NodeId> = node_of(&first.0).into_iter().cloned().collect();
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            let Ok(pending) = rx.try_recv() else { break };
            if let Some(node) = node_of(&pending.0)
                && !nodes.insert(node.clone())
            {
                held_over = Some(pending);
                break;
            }
            batch.push(pending);
        }
        metrics::histogram!("bc_gateway_batch_size", "caller" => caller).record(batch.len() as f64);
        let (requests, answers): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
        // A panic in one batch must not end the task, or every later request of its kind
        // would go unanswered while the gateway looks healthy.
        match AssertUnwindSafe(handle(requests)).catch_unwind().await {
            Ok(results) => {
                for (answer, result) in answers.into_iter().zip(results) {
                    let _ = answer.send(result);
                }
            }
            Err(_) => {
                tracing::error!(
                    caller,
                    requests = answers.len(),
                    "a batch panicked; its connections and sessions end and their daemons come back"
                );
            }
        }
    }
}
