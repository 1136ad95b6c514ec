//! A node's page: its axes, why it is or is not schedulable, conditions, reasons, session,
//! devices, labels and taints, commands with live status and results, its history, and for a
//! bare-metal machine its power, BMC and workflows (`bare_metal.rs`). It follows the node's
//! events and command updates and rereads the node on each.

use std::time::Duration;

use leptos::prelude::*;
use leptos_router::hooks::{use_params_map, use_query_map};

use crate::actions::{ActionDialog, ActionInput, ActionKind, CommandDialog};
use crate::allocations::{DrainProgress, NodeAllocations};
use crate::app::ctx;
use crate::bare_metal::{BareMetalPanel, MetalWatch};
use crate::format::{since, timestamp};
use crate::gql::{
    self, ApiError, CancelCommand, ClearNodeCondition, NodeAsOf, NodeCommandsLive, NodeEvents,
    NodeEventsLive, NodePage as NodePageQuery, cancel_command, clear_node_condition, node_as_of,
    node_commands_live, node_events, node_events_live, node_page, wire,
};
use crate::history::{self, AsOf, Step, Timeline};
use crate::live::{LiveState, follow};
use crate::model::{Row, seed_spelling};
use crate::refresh::Refresher;

/// The least time between two rereads of the node: acceptance writes several events within
/// milliseconds, and one reread after the burst shows them all.
const REREAD_GAP: Duration = Duration::from_millis(250);
/// Events per page of the timeline.
const TIMELINE_PAGE: i64 = 200;

type Node = node_page::NodePageNode;
type Event = node_events::NodeEventsNodeEventsNodes;

#[component]
pub fn NodePage() -> impl IntoView {
    let params = use_params_map();
    let query = use_query_map();
    let id = move || params.with(|p| p.get("id").unwrap_or_default());
    // `?version=N` or `?at=<RFC 3339>` opens the page on a past view (the event log links so).
    let initial = move || {
        query.with_untracked(|q| {
            q.get("version")
                .and_then(|v| v.parse().ok())
                .map(AsOf::Version)
                .or_else(|| q.get("at").map(AsOf::At))
        })
    };
    // A new view per node id: its feeds end with it.
    move || view! { <NodeView id=id() initial=initial()/> }
}

/// The node as `nodeAsOf` rebuilt it, read as the live page's type: both select the same
/// fragment, so this fails only if the operations document is broken.
fn past_node(data: node_as_of::ResponseData) -> Result<Node, ApiError> {
    serde_json::to_value(data.node_as_of)
        .and_then(serde_json::from_value)
        .map_err(|e| ApiError::local("BAD_RESPONSE", format!("a past node: {e}")))
}

fn step_of(e: &Event) -> Step {
    Step {
        id: e.id.clone(),
        event_type: e.type_.clone(),
        node_version: e.node_version,
        axis: e.axis.clone(),
        from: e.from.clone(),
        to: e.to.clone(),
        actor: e.actor.clone(),
        cause: e.cause.clone(),
        at: e.at.clone(),
    }
}

/// Each axis's value now, in the log's spelling, for an axis without a change shown.
fn current_axes(node: &Node) -> Vec<(&'static str, String)> {
    vec![
        (
            "provisionState",
            wire(&node.provision_state).to_ascii_lowercase(),
        ),
        ("maintenance", node.maintenance.to_string()),
        ("cordoned", node.cordoned.to_string()),
        (
            "connectivity",
            wire(&node.connectivity).to_ascii_lowercase(),
        ),
    ]
}

/// `GPU_RESET` → `gpu.reset`: a command kind as the log and the daemon spell it.
pub fn kind_name(wire_kind: &str) -> String {
    wire_kind.to_ascii_lowercase().replacen('_', ".", 1)
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
                "lastTransitionAt": "2026-12-02T15:00:00Z", "updatedAt": "2026-12-02T15:00:00Z",
                "clearWhen": { "kind": "EVIDENCE_GONE", "byHand": true, "description": "d", "steps": [] },
                "proof": null }],
            "session": null,
            "schedulability": { "schedulable": false, "bucket": "UNHEALTHY",
                "failingChecks": [], "reasons": [] },
            "devices": [], "allocations": [], "remediationAttempts": [], "createdAt": "2026-12-02T15:00:00Z", "updatedAt": "2026-12-02T15:00:00Z",
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

        // The past view reads the same fragment as the same type.
        let past: node_as_of::ResponseData = serde_json::from_value(serde_json::json!({
            "nodeAsOf": serde_json::to_value(&node).expect("json")
        }))
        .expect("a past node");
        assert_eq!(past_node(past).expect("converts"), node);
        assert_eq!(kind_name("GPU_RESET"), "gpu.reset");
        assert_eq!(kind_name("DIAG_NVML"), "diag.nvml");
        assert_eq!(kind_name("DISK_WIPE"), "disk.wipe");
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
fn NodeView(id: String, initial: Option<AsOf>) -> impl IntoView {
    let ctx = ctx();
    let node = RwSignal::new(None::<Result<Node, ApiError>>);
    // The past view: which moment, and the node as it was then (None while it loads).
    let as_of = RwSignal::new(initial);
    let past = RwSignal::new(None::<Result<Node, ApiError>>);
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
    // Power, the BMC and the workflows: every node gets the read, only bare-metal nodes show
    // the panel. Their changes are the node's events (power, workflow steps), so the same
    // signals reread it.
    let metal = MetalWatch::new(id.clone());

    let on_signal = move || {
        reread.trigger();
        reread_timeline.trigger();
        metal.trigger();
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

    // Each moment picked reads the node as of it; an answer for a moment no longer picked
    // (the operator moved on, or went back to live) is dropped.
    Effect::new({
        let id = id.clone();
        move |_| {
            let Some(moment) = as_of.get() else {
                past.set(None);
                return;
            };
            past.set(None);
            let id = id.clone();
            leptos::task::spawn_local(async move {
                let (at, version) = match moment.clone() {
                    AsOf::At(at) => (Some(at), None),
                    AsOf::Version(v) => (None, Some(v)),
                };
                let answer = gql::run::<NodeAsOf>(node_as_of::Variables { id, at, version })
                    .await
                    .and_then(past_node);
                if as_of.try_get_untracked().flatten() == Some(moment) {
                    let _ = past.try_set(Some(answer));
                }
            });
        }
    });
    let steps = Memo::new(move |_| events.with(|e| e.iter().map(step_of).collect::<Vec<_>>()));
    let span = Memo::new(move |_| {
        let created = node.with(|n| {
            n.as_ref()
                .and_then(|n| n.as_ref().ok())
                .map(|n| n.created_at.clone())
                .unwrap_or_default()
        });
        steps.with(|s| history::span(s, &created, chrono::Utc::now().timestamp_millis()))
    });
    let lanes = Memo::new(move |_| {
        let current = node.with(|n| {
            n.as_ref()
                .and_then(|n| n.as_ref().ok())
                .map(current_axes)
                .unwrap_or_default()
        });
        steps.with(|s| history::lanes(s, &current, span.get()))
    });
    // Where the past view is on the timeline: its time, or the time of its version's change.
    let selected = Signal::derive(move || match as_of.get() {
        None => None,
        Some(AsOf::At(at)) => history::to_millis(&at),
        Some(AsOf::Version(_)) => past.with(|p| {
            p.as_ref()
                .and_then(|p| p.as_ref().ok())
                .and_then(|n| history::to_millis(&n.updated_at))
        }),
    });
    let pick = Callback::new(move |moment: AsOf| as_of.set(Some(moment)));
    let in_past = move || as_of.with(Option::is_some);

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
            <Show when=in_past>
                <div class="past-view" data-testid="past-view">
                    <strong>"Past view"</strong>
                    <span data-testid="past-moment">{move || match (as_of.get(), past.get()) {
                        (_, Some(Ok(n))) => format!(
                            "the node as it was at version {}, last changed {}; nothing here is live.",
                            n.version, timestamp(&n.updated_at)
                        ),
                        (Some(AsOf::At(at)), _) => format!("as of {} (loading…)", timestamp(&at)),
                        (Some(AsOf::Version(v)), _) => format!("at version {v} (loading…)"),
                        (None, _) => String::new(),
                    }}</span>
                    <button data-testid="back-to-live" on:click=move |_| as_of.set(None)>"Back to live"</button>
                </div>
            </Show>
            {move || match if in_past() { past.get() } else { node.get() } {
                None => view! { <p class="loading">"Loading…"</p> }.into_any(),
                Some(Err(err)) => view! {
                    <p class="error" data-testid="node-error">{err.to_string()}</p>
                }.into_any(),
                Some(Ok(n)) if in_past() => {
                    let name_of = move |id: &str| ctx.names.with(|names| names.name(id).to_owned());
                    view! {
                        <div class="node-head past">
                            <h1 data-testid="node-hostname">{n.hostname.clone()}</h1>
                            <span class="muted">{n.id.clone()}</span>
                            <span class="past-version" data-testid="node-version">{format!("version {} (past)", n.version)}</span>
                        </div>
                        <div class="cards past">
                            <Explanation node=n.clone()/>
                            <Axes node=n.clone() site=name_of(&n.site_id) pool=n.pool_id.as_deref().map(name_of).unwrap_or_default()/>
                        </div>
                        <div class="past">
                            <Conditions node=n.clone() can_clear=false/>
                            <LabelsAndTaints node=n.clone() can_change=false on_open=Callback::new(|_| {})/>
                            <Devices node=n.clone()/>
                        </div>
                    }.into_any()
                }
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
                        <DrainProgress node=n.clone()/>
                        <div class="cards">
                            <Explanation node=n.clone()/>
                            <Axes node=n.clone() site=name_of(&n.site_id) pool=n.pool_id.as_deref().map(name_of).unwrap_or_default()/>
                            <SessionCard node=n.clone()/>
                        </div>
                    }.into_any()
                }
            }}
            // Outside the node's view, which each reread rebuilds: the panel has its own reads
            // and dialogs, and an abort reason being typed survives the node's events.
            <Show when=move || !in_past()>
                <BareMetalPanel watch=metal can_change=Signal::derive(can_change) is_admin=Signal::derive(is_admin)/>
            </Show>
            {move || match (in_past(), node.get()) {
                (false, Some(Ok(n))) => Some(view! {
                    <Conditions node=n.clone() can_clear=can_change()/>
                    <LabelsAndTaints node=n.clone() can_change=can_change() on_open=Callback::new(move |(kind, input)| open_with(kind, input))/>
                    <Devices node=n.clone()/>
                    <NodeAllocations node=n.clone()/>
                    <Remediation node=n.clone()/>
                    <Commands node=n.clone() can_change=can_change() confirming=confirming/>
                }),
                _ => None,
            }}
            {move || dialog.get().map(|d| match d {
                Dialog::Action(kind, prefill, row) => view! {
                    <ActionDialog kind=kind targets=vec![row] prefill=prefill on_close=close/>
                }.into_any(),
                Dialog::Command(row) => view! { <CommandDialog targets=vec![row] on_close=close/> }.into_any(),
            })}
            <section class="timeline" data-testid="timeline">
                <h2>"History"</h2>
                <p class="muted hint">
                    "Each lane is one axis, condition or reason over time; hover a segment for who or what changed it, click it (or slide the time) to see the node as it was."
                </p>
                <Timeline lanes=lanes.into() span=span.into() selected=selected on_pick=pick/>
                <table>
                    <thead><tr><th>"When"</th><th>"Event"</th><th>"Axis"</th><th>"From → to"</th><th>"Actor"</th><th>"Cause"</th><th></th></tr></thead>
                    <tbody>
                        <For
                            each=move || events.get()
                            key=|e| e.id.clone()
                            children=move |e| { let version = e.node_version; view! {
                                <tr
                                    data-testid="event-row"
                                    data-type=e.type_.clone()
                                    class:picked=move || version.is_some() && as_of.with(|a| *a == version.map(AsOf::Version))
                                >
                                    <td class="nowrap">{since(&e.at)}</td>
                                    <td>{e.type_.clone()}</td>
                                    <td>{e.axis.clone().unwrap_or_default()}</td>
                                    <td>{crate::events::from_to(&e.type_, e.from.clone(), e.to.clone())}</td>
                                    <td class="breaks">{e.actor.clone()}</td>
                                    <td class="breaks">{e.cause.clone().unwrap_or_default()}</td>
                                    <td>{version.map(|v| view! {
                                        <button class="link" data-testid="event-as-of" title="Show the node right after this change"
                                            on:click=move |_| pick.run(AsOf::Version(v))>{format!("v{v}")}</button>
                                    })}</td>
                                </tr>
                            }}
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
                    <thead><tr><th>"Reason"</th><th>"Set by"</th><th>"Since"</th><th>"Detail"</th><th>"Clears when"</th></tr></thead>
                    <tbody>
                        {s.reasons.iter().map(|r| view! {
                            <tr data-testid="reason-row" data-reason=r.reason.clone()>
                                <td><code>{r.reason.clone()}</code></td>
                                <td>{r.set_by.clone()}</td>
                                <td class="nowrap">{since(&r.since)}</td>
                                <td>{r.detail.clone().unwrap_or_default()}</td>
                                <td class="clear-rule" data-testid="reason-clear-rule" data-kind=wire(&r.clear_when.kind)>
                                    <span class="rule-kind">{seed_spelling(&wire(&r.clear_when.kind))}</span>" "
                                    {r.clear_when.description.clone()}
                                </td>
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

/// A condition's proof so far, in words: "proof 1/2: gpu.reset (cmd_7) 2026-…; evidence gone …".
fn proof_text(c: &node_page::NodeFieldsConditions) -> String {
    let Some(p) = &c.proof else {
        return String::new();
    };
    let mut parts = vec![format!(
        "proof {}/{} since {}",
        p.satisfied.len(),
        p.steps_total,
        timestamp(&p.since)
    )];
    for step in &p.satisfied {
        parts.push(format!(
            "step {}: {} ({}) at {}",
            step.step,
            kind_name(&wire(&step.kind)),
            step.command_id,
            timestamp(&step.at)
        ));
    }
    if let Some(gone) = &p.evidence_gone_at {
        parts.push(format!("evidence gone at {}", timestamp(gone)));
    }
    if p.restarts > 0 {
        parts.push(format!(
            "restarted {}×{}",
            p.restarts,
            p.last_restart
                .as_deref()
                .map(|r| format!(" (last: {r})"))
                .unwrap_or_default()
        ));
    }
    parts.join("; ")
}

#[component]
fn Conditions(node: Node, can_clear: bool) -> impl IntoView {
    // The condition being cleared by hand, the operator's reason, and what went wrong.
    let clearing = RwSignal::new(None::<String>);
    let why = RwSignal::new(String::new());
    let problem = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let (id, version) = (node.id.clone(), node.version);
    let clear = move |kind: String| {
        let reason = why.get_untracked().trim().to_owned();
        if reason.is_empty() {
            problem.set(Some(
                "Say why you clear it: your reason is recorded with it.".to_owned(),
            ));
            return;
        }
        busy.set(true);
        let id = id.clone();
        leptos::task::spawn_local(async move {
            let input = clear_node_condition::ClearNodeConditionInput {
                id,
                version,
                type_: kind,
                reason,
            };
            let answer =
                gql::run::<ClearNodeCondition>(clear_node_condition::Variables { input }).await;
            // The page rereads on the change's event; this component may be gone by now.
            let _ = busy.try_set(false);
            match answer {
                Ok(_) => {
                    let _ = problem.try_set(None);
                    let _ = clearing.try_set(None);
                }
                Err(err) => {
                    let _ = problem.try_set(Some(err.to_string()));
                }
            }
        });
    };
    view! {
        <section class="card wide" data-testid="conditions">
            <h2>"Conditions"</h2>
            <Show when=move || problem.with(Option::is_some)>
                <p class="error" data-testid="clear-error">{move || problem.get().unwrap_or_default()}</p>
            </Show>
            {if node.conditions.is_empty() {
                view! { <p class="muted">"None reported."</p> }.into_any()
            } else {
                view! {
                    <table>
                        <thead><tr><th>"Type"</th><th>"Status"</th><th>"Reason"</th><th>"Message"</th><th>"Keeps work off"</th><th>"Set by"</th><th>"Since"</th><th>"Clears when"</th></tr></thead>
                        <tbody>
                            {node.conditions.iter().map(|c| {
                                let holds = wire(&c.status) == "TRUE";
                                let kind = c.type_.clone();
                                let is_clearing = {
                                    let kind = kind.clone();
                                    move || clearing.with(|x| x.as_deref() == Some(kind.as_str()))
                                };
                                let proof = proof_text(c);
                                let clear = clear.clone();
                                view! {
                                    <tr data-testid="condition-row" data-type=c.type_.clone()>
                                        <td>{c.type_.clone()}</td>
                                        <td>{seed_spelling(&wire(&c.status))}</td>
                                        <td>{c.reason.clone()}</td>
                                        <td>{c.message.clone()}</td>
                                        <td>{if c.no_schedule { "yes" } else { "no" }}</td>
                                        <td>{c.set_by.clone()}</td>
                                        <td class="nowrap">{since(&c.last_transition_at)}</td>
                                        <td class="clear-rule" data-testid="condition-clear-rule" data-kind=wire(&c.clear_when.kind)>
                                            <span class="rule-kind">{seed_spelling(&wire(&c.clear_when.kind))}</span>" "
                                            {c.clear_when.description.clone()}
                                            {(!proof.is_empty()).then(|| view! { <div class="muted proof" data-testid="condition-proof">{proof.clone()}</div> })}
                                            {(can_clear && holds && c.clear_when.by_hand).then(|| view! {
                                                <Show
                                                    when=is_clearing.clone()
                                                    fallback={
                                                        let kind = kind.clone();
                                                        move || {
                                                            let kind = kind.clone();
                                                            view! { <button data-testid="condition-clear" on:click=move |_| {
                                                                why.set(String::new());
                                                                problem.set(None);
                                                                clearing.set(Some(kind.clone()));
                                                            }>"Clear by hand…"</button> }
                                                        }
                                                    }
                                                >
                                                    <div class="clear-form">
                                                        <input data-testid="condition-clear-reason" placeholder="What you checked or fixed"
                                                            prop:value=move || why.get() on:input=move |ev| why.set(event_target_value(&ev))/>
                                                        <button class="danger" data-testid="condition-clear-confirm" disabled=move || busy.get()
                                                            on:click={ let kind = kind.clone(); let clear = clear.clone(); move |_| clear(kind.clone()) }>"Clear"</button>
                                                        <button on:click=move |_| clearing.set(None)>"Keep"</button>
                                                    </div>
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

/// Health remediation's tries on the node, newest first, grouped by run, with each run's
/// outcome: fixed (and how), under way, or given up (maintenance on, `GpuNeedsPerson`).
#[component]
fn Remediation(node: Node) -> impl IntoView {
    let attempts = node.remediation_attempts;
    if attempts.is_empty() {
        return view! {
            <section class="card wide" data-testid="remediation">
                <h2>"Remediation"</h2>
                <p class="muted">"Health remediation has not acted on this node."</p>
            </section>
        }
        .into_any();
    }
    // The newest run's outcome leads (attempts come newest first).
    let newest = attempts[0].run_id.clone();
    let run: Vec<_> = attempts.iter().filter(|a| a.run_id == newest).collect();
    let outcome = if let Some(a) = run.iter().find(|a| wire(&a.status) == "GAVE_UP") {
        (
            "bad",
            format!(
                "Gave up on {} after step {} of {}: maintenance is on and GpuNeedsPerson is set; a person must look at the node.",
                a.condition, a.step, a.steps_total
            ),
        )
    } else if let Some(a) = run.iter().find(|a| wire(&a.status) == "SUCCEEDED") {
        (
            "good",
            format!(
                "Fixed {}: step {} ({}) and its verification succeeded{}.",
                a.condition,
                a.step,
                a.action
                    .as_ref()
                    .map(|k| kind_name(&wire(k)))
                    .unwrap_or_default(),
                a.finished_at
                    .as_deref()
                    .map(|f| format!(" at {}", timestamp(f)))
                    .unwrap_or_default()
            ),
        )
    } else if run.iter().all(|a| wire(&a.status) == "CANCELLED") {
        (
            "muted",
            format!("Ended without a verdict on {}.", run[0].condition),
        )
    } else {
        let a = run[0];
        (
            "warn",
            format!(
                "Under way on {}: step {} of {}, try {} of {}, {}.",
                a.condition,
                a.step,
                a.steps_total,
                a.attempt,
                a.attempts_allowed,
                seed_spelling(&wire(&a.status))
            ),
        )
    };
    view! {
        <section class="card wide" data-testid="remediation">
            <h2>"Remediation"</h2>
            <p class=format!("outcome {}", outcome.0) data-testid="remediation-outcome" data-outcome=outcome.0>{outcome.1}</p>
            <table>
                <thead><tr><th>"Condition"</th><th>"Step"</th><th>"Action"</th><th>"Try"</th><th>"Status"</th><th>"Commands"</th><th>"Scheduled"</th><th>"Acts at"</th><th>"Finished"</th><th>"Note"</th></tr></thead>
                <tbody>
                    {attempts.iter().map(|a| {
                        let status = wire(&a.status);
                        let commands = [
                            a.action_command_id.as_deref().map(|c| format!("action {c}")),
                            a.verify_command_id.as_deref().map(|c| format!("verify {c}")),
                            a.refresh_command_id.as_deref().map(|c| format!("refresh {c}")),
                        ].into_iter().flatten().collect::<Vec<_>>().join(" · ");
                        view! {
                            <tr data-testid="remediation-row" data-status=status.clone() data-run=a.run_id.clone()>
                                <td>{a.condition.clone()}</td>
                                <td>{format!("{} of {}", a.step, a.steps_total)}</td>
                                <td><code>{a.action.as_ref().map(|k| kind_name(&wire(k))).unwrap_or_default()}</code></td>
                                <td>{format!("{} of {}", a.attempt, a.attempts_allowed)}</td>
                                <td class=format!("status {}", status.to_ascii_lowercase())>{seed_spelling(&status)}</td>
                                <td class="result"><code>{commands}</code></td>
                                <td class="nowrap">{since(&a.created_at)}</td>
                                <td class="nowrap">{timestamp(&a.next_attempt_at)}</td>
                                <td class="nowrap">{a.finished_at.as_deref().map(since).unwrap_or_default()}</td>
                                <td>{a.note.clone().unwrap_or_default()}</td>
                            </tr>
                        }
                    }).collect_view()}
                </tbody>
            </table>
        </section>
    }
    .into_any()
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
                    // A label a controller owns (inventory's) changes only with the node's
                    // reports: no remove button, and the chip says who sets it.
                    let removable = can_change && l.owner.is_none();
                    let title = l.owner.as_ref().map(|o| format!("set by {o} from the node's reports"));
                    view! {
                        <span class="chip" data-testid="label" data-key=l.key.clone()
                            data-owner=l.owner.clone() title=title>
                            {format!("{}={}", l.key, l.value)}
                            {removable.then(|| view! {
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
            let input = cancel_command::CancelCommandInput { id };
            match gql::run::<CancelCommand>(cancel_command::Variables { input }).await {
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
