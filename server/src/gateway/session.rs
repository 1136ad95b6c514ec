//! One bcd/v1 session: `hello`, `welcome`, then heartbeats and inventory until either side
//! ends it. A malformed frame or a protocol violation closes this session with a reason and
//! touches nothing stored.
//!
//! [`run`] takes the session through its phases (hello, open, welcome, follow, end);
//! [`follow`] only waits for the next input (a frame, a signal from the session registry,
//! shutdown) and hands it to one handler on [`Live`] (`on_heartbeat`, `on_command_result`, …),
//! which decides and says what comes [`Next`].

use axum::extract::ws::{CloseFrame, Message, WebSocket, close_code};
use bc_core::protocol::{
    CanonicalSection, DaemonMessage, FrameError, GatewayMessage, INVENTORY_SECTIONS, NodeSpec,
    canonical_section, holds_nul,
};
use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use std::collections::HashSet;
use std::time::Duration;

use crate::error::ApiError;
use crate::service::attributed;
use crate::service::commands::{CommandProgress, CommandReport, DispatchLook};
use crate::service::inventory::ReportedSection;
use crate::service::session_registry::{Inbox, SessionSignal, session_inbox};
use crate::service::sessions::{Hello, OpenedSession};
use bc_core::command::{CommandKind, Outcome};
use bc_core::ids::{CommandId, NodeId};

use super::GatewayState;
use crate::pki::NodeIdentity;

/// How long a daemon has to say `hello` after the upgrade.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long inventory sections wait for the rest of their report before they are stored
/// anyway. A daemon sends a report's sections back to back (all that `welcome` asked for,
/// or those of one `inventory.refresh` before its result), so a report is normally stored
/// as soon as it is complete or the next other frame arrives; this only bounds a daemon
/// that sends fewer sections than asked, or pauses between them.
const INVENTORY_REPORT_WINDOW: Duration = Duration::from_millis(250);

type Sink = SplitSink<WebSocket, Message>;
type Stream = SplitStream<WebSocket>;

/// Why a session ended, for the close frame, the log and the metrics.
struct Ending {
    code: u16,
    reason: String,
    /// Sent as `goodbye` first when the gateway ends a healthy session.
    goodbye: bool,
}

impl Ending {
    fn violation(reason: impl Into<String>) -> Ending {
        Ending {
            code: close_code::POLICY,
            reason: reason.into(),
            goodbye: false,
        }
    }

    /// The gateway is going away: the daemon should come back (to another replica, or later).
    fn shutdown() -> Ending {
        Ending {
            code: close_code::AWAY,
            reason: bc_core::protocol::close::SHUTDOWN.to_owned(),
            goodbye: true,
        }
    }

    /// Something failed on our side (`err`, a server fault); the daemon did nothing wrong and
    /// may reconnect. The reason says whether the database was busy or something broke.
    fn server_fault(err: &ApiError) -> Ending {
        let reason = match err {
            ApiError::Unavailable(_) => bc_core::protocol::close::DATABASE_BUSY,
            _ => bc_core::protocol::close::INTERNAL_ERROR,
        };
        Ending {
            code: close_code::ERROR,
            reason: reason.to_owned(),
            goodbye: true,
        }
    }

    /// The daemon went away while we were writing to it.
    fn gone() -> Ending {
        Ending {
            code: close_code::AWAY,
            reason: "the connection dropped".into(),
            goodbye: false,
        }
    }
}

/// What the session loop does after a handler.
enum Next {
    Continue,
    /// The daemon closed the connection, or it dropped: there is no one left to tell.
    DaemonLeft,
    /// The gateway ends the session with this close (and a `goodbye` if it says so).
    Close(Ending),
}

impl Next {
    fn violation(reason: impl Into<String>) -> Next {
        Next::Close(Ending::violation(reason))
    }
}

/// A step that either went through or ends the session.
impl From<Result<(), Ending>> for Next {
    fn from(result: Result<(), Ending>) -> Next {
        match result {
            Ok(()) => Next::Continue,
            Err(ending) => Next::Close(ending),
        }
    }
}

pub(super) async fn run(state: GatewayState, identity: NodeIdentity, socket: WebSocket) {
    let (mut sink, mut stream) = socket.split();
    let node_id = identity.node_id.clone();

    let hello = match read_hello(&identity, &mut stream).await {
        Ok(hello) => hello,
        Err(ending) => {
            // Nothing was opened yet, so there is nothing to unregister or record.
            if let Some(ending) = ending {
                close(&mut sink, ending).await;
            }
            return;
        }
    };
    let opened = match state.hellos.submit(hello).await {
        Some(Ok(opened)) => opened,
        Some(Err(err)) => {
            tracing::info!(%node_id, code = err.code(), reason = %err.message(), "session refused");
            let ending = if err.is_server_fault() {
                Ending::server_fault(&err)
            } else {
                Ending::violation(err.message())
            };
            close(&mut sink, ending).await;
            return;
        }
        None => {
            close(&mut sink, Ending::shutdown()).await;
            return;
        }
    };
    let epoch = opened.epoch;
    let (kick, inbox) = session_inbox();
    state.services.sessions.register(&node_id, epoch, kick);
    metrics::counter!("bc_gateway_sessions_opened_total").increment(1);

    let ending = match send(&mut sink, &welcome(&state, &opened)).await {
        Err(()) => None,
        Ok(()) => follow(&state, &identity, &opened, &mut sink, &mut stream, &inbox).await,
    };
    // Boxed: ending a session waits for its close frame to go out and for its batch to be
    // written, and inline those futures would make every open session's future that much
    // larger for as long as it runs.
    attributed(
        "gateway.session_end",
        Box::pin(end(&state, &node_id, epoch, ending, &mut sink)),
    )
    .await;
}

/// Waits for the daemon's `hello`. `Err(None)`: the daemon left first; `Err(Some)`: the
/// close that a missing or malformed `hello` earns.
async fn read_hello(identity: &NodeIdentity, stream: &mut Stream) -> Result<Hello, Option<Ending>> {
    let node_id = &identity.node_id;
    let text = match tokio::time::timeout(HELLO_TIMEOUT, stream.next()).await {
        Ok(Some(Ok(Message::Text(text)))) => text,
        Ok(Some(Ok(Message::Close(_))) | None | Some(Err(_))) => return Err(None),
        Ok(Some(Ok(_))) => {
            return Err(Some(Ending::violation("expected a hello text frame")));
        }
        Err(_) => return Err(Some(Ending::violation("no hello within 10 seconds"))),
    };
    let hello = match DaemonMessage::decode(text.as_bytes()) {
        Ok(DaemonMessage::Hello {
            inventory_hashes,
            observed_generation,
            daemon_version,
        }) => {
            tracing::debug!(%node_id, %daemon_version, "hello");
            Hello {
                identity: identity.clone(),
                inventory_hashes,
                observed_generation,
            }
        }
        Ok(_) => return Err(Some(Ending::violation("the first message must be hello"))),
        Err(err) => return Err(Some(rejected(&err))),
    };
    if let Some(unknown) = hello
        .inventory_hashes
        .keys()
        .find(|s| !INVENTORY_SECTIONS.contains(&s.as_str()))
    {
        return Err(Some(Ending::violation(format!(
            "unknown inventory section `{unknown}`"
        ))));
    }
    Ok(hello)
}

fn welcome(state: &GatewayState, opened: &OpenedSession) -> GatewayMessage {
    GatewayMessage::Welcome {
        epoch: opened.epoch,
        gateway_id: state.gateway_id.to_string(),
        want_sections: opened.want_sections.clone(),
        heartbeat_interval_secs: state.heartbeat_interval.as_secs(),
        spec: NodeSpec {
            generation: opened.spec_generation,
        },
    }
}

/// Closes an opened session (`ending`: the gateway's close; None: the daemon left), then
/// forgets it here, hands its in-flight commands back to the queue and records its end
/// (unless the gateway is stopping: see below).
async fn end(
    state: &GatewayState,
    node_id: &NodeId,
    epoch: i64,
    ending: Option<Ending>,
    sink: &mut Sink,
) {
    if let Some(ending) = ending {
        metrics::counter!("bc_gateway_sessions_closed_total", "by" => if ending.goodbye { "gateway" } else { "violation" })
            .increment(1);
        tracing::debug!(%node_id, epoch, reason = %ending.reason, "closing session");
        close(sink, ending).await;
    } else {
        metrics::counter!("bc_gateway_sessions_closed_total", "by" => "daemon").increment(1);
    }
    state.services.sessions.unregister(node_id, epoch);
    // A gateway that is stopping records no session's end: it would keep a stopping server
    // writing (10,000 sessions' ends, one transaction each, once kept it busy for more than
    // 15 s), and the batch task that records them stops with the gateway. Nothing is lost:
    // the daemon reconnects (to another replica, or to this server once it is back), and its
    // next session redelivers the commands this one had in flight (`dispatch_many` treats an
    // older epoch's as lost) and finds the node connected; a daemon that never comes back is
    // found by Liveness, as after a crash.
    if *state.shutdown.borrow() {
        metrics::counter!("bc_gateway_session_ends_left_to_next_session_total").increment(1);
        return;
    }
    match state.ends.submit((node_id.clone(), epoch)).await {
        Some(Ok(requeued)) if !requeued.is_empty() => {
            tracing::info!(%node_id, epoch, commands = requeued.len(), "session ended with commands in flight; requeued or failed them");
        }
        Some(Ok(_)) => {}
        // The gateway began stopping meanwhile, or the batch panicked (logged where it is
        // handled): as above, the next session or Liveness settles it.
        None => {}
        Some(Err(err)) => {
            tracing::warn!(%node_id, epoch, code = err.code(), reason = %err.message(), "recording the session's end failed");
        }
    }
}

/// What a session keeps track of while it runs.
#[derive(Default)]
struct Desk {
    /// Commands sent to the daemon that have not ended yet.
    in_flight: HashSet<CommandId>,
    /// Commands the daemon was told to stop, whose late results are expected and ignored.
    stopped: HashSet<CommandId>,
    /// The `inventory.refresh` commands of `in_flight`: while there is one, the daemon may
    /// send any section.
    refreshes: HashSet<CommandId>,
    /// The spec generation the daemon was last sent (in `welcome`, then in `spec`).
    spec_sent: i64,
    /// The last heartbeat's `seq`; each must be higher than the one before.
    last_seq: Option<u64>,
    /// The report being gathered: sections received and checked, not stored yet.
    report: Vec<ReportedSection>,
    /// When the report is stored even if incomplete ([`INVENTORY_REPORT_WINDOW`]).
    report_due: Option<tokio::time::Instant>,
    /// Sections asked for in `welcome` that have not arrived yet; `None` once they all
    /// have (the first report is complete), or when none were asked for.
    awaited: Option<HashSet<String>>,
}

/// An open session: what its handlers share.
struct Live<'a> {
    state: &'a GatewayState,
    node_id: &'a NodeId,
    epoch: i64,
    /// The sections asked for in `welcome`.
    wanted: &'a [String],
    sink: &'a mut Sink,
    desk: Desk,
}

/// Waits until `at`, or forever when there is nothing to wait for.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Reads frames until the daemon leaves (`None`) or the session must end (`Some`).
async fn follow(
    state: &GatewayState,
    identity: &NodeIdentity,
    opened: &OpenedSession,
    sink: &mut Sink,
    stream: &mut Stream,
    inbox: &Inbox,
) -> Option<Ending> {
    let mut shutdown = state.shutdown.clone();
    let mut live = Live {
        state,
        node_id: &identity.node_id,
        epoch: opened.epoch,
        wanted: &opened.want_sections,
        sink,
        desk: Desk {
            spec_sent: opened.spec_generation,
            awaited: (!opened.want_sections.is_empty())
                .then(|| opened.want_sections.iter().cloned().collect()),
            ..Desk::default()
        },
    };
    // The handlers run boxed, only while they run: they reach storage, and inline their
    // futures (1.4 KB for a frame's) would be part of this one, which every open session
    // holds for as long as it is open (`an_open_session_holds_a_small_future`). One
    // allocation per frame or signal costs far less than a kilobyte per session.
    //
    // Whatever waited for this node (queued commands, those requeued from its last session,
    // a spec newer than the one in `welcome`) goes out before the first frame is read.
    let mut next = Next::from(Box::pin(live.dispatch()).await);
    while let Next::Continue = next {
        let report_due = live.desk.report_due;
        next = tokio::select! {
            frame = stream.next() => Box::pin(live.on_frame(frame)).await,
            signal = inbox.recv() => Box::pin(live.on_signal(signal)).await,
            () = sleep_until_some(report_due) => Box::pin(live.store_report()).await,
            _ = shutdown.changed() => Next::Close(Ending::shutdown()),
        };
    }
    // Sections received before the session ended were checked: they are stored, as they
    // would have been one by one. (A store that failed has emptied the report already.)
    let _ = Box::pin(live.store_report()).await;
    match next {
        Next::Close(ending) => Some(ending),
        Next::Continue | Next::DaemonLeft => None,
    }
}

impl Live<'_> {
    /// A WebSocket frame (or the end of the stream): transport matters here, the message
    /// in it goes to its handler.
    async fn on_frame(&mut self, frame: Option<Result<Message, axum::Error>>) -> Next {
        let text = match frame {
            None | Some(Ok(Message::Close(_))) => return Next::DaemonLeft,
            Some(Err(err)) => return Next::Close(bad_transport(&err)),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => return Next::Continue,
            Some(Ok(Message::Binary(_))) => {
                metrics::counter!("bc_gateway_frames_rejected_total", "reason" => "binary")
                    .increment(1);
                return Next::violation("binary frames are not part of bcd/v1");
            }
            Some(Ok(Message::Text(text))) => text,
        };
        let message = match DaemonMessage::decode(text.as_bytes()) {
            Ok(message) => message,
            Err(err) => return Next::Close(rejected(&err)),
        };
        // The frame's bytes are not needed past here, and the handler may wait for the
        // writer (an inventory section is held as text already: `ReportedSection`).
        drop(text);
        // A report ends where another kind of frame begins: store it first, so what follows
        // (a command's result after its `inventory.refresh`) is handled after it, as sent.
        if !matches!(message, DaemonMessage::Inventory { .. })
            && let next @ (Next::Close(_) | Next::DaemonLeft) = self.store_report().await
        {
            return next;
        }
        match message {
            DaemonMessage::Hello { .. } => Next::violation("hello was already sent"),
            DaemonMessage::Heartbeat { seq } => self.on_heartbeat(seq).await,
            DaemonMessage::CommandStarted { id } => self.on_command_started(&id).await,
            DaemonMessage::CommandResult {
                id,
                outcome,
                exit_code,
                output,
                result,
            } => {
                self.on_command_result(&id, outcome, exit_code, output, result)
                    .await
            }
            DaemonMessage::Converged { generation } => self.on_converged(generation).await,
            DaemonMessage::Inventory {
                section,
                hash,
                content,
            } => self.on_inventory(section, hash, content).await,
        }
    }

    /// A signal from the session registry (see `service::sessions`).
    async fn on_signal(&mut self, signal: Option<SessionSignal>) -> Next {
        match signal {
            Some(SessionSignal::CommandsChanged) => self.dispatch().await.into(),
            Some(SessionSignal::Close(reason)) => Next::Close(Ending {
                code: close_code::NORMAL,
                reason: reason.to_owned(),
                goodbye: true,
            }),
            // The registry let go of this session without a `Close`: the process is
            // stopping.
            None => Next::Close(Ending::shutdown()),
        }
    }

    async fn on_heartbeat(&mut self, seq: u64) -> Next {
        if self.desk.last_seq.is_some_and(|last| seq <= last) {
            return Next::violation(format!("heartbeat seq {seq} does not increase"));
        }
        self.desk.last_seq = Some(seq);
        self.state
            .heartbeats
            .beat(
                self.node_id.clone(),
                self.epoch,
                self.state.services.clock.now(),
            )
            .await;
        Next::Continue
    }

    async fn on_command_started(&mut self, id: &str) -> Next {
        let Ok(id) = CommandId::parse(id) else {
            return Next::violation(format!("`{id}` is not a command id"));
        };
        // Told to stop already: the start crossed our `cancel`, and its result will follow.
        if self.desk.stopped.contains(&id) {
            return Next::Continue;
        }
        if !self.desk.in_flight.contains(&id) {
            return Next::violation(format!("command `{id}` was not sent in this session"));
        }
        self.report_command(id, CommandProgress::Started).await
    }

    async fn on_command_result(
        &mut self,
        id: &str,
        outcome: Outcome,
        exit_code: Option<i32>,
        output: String,
        result: Option<serde_json::Value>,
    ) -> Next {
        let Ok(id) = CommandId::parse(id) else {
            return Next::violation(format!("`{id}` is not a command id"));
        };
        if !self.desk.in_flight.remove(&id) && !self.desk.stopped.remove(&id) {
            return Next::violation(format!("command `{id}` was not sent in this session"));
        }
        // A refresh's sections came before its result and were stored then (`on_frame`).
        self.desk.refreshes.remove(&id);
        let progress = CommandProgress::Finished {
            outcome,
            exit_code,
            output,
            result,
        };
        if let next @ (Next::Close(_) | Next::DaemonLeft) = self.report_command(id, progress).await
        {
            return next;
        }
        // The lane is free: send what waits behind it.
        self.dispatch().await.into()
    }

    /// Records a report of one of this session's commands, with other sessions' reports
    /// ([`super::Batches`]). A refused report (a cancel or timeout that won the race; the
    /// daemon hears `cancel`) is logged, and so is one that could not be written: the session
    /// goes on either way. Ending it would requeue a command whose result had come, and the
    /// daemon would run it again; unrecorded, the command times out instead.
    async fn report_command(&mut self, id: CommandId, progress: CommandProgress) -> Next {
        let report = CommandReport {
            node_id: self.node_id.clone(),
            id: id.clone(),
            progress,
        };
        match self.state.command_reports.submit(report).await {
            None => Next::Close(Ending::shutdown()),
            Some(Ok(_)) => Next::Continue,
            Some(Err(err)) if err.is_server_fault() => {
                tracing::warn!(node_id = %self.node_id, %id, code = err.code(), reason = %err.message(), "recording a command report failed");
                Next::Continue
            }
            Some(Err(err)) => {
                tracing::debug!(node_id = %self.node_id, %id, code = err.code(), reason = %err.message(), "late command report ignored");
                Next::Continue
            }
        }
    }

    async fn on_converged(&mut self, generation: i64) -> Next {
        let report = (self.node_id.clone(), generation);
        match self.state.convergences.submit(report).await {
            Some(Ok(())) => Next::Continue,
            Some(Err(err)) if err.is_server_fault() => Next::Close(Ending::server_fault(&err)),
            Some(Err(err)) => Next::violation(format!("converged: {}", err.message())),
            None => Next::Close(Ending::shutdown()),
        }
    }

    async fn on_inventory(
        &mut self,
        section: String,
        hash: String,
        content: serde_json::Value,
    ) -> Next {
        // Sections asked for in `welcome`, or any section while an
        // `inventory.refresh` runs (that is what it is for).
        let refreshing = !self.desk.refreshes.is_empty();
        let known = INVENTORY_SECTIONS.contains(&section.as_str());
        if !(self.wanted.contains(&section) || refreshing && known) {
            return Next::violation(format!("inventory section `{section}` was not asked for"));
        }
        // Held as text until stored (`ReportedSection`): the very text the hash is checked on.
        let CanonicalSection {
            text,
            hash: computed,
        } = canonical_section(&content);
        if computed != hash {
            return Next::violation(format!(
                "inventory section `{section}` does not match its hash"
            ));
        }
        drop(computed);
        // PostgreSQL's `jsonb` cannot hold a NUL character, and the report is stored in a
        // batch with other daemons' reports: refused here, it fails this session alone.
        if holds_nul(&content) {
            return Next::violation(format!(
                "inventory section `{section}` contains a NUL character"
            ));
        }
        // The parsed value goes now, not when this handler's future ends (after it may have
        // waited for the writer).
        drop(content);
        if let Some(awaited) = &mut self.desk.awaited {
            awaited.remove(&section);
        }
        self.desk.report.retain(|r| r.section != section);
        self.desk.report.push(ReportedSection {
            section,
            hash,
            content: text,
        });
        // The sections `welcome` asked for are one report: stored once all have come.
        // Sections of a refresh are stored at its result (see `on_frame`) or when the window
        // closes.
        if self.desk.awaited.as_ref().is_some_and(HashSet::is_empty) {
            self.desk.awaited = None;
            return self.store_report().await;
        }
        self.desk
            .report_due
            .get_or_insert_with(|| tokio::time::Instant::now() + INVENTORY_REPORT_WINDOW);
        Next::Continue
    }

    /// Stores the report gathered so far (nothing if there is none), with other sessions'
    /// reports ([`super::Batches`]).
    async fn store_report(&mut self) -> Next {
        self.desk.report_due = None;
        let report = std::mem::take(&mut self.desk.report);
        if report.is_empty() {
            return Next::Continue;
        }
        match self
            .state
            .inventories
            .submit((self.node_id.clone(), report))
            .await
        {
            None => Next::Close(Ending::shutdown()),
            Some(Ok(())) => Next::Continue,
            // The content is the daemon's fault (a malformed `gpus` section): a violation.
            Some(Err(ApiError::BadUserInput(message))) => Next::violation(message),
            Some(Err(err)) => {
                let source = match &err {
                    ApiError::Internal(source) => format!("{source:#}"),
                    other => other.message(),
                };
                tracing::warn!(node_id = %self.node_id, code = err.code(), error = %source, "storing inventory failed");
                Next::Close(Ending::server_fault(&err))
            }
        }
    }

    /// Tells the daemon to stop commands that ended here (cancelled, timed out), sends a
    /// newer spec, and sends the commands whose lane is free: what one look at the node,
    /// batched with other sessions' ([`super::Batches`]), says to send.
    async fn dispatch(&mut self) -> Result<(), Ending> {
        let look = DispatchLook {
            node_id: self.node_id.clone(),
            epoch: self.epoch,
            in_flight: self.desk.in_flight.iter().cloned().collect(),
            spec_sent: self.desk.spec_sent,
        };
        let dispatch = match self.state.dispatches.submit(look).await {
            None => return Err(Ending::shutdown()),
            Some(Ok(dispatch)) => dispatch,
            Some(Err(err)) => return Err(self.internal(err)),
        };
        // `cancel` for every in-flight command that reached a final state here (cancelled,
        // timed out) or is gone; its late result is then expected, not a violation.
        for id in dispatch.stop {
            self.desk.in_flight.remove(&id);
            self.desk.refreshes.remove(&id);
            send(self.sink, &GatewayMessage::Cancel { id: id.to_string() })
                .await
                .map_err(|()| Ending::gone())?;
            self.desk.stopped.insert(id);
        }
        if let Some(generation) = dispatch.spec {
            send(
                self.sink,
                &GatewayMessage::Spec {
                    spec: NodeSpec { generation },
                },
            )
            .await
            .map_err(|()| Ending::gone())?;
            self.desk.spec_sent = generation;
        }
        for command in dispatch.send {
            let message = GatewayMessage::Command {
                id: command.id.to_string(),
                kind: command.kind,
                params: command.params.clone(),
                timeout_secs: command.timeout.num_seconds(),
            };
            send(self.sink, &message)
                .await
                .map_err(|()| Ending::gone())?;
            if command.kind == CommandKind::InventoryRefresh {
                self.desk.refreshes.insert(command.id.clone());
            }
            self.desk.in_flight.insert(command.id);
        }
        Ok(())
    }

    /// A failed command dispatch, logged; the session ends with an internal error.
    fn internal(&self, err: ApiError) -> Ending {
        tracing::warn!(node_id = %self.node_id, code = err.code(), reason = %err.message(), "command dispatch failed");
        Ending::server_fault(&err)
    }
}

/// A frame that is not a daemon message: counted by its reason, and the session closes
/// saying what was wrong with it.
fn rejected(err: &FrameError) -> Ending {
    metrics::counter!("bc_gateway_frames_rejected_total", "reason" => err.reason()).increment(1);
    Ending::violation(err.to_string())
}

/// A frame the WebSocket layer could not read: oversized frames and broken framing surface
/// here.
fn bad_transport(err: &axum::Error) -> Ending {
    let too_big =
        err.to_string().to_lowercase().contains("too long") || err.to_string().contains("size");
    metrics::counter!("bc_gateway_frames_rejected_total", "reason" => "transport").increment(1);
    let code = if too_big {
        close_code::SIZE
    } else {
        close_code::PROTOCOL
    };
    Ending {
        code,
        reason: format!("bad frame: {err}"),
        goodbye: false,
    }
}

async fn send(sink: &mut Sink, message: &GatewayMessage) -> Result<(), ()> {
    let text = serde_json::to_string(message).map_err(|_| ())?;
    sink.send(Message::Text(text.into())).await.map_err(|_| ())
}

async fn close(sink: &mut Sink, ending: Ending) {
    if ending.goodbye {
        let reconnect = ending.reason != bc_core::protocol::close::IDENTITY_REVOKED;
        let _ = send(
            sink,
            &GatewayMessage::Goodbye {
                reason: ending.reason.clone(),
                reconnect,
            },
        )
        .await;
    }
    // Close reasons are limited to 123 bytes by the WebSocket protocol.
    let mut reason = ending.reason;
    while reason.len() > 123 {
        reason.pop();
    }
    let _ = sink
        .send(Message::Close(Some(CloseFrame {
            code: ending.code,
            reason: reason.into(),
        })))
        .await;
    let _ = sink.close().await;
}

#[cfg(test)]
mod tests {
    use crate::held_sizes::size_returned_by;

    /// An open session's future lives as long as the session: 10,000 sessions hold 10,000 of
    /// them. Storage calls' futures are large (ending a session reaches the database: 8 KB in
    /// a test build), and inline, doubled by `attributed` when it was an `async fn`, they
    /// made this future 17 KB in a test build; the task around it (which held it twice as
    /// well) was 36 KB per session in a release build (heaptrack: most of the memory per node
    /// of issue 16). What reaches storage runs boxed, only while it runs; this keeps it so.
    /// (The frame and signal handlers inline made it 3,152 bytes; boxed, 2,064.)
    #[test]
    fn an_open_session_holds_a_small_future() {
        const BUDGET_BYTES: usize = 2560;
        let size = size_returned_by(super::run);
        assert!(
            size <= BUDGET_BYTES,
            "a session's future is {size} bytes, over {BUDGET_BYTES}: box what it awaits that is large"
        );
    }

    /// A session ended by a failure on the server's side tells its daemon which: a busy
    /// database (`UNAVAILABLE`) or anything else, with the close code that says reconnect.
    #[test]
    fn a_server_fault_closes_saying_whether_the_database_was_busy() {
        use crate::error::ApiError;
        use bc_core::protocol::close;
        let busy = super::Ending::server_fault(&ApiError::Unavailable("no connection".into()));
        let broken = super::Ending::server_fault(&ApiError::Internal(anyhow::anyhow!("bug")));
        assert_eq!(
            (busy.reason.as_str(), broken.reason.as_str()),
            (close::DATABASE_BUSY, close::INTERNAL_ERROR)
        );
        assert_eq!(
            (busy.code, broken.code),
            (super::close_code::ERROR, super::close_code::ERROR)
        );
        assert!(busy.goodbye && broken.goodbye);
    }
}
