//! The gateway: the TLS listener daemons talk to (`bcd/v1`, see PROTOCOL.md). It serves
//! JoinService (`/v1/join`), renewal (`/v1/renew`), the CA (`/v1/ca.pem`) and sessions
//! (`/v1/session`, a WebSocket), and always speaks TLS with optional client certificates:
//! joining needs none, everything else needs a node certificate. Connections are capped
//! per listener and per peer address at accept, and timed out in the TLS handshake, while
//! headers are awaited and when idle (`listener.rs`; `[gateway]` in the configuration).

mod batches;
mod heartbeats;
mod http;
mod session;
mod tls;

use bc_core::event::EventType;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use crate::config::GatewayConfig;
use crate::error::{ApiError, ApiResult};
use crate::listener::{
    Admitted, ConnectionGate, IdleTimeout, StopSignal, accept_loop, count_timeout, serve_http,
};
use crate::pki::NodeIdentity;
use crate::service::Services;
use crate::service::commands::{CommandReport, Dispatch, DispatchLook};
use crate::service::inventory::ReportedSection;
use crate::service::sessions::{Hello, OpenedSession};
pub use batches::Batches;
use bc_core::command::Command;
use bc_core::ids::NodeId;
use bc_core::protocol::{IssuedIdentity, JoinRequest};
pub use heartbeats::HeartbeatWriter;

/// How long a shutting-down gateway waits for its sessions to say goodbye and end (a
/// stopping gateway leaves their ends to the next session or Liveness: `session::end`).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// What the gateway's handlers share.
#[derive(Clone)]
pub(crate) struct GatewayState {
    pub services: Services,
    pub gateway_id: Arc<str>,
    pub heartbeat_interval: Duration,
    pub heartbeats: HeartbeatWriter,
    /// Connections' certificate checks before their upgrade to a session, read in batches.
    pub identities: Batches<NodeIdentity, ApiResult<()>>,
    /// Joins, written in batches.
    pub joins: Batches<JoinRequest, ApiResult<IssuedIdentity>>,
    /// Hellos, opened in batches.
    pub hellos: Batches<Hello, ApiResult<OpenedSession>>,
    /// `converged` reports, written in batches.
    pub convergences: Batches<(NodeId, i64), ApiResult<()>>,
    /// Inventory reports, stored in batches.
    pub inventories: Batches<(NodeId, Vec<ReportedSection>), ApiResult<()>>,
    /// Sessions' looks at their nodes' commands and spec, taken in batches.
    pub dispatches: Batches<DispatchLook, ApiResult<Dispatch>>,
    /// Daemons' `command.started` and `command.result`, written in batches.
    pub command_reports: Batches<CommandReport, ApiResult<Command>>,
    /// Sessions' ends, each `(node, epoch)`, recorded in batches.
    pub ends: Batches<(NodeId, i64), ApiResult<Vec<Command>>>,
    pub shutdown: watch::Receiver<bool>,
    pub session_tasks: SessionTasks,
}

/// How many session tasks run, from the upgrade to the last write of their end. Shutdown
/// waits for them before the database pool closes: a session is unregistered before it
/// records its end, so an empty registry does not mean its writes are done.
#[derive(Clone, Default)]
pub(crate) struct SessionTasks(Arc<std::sync::atomic::AtomicUsize>);

/// One running session task; dropping it ends the count.
pub(crate) struct SessionTask(SessionTasks);

impl SessionTasks {
    pub fn enter(&self) -> SessionTask {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        SessionTask(self.clone())
    }

    fn running(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for SessionTask {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A running gateway.
pub struct Gateway {
    pub local_addr: SocketAddr,
    pub gateway_id: String,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
    /// The heartbeat writer, the certificate check, join, hello, convergence, inventory,
    /// dispatch, command report and session end batches and the command router, which stop
    /// with `shutdown`.
    background: Vec<JoinHandle<()>>,
    session_tasks: SessionTasks,
    services: Services,
}

impl Gateway {
    /// Binds the listener and starts accepting, at most `caps.0` connections at once and
    /// `caps.1` from one peer address.
    pub async fn start(
        config: &GatewayConfig,
        caps: (usize, usize),
        services: Services,
        feed: Arc<crate::feed::Feed>,
        heartbeat_interval: Duration,
    ) -> anyhow::Result<Gateway> {
        let gateway_id = config
            .gateway_id
            .clone()
            .unwrap_or_else(|| format!("gw-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
        let tls = tls::server_config(&services.ca, &config.hostnames, services.clock.now())?;
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let listener = TcpListener::bind(config.listen).await?;
        let local_addr = listener.local_addr()?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let (heartbeats, heartbeat_writer) =
            HeartbeatWriter::start(services.clone(), shutdown_rx.clone());
        let gateway_id: Arc<str> = gateway_id.into();
        let (identities, identities_task) = {
            let services = services.clone();
            Batches::start(
                "gateway.identity",
                |_: &NodeIdentity| None,
                move |batch| check_identities(services.clone(), batch),
                shutdown_rx.clone(),
            )
        };
        let (joins, joins_task) = {
            let services = services.clone();
            Batches::start(
                "gateway.join",
                |_: &JoinRequest| None,
                move |batch: Vec<JoinRequest>| {
                    let services = services.clone();
                    async move { services.join_many(&batch).await }
                },
                shutdown_rx.clone(),
            )
        };
        let (hellos, hellos_task) = {
            let (services, gateway_id) = (services.clone(), gateway_id.clone());
            Batches::start(
                "gateway.hello",
                |hello: &Hello| Some(&hello.identity.node_id),
                move |batch| open_sessions(services.clone(), gateway_id.clone(), batch),
                shutdown_rx.clone(),
            )
        };
        let (convergences, convergences_task) = {
            let services = services.clone();
            Batches::start(
                "gateway.converged",
                |(node, _): &(NodeId, i64)| Some(node),
                move |batch| report_converged(services.clone(), batch),
                shutdown_rx.clone(),
            )
        };
        let (inventories, inventories_task) = {
            let services = services.clone();
            Batches::start(
                "gateway.inventory",
                |(node, _): &(NodeId, Vec<ReportedSection>)| Some(node),
                move |batch| store_inventory(services.clone(), batch),
                shutdown_rx.clone(),
            )
        };
        let (dispatches, dispatches_task) = {
            let services = services.clone();
            Batches::start(
                "gateway.dispatch",
                |look: &DispatchLook| Some(&look.node_id),
                move |batch| dispatch(services.clone(), batch),
                shutdown_rx.clone(),
            )
        };
        let (command_reports, command_reports_task) = {
            let services = services.clone();
            Batches::start(
                "gateway.command_report",
                |report: &CommandReport| Some(&report.node_id),
                move |batch| report_commands(services.clone(), batch),
                shutdown_rx.clone(),
            )
        };
        let (ends, ends_task) = {
            let services = services.clone();
            Batches::start(
                "gateway.session_end",
                |(node, _): &(NodeId, i64)| Some(node),
                move |batch| end_sessions(services.clone(), batch),
                shutdown_rx.clone(),
            )
        };
        let session_tasks = SessionTasks::default();
        let state = GatewayState {
            heartbeats,
            identities,
            joins,
            hellos,
            convergences,
            inventories,
            dispatches,
            command_reports,
            ends,
            services: services.clone(),
            gateway_id: gateway_id.clone(),
            heartbeat_interval,
            shutdown: shutdown_rx.clone(),
            session_tasks: session_tasks.clone(),
        };
        let app = http::router(state, config);
        let router = tokio::spawn(crate::service::attributed(
            "gateway.command_router",
            route_command_events(services.clone(), feed, shutdown_rx.clone()),
        ));
        let gate = ConnectionGate::new("gateway", caps.0, caps.1, 0);
        let timeouts = Timeouts {
            tls_handshake: config.tls_handshake_timeout(),
            header: config.header_timeout(),
            idle: config.idle_timeout(),
        };
        let mut stopped = shutdown_rx;
        let stop = async move {
            let _ = stopped.changed().await;
        };
        let task = tokio::spawn(accept_loop(
            listener,
            gate,
            stop,
            move |socket, peer, stop| {
                serve_connection(socket, peer, acceptor.clone(), app.clone(), timeouts, stop)
            },
        ));
        tracing::info!(%local_addr, %gateway_id, "gateway is listening (TLS)");
        Ok(Gateway {
            local_addr,
            gateway_id: gateway_id.to_string(),
            shutdown: shutdown_tx,
            task,
            background: vec![
                heartbeat_writer,
                identities_task,
                joins_task,
                hellos_task,
                convergences_task,
                inventories_task,
                dispatches_task,
                command_reports_task,
                ends_task,
                router,
            ],
            session_tasks,
            services,
        })
    }

    /// Stops accepting, tells every session goodbye, and waits (briefly) for them to end (a
    /// session that ended before the stop may still be writing its end), and for the last
    /// heartbeats to be written: after this the database pool may close without failing a
    /// write of the gateway's.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        self.services
            .sessions
            .kick_all(bc_core::protocol::close::SHUTDOWN);
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        while self.session_tasks.running() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = self.task.await;
        for task in self.background {
            let _ = task.await;
        }
    }
}

/// Commands queued or cancelled, and new spec generations, written through any replica reach the session that holds their node
/// through the live event feed: this routes each command event to the session held here.
async fn route_command_events(
    services: Services,
    feed: Arc<crate::feed::Feed>,
    mut shutdown: watch::Receiver<bool>,
) {
    use futures::StreamExt;
    loop {
        let events = feed.subscribe_events(services.clone(), feed.head());
        tokio::pin!(events);
        loop {
            let item = tokio::select! {
                item = events.next() => item,
                _ = shutdown.changed() => return,
            };
            match item {
                Some(Ok(e)) => {
                    let wakes_session = matches!(
                        e.event_type,
                        EventType::CommandQueued
                            | EventType::CommandCancelled
                            | EventType::CommandTimedOut
                            | EventType::NodeSpecGeneration
                    );
                    if wakes_session && let Some(node) = &e.node_id {
                        services.sessions.poke(node);
                    }
                }
                // Fell behind (a burst of events): every session looks at its commands again,
                // and routing resumes from now.
                Some(Err(_)) => {
                    services.sessions.poke_all();
                    break;
                }
                None => return,
            }
        }
    }
}

/// The gateway's timeouts for one connection.
#[derive(Debug, Clone, Copy)]
struct Timeouts {
    tls_handshake: Duration,
    header: Duration,
    idle: Duration,
}

/// One connection: the TLS handshake (within its timeout), then HTTP with the client
/// certificate's identity for the routes to check.
async fn serve_connection(
    socket: Admitted<tokio::net::TcpStream>,
    peer: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    app: axum::Router,
    timeouts: Timeouts,
    mut stop: StopSignal,
) {
    let socket = IdleTimeout::new(socket, "gateway", timeouts.idle);
    let handshake = tokio::time::timeout(timeouts.tls_handshake, acceptor.accept(socket));
    let handshake = tokio::select! {
        handshake = handshake => handshake,
        // The gateway is stopping: no new sessions.
        () = stop.stopping() => return,
    };
    let tls = match handshake {
        Ok(Ok(tls)) => tls,
        Ok(Err(err)) => {
            metrics::counter!("bc_gateway_tls_handshake_failures_total").increment(1);
            tracing::debug!(%peer, error = %err, "TLS handshake refused");
            return;
        }
        Err(_) => {
            count_timeout("gateway", "tls_handshake");
            tracing::debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    let identity = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(crate::pki::node_identity);
    let app = app.layer(axum::Extension(http::PeerIdentity(identity)));
    let service = hyper_util::service::TowerToHyperService::new(app);
    serve_http("gateway", tls, service, timeouts.header, stop).await;
}

/// One batch of hellos ([`Services::open_sessions`]).
async fn open_sessions(
    services: Services,
    gateway_id: Arc<str>,
    batch: Vec<Hello>,
) -> Vec<ApiResult<OpenedSession>> {
    handled("opening sessions", &batch, |hellos| {
        services.open_sessions(&gateway_id, hellos)
    })
    .await
}

/// One batch of `converged` reports ([`Services::report_converged_many`]).
async fn report_converged(services: Services, batch: Vec<(NodeId, i64)>) -> Vec<ApiResult<()>> {
    handled("recording convergence", &batch, |reports| {
        services.report_converged_many(reports)
    })
    .await
}

/// One batch of inventory reports ([`Services::store_inventory_reports`]).
async fn store_inventory(
    services: Services,
    batch: Vec<(NodeId, Vec<ReportedSection>)>,
) -> Vec<ApiResult<()>> {
    handled("storing inventory", &batch, |reports| {
        services.store_inventory_reports(reports)
    })
    .await
}

/// One batch of sessions' looks at their nodes ([`Services::dispatch_many`]).
async fn dispatch(services: Services, batch: Vec<DispatchLook>) -> Vec<ApiResult<Dispatch>> {
    handled_all_or_none("dispatching commands", &batch, |looks| {
        services.dispatch_many(looks)
    })
    .await
}

/// One batch of sessions' ends ([`Services::end_sessions`]).
async fn end_sessions(
    services: Services,
    batch: Vec<(NodeId, i64)>,
) -> Vec<ApiResult<Vec<Command>>> {
    handled_all_or_none("recording sessions' ends", &batch, |ended| {
        services.end_sessions(ended)
    })
    .await
}

/// One batch of connections' certificate checks ([`Services::check_identities`]).
async fn check_identities(services: Services, batch: Vec<NodeIdentity>) -> Vec<ApiResult<()>> {
    handled("checking node certificates", &batch, |identities| {
        services.check_identities(identities)
    })
    .await
}

/// One batch of daemons' command reports ([`Services::report_commands`]).
async fn report_commands(services: Services, batch: Vec<CommandReport>) -> Vec<ApiResult<Command>> {
    handled("recording command reports", &batch, |reports| {
        services.report_commands(reports)
    })
    .await
}

/// Handles a batch with `handle` (a write, or the certificate checks' read). A batch that
/// fails as a whole (the database refused one request's data, say a daemon's section
/// PostgreSQL will not store) is handled again a request at a time, so that one daemon's bad data fails its own request only; a request
/// that fails alone is logged and answered with an internal error. A batch that found no
/// database connection in time answers every request `UNAVAILABLE` (logged where it arose,
/// at most every few seconds), which its session ends on as "database busy" (a connection
/// not yet upgraded is answered `503`): a request at a time, each would wait as long again.
async fn handled<'a, T, R, F, Fut>(what: &str, batch: &'a [T], handle: F) -> Vec<ApiResult<R>>
where
    F: Fn(&'a [T]) -> Fut,
    Fut: std::future::Future<Output = ApiResult<Vec<ApiResult<R>>>>,
{
    let failed = |err: ApiError| match err {
        ApiError::Unavailable(_) => Err(err),
        err => {
            tracing::warn!(error = ?err, "{what} failed");
            Err(ApiError::Internal(anyhow::anyhow!("{what} failed")))
        }
    };
    match handle(batch).await {
        Ok(answers) => answers,
        Err(err) if batch.len() == 1 => vec![failed(err)],
        Err(ApiError::Unavailable(message)) => batch
            .iter()
            .map(|_| Err(ApiError::Unavailable(message.clone())))
            .collect(),
        Err(err) => {
            tracing::warn!(requests = batch.len(), error = ?err, "{what} failed for a whole batch; handling its requests one at a time");
            let mut answers = Vec::with_capacity(batch.len());
            for one in batch.chunks(1) {
                answers.push(match handle(one).await {
                    Ok(mut answer) => answer.pop().unwrap_or_else(|| {
                        failed(ApiError::Internal(anyhow::anyhow!("no answer")))
                    }),
                    Err(err) => failed(err),
                });
            }
            answers
        }
    }
}

/// [`handled`], for a `handle` that answers every request of its batch or fails as a whole
/// (one transaction with no request of its own to refuse): a failed batch is still taken again
/// a request at a time, like any other.
async fn handled_all_or_none<'a, T, R, F, Fut>(
    what: &str,
    batch: &'a [T],
    handle: F,
) -> Vec<ApiResult<R>>
where
    F: Fn(&'a [T]) -> Fut,
    Fut: std::future::Future<Output = ApiResult<Vec<R>>>,
{
    handled(what, batch, |requests| {
        let answers = handle(requests);
        async move { Ok(answers.await?.into_iter().map(Ok).collect()) }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::handled;
    use crate::error::{ApiError, ApiResult};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A batch of the gateway's writes that found no database connection answers every
    /// request `UNAVAILABLE` at once, without writing them one at a time (each would wait as
    /// long again); one that failed otherwise is handled again a request at a time.
    #[tokio::test]
    async fn a_busy_database_answers_the_whole_batch_unavailable_at_once() {
        let writes = AtomicUsize::new(0);
        let answers: Vec<ApiResult<()>> = handled("testing", &[1, 2, 3], |_| {
            writes.fetch_add(1, Ordering::Relaxed);
            async { Err(ApiError::Unavailable("no connection in time".into())) }
        })
        .await;
        let codes: Vec<&str> = answers
            .iter()
            .map(|answer| answer.as_ref().map_or_else(|err| err.code(), |()| "OK"))
            .collect();
        assert_eq!(codes, ["UNAVAILABLE"; 3]);
        assert_eq!(writes.load(Ordering::Relaxed), 1, "tried once, as a whole");

        let writes = AtomicUsize::new(0);
        let answers: Vec<ApiResult<()>> = handled("testing", &[1, 2, 3], |batch: &[i32]| {
            writes.fetch_add(1, Ordering::Relaxed);
            let whole = batch.len() > 1;
            async move {
                if whole {
                    Err(ApiError::Internal(anyhow::anyhow!("one request's data")))
                } else {
                    Ok(vec![Ok(())])
                }
            }
        })
        .await;
        assert!(answers.iter().all(Result::is_ok));
        assert_eq!(
            writes.load(Ordering::Relaxed),
            4,
            "the batch, then each of its 3"
        );
    }
}
