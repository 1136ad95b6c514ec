//! One bcd/v1 session: `hello`, `welcome`, then heartbeats and inventory until either side
//! ends it. A malformed frame or a protocol violation closes this session with a reason and
//! touches nothing stored.

use axum::extract::ws::{CloseFrame, Message, WebSocket, close_code};
use bc_core::protocol::{
    DaemonMessage, GatewayMessage, INVENTORY_SECTIONS, NodeSpec, section_hash,
};
use futures::{SinkExt, StreamExt};
use std::collections::HashSet;
use std::time::Duration;
use tokio::sync::mpsc;

use crate::service::session_registry::SessionSignal;
use bc_core::ids::CommandId;

use super::GatewayState;
use crate::pki::NodeIdentity;

/// How long a daemon has to say `hello` after the upgrade.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

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
}

pub(super) async fn run(state: GatewayState, identity: NodeIdentity, socket: WebSocket) {
    let (mut sink, mut stream) = socket.split();
    let node_id = identity.node_id.clone();

    // 1. hello
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, stream.next()).await {
        Ok(Some(Ok(Message::Text(text)))) => serde_json::from_str::<DaemonMessage>(&text),
        Ok(Some(Ok(Message::Close(_)))) | Ok(None) | Ok(Some(Err(_))) => return,
        Ok(Some(Ok(_))) => {
            close(&mut sink, Ending::violation("expected a hello text frame")).await;
            return;
        }
        Err(_) => {
            close(&mut sink, Ending::violation("no hello within 10 seconds")).await;
            return;
        }
    };
    let (inventory_hashes, observed_generation) = match hello {
        Ok(DaemonMessage::Hello {
            inventory_hashes,
            observed_generation,
            daemon_version,
        }) => {
            tracing::debug!(%node_id, %daemon_version, "hello");
            (inventory_hashes, observed_generation)
        }
        Ok(_) => {
            close(
                &mut sink,
                Ending::violation("the first message must be hello"),
            )
            .await;
            return;
        }
        Err(err) => {
            close(
                &mut sink,
                Ending::violation(format!("malformed hello: {err}")),
            )
            .await;
            return;
        }
    };
    if let Some(unknown) = inventory_hashes
        .keys()
        .find(|s| !INVENTORY_SECTIONS.contains(&s.as_str()))
    {
        close(
            &mut sink,
            Ending::violation(format!("unknown inventory section `{unknown}`")),
        )
        .await;
        return;
    }
    let opened = match state
        .services
        .open_session(
            &identity,
            &state.gateway_id,
            &inventory_hashes,
            observed_generation,
        )
        .await
    {
        Ok(opened) => opened,
        Err(err) => {
            tracing::info!(%node_id, code = err.code(), reason = %err.message(), "session refused");
            close(&mut sink, Ending::violation(err.message())).await;
            return;
        }
    };
    let epoch = opened.epoch;
    let (kick_tx, mut kick_rx) = mpsc::unbounded_channel();
    state.services.sessions.register(&node_id, epoch, kick_tx);
    metrics::counter!("bc_gateway_sessions_opened_total").increment(1);

    let welcome = GatewayMessage::Welcome {
        epoch,
        gateway_id: state.gateway_id.to_string(),
        want_sections: opened.want_sections.clone(),
        heartbeat_interval_secs: state.heartbeat_interval.as_secs(),
        spec: NodeSpec {
            generation: opened.spec_generation,
        },
    };
    let ending = match send(&mut sink, &welcome).await {
        Err(()) => None,
        Ok(()) => {
            follow(
                &state,
                &identity,
                &opened,
                &mut sink,
                &mut stream,
                &mut kick_rx,
            )
            .await
        }
    };
    if let Some(ending) = ending {
        metrics::counter!("bc_gateway_sessions_closed_total", "by" => if ending.goodbye { "gateway" } else { "violation" })
            .increment(1);
        tracing::debug!(%node_id, epoch, reason = %ending.reason, "closing session");
        close(&mut sink, ending).await;
    } else {
        metrics::counter!("bc_gateway_sessions_closed_total", "by" => "daemon").increment(1);
    }
    state.services.sessions.unregister(&node_id, epoch);
    match state.services.commands_session_lost(&node_id, epoch).await {
        Ok(requeued) if !requeued.is_empty() => {
            tracing::info!(%node_id, epoch, commands = requeued.len(), "session ended with commands in flight; requeued or failed them");
        }
        Ok(_) => {}
        Err(err) => {
            tracing::warn!(%node_id, epoch, code = err.code(), reason = %err.message(), "handling in-flight commands failed")
        }
    }
    if let Err(err) = state.services.close_session(&node_id, epoch).await {
        tracing::warn!(%node_id, epoch, code = err.code(), reason = %err.message(), "recording the session's end failed");
    }
}

/// What a session keeps track of while it runs.
#[derive(Default)]
struct Desk {
    /// Commands sent to the daemon that have not ended yet.
    in_flight: HashSet<CommandId>,
    /// Commands the daemon was told to stop, whose late results are expected and ignored.
    stopped: HashSet<CommandId>,
    /// The `inventory.refresh` commands sent in this session.
    refreshes: HashSet<CommandId>,
    /// The spec generation the daemon was last sent (in `welcome`, then in `spec`).
    spec_sent: i64,
}

/// Reads frames until the daemon leaves (`None`) or the session must end (`Some`).
async fn follow(
    state: &GatewayState,
    identity: &NodeIdentity,
    opened: &crate::service::sessions::OpenedSession,
    sink: &mut futures::stream::SplitSink<WebSocket, Message>,
    stream: &mut futures::stream::SplitStream<WebSocket>,
    kicks: &mut mpsc::UnboundedReceiver<SessionSignal>,
) -> Option<Ending> {
    let mut shutdown = state.shutdown.clone();
    let mut last_seq: Option<u64> = None;
    let epoch = opened.epoch;
    let wanted = &opened.want_sections;
    let mut desk = Desk {
        spec_sent: opened.spec_generation,
        ..Desk::default()
    };
    if let Err(ending) = dispatch(state, &identity.node_id, epoch, sink, &mut desk).await {
        return Some(ending);
    }
    loop {
        let frame = tokio::select! {
            frame = stream.next() => frame,
            signal = kicks.recv() => match signal {
                Some(SessionSignal::CommandsChanged) => {
                    if let Err(ending) = dispatch(state, &identity.node_id, epoch, sink, &mut desk).await {
                        return Some(ending);
                    }
                    continue;
                }
                Some(SessionSignal::Close(reason)) => {
                    return Some(Ending { code: close_code::NORMAL, reason: reason.to_owned(), goodbye: true });
                }
                None => {
                    return Some(Ending { code: close_code::AWAY, reason: bc_core::protocol::close::SHUTDOWN.to_owned(), goodbye: true });
                }
            },
            _ = shutdown.changed() => {
                return Some(Ending { code: close_code::AWAY, reason: bc_core::protocol::close::SHUTDOWN.to_owned(), goodbye: true });
            }
        };
        let text = match frame {
            None | Some(Ok(Message::Close(_))) => return None,
            Some(Err(err)) => {
                // Oversized frames and broken framing surface here.
                let too_big = err.to_string().to_lowercase().contains("too long")
                    || err.to_string().contains("size");
                metrics::counter!("bc_gateway_frames_rejected_total", "reason" => "transport")
                    .increment(1);
                let code = if too_big {
                    close_code::SIZE
                } else {
                    close_code::PROTOCOL
                };
                return Some(Ending {
                    code,
                    reason: format!("bad frame: {err}"),
                    goodbye: false,
                });
            }
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Binary(_))) => {
                metrics::counter!("bc_gateway_frames_rejected_total", "reason" => "binary")
                    .increment(1);
                return Some(Ending::violation("binary frames are not part of bcd/v1"));
            }
            Some(Ok(Message::Text(text))) => text,
        };
        let message = match serde_json::from_str::<DaemonMessage>(&text) {
            Ok(message) => message,
            Err(err) => {
                metrics::counter!("bc_gateway_frames_rejected_total", "reason" => "malformed")
                    .increment(1);
                return Some(Ending::violation(format!("malformed message: {err}")));
            }
        };
        match message {
            DaemonMessage::Heartbeat { seq } => {
                if last_seq.is_some_and(|last| seq <= last) {
                    return Some(Ending::violation(format!(
                        "heartbeat seq {seq} does not increase"
                    )));
                }
                last_seq = Some(seq);
                state
                    .heartbeats
                    .beat(identity.node_id.clone(), epoch, state.services.clock.now())
                    .await;
            }
            DaemonMessage::Hello { .. } => {
                return Some(Ending::violation("hello was already sent"));
            }
            DaemonMessage::CommandStarted { id } => {
                let Ok(id) = CommandId::parse(&id) else {
                    return Some(Ending::violation(format!("`{id}` is not a command id")));
                };
                if desk.stopped.contains(&id) {
                    continue;
                }
                if !desk.in_flight.contains(&id) {
                    return Some(Ending::violation(format!(
                        "command `{id}` was not sent in this session"
                    )));
                }
                if let Err(err) = state.services.command_started(&identity.node_id, &id).await {
                    // A cancel or timeout that won the race; the daemon hears `cancel`.
                    tracing::debug!(node_id = %identity.node_id, %id, code = err.code(), reason = %err.message(), "late command start");
                }
            }
            DaemonMessage::CommandResult {
                id,
                outcome,
                exit_code,
                output,
                result,
            } => {
                let Ok(id) = CommandId::parse(&id) else {
                    return Some(Ending::violation(format!("`{id}` is not a command id")));
                };
                if !desk.in_flight.remove(&id) && !desk.stopped.remove(&id) {
                    return Some(Ending::violation(format!(
                        "command `{id}` was not sent in this session"
                    )));
                }
                if let Err(err) = state
                    .services
                    .command_finished(&identity.node_id, &id, outcome, exit_code, &output, result)
                    .await
                {
                    tracing::debug!(node_id = %identity.node_id, %id, code = err.code(), reason = %err.message(), "late command result ignored");
                }
                // The lane is free: send what waits behind it.
                if let Err(ending) =
                    dispatch(state, &identity.node_id, epoch, sink, &mut desk).await
                {
                    return Some(ending);
                }
            }
            DaemonMessage::Converged { generation } => {
                if let Err(err) = state
                    .services
                    .report_converged(&identity.node_id, generation)
                    .await
                {
                    return Some(Ending::violation(format!("converged: {}", err.message())));
                }
            }
            DaemonMessage::Inventory {
                section,
                hash,
                content,
            } => {
                // Sections asked for in `welcome`, or any section while an
                // `inventory.refresh` runs (that is what it is for).
                let refreshing = desk.in_flight.iter().any(|id| desk.refreshes.contains(id));
                let known = INVENTORY_SECTIONS.contains(&section.as_str());
                if !(wanted.contains(&section) || refreshing && known) {
                    return Some(Ending::violation(format!(
                        "inventory section `{section}` was not asked for"
                    )));
                }
                if section_hash(&content) != hash {
                    return Some(Ending::violation(format!(
                        "inventory section `{section}` does not match its hash"
                    )));
                }
                if let Err(err) = state
                    .services
                    .store_inventory_section(&identity.node_id, &section, &hash, content)
                    .await
                {
                    if let crate::error::ApiError::BadUserInput(message) = err {
                        return Some(Ending::violation(message));
                    }
                    tracing::warn!(node_id = %identity.node_id, code = err.code(), "storing inventory failed");
                    return Some(Ending {
                        code: close_code::ERROR,
                        reason: "internal error".into(),
                        goodbye: true,
                    });
                }
            }
        }
    }
}

/// Tells the daemon to stop commands that ended here (cancelled, timed out) and sends the
/// commands whose lane is free.
async fn dispatch(
    state: &GatewayState,
    node_id: &bc_core::ids::NodeId,
    epoch: i64,
    sink: &mut futures::stream::SplitSink<WebSocket, Message>,
    desk: &mut Desk,
) -> Result<(), Ending> {
    let internal = |err: crate::error::ApiError| {
        tracing::warn!(%node_id, code = err.code(), reason = %err.message(), "command dispatch failed");
        Ending {
            code: close_code::ERROR,
            reason: "internal error".into(),
            goodbye: true,
        }
    };
    let mut ended = Vec::new();
    for id in desk.in_flight.iter() {
        let command = state
            .services
            .command_for_gateway(id)
            .await
            .map_err(internal)?;
        if command.is_none_or(|c| c.status.is_final()) {
            ended.push(id.clone());
        }
    }
    for id in ended {
        desk.in_flight.remove(&id);
        send(sink, &GatewayMessage::Cancel { id: id.to_string() })
            .await
            .map_err(|()| gone())?;
        desk.stopped.insert(id);
    }
    let generation = state
        .services
        .spec_generation(node_id)
        .await
        .map_err(internal)?;
    if generation > desk.spec_sent {
        send(
            sink,
            &GatewayMessage::Spec {
                spec: NodeSpec { generation },
            },
        )
        .await
        .map_err(|()| gone())?;
        desk.spec_sent = generation;
    }
    for command in state
        .services
        .dispatch_commands(node_id, epoch)
        .await
        .map_err(internal)?
    {
        let message = GatewayMessage::Command {
            id: command.id.to_string(),
            kind: command.kind,
            params: command.params.clone(),
            timeout_secs: command.timeout.num_seconds(),
        };
        send(sink, &message).await.map_err(|()| gone())?;
        if command.kind == bc_core::command::CommandKind::InventoryRefresh {
            desk.refreshes.insert(command.id.clone());
        }
        desk.in_flight.insert(command.id);
    }
    Ok(())
}

/// The daemon went away while we were writing to it.
fn gone() -> Ending {
    Ending {
        code: close_code::AWAY,
        reason: "the connection dropped".into(),
        goodbye: false,
    }
}

async fn send(
    sink: &mut futures::stream::SplitSink<WebSocket, Message>,
    message: &GatewayMessage,
) -> Result<(), ()> {
    let text = serde_json::to_string(message).map_err(|_| ())?;
    sink.send(Message::Text(text.into())).await.map_err(|_| ())
}

async fn close(sink: &mut futures::stream::SplitSink<WebSocket, Message>, ending: Ending) {
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
