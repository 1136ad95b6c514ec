//! A node's page: its axes, why it is or is not schedulable, conditions, reasons, session,
//! devices, labels and taints, commands with live status and results, and its history. It
//! follows the node's events and command updates and rereads the node on each.

use std::time::Duration;

use leptos::prelude::*;
use leptos_router::hooks::use_params_map;

use crate::actions::{ActionDialog, ActionInput, ActionKind, CommandDialog};
use crate::app::ctx;
use crate::format::since;
use crate::gql::{
    self, ApiError, CancelCommand, NodeCommandsLive, NodeEvents, NodeEventsLive,
    NodePage as NodePageQuery, cancel_command, node_commands_live, node_events, node_events_live,
    node_page, wire,
};
use crate::live::{LiveState, follow};
use crate::model::{Row, seed_spelling};
use crate::refresh::Refresher;

/// The least time between two rereads of the node: acceptance writes several events within
/// milliseconds, and one reread after the burst shows them all.
const REREAD_GAP: Duration = Duration::from_millis(250);
/// Events per page of the timeline.
const TIMELINE_PAGE: i64 = 50;

type Node = node_page::NodePageNode;
type Event = node_events::NodeEventsNodeEventsNodes;

#[component]
pub fn NodePage() -> impl IntoView {
    let params = use_params_map();
    let id = move || params.with(|p| p.get("id").unwrap_or_default());
    // A new view per node id: its feeds end with it.
    move || view! { <NodeView id=id()/> }
}

/// The node as a fleet-table row, which is what a conflict compares. The page selects every
/// field of the FleetRow fragment (and more), so the row is read from the same JSON rather
/// than mapped a second time.
pub fn row_of(node: &Node) -> Row {
    crate::store::row_from_fragment(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_page_reads_as_its_fleet_row() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "id": "node_1", "hostname": "gpu-1", "siteId": "site_a", "poolId": "pool_a",
            "role": "HOST", "trust": "TENANT_OWNED", "version": 4, "provisionState": "ADOPTED",
            "maintenance": false, "cordoned": true, "connectivity": "CONNECTED",
            "noScheduleReasons": ["GpuCountMismatch"], "gpuCount": 7,
            "ownerTenantId": null, "hardwareKeyTrusted": true, "generation": 1,
            "observedGeneration": 1, "identityGeneration": 1, "failedFrom": null,
            "maintenanceReason": null, "cordon": null, "drain": null,
            "connectivitySince": "2026-12-02T15:00:00Z", "labels": [], "taints": [],
            "conditions": [{ "type": "GpuCountMismatch", "status": "TRUE", "reason": "r",
                "message": "m", "noSchedule": true, "setBy": "controller:inventory",
                "lastTransitionAt": "2026-12-02T15:00:00Z", "updatedAt": "2026-12-02T15:00:00Z" }],
            "session": null,
            "schedulability": { "schedulable": false, "bucket": "UNHEALTHY",
                "failingChecks": [], "reasons": [] },
            "devices": [], "createdAt": "2026-12-02T15:00:00Z", "updatedAt": "2026-12-02T15:00:00Z",
            "commands": { "nodes": [] }
        }))
        .expect("a node page");
        let row = row_of(&node);
        assert_eq!(row.hostname, "gpu-1");
        assert_eq!(row.trust, "tenant-owned");
        assert_eq!(row.version, 4);
        assert!(row.cordoned);
        assert_eq!(row.conditions, ["GpuCountMismatch"]);
        assert_eq!(row.gpus, 7);
        assert_eq!(row.bucket, "unhealthy");
    }
}

/// The open dialog, with the node as it was when the dialog opened: the version its action
/// passes, and what a conflict compares against. It lives outside the node's view, which is
/// rebuilt on every reread, so a reread never resets what the operator is typing.
#[derive(Clone)]
enum Dialog {
    Action(ActionKind, ActionInput, Row),
    Command(Row),
}

#[component]
fn NodeView(id: String) -> impl IntoView {
    let ctx = ctx();
    let node = RwSignal::new(None::<Result<Node, ApiError>>);
    let events = RwSignal::new(Vec::<Event>::new());
    let older = RwSignal::new(None::<String>);
    let live = RwSignal::new(LiveState::Connecting);

    let reread = {
        let id = id.clone();
        Refresher::new(REREAD_GAP, move || {
            let id = id.clone();
            async move {
                let result = gql::run::<NodePageQuery>(node_page::Variables { id }).await;
                node.set(Some(result.map(|d| d.node)));
            }
        })
    };
    let reread_timeline = {
        let id = id.clone();
        Refresher::new(REREAD_GAP, move || {
            let id = id.clone();
            async move {
                let page = gql::run::<NodeEvents>(node_events::Variables {
                    id,
                    first: TIMELINE_PAGE,
                    after: None,
                })
                .await;
                if let Ok(page) = page {
                    let head = page.node.events;
                    events.update(|known| {
                        // Keep the older pages already loaded below the fresh first page.
                        let fresh: std::collections::HashSet<String> =
                            head.nodes.iter().map(|e| e.id.clone()).collect();
                        let mut merged = head.nodes.clone();
                        let had_older = known.len() > merged.len();
                        merged.extend(known.drain(..).filter(|e| !fresh.contains(&e.id)));
                        *known = merged;
                        if !had_older {
                            older.set(if head.page_info.has_next_page {
                                head.page_info.end_cursor.clone()
                            } else {
                                None
                            });
                        }
                    });
                }
            }
        })
    };
    reread.trigger();
    reread_timeline.trigger();

    let on_signal = move || {
        reread.trigger();
        reread_timeline.trigger();
    };
    let events_feed = {
        let id = id.clone();
        follow::<NodeEventsLive>(
            move |after| node_events_live::Variables {
                node_id: id.clone(),
                after,
            },
            |d| Some(d.events.id.clone()),
            move |_| on_signal(),
            live,
        )
    };
    let commands_live = RwSignal::new(LiveState::Connecting);
    let commands_feed = {
        let id = id.clone();
        follow::<NodeCommandsLive>(
            move |after| node_commands_live::Variables {
                node_id: id.clone(),
                after,
            },
            |d| Some(d.command_updates.cursor.clone()),
            move |_| reread.trigger(),
            commands_live,
        )
    };
    on_cleanup(move || {
        events_feed.stop();
        commands_feed.stop();
    });

    let load_older = {
        let id = id.clone();
        move |_| {
            let id = id.clone();
            let Some(after) = older.get_untracked() else {
                return;
            };
            leptos::task::spawn_local(async move {
                if let Ok(page) = gql::run::<NodeEvents>(node_events::Variables {
                    id,
                    first: TIMELINE_PAGE,
                    after: Some(after),
                })
                .await
                {
                    let page = page.node.events;
                    older.set(if page.page_info.has_next_page {
                        page.page_info.end_cursor.clone()
                    } else {
                        None
                    });
                    events.update(|e| e.extend(page.nodes));
                }
            });
        }
    };

    let dialog = RwSignal::new(None::<Dialog>);
    let close = Callback::new(move |()| dialog.set(None));
    let can_change = move || {
        ctx.operator
            .with(|o| o.as_ref().is_some_and(|o| o.can_change()))
    };
    let is_admin = move || {
        ctx.operator
            .with(|o| o.as_ref().is_some_and(|o| o.is_admin()))
    };
    let shown_row =
        move || node.with_untracked(|n| n.as_ref().and_then(|n| n.as_ref().ok()).map(row_of));
    let open_with = move |kind: ActionKind, input: ActionInput| {
        if let Some(row) = shown_row() {
            dialog.set(Some(Dialog::Action(kind, input, row)));
        }
    };
    let open = move |kind: ActionKind| open_with(kind, ActionInput::default());
    let confirming = RwSignal::new(None::<String>);

    view! {
        <section class="node-page">
            {move || match node.get() {
                None => view! { <p class="loading">"Loading…"</p> }.into_any(),
                Some(Err(err)) => view! {
                    <p class="error" data-testid="node-error">{err.to_string()}</p>
                }.into_any(),
                Some(Ok(n)) => {
                    let name_of = move |id: &str| ctx.names.with(|names| names.name(id).to_owned());
                    view! {
                        <div class="node-head">
                            <h1 data-testid="node-hostname">{n.hostname.clone()}</h1>
                            <span class="muted">{n.id.clone()}</span>
                            <span class="muted" data-testid="node-version">{format!("version {}", n.version)}</span>
                            <span class=move || format!("live-state {}", if live.get() == LiveState::Live { "live" } else { "connecting" })>
                                {move || if live.get() == LiveState::Live { "live" } else { "connecting…" }}
                            </span>
                        </div>
                        <Show when=can_change>
                            <div class="actions">
                                {if n.cordoned {
                                    view! { <button data-testid="action-uncordon" on:click=move |_| open(ActionKind::Uncordon)>"Uncordon"</button> }.into_any()
                                } else {
                                    view! { <button data-testid="action-cordon" on:click=move |_| open(ActionKind::Cordon)>"Cordon"</button> }.into_any()
                                }}
                                <button data-testid="action-drain" on:click=move |_| open(ActionKind::Drain)>"Drain"</button>
                                <button data-testid="action-taint" on:click=move |_| open(ActionKind::Taint)>"Taint"</button>
                                <button data-testid="action-label" on:click=move |_| open(ActionKind::Label)>"Labels"</button>
                                <button data-testid="action-command" on:click=move |_| {
                                    if let Some(row) = shown_row() { dialog.set(Some(Dialog::Command(row))); }
                                }>"Send command"</button>
                                <Show when=is_admin>
                                    <button class="danger" data-testid="action-revoke" on:click=move |_| open(ActionKind::Revoke)>"Revoke identity"</button>
                                </Show>
                            </div>
                        </Show>
                        <div class="cards">
                            <Explanation node=n.clone()/>
                            <Axes node=n.clone() site=name_of(&n.site_id) pool=n.pool_id.as_deref().map(name_of).unwrap_or_default()/>
                            <SessionCard node=n.clone()/>
                        </div>
                        <Conditions node=n.clone()/>
                        <LabelsAndTaints node=n.clone() can_change=can_change() on_open=Callback::new(move |(kind, input)| open_with(kind, input))/>
                        <Devices node=n.clone()/>
                        <Commands node=n.clone() can_change=can_change() confirming=confirming/>
                    }.into_any()
                }
            }}
            {move || dialog.get().map(|d| match d {
                Dialog::Action(kind, prefill, row) => view! {
                    <ActionDialog kind=kind targets=vec![row] prefill=prefill on_close=close/>
                }.into_any(),
                Dialog::Command(row) => view! { <CommandDialog targets=vec![row] on_close=close/> }.into_any(),
            })}
            <section class="timeline" data-testid="timeline">
                <h2>"History"</h2>
                <table>
                    <thead><tr><th>"When"</th><th>"Event"</th><th>"Axis"</th><th>"From → to"</th><th>"Actor"</th><th>"Cause"</th></tr></thead>
                    <tbody>
                        <For
                            each=move || events.get()
                            key=|e| e.id.clone()
                            children=|e| view! {
                                <tr data-testid="event-row" data-type=e.type_.clone()>
                                    <td class="nowrap">{since(&e.at)}</td>
                                    <td>{e.type_.clone()}</td>
                                    <td>{e.axis.clone().unwrap_or_default()}</td>
                                    <td>{match (e.from.clone(), e.to.clone()) {
                                        (None, None) => String::new(),
                                        (from, to) => format!("{} → {}", from.unwrap_or_default(), to.unwrap_or_default()),
                                    }}</td>
                                    <td>{e.actor.clone()}</td>
                                    <td>{e.cause.clone().unwrap_or_default()}</td>
                                </tr>
                            }
                        />
                    </tbody>
                </table>
                <Show when=move || older.with(Option::is_some)>
                    <button data-testid="older-events" on:click=load_older.clone()>"Older events"</button>
                </Show>
            </section>
        </section>
    }
}

#[component]
fn Explanation(node: Node) -> impl IntoView {
    let s = node.schedulability;
    let verdict = if s.schedulable {
        "Schedulable".to_owned()
    } else {
        format!(
            "Not schedulable: counted as {}",
            seed_spelling(&wire(&s.bucket))
        )
    };
    view! {
        <div class="card explanation" data-testid="explanation">
            <h2>"Why (not) schedulable?"</h2>
            <p class=if s.schedulable { "verdict good" } else { "verdict bad" } data-testid="verdict">{verdict}</p>
            {(!s.failing_checks.is_empty()).then(|| view! {
                <ol class="checks">
                    {s.failing_checks.iter().map(|c| view! {
                        <li data-testid="failing-check" data-check=wire(&c.check)>
                            <strong>{seed_spelling(&wire(&c.check))}</strong>": "{c.message.clone()}
                            <span class="muted">{format!(" (→ {})", seed_spelling(&wire(&c.bucket)))}</span>
                        </li>
                    }).collect_view()}
                </ol>
            })}
            {(!s.reasons.is_empty()).then(|| view! {
                <table class="reasons">
                    <thead><tr><th>"Reason"</th><th>"Set by"</th><th>"Since"</th><th>"Detail"</th><th>"Cleared by"</th></tr></thead>
                    <tbody>
                        {s.reasons.iter().map(|r| view! {
                            <tr data-testid="reason-row" data-reason=r.reason.clone()>
                                <td><code>{r.reason.clone()}</code></td>
                                <td>{r.set_by.clone()}</td>
                                <td class="nowrap">{since(&r.since)}</td>
                                <td>{r.detail.clone().unwrap_or_default()}</td>
                                <td>{r.cleared_by.clone()}</td>
                            </tr>
                        }).collect_view()}
                    </tbody>
                </table>
            })}
        </div>
    }
}

#[component]
fn Axes(node: Node, site: String, pool: String) -> impl IntoView {
    let yes_no = |b: bool| if b { "yes" } else { "no" }.to_owned();
    let mut facts: Vec<(&str, String)> = vec![
        (
            "Provision state",
            match &node.failed_from {
                Some(from) => format!(
                    "{} (from {})",
                    seed_spelling(&wire(&node.provision_state)),
                    seed_spelling(&wire(from))
                ),
                None => seed_spelling(&wire(&node.provision_state)),
            },
        ),
        (
            "Maintenance",
            match &node.maintenance_reason {
                Some(why) if node.maintenance => format!("yes: {why}"),
                _ => yes_no(node.maintenance),
            },
        ),
        (
            "Cordoned",
            match &node.cordon {
                Some(c) if node.cordoned => {
                    format!("yes: {} ({}, {})", c.reason, c.by, since(&c.at))
                }
                _ => yes_no(node.cordoned),
            },
        ),
        (
            "Connectivity",
            format!(
                "{} since {}",
                seed_spelling(&wire(&node.connectivity)),
                since(&node.connectivity_since)
            ),
        ),
    ];
    if let Some(drain) = &node.drain {
        facts.push((
            "Draining",
            format!(
                "since {}{}",
                since(&drain.started_at),
                drain
                    .deadline
                    .as_deref()
                    .map(|d| format!(", deadline {}", crate::format::timestamp(d)))
                    .unwrap_or_default()
            ),
        ));
    }
    facts.extend([
        ("Role", seed_spelling(&wire(&node.role))),
        ("Trust", seed_spelling(&wire(&node.trust))),
        ("Site", site),
        ("Pool", pool),
        ("GPUs", node.gpu_count.to_string()),
        (
            "Spec generation",
            format!(
                "{} (observed {})",
                node.generation, node.observed_generation
            ),
        ),
        ("Identity generation", node.identity_generation.to_string()),
        ("Hardware key trusted", yes_no(node.hardware_key_trusted)),
        (
            "Owner tenant",
            node.owner_tenant_id.clone().unwrap_or_default(),
        ),
        ("Created", since(&node.created_at)),
    ]);
    view! {
        <div class="card" data-testid="axes">
            <h2>"State"</h2>
            <dl>
                {facts.into_iter().map(|(k, v)| view! { <dt>{k}</dt><dd data-fact=k>{v}</dd> }).collect_view()}
            </dl>
        </div>
    }
}

#[component]
fn SessionCard(node: Node) -> impl IntoView {
    view! {
        <div class="card" data-testid="session">
            <h2>"Session"</h2>
            {match node.session {
                None => view! { <p class="muted">"The node never opened a session."</p> }.into_any(),
                Some(s) => view! {
                    <dl>
                        <dt>"Epoch"</dt><dd>{s.epoch}</dd>
                        <dt>"Gateway"</dt><dd>{s.gateway_id.clone()}</dd>
                        <dt>"Connected"</dt><dd>{since(&s.connected_at)}</dd>
                        <dt>"Last seen"</dt><dd>{since(&s.last_seen)}</dd>
                        {s.disconnected_at.as_deref().map(|d| view! { <dt>"Disconnected"</dt><dd>{since(d)}</dd> })}
                    </dl>
                }.into_any(),
            }}
        </div>
    }
}

#[component]
fn Conditions(node: Node) -> impl IntoView {
    view! {
        <section class="card wide" data-testid="conditions">
            <h2>"Conditions"</h2>
            {if node.conditions.is_empty() {
                view! { <p class="muted">"None reported."</p> }.into_any()
            } else {
                view! {
                    <table>
                        <thead><tr><th>"Type"</th><th>"Status"</th><th>"Reason"</th><th>"Message"</th><th>"Keeps work off"</th><th>"Set by"</th><th>"Since"</th></tr></thead>
                        <tbody>
                            {node.conditions.iter().map(|c| view! {
                                <tr data-testid="condition-row" data-type=c.type_.clone()>
                                    <td>{c.type_.clone()}</td>
                                    <td>{seed_spelling(&wire(&c.status))}</td>
                                    <td>{c.reason.clone()}</td>
                                    <td>{c.message.clone()}</td>
                                    <td>{if c.no_schedule { "yes" } else { "no" }}</td>
                                    <td>{c.set_by.clone()}</td>
                                    <td class="nowrap">{since(&c.last_transition_at)}</td>
                                </tr>
                            }).collect_view()}
                        </tbody>
                    </table>
                }.into_any()
            }}
        </section>
    }
}

#[component]
fn LabelsAndTaints(
    node: Node,
    can_change: bool,
    on_open: Callback<(ActionKind, ActionInput)>,
) -> impl IntoView {
    view! {
        <section class="card wide" data-testid="labels">
            <h2>"Labels and taints"</h2>
            <div class="chips">
                {node.labels.iter().map(|l| {
                    let key = l.key.clone();
                    view! {
                        <span class="chip" data-testid="label" data-key=l.key.clone()>
                            {format!("{}={}", l.key, l.value)}
                            {can_change.then(|| view! {
                                <button class="chip-x" title="Remove label" on:click=move |_| on_open.run((
                                    ActionKind::Label,
                                    ActionInput { remove_labels: key.clone(), ..ActionInput::default() },
                                ))>"×"</button>
                            })}
                        </span>
                    }
                }).collect_view()}
            </div>
            <div class="chips">
                {node.taints.iter().map(|t| {
                    let key = t.key.clone();
                    view! {
                        <span class="chip taint" data-testid="taint" data-key=t.key.clone()>
                            {format!("{}={}:{} ({}, {})", t.key, t.value, seed_spelling(&wire(&t.effect)), t.added_by, since(&t.added_at))}
                            {can_change.then(|| view! {
                                <button class="chip-x" title="Untaint" data-testid="untaint" on:click=move |_| on_open.run((
                                    ActionKind::Untaint,
                                    ActionInput { key: key.clone(), ..ActionInput::default() },
                                ))>"×"</button>
                            })}
                        </span>
                    }
                }).collect_view()}
                {node.taints.is_empty().then(|| view! { <span class="muted">"No taints."</span> })}
            </div>
        </section>
    }
}

#[component]
fn Devices(node: Node) -> impl IntoView {
    view! {
        <section class="card wide" data-testid="devices">
            <h2>{format!("Devices ({})", node.devices.len())}</h2>
            <table>
                <thead><tr><th>"Name"</th><th>"Model"</th><th>"Memory"</th><th>"PCI bus"</th><th>"UUID"</th><th>"Serial"</th><th>"Atom"</th><th>"Healthy"</th></tr></thead>
                <tbody>
                    {node.devices.iter().map(|d| view! {
                        <tr data-testid="device-row">
                            <td>{d.name.clone()}</td>
                            <td>{d.model.clone()}</td>
                            <td>{format!("{} MiB", d.memory_mib)}</td>
                            <td><code>{d.pci_bus_id.clone()}</code></td>
                            <td><code>{d.uuid.clone()}</code></td>
                            <td>{d.serial.clone().unwrap_or_default()}</td>
                            <td><code>{d.atom.clone()}</code></td>
                            <td class=if d.healthy { "good" } else { "bad" }>{if d.healthy { "yes" } else { "no" }}</td>
                        </tr>
                    }).collect_view()}
                </tbody>
            </table>
        </section>
    }
}

/// Statuses a command can still be cancelled in.
fn cancellable(status: &str) -> bool {
    matches!(status, "QUEUED" | "DISPATCHED" | "RUNNING")
}

#[component]
fn Commands(node: Node, can_change: bool, confirming: RwSignal<Option<String>>) -> impl IntoView {
    let problem = RwSignal::new(None::<String>);
    let cancel = move |id: String| {
        leptos::task::spawn_local(async move {
            match gql::run::<CancelCommand>(cancel_command::Variables { id }).await {
                Ok(_) => problem.set(None),
                Err(err) => problem.set(Some(err.to_string())),
            }
            confirming.set(None);
        });
    };
    let commands = node.commands.nodes;
    view! {
        <section class="card wide" data-testid="commands">
            <h2>"Commands"</h2>
            <Show when=move || problem.with(Option::is_some)>
                <p class="error">{move || problem.get().unwrap_or_default()}</p>
            </Show>
            {if commands.is_empty() {
                view! { <p class="muted">"No commands yet."</p> }.into_any()
            } else {
                view! {
                    <table>
                        <thead><tr><th>"Kind"</th><th>"Status"</th><th>"Attempts"</th><th>"Sent"</th><th>"Finished"</th><th>"Result"</th><th></th></tr></thead>
                        <tbody>
                            {commands.into_iter().map(|c| {
                                let status = wire(&c.status);
                                let id = c.id.clone();
                                let confirm_id = c.id.clone();
                                let is_confirming = {
                                    let id = c.id.clone();
                                    move || confirming.with(|x| x.as_deref() == Some(id.as_str()))
                                };
                                let result = c.result.as_ref().map(|r| r.to_string()).unwrap_or_default();
                                let details = [
                                    c.exit_code.map(|e| format!("exit {e}")),
                                    c.error.clone(),
                                    (!result.is_empty()).then_some(result),
                                ].into_iter().flatten().collect::<Vec<_>>().join(" · ");
                                view! {
                                    <tr data-testid="command-row" data-command=c.id.clone() data-kind=c.kind_name.clone() data-status=status.clone()>
                                        <td>{c.kind_name.clone()}{c.destructive.then_some(" (destructive)")}</td>
                                        <td class=format!("status {}", status.to_ascii_lowercase())>{seed_spelling(&status)}</td>
                                        <td>{c.attempts}</td>
                                        <td class="nowrap">{format!("{} by {}", since(&c.created_at), c.created_by)}</td>
                                        <td class="nowrap">{c.finished_at.as_deref().map(since).unwrap_or_default()}</td>
                                        <td class="result" data-testid="command-result">
                                            {details}
                                            {(!c.output.is_empty()).then(|| view! { <details><summary>"output"</summary><pre>{c.output.clone()}</pre></details> })}
                                        </td>
                                        <td>
                                            {(can_change && cancellable(&status)).then(|| view! {
                                                <Show
                                                    when=is_confirming.clone()
                                                    fallback=move || {
                                                        let id = id.clone();
                                                        view! { <button data-testid="command-cancel" on:click=move |_| confirming.set(Some(id.clone()))>"Cancel"</button> }
                                                    }
                                                >
                                                    <button class="danger" data-testid="command-cancel-confirm" on:click={
                                                        let id = confirm_id.clone();
                                                        move |_| cancel(id.clone())
                                                    }>"Confirm cancel"</button>
                                                </Show>
                                            })}
                                        </td>
                                    </tr>
                                }
                            }).collect_view()}
                        </tbody>
                    </table>
                }.into_any()
            }}
        </section>
    }
}
