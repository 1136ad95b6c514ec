//! Opening sessions is the gateway's busiest write while a fleet comes up: every daemon's
//! `hello`, a hundred a second and more. They are written in batches: whatever hellos
//! arrived while the last batch was being written go into the next, in one transaction
//! whose statements do not grow with it ([`Services::open_sessions`]). A hello that finds
//! the writer idle is written at once, alone, so batching adds no wait of its own.

use std::collections::HashSet;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, watch};

use crate::error::ApiResult;
use crate::service::Services;
use crate::service::sessions::{Hello, OpenedSession};

/// The most hellos written in one transaction: enough that a burst of a thousand connecting
/// daemons costs a handful of transactions, few enough that one transaction holds SQLite's
/// writer (which operators' mutations wait on) for tens of milliseconds, not seconds.
const MAX_BATCH: usize = 256;
/// Hellos waiting to be written before sessions wait to hand theirs over.
const QUEUE_CAPACITY: usize = 4_096;

type Pending = (Hello, oneshot::Sender<ApiResult<OpenedSession>>);

#[derive(Clone)]
pub struct SessionOpener {
    tx: mpsc::Sender<Pending>,
}

impl SessionOpener {
    /// Starts the opener for the gateway `gateway_id`; the task ends after `shutdown`,
    /// answering nothing more.
    pub fn start(
        services: Services,
        gateway_id: Arc<str>,
        shutdown: watch::Receiver<bool>,
    ) -> (SessionOpener, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let task = tokio::spawn(run(services, gateway_id, rx, shutdown));
        (SessionOpener { tx }, task)
    }

    /// Opens a session for `hello`. `None`: the gateway is shutting down and opened nothing.
    pub async fn open(&self, hello: Hello) -> Option<ApiResult<OpenedSession>> {
        let (answer, answered) = oneshot::channel();
        self.tx.send((hello, answer)).await.ok()?;
        answered.await.ok()
    }
}

async fn run(
    services: Services,
    gateway_id: Arc<str>,
    mut rx: mpsc::Receiver<Pending>,
    mut shutdown: watch::Receiver<bool>,
) {
    // A second hello of a node already in the batch (a daemon that reconnected at once)
    // waits for the next one: a batch opens each node's session once.
    let mut held_over: Option<Pending> = None;
    loop {
        let first = match held_over.take() {
            Some(pending) => pending,
            None => tokio::select! {
                received = rx.recv() => match received {
                    Some(pending) => pending,
                    None => return,
                },
                _ = shutdown.changed() => return,
            },
        };
        let mut nodes = HashSet::from([first.0.identity.node_id.clone()]);
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            let Ok(pending) = rx.try_recv() else { break };
            if !nodes.insert(pending.0.identity.node_id.clone()) {
                held_over = Some(pending);
                break;
            }
            batch.push(pending);
        }
        open(&services, &gateway_id, batch).await;
    }
}

async fn open(services: &Services, gateway_id: &str, batch: Vec<Pending>) {
    metrics::histogram!("bc_gateway_hello_batch_size").record(batch.len() as f64);
    let (hellos, answers): (Vec<Hello>, Vec<_>) = batch.into_iter().unzip();
    match services.open_sessions(gateway_id, hellos).await {
        Ok(opened) => {
            for (answer, result) in answers.into_iter().zip(opened) {
                let _ = answer.send(result);
            }
        }
        Err(err) => {
            // The batch as a whole failed (the database, mostly): every hello in it gets the
            // error, and each daemon will say hello again.
            tracing::warn!(hellos = answers.len(), error = ?err, "opening a batch of sessions failed");
            for answer in answers {
                let _ = answer.send(Err(crate::error::ApiError::Internal(anyhow::anyhow!(
                    "opening a batch of sessions failed"
                ))));
            }
        }
    }
}
