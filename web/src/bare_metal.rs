//! Bare metal on the dashboard: the enrol page (a machine known by its BMC becomes a node,
//! `enrollBareMetalNode`), and on a node's page the bare-metal panel: power and the BMC,
//! power actions and aborting a workflow at the version the operator saw, and the workflows
//! with every step and its log, kept live.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use leptos::prelude::*;
use leptos_router::hooks::use_navigate;

use crate::app::{PoolInfo, ctx};
use crate::format::{since, timestamp};
use crate::gql::{
    self, AbortWorkflow, ApiError, BareMetalNodeById, EnrollBareMetalNode, PowerNode,
    ProvisionStateTable, TransitionNode, abort_workflow, bare_metal_node_by_id,
    enroll_bare_metal_node, power_node, provision_state_table, transition_node, wire,
};
use crate::metal::{
    BareMetal, Edge, EnrolField, EnrolForm, PowerChoice, Step, TLS_CHOICES, TlsChoice, Workflow,
    attempts_text, deadline_text, field_of, moves_from, needs_force, power_text, step_duration,
    step_name, tls_text, workflow_summary,
};
use crate::model::seed_spelling;
use crate::refresh::Refresher;

/// The least time between two reads of the bare-metal view: a workflow step writes its
/// status change and its log within moments, and one read after them shows both.
const REREAD_GAP: Duration = Duration::from_millis(500);
/// How often the view is read while something moves that writes no event (a step's log, a
/// BMC's first polls): modest, since a page may stay open for hours.
const POLL_EVERY: Duration = Duration::from_secs(4);
/// How long after a power action the view is read on the poll: the Power controller reads
/// the BMC at its next tick, and the machine may take a few seconds to act.
const POWER_WATCH: chrono::TimeDelta = chrono::TimeDelta::seconds(40);

/// A node's bare-metal view, kept current for its page: reread on the node's events (the
/// page calls [`MetalWatch::trigger`]) and polled while something moves without events.
/// `None` until read, and when the principal may not read it (a viewer's token): then the
/// page shows no panel and logs nothing.
#[derive(Clone, Copy)]
pub struct MetalWatch {
    view: RwSignal<Option<BareMetal>>,
    reread: Refresher,
    watch_until: RwSignal<Option<DateTime<Utc>>>,
}

impl MetalWatch {
    /// Starts following node `id`: reads it now, then on each trigger and poll. The poll's
    /// timer belongs to the calling component and stops with it.
    pub fn new(id: String) -> MetalWatch {
        let view = RwSignal::new(None::<BareMetal>);
        let reread = Refresher::new(REREAD_GAP, move || {
            let id = id.clone();
            async move {
                match gql::run::<BareMetalNodeById>(bare_metal_node_by_id::Variables { id }).await {
                    Ok(data) => {
                        let _ = view.try_set(BareMetal::of(&data.bare_metal_node));
                    }
                    // A role that may not read the view sees no panel.
                    Err(err) if matches!(err.code.as_str(), "FORBIDDEN" | "NOT_FOUND") => {
                        let _ = view.try_set(None);
                    }
                    // A network failure keeps what is shown; the next event or poll reads again.
                    Err(_) => {}
                }
            }
        });
        let watch = MetalWatch {
            view,
            reread,
            watch_until: RwSignal::new(None),
        };
        let every_ms = u32::try_from(POLL_EVERY.as_millis()).unwrap_or(4_000);
        StoredValue::new_local(gloo_timers::callback::Interval::new(every_ms, move || {
            let now = Utc::now();
            let until = watch.watch_until.try_get_untracked().flatten();
            let polling = watch
                .view
                .try_with_untracked(|v| v.as_ref().is_some_and(|v| v.wants_polling(now, until)))
                .unwrap_or(false);
            if polling {
                watch.reread.trigger();
            }
        }));
        reread.trigger();
        watch
    }

    pub fn trigger(self) {
        self.reread.trigger();
    }

    /// Shows a mutation's answer at once (the events it causes reread anyway).
    fn apply(self, answer: Option<BareMetal>) {
        if answer.is_some() {
            let _ = self.view.try_set(answer);
        }
    }
}

/// What the operator is confirming in the panel's dialog.
#[derive(Clone, Debug, PartialEq)]
enum Confirm {
    /// The server refused `choice` because the node holds work: its words.
    Force(PowerChoice, String),
    /// A change of the node's workflow at the version the operator saw.
    Workflow(Intent, i64),
}

/// What a workflow dialog does.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Intent {
    /// Abort the running workflow (`abortWorkflow`): the node fails, maintenance on.
    Abort,
    /// A provision move of [`crate::metal::PANEL_MOVES`] (`transitionNode`), which starts
    /// its state's workflow: the move, its title, and whether that workflow wipes the disks.
    Move(&'static str, &'static str, bool),
}

/// `provisionStateTable` as the panel uses it; read once per panel, on the first bare-metal
/// view (an ordinary node's page never asks).
async fn load_moves(table: RwSignal<Vec<Edge>>) {
    if let Ok(data) = gql::run::<ProvisionStateTable>(provision_state_table::Variables {}).await {
        let edges = data
            .provision_state_table
            .iter()
            .map(|e| Edge {
                step: wire(&e.move_),
                from: e.from.iter().map(wire).collect(),
            })
            .collect();
        let _ = table.try_set(edges);
    }
}

/// The bare-metal panel of a node's page; nothing for a node without a power driver or BMC.
#[component]
pub fn BareMetalPanel(
    watch: MetalWatch,
    can_change: Signal<bool>,
    is_admin: Signal<bool>,
) -> impl IntoView {
    let problem = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let confirm = RwSignal::new(None::<Confirm>);
    // Past workflows the operator opened; the panel is redrawn on each read, they stay open.
    let opened = RwSignal::new(HashSet::<String>::new());
    let table = RwSignal::new(Vec::<Edge>::new());
    Effect::new(move |asked: Option<bool>| {
        if asked == Some(true) {
            return true;
        }
        let bare_metal = watch
            .view
            .with(|v| v.as_ref().is_some_and(BareMetal::is_bare_metal));
        if bare_metal {
            leptos::task::spawn_local(load_moves(table));
        }
        bare_metal
    });

    let power = move |choice: PowerChoice, force: bool| {
        let Some(shown) = watch.view.get_untracked() else {
            return;
        };
        busy.set(true);
        leptos::task::spawn_local(async move {
            use power_node::PowerAction;
            let input = power_node::PowerNodeInput {
                id: shown.node.id.clone(),
                version: shown.node.version,
                action: match choice {
                    PowerChoice::On => PowerAction::ON,
                    PowerChoice::Off => PowerAction::OFF,
                    PowerChoice::Cycle => PowerAction::CYCLE,
                },
                force,
            };
            let answer = gql::run::<PowerNode>(power_node::Variables { input }).await;
            let outcome = match answer {
                Ok(data) => {
                    watch.apply(BareMetal::of(&data.power_node.bare_metal_node));
                    let _ = watch.watch_until.try_set(Some(Utc::now() + POWER_WATCH));
                    let _ = confirm.try_set(None);
                    None
                }
                Err(err) if !force && needs_force(&err, choice) => {
                    let _ = confirm.try_set(Some(Confirm::Force(choice, err.message)));
                    None
                }
                Err(err) => Some(action_refused(&err, watch)),
            };
            let _ = problem.try_set(outcome);
            let _ = busy.try_set(false);
        });
    };

    view! {
        {move || watch.view.get().filter(BareMetal::is_bare_metal).map(|v| {
            let (reach_class, reach_text) = v.reachability();
            let reachable = match v.bmc_reachable {
                Some(true) => "true",
                Some(false) => "false",
                None => "unknown",
            };
            let version = v.node.version;
            let workflow_actions: Vec<(Intent, String, &'static str)> = if v.running().is_some() {
                vec![(Intent::Abort, "Abort workflow…".to_owned(), "workflow-abort")]
            } else {
                let state = v.node.provision_state.clone();
                table.with(|t| moves_from(t, &state)).into_iter().map(|(step, title, wipes)| {
                    (Intent::Move(step, title, wipes), format!("{title}…"), "provision-move")
                }).collect()
            };
            let (latest, past) = match v.workflows.split_first() {
                Some((latest, past)) => (Some(latest.clone()), past.to_vec()),
                None => (None, Vec::new()),
            };
            let now = Utc::now();
            view! {
                <section class="card wide bare-metal" data-testid="bare-metal">
                    <h2>"Bare metal"</h2>
                    <div class="metal-head">
                        <span class=format!("power {}", power_text(&v.power)) data-testid="power-state" data-power=v.power.clone()>
                            {format!("power {}", power_text(&v.power))}
                        </span>
                        <span class=format!("bmc-state {reach_class}") data-testid="bmc-reachable" data-reachable=reachable>
                            {format!("BMC {reach_text}")}
                        </span>
                    </div>
                    <dl class="metal-facts">
                        <dt>"Power driver"</dt><dd>{seed_spelling(&v.power_driver)}</dd>
                        {v.bmc.clone().map(|b| view! {
                            <dt>"BMC"</dt>
                            <dd data-testid="bmc-address"><code>{b.address.clone()}</code>
                                {b.system_path.clone().or(b.system_id.clone()).map(|s| view! { " " <code class="muted">{s}</code> })}
                            </dd>
                            <dt>"TLS"</dt><dd>{tls_text(&b.tls_verification)}</dd>
                            <dt>"Polled"</dt>
                            <dd>{b.last_polled_at.as_deref().map_or_else(|| "not yet".to_owned(), since)}
                                <span class="muted">{format!("; next at {}", timestamp(&b.next_poll_at))}</span>
                            </dd>
                        })}
                    </dl>
                    <Show when=move || can_change.get()>
                        <div class="actions">
                            {PowerChoice::ALL.into_iter().map(|choice| view! {
                                <button data-testid=format!("power-{}", choice.key()) disabled=move || busy.get()
                                    on:click=move |_| { problem.set(None); power(choice, false) }>{choice.title()}</button>
                            }).collect_view()}
                            {workflow_actions.clone().into_iter().map(|(intent, title, testid)| {
                                let step = match intent { Intent::Move(step, _, _) => Some(step), Intent::Abort => None };
                                view! {
                                    <button class:danger={intent == Intent::Abort} data-testid=testid data-move=step
                                        on:click=move |_| {
                                            problem.set(None);
                                            confirm.set(Some(Confirm::Workflow(intent, version)));
                                        }>{title}</button>
                                }
                            }).collect_view()}
                        </div>
                    </Show>
                    <Show when=move || problem.with(Option::is_some)>
                        <p class="error" data-testid="bare-metal-error">{move || problem.get().unwrap_or_default()}</p>
                    </Show>
                    {match latest {
                        None => view! { <p class="muted" data-testid="no-workflow">"No workflow has run on this machine."</p> }.into_any(),
                        Some(w) => view! {
                            <div class="workflow" data-testid="workflow" data-kind=w.kind.clone() data-status=w.status.clone()>
                                <h3>{format!("Workflow {}", seed_spelling(&w.kind))}</h3>
                                <p class=format!("outcome {}", outcome_class(&w.status)) data-testid="workflow-summary">{workflow_summary(&w, now)}</p>
                                <StepsTable workflow=w.clone() now=now/>
                            </div>
                        }.into_any(),
                    }}
                    {(!past.is_empty()).then(|| view! {
                        <h3>"Earlier workflows"</h3>
                        <ul class="past-workflows">
                            {past.into_iter().map(|w| {
                                let id = w.id.clone();
                                let is_open = { let id = id.clone(); move || opened.with(|o| o.contains(&id)) };
                                let toggle = move |_| opened.update(|o| if !o.remove(&id) { o.insert(id.clone()); });
                                let workflow = w.clone();
                                view! {
                                    <li data-testid="past-workflow" data-kind=w.kind.clone() data-status=w.status.clone()>
                                        <span class=format!("outcome {}", outcome_class(&w.status))>{workflow_summary(&w, now)}</span>
                                        <span class="muted">{format!(" (started {})", timestamp(&w.created_at))}</span>
                                        <button class="link" on:click=toggle>{let is_open = is_open.clone(); move || if is_open() { "hide steps" } else { "show steps" }}</button>
                                        <Show when=is_open.clone()>
                                            <StepsTable workflow=workflow.clone() now=now/>
                                        </Show>
                                    </li>
                                }
                            }).collect_view()}
                        </ul>
                    })}
                </section>
            }
        })}
        {move || confirm.get().map(|c| {
            let hostname = watch.view.with_untracked(|v| v.as_ref().map(|v| v.node.hostname.clone()).unwrap_or_default());
            view! {
                <div class="modal" on:click=move |_| confirm.set(None)>
                    <div class="dialog" role="dialog" on:click=|ev| ev.stop_propagation()>
                        {match c {
                            Confirm::Force(choice, why) => view! {
                                <div data-testid="power-force-dialog">
                                    <h2>{format!("{} {hostname} although it holds work?", choice.title())}</h2>
                                    <p class="warning">{why}</p>
                                    {if is_admin.get_untracked() {
                                        view! {
                                            <div class="buttons">
                                                <button type="button" on:click=move |_| confirm.set(None)>"Keep it running"</button>
                                                <button type="button" class="danger" data-testid="power-force-confirm" disabled=move || busy.get()
                                                    on:click=move |_| power(choice, true)>{format!("Force: {}", choice.title().to_lowercase())}</button>
                                            </div>
                                        }.into_any()
                                    } else {
                                        view! {
                                            <p>"Only an admin may force it; drain the node first."</p>
                                            <div class="buttons"><button type="button" on:click=move |_| confirm.set(None)>"Close"</button></div>
                                        }.into_any()
                                    }}
                                </div>
                            }.into_any(),
                            Confirm::Workflow(intent, version) => view! {
                                <WorkflowForm intent=intent version=version hostname=hostname watch=watch on_close=Callback::new(move |()| confirm.set(None))/>
                            }.into_any(),
                        }}
                    </div>
                </div>
            }
        })}
    }
}

/// What the panel says of a refused action; a `CONFLICT` also rereads, so the operator sees
/// what changed before trying again.
fn action_refused(err: &ApiError, watch: MetalWatch) -> String {
    if err.is_conflict() {
        watch.trigger();
        format!(
            "The node changed since you looked{}; check what it shows now and try again.",
            err.current_version
                .map(|v| format!(" (now version {v})"))
                .unwrap_or_default()
        )
    } else {
        err.to_string()
    }
}

fn outcome_class(status: &str) -> &'static str {
    match status {
        "SUCCEEDED" => "good",
        "RUNNING" => "warn",
        _ => "bad",
    }
}

/// Aborting the running workflow, or a provision move that starts one: the operator's reason
/// (required to abort, kept with the event otherwise), at the version they saw; a `CONFLICT`
/// says the node moved and offers the same at its new version.
#[component]
fn WorkflowForm(
    intent: Intent,
    version: i64,
    hostname: String,
    watch: MetalWatch,
    on_close: Callback<()>,
) -> impl IntoView {
    let reason = RwSignal::new(String::new());
    let version = RwSignal::new(version);
    let problem = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let (prefix, heading, warning, verb) = match intent {
        Intent::Abort => (
            "abort",
            format!("Abort the workflow on {hostname}?"),
            Some(
                "The workflow ends aborted and the node fails with maintenance on; recovering it starts the workflow over.",
            ),
            "Abort",
        ),
        Intent::Move(_, title, wipes) => (
            "move",
            format!("{title} {hostname}?"),
            wipes.then_some("Its workflow wipes every local disk of the machine."),
            title,
        ),
    };
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let why = reason.get_untracked().trim().to_owned();
        if why.is_empty() && intent == Intent::Abort {
            problem.set(Some(
                "Say why you abort it: the reason is kept with the workflow and the failure."
                    .to_owned(),
            ));
            return;
        }
        let Some(id) = watch
            .view
            .with_untracked(|v| v.as_ref().map(|v| v.node.id.clone()))
        else {
            return;
        };
        busy.set(true);
        leptos::task::spawn_local(async move {
            let at = version.get_untracked();
            let answer = match intent {
                Intent::Abort => {
                    let input = abort_workflow::AbortWorkflowInput {
                        id,
                        version: at,
                        reason: why,
                    };
                    gql::run::<AbortWorkflow>(abort_workflow::Variables { input })
                        .await
                        .map(|d| BareMetal::of(&d.abort_workflow.bare_metal_node))
                }
                Intent::Move(step, _, _) => {
                    // The generated enum reads its own wire names (and keeps any other).
                    let step: transition_node::ProvisionMove =
                        serde_json::from_value(serde_json::Value::from(step))
                            .unwrap_or(transition_node::ProvisionMove::Other(step.to_owned()));
                    let input = transition_node::TransitionNodeInput {
                        id,
                        version: at,
                        move_: step,
                        reason: Some(why).filter(|r| !r.is_empty()),
                    };
                    // The move answers the node; the panel rereads its view.
                    gql::run::<TransitionNode>(transition_node::Variables { input })
                        .await
                        .map(|_| None)
                }
            };
            match answer {
                Ok(view) => {
                    watch.apply(view);
                    watch.trigger();
                    on_close.run(());
                }
                Err(err) if err.is_conflict() => {
                    if let Some(now) = err.current_version {
                        let _ = version.try_set(now);
                    }
                    watch.trigger();
                    let _ = problem.try_set(Some(format!(
                        "The node changed since you looked (version {at} → {}): check what the page shows now, then try again at the new version.",
                        err.current_version.map_or_else(|| "?".to_owned(), |v| v.to_string())
                    )));
                }
                Err(err) => {
                    let _ = problem.try_set(Some(err.to_string()));
                }
            }
            let _ = busy.try_set(false);
        });
    };
    // Aborting and wiping cannot be taken back; starting an inspection or a deployment can.
    let danger = matches!(intent, Intent::Abort | Intent::Move(_, _, true));
    let placeholder = if intent == Intent::Abort {
        "What you saw, for whoever recovers it"
    } else {
        "Optional: kept with the event"
    };
    view! {
        <form data-testid=format!("{prefix}-dialog") on:submit=submit>
            <h2>{heading}</h2>
            {warning.map(|w| view! { <p class="warning">{w}</p> })}
            <label>"Why"
                <input data-testid=format!("{prefix}-reason") placeholder=placeholder
                    prop:value=move || reason.get() on:input=move |ev| reason.set(event_target_value(&ev))/>
            </label>
            <Show when=move || problem.with(Option::is_some)>
                <p class="error" data-testid=format!("{prefix}-error")>{move || problem.get().unwrap_or_default()}</p>
            </Show>
            <div class="buttons">
                <button type="button" on:click=move |_| on_close.run(())>"Cancel"</button>
                <button type="submit" class:danger=danger data-testid=format!("{prefix}-confirm") disabled=move || busy.get()>
                    {move || format!("{verb} at version {}", version.get())}
                </button>
            </div>
        </form>
    }
}

/// A workflow's steps in order, each with its log under it.
#[component]
fn StepsTable(workflow: Workflow, now: DateTime<Utc>) -> impl IntoView {
    view! {
        <table class="steps">
            <thead><tr><th>"#"</th><th>"Step"</th><th>"Status"</th><th>"Attempts"</th><th>"Started"</th><th>"Took"</th><th>"Deadline"</th><th>"Command"</th></tr></thead>
            <tbody>
                {workflow.steps.into_iter().enumerate().map(|(i, s)| step_rows(i, s, now)).collect_view()}
            </tbody>
        </table>
    }
}

fn step_rows(index: usize, step: Step, now: DateTime<Utc>) -> impl IntoView {
    let status = step.status.clone();
    let log = step.log.clone();
    view! {
        <tr data-testid="workflow-step" data-kind=step.kind.clone() data-status=status.clone()>
            <td>{(index + 1).to_string()}</td>
            <td>{step_name(&step.kind)}</td>
            <td class=format!("status {}", status.to_ascii_lowercase())>{seed_spelling(&status)}</td>
            <td>{attempts_text(&step)}</td>
            <td class="nowrap">{step.started_at.as_deref().map(timestamp).unwrap_or_default()}</td>
            <td class="nowrap">{step_duration(&step, now)}</td>
            <td class="nowrap">{deadline_text(&step, now)}</td>
            <td><code>{step.command_id.clone().unwrap_or_default()}</code></td>
        </tr>
        {(!log.is_empty()).then(|| view! {
            <tr class="step-log-row">
                <td></td>
                <td colspan="7">
                    <ol class="step-log" data-testid="workflow-log">
                        {log.into_iter().map(|line| view! {
                            <li data-testid="workflow-log-line">
                                <span class="muted nowrap">{clock(&line.at)}</span>" "{line.message}
                            </li>
                        }).collect_view()}
                    </ol>
                </td>
            </tr>
        })}
    }
}

/// `02:00:01`: a log line's time of day (UTC); its date is the step's.
fn clock(rfc3339: &str) -> String {
    DateTime::parse_from_rfc3339(rfc3339).map_or_else(
        |_| rfc3339.to_owned(),
        |t| t.with_timezone(&Utc).format("%H:%M:%S").to_string(),
    )
}

/// A refusal of the enrol form, the form's own or the server's, and the field it is about.
#[derive(Clone, Debug, PartialEq)]
struct Refusal {
    field: Option<EnrolField>,
    /// The server's `extensions.code`; none for the form's own checks.
    code: Option<String>,
    message: String,
}

impl Refusal {
    fn text(&self) -> String {
        match &self.code {
            Some(code) => format!("{code}: {}", self.message),
            None => self.message.clone(),
        }
    }
}

/// The enrol page: a machine known by its BMC becomes a node of a bare-metal pool, starting
/// `enrolling`; the Power controller reads its power from then on. The server's refusals
/// show beside the field they name; a success opens the new node's page.
#[component]
pub fn EnrolPage() -> impl IntoView {
    let ctx = ctx();
    let form = RwSignal::new(EnrolForm::default());
    let refusal = RwSignal::new(None::<Refusal>);
    let running = RwSignal::new(false);
    let navigate = use_navigate();
    // Pools are created while the dashboard is open; the form offers the ones there are now.
    leptos::task::spawn_local(ctx.load_catalog());
    let is_admin = move || {
        ctx.operator
            .with(|o| o.as_ref().is_some_and(|o| o.is_admin()))
    };
    let metal_pools = move || {
        ctx.pools
            .get()
            .into_iter()
            .filter(PoolInfo::is_bare_metal)
            .collect::<Vec<_>>()
    };
    let metal_sites = move || {
        let pools = metal_pools();
        ctx.sites
            .get()
            .into_iter()
            .filter(|(id, _)| pools.iter().any(|p| &p.site_id == id))
            .collect::<Vec<_>>()
    };

    // Choosing a site chooses its pool when it has one bare-metal pool, and never leaves
    // another site's pool chosen.
    let choose_site = move |site: String| {
        let pools: Vec<PoolInfo> = metal_pools()
            .into_iter()
            .filter(|p| p.site_id == site)
            .collect();
        form.update(|f| {
            f.pool = match pools.as_slice() {
                [only] => only.id.clone(),
                _ => String::new(),
            };
            f.site = site;
        });
    };
    // The catalog may arrive after the page opens; with one bare-metal site there is nothing
    // to choose.
    Effect::new(move |_| {
        if let [(only, _)] = metal_sites().as_slice()
            && form.with_untracked(|f| f.site.is_empty())
        {
            choose_site(only.clone());
        }
    });

    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let input = match form.with_untracked(EnrolForm::check) {
            Ok(input) => input,
            Err((field, message)) => {
                refusal.set(Some(Refusal {
                    field: Some(field),
                    code: None,
                    message,
                }));
                return;
            }
        };
        refusal.set(None);
        running.set(true);
        let navigate = navigate.clone();
        leptos::task::spawn_local(async move {
            let answer =
                gql::run::<EnrollBareMetalNode>(enroll_bare_metal_node::Variables { input }).await;
            let _ = running.try_set(false);
            match answer {
                Ok(data) => {
                    let id = data.enroll_bare_metal_node.bare_metal_node.node.id;
                    navigate(&format!("/nodes/{id}"), Default::default());
                }
                Err(err) => {
                    let _ = refusal.try_set(Some(Refusal {
                        field: err.field.as_deref().and_then(field_of),
                        code: Some(err.code),
                        message: err.message,
                    }));
                }
            }
        });
    };

    // A text input bound to one field of the form.
    let text = move |get: fn(&EnrolForm) -> String, set: fn(&mut EnrolForm, String)| {
        (
            move || form.with(get),
            move |ev| form.update(|f| set(f, event_target_value(&ev))),
        )
    };
    let (hostname, on_hostname) = text(|f| f.hostname.clone(), |f, v| f.hostname = v);
    let (address, on_address) = text(|f| f.address.clone(), |f, v| f.address = v);
    let (system_id, on_system_id) = text(|f| f.system_id.clone(), |f, v| f.system_id = v);
    let (username, on_username) = text(|f| f.username.clone(), |f, v| f.username = v);
    let (password, on_password) = text(|f| f.password.clone(), |f, v| f.password = v);
    let (ca_pem, on_ca_pem) = text(|f| f.ca_pem.clone(), |f, v| f.ca_pem = v);
    let (macs, on_macs) = text(|f| f.macs.clone(), |f, v| f.macs = v);
    let (serial, on_serial) = text(|f| f.serial.clone(), |f, v| f.serial = v);
    let (uuid, on_uuid) = text(|f| f.system_uuid.clone(), |f, v| f.system_uuid = v);
    let about = move |field: EnrolField| view! { <FieldRefusal field=field refusal=refusal/> };
    let general = move || refusal.get().filter(|r| r.field.is_none());

    view! {
        <section class="enrol-page" data-testid="enrol">
            <div class="page-head"><h1>"Enrol a bare-metal machine"</h1></div>
            <p class="muted hint">
                "A machine known by its BMC joins a bare-metal pool as enrolling; the control plane reads its power through Redfish from then on, and inspection links the daemon that later boots on it to this node by its identifiers."
            </p>
            <Show when=move || !is_admin()>
                <p class="warning" data-testid="enrol-admin-only">"Enrolling machines needs the admin role."</p>
            </Show>
            <Show when=move || metal_pools().is_empty()>
                <p class="warning" data-testid="enrol-no-pools">
                    "No pool binds the Redfish power driver (drivers: power = redfish); create one first."
                </p>
            </Show>
            <form class="card enrol-form" on:submit=submit autocomplete="off">
                <fieldset>
                    <legend>"Where it goes"</legend>
                    <div class="form-row">
                        <label>"Site"
                            <select data-testid="enrol-site" required on:change=move |ev| choose_site(event_target_value(&ev))>
                                <option value="">"Choose…"</option>
                                {move || metal_sites().into_iter().map(|(id, name)| {
                                    let chosen = id.clone();
                                    view! { <option value=id selected=move || form.with(|f| f.site == chosen)>{name}</option> }
                                }).collect_view()}
                            </select>
                            {about(EnrolField::Site)}
                        </label>
                        <label>"Bare-metal pool"
                            <select data-testid="enrol-pool" required on:change=move |ev| {
                                let v = event_target_value(&ev);
                                form.update(|f| f.pool = v);
                            }>
                                <option value="">"Choose…"</option>
                                {move || {
                                    let site = form.with(|f| f.site.clone());
                                    metal_pools().into_iter().filter(|p| p.site_id == site).map(|p| {
                                        let chosen = p.id.clone();
                                        view! { <option value=p.id.clone() selected=move || form.with(|f| f.pool == chosen)>{p.name}</option> }
                                    }).collect_view()
                                }}
                            </select>
                            {about(EnrolField::Pool)}
                        </label>
                    </div>
                    <label>"Hostname"
                        <input data-testid="enrol-hostname" placeholder="gpu-r12-04" prop:value=hostname on:input=on_hostname/>
                        {about(EnrolField::Hostname)}
                    </label>
                </fieldset>
                <fieldset>
                    <legend>"Its BMC (Redfish)"</legend>
                    <div class="form-row">
                        <label class="grow">"Address"
                            <input data-testid="enrol-address" placeholder="https://10.1.12.4" prop:value=address on:input=on_address/>
                            {about(EnrolField::Address)}
                        </label>
                        <label>"System id (optional)"
                            <input data-testid="enrol-system-id" placeholder="the only system" prop:value=system_id on:input=on_system_id/>
                            {about(EnrolField::SystemId)}
                        </label>
                    </div>
                    <div class="form-row">
                        <label>"User"
                            <input data-testid="enrol-username" autocomplete="off" prop:value=username on:input=on_username/>
                            {about(EnrolField::Username)}
                        </label>
                        <label>"Password"
                            // Kept in this form only: sent once, stored sealed by the server, never shown again.
                            <input type="password" data-testid="enrol-password" autocomplete="new-password" prop:value=password on:input=on_password/>
                            {about(EnrolField::Password)}
                        </label>
                    </div>
                    <label>"TLS"
                        <select data-testid="enrol-tls" on:change=move |ev| {
                            let i: usize = event_target_value(&ev).parse().unwrap_or(0);
                            form.update(|f| f.tls = TLS_CHOICES.get(i).map_or(TlsChoice::Verify, |c| c.0));
                        }>
                            {TLS_CHOICES.iter().enumerate().map(|(i, (choice, text))| {
                                let choice = *choice;
                                view! { <option value=i.to_string() selected=move || form.with(|f| f.tls == choice)>{*text}</option> }
                            }).collect_view()}
                        </select>
                    </label>
                    <Show when=move || form.with(|f| f.tls == TlsChoice::CustomCa)>
                        <label>"CA certificate (PEM)"
                            <textarea data-testid="enrol-ca" rows="5" placeholder="-----BEGIN CERTIFICATE-----"
                                prop:value=ca_pem on:input=on_ca_pem></textarea>
                            {about(EnrolField::CaCertificate)}
                        </label>
                    </Show>
                </fieldset>
                <fieldset>
                    <legend>"Its identifiers (none, or at least two kinds)"</legend>
                    <label>"MAC addresses (comma or space separated)"
                        <input data-testid="enrol-macs" placeholder="3c:ec:ef:00:12:34" prop:value=macs on:input=on_macs/>
                    </label>
                    <div class="form-row">
                        <label>"System serial"
                            <input data-testid="enrol-serial" prop:value=serial on:input=on_serial/>
                        </label>
                        <label>"System UUID"
                            <input data-testid="enrol-uuid" prop:value=uuid on:input=on_uuid/>
                        </label>
                    </div>
                    {about(EnrolField::Identifiers)}
                </fieldset>
                <Show when=move || general().is_some()>
                    <p class="error" data-testid="enrol-error" data-code=move || general().and_then(|r| r.code)>
                        {move || general().map(|r| r.text()).unwrap_or_default()}
                    </p>
                </Show>
                <div class="buttons">
                    <button type="submit" data-testid="enrol-submit" disabled=move || running.get() || !is_admin()>
                        {move || if running.get() { "Enrolling…" } else { "Enrol" }}
                    </button>
                </div>
            </form>
        </section>
    }
}

/// A refusal about one field of the enrol form, shown under it.
#[component]
fn FieldRefusal(field: EnrolField, refusal: RwSignal<Option<Refusal>>) -> impl IntoView {
    let here = move || refusal.get().filter(|r| r.field == Some(field));
    view! {
        <Show when=move || here().is_some()>
            <span class="error field-error" data-testid="field-error" data-field=field.key()
                data-code=move || here().and_then(|r| r.code)>
                {move || here().map(|r| r.text()).unwrap_or_default()}
            </span>
        </Show>
    }
}
