//! The live event feed: the event table is the outbox; this turns it into streams.
//!
//! One tailer per process reads events committed after its head (woken by this process's
//! commits, by PostgreSQL `NOTIFY` from other replicas, and by a slow poll as a safety net),
//! attaches to each event its node as it was right after that event (rebuilt from the log
//! when it has changed since, see `service::history`), and broadcasts them. It broadcasts
//! twice: every event as committed, to this process's own followers (the gateway's command
//! routing, the placement loop), which need no node; and every event with its node, to GraphQL
//! subscriptions, and only while one listens: attaching nodes is most of the feed's cost, and a
//! fleet coming up with no one watching paid it for every event. A subscriber first replays
//! from its cursor out of the table, then follows the broadcast; it subscribes to the
//! broadcast before replaying and skips what it already delivered, so there is no gap and no
//! duplicate between the two. The broadcast is bounded: a subscriber that falls more than
//! [`FEED_BUFFER`] events behind is ended with `RESUME_REQUIRED` and its cursor, and resumes
//! from the table.

use bc_core::event::RecordedEvent;
use bc_core::view::NodeDetail;
use futures::Stream;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, watch};

use crate::error::ApiError;
use crate::service::Services;
use crate::service::history::NodeAtEvent;

/// Events the broadcast holds for slow subscribers before they must resume from the table.
pub const FEED_BUFFER: usize = 4096;
/// Events read from the table at a time.
const READ_BATCH: u64 = 1000;
/// The tailer reads the table at least this often even without a wakeup: a missed
/// notification (a dropped LISTEN connection) delays events by at most this much.
const POLL_FALLBACK: Duration = Duration::from_secs(1);
/// How long the tailer waits after a commit wakes it before it reads, so the commits of a
/// burst are read together. While a fleet comes up there are a few hundred commits a second,
/// and a read after each was the second-busiest statement of the bring-up's profile; this
/// bounds the reads to about a hundred a second, for at most this much more delivery
/// latency (issue 16 allows 100 ms from commit to receipt).
const COALESCE_WINDOW: Duration = Duration::from_millis(10);

/// One event with its node as it was right after the event (absent for events not about a
/// node). A replayed event carries the node of its time, never today's.
#[derive(Debug, Clone)]
pub struct FeedEvent {
    pub event: RecordedEvent,
    pub node: Option<Arc<NodeDetail>>,
    /// The version of the node that could not be rebuilt for this event (history written
    /// before events carried rebuild data); `node` is then `None`.
    pub node_not_recorded: Option<i64>,
}

/// Something the feed delivers in commit order: an event, with or without its node.
pub trait Sequenced {
    /// The event's sequence number.
    fn seq(&self) -> i64;
}

impl Sequenced for RecordedEvent {
    fn seq(&self) -> i64 {
        self.id.0
    }
}

impl Sequenced for FeedEvent {
    fn seq(&self) -> i64 {
        self.event.id.0
    }
}

pub struct Feed {
    /// Every event as committed, without its node.
    events: broadcast::Sender<Arc<RecordedEvent>>,
    /// Every event with its node; nodes are attached only while a receiver exists.
    with_nodes: broadcast::Sender<Arc<FeedEvent>>,
    head: watch::Sender<i64>,
    /// Ends every subscriber's stream when the server shuts down.
    stopped: watch::Receiver<bool>,
    /// The tailer and the LISTEN task, awaited by [`Feed::stopped`].
    tasks: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Feed {
    /// Starts the tailer (and, on PostgreSQL, the LISTEN task). Both stop with `shutdown`.
    pub async fn start(
        services: Services,
        shutdown: watch::Receiver<bool>,
    ) -> anyhow::Result<Arc<Feed>> {
        let start = services.event_head().await?;
        let (events, _) = broadcast::channel(FEED_BUFFER);
        let (with_nodes, _) = broadcast::channel(FEED_BUFFER);
        let (head, _) = watch::channel(start);
        let feed = Arc::new(Feed {
            events,
            with_nodes,
            head,
            stopped: shutdown.clone(),
            tasks: std::sync::Mutex::default(),
        });
        let wake = services.committed_writes();
        let mut tasks = Vec::new();
        if let Some(listener) = services.other_writers_listener(wake.clone(), shutdown.clone()) {
            tasks.push(tokio::spawn(listener));
        }
        tasks.push(tokio::spawn(crate::service::attributed(
            "feed",
            tail(feed.clone(), services, wake, shutdown),
        )));
        *feed
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = tasks;
        Ok(feed)
    }

    /// Waits until the tailer and the LISTEN task have stopped (after `shutdown`), so the
    /// database pool can close without failing a read of theirs.
    pub async fn stopped(&self) {
        let tasks = std::mem::take(
            &mut *self
                .tasks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for task in tasks {
            let _ = task.await;
        }
    }

    /// The newest event published.
    pub fn head(&self) -> i64 {
        *self.head.borrow()
    }

    /// Every event after `after`, then every new one, as they commit, each with its node as
    /// it was right after the event: what GraphQL subscriptions deliver.
    pub fn subscribe(
        self: &Arc<Self>,
        services: Services,
        after: i64,
    ) -> impl Stream<Item = Result<Arc<FeedEvent>, ApiError>> + Send + use<> {
        follow(
            self.with_nodes.subscribe(),
            self.stopped.clone(),
            after,
            move |last| {
                let services = services.clone();
                async move {
                    let batch = services.events_after(last, READ_BATCH).await?;
                    enrich(&services, batch).await
                }
            },
        )
    }

    /// [`Feed::subscribe`] without nodes, for followers that act on the events themselves
    /// (which node, which type, which pool) and so cost the feed nothing to serve.
    pub fn subscribe_events(
        self: &Arc<Self>,
        services: Services,
        after: i64,
    ) -> impl Stream<Item = Result<Arc<RecordedEvent>, ApiError>> + Send + use<> {
        follow(
            self.events.subscribe(),
            self.stopped.clone(),
            after,
            move |last| {
                let services = services.clone();
                async move { services.events_after(last, READ_BATCH).await }
            },
        )
    }
}

/// A subscriber's stream: replay from the table (`read` answers the events after a sequence
/// number, oldest first) until it has nothing newer, then follow the broadcast `rx`,
/// subscribed before the replay began, skipping what the replay already delivered.
fn follow<T, R, F>(
    mut rx: broadcast::Receiver<Arc<T>>,
    mut stopped: watch::Receiver<bool>,
    after: i64,
    mut read: R,
) -> impl Stream<Item = Result<Arc<T>, ApiError>> + Send + use<T, R, F>
where
    T: Sequenced + Send + Sync + 'static,
    R: FnMut(i64) -> F + Send + 'static,
    F: Future<Output = Result<Vec<T>, ApiError>> + Send,
{
    async_stream::stream! {
        let mut last = after;
        // Replay from the table until it has nothing newer. The read runs boxed: inline, its
        // storage future would stay in every subscriber's stream for as long as it follows.
        loop {
            let batch = match Box::pin(read(last)).await {
                Ok(batch) => batch,
                Err(err) => { yield Err(err); return; }
            };
            if batch.is_empty() {
                break;
            }
            for event in batch {
                last = event.seq();
                yield Ok(Arc::new(event));
            }
        }
        // Follow the broadcast, skipping what the replay already delivered.
        loop {
            let received = tokio::select! {
                received = rx.recv() => received,
                // The server is stopping: the stream ends, the client resumes elsewhere.
                _ = stopped.changed() => return,
            };
            match received {
                Ok(event) => {
                    if event.seq() <= last {
                        continue;
                    }
                    last = event.seq();
                    yield Ok(event);
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    metrics::counter!("bc_feed_subscribers_lagged_total").increment(1);
                    yield Err(ApiError::resume_after(last));
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}

/// Attaches to each event its node as it was right after the event (deleted ones included):
/// the current row where the node has not changed since, else rebuilt from the log.
async fn enrich(
    services: &Services,
    batch: Vec<RecordedEvent>,
) -> Result<Vec<FeedEvent>, ApiError> {
    let nodes = services.nodes_at_events(&batch).await?;
    Ok(batch
        .into_iter()
        .zip(nodes)
        .map(|(event, node)| match node {
            Some(NodeAtEvent::Node(node)) => FeedEvent {
                event,
                node: Some(node),
                node_not_recorded: None,
            },
            Some(NodeAtEvent::NotRecorded { version }) => FeedEvent {
                event,
                node: None,
                node_not_recorded: Some(version),
            },
            None => FeedEvent {
                event,
                node: None,
                node_not_recorded: None,
            },
        })
        .collect())
}

async fn tail(
    feed: Arc<Feed>,
    services: Services,
    wake: Arc<tokio::sync::Notify>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        loop {
            let head = feed.head();
            let batch = match services.events_after(head, READ_BATCH).await {
                Ok(batch) => batch,
                Err(err) => {
                    tracing::warn!(code = err.code(), reason = %err.message(), "the event feed could not read new events");
                    break;
                }
            };
            let Some(newest) = batch.last().map(Sequenced::seq) else {
                break;
            };
            // A short batch is all there was: a commit after the read has woken the tailer
            // again (`notify_one` keeps a permit), so reading once more to find nothing is
            // a wasted query per commit.
            let drained = (batch.len() as u64) < READ_BATCH;
            // Nodes are attached only for a subscriber that is there now. One that subscribes
            // after this check replays this batch from the table (it was committed before
            // it was read here), with nodes, before following the broadcast.
            if feed.with_nodes.receiver_count() > 0 {
                let enriched = match enrich(&services, batch.clone()).await {
                    Ok(enriched) => enriched,
                    Err(err) => {
                        tracing::warn!(code = err.code(), reason = %err.message(), "the event feed could not load nodes");
                        break;
                    }
                };
                for event in enriched {
                    // A subscriber that left meanwhile is fine.
                    let _ = feed.with_nodes.send(Arc::new(event));
                }
            }
            for event in batch {
                // No receivers is fine: nobody follows.
                let _ = feed.events.send(Arc::new(event));
            }
            feed.head.send_replace(newest);
            metrics::gauge!("bc_feed_head").set(newest as f64);
            if drained {
                break;
            }
        }
        tokio::select! {
            () = wake.notified() => tokio::time::sleep(COALESCE_WINDOW).await,
            () = tokio::time::sleep(POLL_FALLBACK) => {}
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Feed;
    use crate::held_sizes::size_returned_by;

    /// A feed stream lives as long as its follower: each `nodeChanges` and `commandUpdates`
    /// subscription holds one, as does each `events` subscription resuming from a cursor its
    /// hub has passed, and issue 16 gives a subscriber 10 KB in all. The replay's read (the
    /// events and their nodes from storage) ran inline, so every stream kept room for that
    /// storage future while it followed the broadcast (3,720 bytes in a test build, 896
    /// with the read boxed); it runs boxed now, only while it runs.
    #[test]
    fn a_subscriber_holds_a_small_stream() {
        const BUDGET_BYTES: usize = 2048;
        for (stream, size) in [
            ("subscribe", size_returned_by(Feed::subscribe)),
            ("subscribe_events", size_returned_by(Feed::subscribe_events)),
        ] {
            assert!(
                size <= BUDGET_BYTES,
                "Feed::{stream}'s stream is {size} bytes, over {BUDGET_BYTES}: box what it awaits that is large"
            );
        }
    }
}
