//! The gateway's per-node writes that a fleet coming up sends by the hundred a second (every
//! daemon's join, `hello`, `converged`, inventory report, command start and result, and every
//! session's look at its commands) are written in batches: whatever arrived while the last
//! batch was being written goes into the next, in one transaction whose statements do not
//! grow with it (`Services::join_many`, `Services::open_sessions`,
//! `Services::report_converged_many`, `Services::store_inventory_reports`,
//! `Services::report_commands`, `Services::dispatch_many`), or whose contended locks (a join
//! token's row, the event order) are taken once for the batch. On
//! SQLite every statement is a round trip to the one writer that everything else waits on.
//! A request that finds the writer idle is written at once, alone, so batching adds no wait
//! of its own.

use bc_core::ids::NodeId;
use futures::FutureExt;
use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use tokio::sync::{mpsc, oneshot, watch};

/// The most requests written in one transaction: enough that a burst of a thousand
/// connecting daemons costs a handful of transactions, few enough that one transaction holds
/// SQLite's writer (which operators' mutations wait on) for tens of milliseconds, not seconds.
const MAX_BATCH: usize = 256;
/// Requests waiting to be written before sessions wait to hand theirs over.
const QUEUE_CAPACITY: usize = 4_096;

type Pending<T, R> = (T, oneshot::Sender<R>);

/// A task that writes requests of type `T` in batches and answers each with an `R`.
pub struct WriteBatches<T, R> {
    tx: mpsc::Sender<Pending<T, R>>,
}

impl<T, R> Clone for WriteBatches<T, R> {
    fn clone(&self) -> Self {
        WriteBatches {
            tx: self.tx.clone(),
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> WriteBatches<T, R> {
    /// Starts the task. `write` writes one batch and answers every request of it, in the
    /// order given; a batch holds each node (`node_of`) once, so a node's second request
    /// waits for the next batch and is written after its first (a request that names no node
    /// yet, a join, is never held back). Statements are counted under
    /// `caller` (README: "Profiling"). After `shutdown` the task writes what is already
    /// queued, then ends.
    pub fn start<W, Fut>(
        caller: &'static str,
        node_of: fn(&T) -> Option<&NodeId>,
        write: W,
        shutdown: watch::Receiver<bool>,
    ) -> (WriteBatches<T, R>, tokio::task::JoinHandle<()>)
    where
        W: FnMut(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<R>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let task = tokio::spawn(crate::service::attributed(
            caller,
            run(caller, node_of, write, rx, shutdown),
        ));
        (WriteBatches { tx }, task)
    }

    /// Writes `request` with whatever else is waiting. `None`: the gateway is shutting down
    /// and wrote nothing, or the batch's write panicked (logged); either way the session
    /// ends and the daemon comes back.
    pub async fn submit(&self, request: T) -> Option<R> {
        let (answer, answered) = oneshot::channel();
        self.tx.send((request, answer)).await.ok()?;
        answered.await.ok()
    }
}

async fn run<T, R, W, Fut>(
    caller: &'static str,
    node_of: fn(&T) -> Option<&NodeId>,
    mut write: W,
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
            // Stopping: what sessions handed over before the gateway stopped is written (a
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
        metrics::histogram!("bc_gateway_write_batch_size", "caller" => caller)
            .record(batch.len() as f64);
        let (requests, answers): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
        // A panic in one batch must not end the task, or every later request of its kind
        // would go unanswered while the gateway looks healthy.
        match AssertUnwindSafe(write(requests)).catch_unwind().await {
            Ok(results) => {
                for (answer, result) in answers.into_iter().zip(results) {
                    let _ = answer.send(result);
                }
            }
            Err(_) => {
                tracing::error!(
                    caller,
                    requests = answers.len(),
                    "a batch write panicked; its sessions end and their daemons come back"
                );
            }
        }
    }
}
