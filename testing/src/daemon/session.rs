//! One session: open it (`hello`, `welcome`), report the inventory the gateway wants, then
//! follow it until it ends. The loop in [`Live::follow`] only waits for the next input (the
//! stop signal, the heartbeat, flapping and renewal timers, a finished command, a frame) and
//! hands it to one handler (`on_heartbeat_due`, `on_command`, `on_cancel`, …) that says what
//! comes [`Next`].

use super::commands::{CommandEffect, Underway, cancelled};
use super::identity::{Identity, RENEW_RETRY_DELAY};
use super::tls::{GatewayContext, Trust, connect};
use super::{DaemonError, DaemonKnobs, FakeDaemon, Phase, stopped};
use bc_core::command::CommandKind;
use bc_core::protocol::{self, DaemonMessage, GatewayMessage};
use futures::{SinkExt, StreamExt};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::{
    self, Message, protocol::CloseFrame, protocol::frame::coding::CloseCode,
};

/// How long opening a session may take: TCP, TLS, the WebSocket upgrade and `welcome`.
const SESSION_OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long to wait for the gateway's close frame after the daemon sent its own, or after a
/// `goodbye`, before dropping the connection.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) type Session = WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>;

/// How a session ended.
pub(super) enum SessionEnd {
    Stopped,
    /// The gateway closed it (after a `goodbye`, or not); `reconnect` is the goodbye's advice.
    Closed {
        reason: String,
        reconnect: bool,
    },
    /// The flapping knob dropped it (or the machine rebooted).
    Flapped,
    Revoked(String),
    Failed(DaemonError),
}

/// What `welcome` said.
struct Welcome {
    epoch: i64,
    gateway_id: String,
    want_sections: Vec<String>,
    heartbeat_interval_secs: u64,
    generation: i64,
}

/// Why a session did not open.
pub(super) enum Opening {
    Revoked(String),
    Closed { reason: String, reconnect: bool },
    Failed(DaemonError),
}

impl From<DaemonError> for Opening {
    fn from(err: DaemonError) -> Opening {
        Opening::Failed(err)
    }
}

impl From<std::io::Error> for Opening {
    fn from(err: std::io::Error) -> Opening {
        Opening::Failed(err.into())
    }
}

impl From<tungstenite::Error> for Opening {
    fn from(err: tungstenite::Error) -> Opening {
        Opening::Failed(err.into())
    }
}

impl From<Opening> for SessionEnd {
    fn from(opening: Opening) -> SessionEnd {
        match opening {
            Opening::Revoked(reason) => SessionEnd::Revoked(reason),
            Opening::Closed { reason, reconnect } => SessionEnd::Closed { reason, reconnect },
            Opening::Failed(err) => SessionEnd::Failed(err),
        }
    }
}

/// What the session loop does after a handler. A handler's error (a frame it could not
/// send) ends the session as failed.
enum Next {
    Continue,
    End(SessionEnd),
}

impl FakeDaemon {
    /// One session, from connecting to its end.
    pub(super) async fn session(
        &self,
        context: &GatewayContext,
        trust: &mut Arc<Trust>,
        identity: &mut Identity,
        hashes: &BTreeMap<String, String>,
        inventory: BTreeMap<String, Value>,
    ) -> SessionEnd {
        // What this daemon converged before: `hello` reports it, and a newer generation in
        // `welcome` is converged and said so.
        let observed_generation = self.shared.status.borrow().observed_generation;
        let (ws, welcome) = match self
            .open(context, identity, hashes, observed_generation)
            .await
        {
            Ok(opened) => opened,
            Err(end) => return end,
        };
        self.session_up(&welcome);
        let mut live = Live {
            daemon: self,
            context,
            trust,
            identity,
            inventory,
            ws,
            underway: Underway::default(),
            seq: 0,
            goodbye: None,
        };
        if let Err(err) = live.report(&welcome, observed_generation).await {
            return SessionEnd::Failed(err);
        }
        live.follow(welcome.heartbeat_interval_secs).await
    }

    /// Takes a handshake slot and opens the session within [`SESSION_OPEN_TIMEOUT`]; what
    /// prevented it is how the session ended.
    async fn open(
        &self,
        context: &GatewayContext,
        identity: &Identity,
        hashes: &BTreeMap<String, String>,
        observed_generation: i64,
    ) -> Result<(Session, Welcome), SessionEnd> {
        self.update(|s| s.phase = Phase::Connecting);
        let Some(permit) = self.unless_stopped(context.session_permit()).await else {
            return Err(SessionEnd::Stopped);
        };
        let hello = DaemonMessage::Hello {
            daemon_version: self.shared.knobs.daemon_version.clone(),
            inventory_hashes: hashes.clone(),
            observed_generation,
        };
        let opened = self
            .unless_stopped(tokio::time::timeout(
                SESSION_OPEN_TIMEOUT,
                open_session(context, self.gateway(), identity, &hello),
            ))
            .await;
        drop(permit);
        match opened {
            None => Err(SessionEnd::Stopped),
            Some(Err(_elapsed)) => Err(SessionEnd::Failed(DaemonError::Timeout(
                "opening the session",
            ))),
            Some(Ok(Err(opening))) => Err(opening.into()),
            Some(Ok(Ok(opened))) => Ok(opened),
        }
    }

    /// Counts the session and shows it in the status.
    fn session_up(&self, welcome: &Welcome) {
        let Welcome {
            epoch,
            gateway_id,
            want_sections,
            generation,
            ..
        } = welcome;
        self.shared
            .counters
            .sessions
            .fetch_add(1, Ordering::Relaxed);
        self.update(|s| {
            s.phase = Phase::Connected;
            s.epoch = Some(*epoch);
            s.gateway_id = Some(gateway_id.clone());
            s.sessions += 1;
            // The simulated machine converges a new spec at once.
            s.observed_generation = *generation;
        });
        self.set_connected(true);
        tracing::debug!(hostname = %self.hostname(), epoch, %gateway_id, wanted = ?want_sections, "session up");
    }
}

/// An open session: what its handlers share.
struct Live<'a> {
    daemon: &'a FakeDaemon,
    context: &'a GatewayContext,
    trust: &'a mut Arc<Trust>,
    identity: &'a mut Identity,
    /// The machine's inventory as this session reported it; a reset that clears a fault
    /// updates it, so a later `inventory.refresh` reports the machine as it is.
    inventory: BTreeMap<String, Value>,
    ws: Session,
    underway: Underway,
    /// The last heartbeat's `seq`.
    seq: u64,
    /// The gateway's `goodbye` (reason, reconnect), kept for when it closes the connection.
    goodbye: Option<(String, bool)>,
}

impl Live<'_> {
    /// The inventory sections `welcome` asked for, then `converged` if `welcome` carried a
    /// newer spec.
    async fn report(
        &mut self,
        welcome: &Welcome,
        observed_generation: i64,
    ) -> Result<(), DaemonError> {
        for section in &welcome.want_sections {
            let Some(content) = self.inventory.get(section) else {
                tracing::warn!(hostname = %self.daemon.hostname(), %section, "the gateway wants a section this daemon does not have");
                continue;
            };
            send(&mut self.ws, &inventory_message(section, content)).await?;
            self.daemon.update(|s| s.inventory_sections_sent += 1);
        }
        // The simulated machine converges a new spec at once and says so.
        let generation = welcome.generation;
        if generation > observed_generation {
            send(&mut self.ws, &DaemonMessage::Converged { generation }).await?;
        }
        Ok(())
    }

    /// Waits for the next input and hands it to its handler, until one ends the session.
    async fn follow(mut self, heartbeat_interval_secs: u64) -> SessionEnd {
        let daemon = self.daemon;
        let knobs = &daemon.shared.knobs;
        let mut heartbeats =
            (!knobs.skip_heartbeats).then(|| heartbeat_interval(knobs, heartbeat_interval_secs));
        let flap_at = knobs.flapping.map(|every| Instant::now() + every);
        let mut stop = daemon.shared.stop.subscribe();
        let mut faults = daemon.watch_faults();
        faults.mark_unchanged();
        // Faults that changed while this session was starting (after its hello took the
        // inventory) were just marked seen: they are reported now, or never would be.
        match self.on_faults_changed().await {
            Ok(Next::Continue) => {}
            Ok(Next::End(end)) => return end,
            Err(err) => return SessionEnd::Failed(err),
        }
        loop {
            let faults_due = daemon.faults_due();
            let handled = tokio::select! {
                () = stopped(&mut stop) => self.on_stop().await,
                () = sleep_until(faults_due) => {
                    daemon.faults_appear();
                    Ok(Next::Continue)
                }
                changed = faults.changed() => match changed {
                    Ok(()) => self.on_faults_changed().await,
                    Err(_) => Ok(Next::Continue),
                },
                () = tick(&mut heartbeats) => self.on_heartbeat_due().await,
                () = sleep_until(flap_at) => self.on_flap().await,
                () = tokio::time::sleep_until(self.identity.renew_at) => self.on_renew_due().await,
                () = sleep_until(self.underway.next_done()) => self.on_commands_done().await,
                frame = self.ws.next() => self.on_frame(frame).await,
            };
            match handled {
                Ok(Next::Continue) => {}
                Ok(Next::End(end)) => return end,
                Err(err) => return SessionEnd::Failed(err),
            }
        }
    }

    async fn on_stop(&mut self) -> Result<Next, DaemonError> {
        close(&mut self.ws, "daemon stopping").await;
        Ok(Next::End(SessionEnd::Stopped))
    }

    async fn on_heartbeat_due(&mut self) -> Result<Next, DaemonError> {
        self.seq += 1;
        send(&mut self.ws, &DaemonMessage::Heartbeat { seq: self.seq }).await?;
        self.daemon
            .shared
            .counters
            .heartbeats_sent
            .fetch_add(1, Ordering::Relaxed);
        self.daemon.update(|s| s.heartbeats_sent += 1);
        Ok(Next::Continue)
    }

    /// The machine's faults changed outside a command (a GPU failed): the session ends and
    /// the next `hello` announces the changed `gpus` section, which the gateway then asks
    /// for. (A reset's own change is reported by the `inventory.refresh` that verifies it.)
    async fn on_faults_changed(&mut self) -> Result<Next, DaemonError> {
        let now = self.daemon.inventory();
        if now.get("gpus") == self.inventory.get("gpus") {
            return Ok(Next::Continue);
        }
        tracing::debug!(hostname = %self.daemon.hostname(), "the GPUs' faults changed: reconnecting to report them");
        close(&mut self.ws, "inventory changed").await;
        Ok(Next::End(SessionEnd::Flapped))
    }

    async fn on_flap(&mut self) -> Result<Next, DaemonError> {
        tracing::debug!(hostname = %self.daemon.hostname(), "flapping: dropping the session");
        close(&mut self.ws, "flapping").await;
        Ok(Next::End(SessionEnd::Flapped))
    }

    /// Renews the certificate while the session goes on: the session keeps the certificate
    /// it was opened with; the next one uses the new.
    async fn on_renew_due(&mut self) -> Result<Next, DaemonError> {
        match self
            .daemon
            .renew(self.context, self.trust, self.identity)
            .await
        {
            Ok(renewed) => {
                self.daemon.record_renewal(&renewed);
                *self.identity = renewed;
            }
            // The gateway no longer accepts this identity: it was revoked.
            Err(DaemonError::Refused {
                status: 403,
                message,
                ..
            }) => {
                close(&mut self.ws, "identity revoked").await;
                return Ok(Next::End(SessionEnd::Revoked(message)));
            }
            Err(err) => {
                tracing::info!(hostname = %self.daemon.hostname(), error = %err, "renewal failed; retrying later");
                self.daemon.record_error(&err);
                self.identity.renew_at = Instant::now() + RENEW_RETRY_DELAY;
            }
        }
        Ok(Next::Continue)
    }

    /// Sends the results of the commands that finished; a reboot ends the session (and
    /// whatever else finished with it is lost, as on a real machine).
    async fn on_commands_done(&mut self) -> Result<Next, DaemonError> {
        for command in self.underway.take_done() {
            match self
                .daemon
                .finish_command(&mut self.ws, command, &self.inventory)
                .await?
            {
                CommandEffect::None => {}
                CommandEffect::Reinventory => {
                    // The machine changed under this session (a reset cleared a fault):
                    // what it reports from now on is the machine as it is.
                    self.inventory = self.daemon.inventory();
                }
                CommandEffect::Reboot => {
                    close(&mut self.ws, "rebooting").await;
                    return Ok(Next::End(SessionEnd::Flapped));
                }
            }
        }
        Ok(Next::Continue)
    }

    /// A WebSocket frame (or the end of the stream): transport matters here, the message in
    /// it goes to its handler.
    async fn on_frame(
        &mut self,
        frame: Option<Result<Message, tungstenite::Error>>,
    ) -> Result<Next, DaemonError> {
        match frame {
            Some(Ok(Message::Text(text))) => {
                match serde_json::from_str::<GatewayMessage>(text.as_str()) {
                    Ok(message) => self.on_message(message).await,
                    Err(err) => {
                        // Newer gateways may send messages this daemon does not know yet.
                        tracing::warn!(hostname = %self.daemon.hostname(), error = %err, frame = %truncate(text.as_str()), "an unknown gateway message; ignored");
                        Ok(Next::Continue)
                    }
                }
            }
            Some(Ok(Message::Close(frame))) => {
                let (code, close_reason) = frame.map_or((None, String::new()), |f| {
                    (Some(u16::from(f.code)), f.reason.to_string())
                });
                drain(&mut self.ws).await;
                Ok(Next::End(ended_by_gateway(
                    self.goodbye.take(),
                    code,
                    close_reason,
                )))
            }
            Some(Ok(Message::Binary(_))) => {
                tracing::warn!(hostname = %self.daemon.hostname(), "a binary frame from the gateway; ignored");
                Ok(Next::Continue)
            }
            // Pings and pongs: tungstenite answers pings itself.
            Some(Ok(_)) => Ok(Next::Continue),
            Some(Err(err)) => Ok(Next::End(self.dropped(err.into()))),
            None => Ok(Next::End(self.dropped(DaemonError::Protocol(
                "the connection closed without a close frame".to_owned(),
            )))),
        }
    }

    /// The connection ended without a close frame: after a `goodbye` that is the gateway
    /// leaving as it said; otherwise the session failed with `err`.
    fn dropped(&mut self, err: DaemonError) -> SessionEnd {
        match self.goodbye.take() {
            Some((reason, reconnect)) => SessionEnd::Closed { reason, reconnect },
            None => SessionEnd::Failed(err),
        }
    }

    async fn on_message(&mut self, message: GatewayMessage) -> Result<Next, DaemonError> {
        match message {
            GatewayMessage::Goodbye { reason, reconnect } => Ok(self.on_goodbye(reason, reconnect)),
            GatewayMessage::Welcome { .. } => {
                tracing::warn!(hostname = %self.daemon.hostname(), "a second welcome; ignored");
                Ok(Next::Continue)
            }
            GatewayMessage::Command {
                id, kind, params, ..
            } => self.on_command(id, kind, params).await,
            GatewayMessage::Cancel { id } => self.on_cancel(id).await,
            GatewayMessage::Spec { spec } => self.on_spec(spec.generation).await,
        }
    }

    /// The gateway is about to close; its close frame (or the dropped connection) ends the
    /// session, and this says why and whether to come back.
    fn on_goodbye(&mut self, reason: String, reconnect: bool) -> Next {
        tracing::debug!(hostname = %self.daemon.hostname(), %reason, reconnect, "goodbye");
        self.goodbye = Some((reason, reconnect));
        Next::Continue
    }

    async fn on_command(
        &mut self,
        id: String,
        kind: CommandKind,
        params: Value,
    ) -> Result<Next, DaemonError> {
        send(
            &mut self.ws,
            &DaemonMessage::CommandStarted { id: id.clone() },
        )
        .await?;
        self.daemon.update(|s| s.commands_received += 1);
        self.underway.start(id, kind, params);
        Ok(Next::Continue)
    }

    async fn on_cancel(&mut self, id: String) -> Result<Next, DaemonError> {
        // A command no longer running finished already; its result is on its way.
        if self.underway.cancel(&id) {
            send(&mut self.ws, &cancelled(id)).await?;
        }
        Ok(Next::Continue)
    }

    /// A new desired state, which the simulated machine converges at once.
    async fn on_spec(&mut self, generation: i64) -> Result<Next, DaemonError> {
        self.daemon.update(|s| s.observed_generation = generation);
        send(&mut self.ws, &DaemonMessage::Converged { generation }).await?;
        Ok(Next::Continue)
    }
}

/// The heartbeat timer: the gateway's interval (or the knob's), plus the knob's delay. The
/// first beat comes one period after the session opens.
fn heartbeat_interval(knobs: &DaemonKnobs, heartbeat_interval_secs: u64) -> Interval {
    let base = knobs
        .heartbeat_interval_override
        .unwrap_or(Duration::from_secs(heartbeat_interval_secs.max(1)));
    let period = base + knobs.heartbeat_delay;
    let mut interval = tokio::time::interval_at(Instant::now() + period, period);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    interval
}

/// TCP, TLS with the node certificate, the WebSocket upgrade (`bcd.v1`), `hello`, `welcome`.
async fn open_session(
    context: &GatewayContext,
    gateway: usize,
    identity: &Identity,
    hello: &DaemonMessage,
) -> Result<(Session, Welcome), Opening> {
    let mut ws = connect(context, gateway, identity).await?;
    send(&mut ws, hello).await?;
    let welcome = read_welcome(&mut ws).await?;
    Ok((ws, welcome))
}

/// Reads up to `welcome`; a `goodbye` or a close instead means the gateway would not have
/// this session.
async fn read_welcome(ws: &mut Session) -> Result<Welcome, Opening> {
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) => {
                return match serde_json::from_str::<GatewayMessage>(text.as_str()) {
                    Ok(GatewayMessage::Welcome {
                        epoch,
                        gateway_id,
                        want_sections,
                        heartbeat_interval_secs,
                        spec,
                    }) => Ok(Welcome {
                        epoch,
                        gateway_id,
                        want_sections,
                        heartbeat_interval_secs,
                        generation: spec.generation,
                    }),
                    Ok(GatewayMessage::Goodbye { reason, reconnect }) => {
                        drain(ws).await;
                        Err(Opening::Closed { reason, reconnect })
                    }
                    Ok(_) => Err(Opening::Failed(DaemonError::Protocol(format!(
                        "expected welcome, got {}",
                        truncate(text.as_str())
                    )))),
                    Err(err) => Err(Opening::Failed(DaemonError::Protocol(format!(
                        "expected welcome, got {} ({err})",
                        truncate(text.as_str())
                    )))),
                };
            }
            Some(Ok(Message::Close(frame))) => {
                drain(ws).await;
                let (code, reason) = frame.map_or((None, String::new()), |f| {
                    (Some(u16::from(f.code)), f.reason.to_string())
                });
                return Err(match ended_by_gateway(None, code, reason.clone()) {
                    SessionEnd::Revoked(reason) => Opening::Revoked(reason),
                    SessionEnd::Closed { reason, reconnect } => {
                        Opening::Closed { reason, reconnect }
                    }
                    SessionEnd::Failed(err) => Opening::Failed(err),
                    SessionEnd::Stopped | SessionEnd::Flapped => Opening::Closed {
                        reason,
                        reconnect: true,
                    },
                });
            }
            Some(Ok(Message::Binary(_))) => {
                return Err(Opening::Failed(DaemonError::Protocol(
                    "a binary frame before welcome".to_owned(),
                )));
            }
            Some(Ok(_)) => {}
            Some(Err(err)) => return Err(err.into()),
            None => {
                return Err(Opening::Failed(DaemonError::Protocol(
                    "the connection closed before welcome".to_owned(),
                )));
            }
        }
    }
}

/// How a session the gateway closed ended: a revoked identity, or a close to come back from
/// (unless a goodbye said not to).
fn ended_by_gateway(
    goodbye: Option<(String, bool)>,
    code: Option<u16>,
    close_reason: String,
) -> SessionEnd {
    let reconnect = goodbye.as_ref().is_none_or(|(_, reconnect)| *reconnect);
    let reason = match goodbye {
        Some((reason, _)) => reason,
        None if close_reason.is_empty() => {
            code.map_or_else(|| "closed".to_owned(), |code| format!("closed ({code})"))
        }
        None => match code {
            Some(code) => format!("{close_reason} ({code})"),
            None => close_reason.clone(),
        },
    };
    if close_reason == protocol::close::IDENTITY_REVOKED
        || reason == protocol::close::IDENTITY_REVOKED
    {
        return SessionEnd::Revoked(reason);
    }
    SessionEnd::Closed { reason, reconnect }
}

/// One inventory section as the gateway wants it: with the hash of its content.
pub(super) fn inventory_message(section: &str, content: &Value) -> DaemonMessage {
    DaemonMessage::Inventory {
        section: section.to_owned(),
        hash: protocol::section_hash(content),
        content: content.clone(),
    }
}

pub(super) async fn send(ws: &mut Session, message: &DaemonMessage) -> Result<(), DaemonError> {
    let text = serde_json::to_string(message).map_err(|e| DaemonError::Protocol(e.to_string()))?;
    ws.send(Message::text(text)).await?;
    Ok(())
}

/// Sends a normal close and waits (briefly) for the gateway's.
async fn close(ws: &mut Session, reason: &str) {
    let frame = CloseFrame {
        code: CloseCode::Normal,
        reason: reason.to_owned().into(),
    };
    if ws.close(Some(frame)).await.is_ok() {
        drain(ws).await;
    }
}

/// Reads until the connection ends, at most [`CLOSE_TIMEOUT`], so the closing handshake
/// completes.
async fn drain(ws: &mut Session) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
        while let Some(Ok(_)) = ws.next().await {}
    })
    .await;
}

async fn tick(interval: &mut Option<Interval>) {
    match interval {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The first few hundred characters of a frame, for logs.
fn truncate(text: &str) -> &str {
    const MAX_LOGGED: usize = 200;
    match text.char_indices().nth(MAX_LOGGED) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_closes_are_classified() {
        assert!(matches!(
            ended_by_gateway(None, Some(1008), protocol::close::IDENTITY_REVOKED.into()),
            SessionEnd::Revoked(_)
        ));
        assert!(matches!(
            ended_by_gateway(
                Some((protocol::close::SUPERSEDED.into(), true)),
                Some(1000),
                String::new()
            ),
            SessionEnd::Closed {
                reconnect: true,
                ..
            }
        ));
        assert!(matches!(
            ended_by_gateway(Some(("maintenance".into(), false)), None, String::new()),
            SessionEnd::Closed {
                reconnect: false,
                ..
            }
        ));
        match ended_by_gateway(None, Some(1008), "unknown message type".into()) {
            SessionEnd::Closed { reason, reconnect } => {
                assert!(reconnect);
                assert_eq!(reason, "unknown message type (1008)");
            }
            _ => panic!("a close to come back from"),
        }
    }
}
