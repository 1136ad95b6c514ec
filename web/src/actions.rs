//! What an operator does to nodes: the actions (each passes the version the operator saw),
//! the dialog that collects their input and confirms the destructive ones, running them on
//! one node or a selection, and what a `CONFLICT` shows: what changed, and a retry.

use futures::StreamExt;
use leptos::prelude::*;

use crate::app::ctx;
use crate::gql::{
    self, ApiError, CordonNode, DrainNode, LabelNode, NodeRowById, RevokeNodeIdentity, SendCommand,
    TaintNode, UncordonNode, UntaintNode, cordon_node, drain_node, label_node, node_row_by_id,
    revoke_node_identity, send_command, taint_node, uncordon_node, untaint_node,
};
use crate::model::{FactChange, Names, Row, what_changed};
use crate::store::row_from_read;

/// How many mutations of a bulk action are in flight at once: enough to finish a few hundred
/// nodes in seconds, few enough not to crowd out the live feed on the same server.
const BULK_CONCURRENCY: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActionKind {
    Cordon,
    Uncordon,
    Drain,
    Taint,
    Untaint,
    Label,
    Revoke,
}

impl ActionKind {
    pub const BULK: [ActionKind; 6] = [
        ActionKind::Cordon,
        ActionKind::Uncordon,
        ActionKind::Drain,
        ActionKind::Taint,
        ActionKind::Untaint,
        ActionKind::Label,
    ];

    pub fn title(self) -> &'static str {
        match self {
            ActionKind::Cordon => "Cordon",
            ActionKind::Uncordon => "Uncordon",
            ActionKind::Drain => "Drain",
            ActionKind::Taint => "Taint",
            ActionKind::Untaint => "Untaint",
            ActionKind::Label => "Labels",
            ActionKind::Revoke => "Revoke identity",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            ActionKind::Cordon => "cordon",
            ActionKind::Uncordon => "uncordon",
            ActionKind::Drain => "drain",
            ActionKind::Taint => "taint",
            ActionKind::Untaint => "untaint",
            ActionKind::Label => "label",
            ActionKind::Revoke => "revoke",
        }
    }

    /// Actions that take work off a node or cut it off: the dialog says so and the button
    /// that confirms names the action.
    pub fn destructive(self) -> bool {
        matches!(self, ActionKind::Drain | ActionKind::Revoke)
    }

    fn warning(self) -> Option<&'static str> {
        match self {
            ActionKind::Drain => Some(
                "Draining cordons the node and keeps it out of scheduling until its work is released or the deadline passes.",
            ),
            ActionKind::Revoke => Some(
                "Revoking bumps the identity generation: the node's certificate stops working at once and its session ends. The daemon must join again with a new token.",
            ),
            _ => None,
        }
    }

    fn needs_reason(self) -> bool {
        matches!(
            self,
            ActionKind::Cordon | ActionKind::Drain | ActionKind::Revoke
        )
    }
}

/// What the dialog's inputs say, before they are checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ActionInput {
    pub reason: String,
    /// RFC 3339, already converted from the browser's local time.
    pub deadline: Option<String>,
    pub key: String,
    pub value: String,
    pub prefer_no_schedule: bool,
    /// `key=value` pairs, one per line or separated by commas.
    pub set_labels: String,
    /// Label keys, separated by commas or spaces.
    pub remove_labels: String,
}

/// A checked action, ready to run on any number of nodes.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeAction {
    Cordon {
        reason: String,
    },
    Uncordon,
    Drain {
        reason: String,
        deadline: Option<String>,
    },
    Taint {
        key: String,
        value: String,
        prefer_no_schedule: bool,
    },
    Untaint {
        key: String,
    },
    Label {
        set: Vec<(String, String)>,
        remove: Vec<String>,
    },
    Revoke {
        reason: String,
    },
}

impl NodeAction {
    /// Checks the inputs for `kind`; the error says what is missing.
    pub fn from_input(kind: ActionKind, input: &ActionInput) -> Result<NodeAction, String> {
        let reason = input.reason.trim().to_owned();
        if kind.needs_reason() && reason.is_empty() {
            return Err(format!("{} needs a reason.", kind.title()));
        }
        let key = input.key.trim().to_owned();
        if matches!(kind, ActionKind::Taint | ActionKind::Untaint) && key.is_empty() {
            return Err("A taint needs a key.".to_owned());
        }
        Ok(match kind {
            ActionKind::Cordon => NodeAction::Cordon { reason },
            ActionKind::Uncordon => NodeAction::Uncordon,
            ActionKind::Drain => NodeAction::Drain {
                reason,
                deadline: input.deadline.clone(),
            },
            ActionKind::Taint => NodeAction::Taint {
                key,
                value: input.value.trim().to_owned(),
                prefer_no_schedule: input.prefer_no_schedule,
            },
            ActionKind::Untaint => NodeAction::Untaint { key },
            ActionKind::Revoke => NodeAction::Revoke { reason },
            ActionKind::Label => {
                let mut set = Vec::new();
                for pair in input
                    .set_labels
                    .split([',', '\n'])
                    .map(str::trim)
                    .filter(|p| !p.is_empty())
                {
                    let Some((k, v)) = pair.split_once('=') else {
                        return Err(format!("`{pair}` is not key=value."));
                    };
                    if k.trim().is_empty() {
                        return Err(format!("`{pair}` has no key."));
                    }
                    set.push((k.trim().to_owned(), v.trim().to_owned()));
                }
                let remove: Vec<String> = input
                    .remove_labels
                    .split([',', ' ', '\n'])
                    .map(str::trim)
                    .filter(|k| !k.is_empty())
                    .map(str::to_owned)
                    .collect();
                if set.is_empty() && remove.is_empty() {
                    return Err("Name labels to set or remove.".to_owned());
                }
                NodeAction::Label { set, remove }
            }
        })
    }

    /// Runs the action on one node at the version the operator saw; the new version.
    pub async fn apply(&self, id: &str, version: i64) -> Result<i64, ApiError> {
        let id = id.to_owned();
        match self.clone() {
            NodeAction::Cordon { reason } => gql::run::<CordonNode>(cordon_node::Variables {
                input: cordon_node::CordonNodeInput {
                    id,
                    version,
                    reason,
                },
            })
            .await
            .map(|d| d.cordon_node.node.version),
            NodeAction::Uncordon => gql::run::<UncordonNode>(uncordon_node::Variables {
                input: uncordon_node::UncordonNodeInput { id, version },
            })
            .await
            .map(|d| d.uncordon_node.node.version),
            NodeAction::Drain { reason, deadline } => {
                gql::run::<DrainNode>(drain_node::Variables {
                    input: drain_node::DrainNodeInput {
                        id,
                        version,
                        reason,
                        deadline,
                    },
                })
                .await
                .map(|d| d.drain_node.node.version)
            }
            NodeAction::Taint {
                key,
                value,
                prefer_no_schedule,
            } => gql::run::<TaintNode>(taint_node::Variables {
                input: taint_node::TaintNodeInput {
                    id,
                    version,
                    key,
                    value,
                    effect: if prefer_no_schedule {
                        taint_node::TaintEffect::PREFER_NO_SCHEDULE
                    } else {
                        taint_node::TaintEffect::NO_SCHEDULE
                    },
                },
            })
            .await
            .map(|d| d.taint_node.node.version),
            NodeAction::Untaint { key } => gql::run::<UntaintNode>(untaint_node::Variables {
                input: untaint_node::UntaintNodeInput { id, version, key },
            })
            .await
            .map(|d| d.untaint_node.node.version),
            NodeAction::Label { set, remove } => gql::run::<LabelNode>(label_node::Variables {
                input: label_node::LabelNodeInput {
                    id,
                    version,
                    set: set
                        .into_iter()
                        .map(|(key, value)| label_node::LabelInput { key, value })
                        .collect(),
                    remove,
                },
            })
            .await
            .map(|d| d.label_node.node.version),
            NodeAction::Revoke { reason } => {
                gql::run::<RevokeNodeIdentity>(revoke_node_identity::Variables {
                    input: revoke_node_identity::RevokeNodeIdentityInput {
                        id,
                        version,
                        reason,
                    },
                })
                .await
                .map(|d| d.revoke_node_identity.node.version)
            }
        }
    }
}

/// How one node fared.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The node as the operator saw it when the dialog opened.
    pub before: Row,
    pub result: Result<i64, ApiError>,
    /// For a conflict: the node as it is now, and what differs.
    pub now: Option<Row>,
    pub changes: Vec<FactChange>,
}

/// Runs `action` on every target at the version it had on screen. `names` (the catalog's)
/// word what a conflict shows.
pub async fn run_on_all(action: NodeAction, targets: Vec<Row>, names: Names) -> Vec<Outcome> {
    futures::stream::iter(targets)
        .map(|before| {
            let action = action.clone();
            let names = names.clone();
            async move {
                let result = action.apply(&before.id, before.version).await;
                let (now, changes) = match &result {
                    Err(err) if err.is_conflict() => match current_row(&before.id).await {
                        Some(now) => {
                            let changes = what_changed(&before, &now, &names);
                            (Some(now), changes)
                        }
                        None => (None, Vec::new()),
                    },
                    _ => (None, Vec::new()),
                };
                Outcome {
                    before,
                    result,
                    now,
                    changes,
                }
            }
        })
        .buffered(BULK_CONCURRENCY)
        .collect()
        .await
}

/// The node as stored now (read, not taken from the live feed, which may lag).
async fn current_row(id: &str) -> Option<Row> {
    gql::run::<NodeRowById>(node_row_by_id::Variables { id: id.to_owned() })
        .await
        .ok()
        .map(|d| row_from_read(d.node))
}

/// The dialog for one action on `targets` (one node, or a selection). `on_close` is called
/// when the operator closes it.
#[component]
pub fn ActionDialog(
    kind: ActionKind,
    targets: Vec<Row>,
    #[prop(optional)] prefill: ActionInput,
    on_close: Callback<()>,
) -> impl IntoView {
    let names = ctx().names;
    let input = RwSignal::new(prefill);
    let targets = RwSignal::new(targets);
    let problem = RwSignal::new(None::<String>);
    let running = RwSignal::new(false);
    let outcomes = RwSignal::new(None::<Vec<Outcome>>);
    let offset_west = js_sys::Date::new_0().get_timezone_offset() as i32;

    let run = move |retry: Vec<Row>| {
        let action = match NodeAction::from_input(kind, &input.get_untracked()) {
            Ok(action) => action,
            Err(why) => {
                problem.set(Some(why));
                return;
            }
        };
        problem.set(None);
        running.set(true);
        targets.set(retry.clone());
        let names = names.get_untracked();
        leptos::task::spawn_local(async move {
            let results = run_on_all(action, retry, names).await;
            outcomes.set(Some(results));
            running.set(false);
        });
    };
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        run(targets.get_untracked());
    };
    let retry_conflicts = move |_| {
        let again: Vec<Row> = outcomes
            .get_untracked()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|o| o.now)
            .collect();
        outcomes.set(None);
        run(again);
    };
    let count = move || targets.with(Vec::len);
    let heading = move || {
        let n = count();
        if n == 1 {
            let host = targets.with(|t| t.first().map(|r| r.hostname.clone()).unwrap_or_default());
            format!("{} {host}", kind.title())
        } else {
            format!("{} {n} nodes", kind.title())
        }
    };
    let field = move |get: fn(&ActionInput) -> String, set: fn(&mut ActionInput, String)| {
        (
            move || input.with(get),
            move |ev| input.update(|i| set(i, event_target_value(&ev))),
        )
    };
    let (reason, on_reason) = field(|i| i.reason.clone(), |i, v| i.reason = v);
    let (key, on_key) = field(|i| i.key.clone(), |i, v| i.key = v);
    let (value, on_value) = field(|i| i.value.clone(), |i, v| i.value = v);
    let (set_labels, on_set_labels) = field(|i| i.set_labels.clone(), |i, v| i.set_labels = v);
    let (remove_labels, on_remove_labels) =
        field(|i| i.remove_labels.clone(), |i, v| i.remove_labels = v);

    view! {
        <div class="modal" on:click=move |_| on_close.run(())>
            <div
                class="dialog"
                role="dialog"
                data-testid="action-dialog"
                data-action=kind.key()
                on:click=|ev| ev.stop_propagation()
            >
                <h2>{heading}</h2>
                <Show when=move || outcomes.with(Option::is_none)>
                    <form on:submit=submit>
                        {kind.warning().map(|w| view! { <p class="warning">{w}</p> })}
                        {kind.needs_reason().then(|| view! {
                            <label>"Reason"
                                <input data-testid="action-reason" prop:value=reason on:input=on_reason required/>
                            </label>
                        })}
                        {(kind == ActionKind::Drain).then(|| view! {
                            <label>"Deadline (optional, your local time)"
                                <input
                                    type="datetime-local"
                                    data-testid="action-deadline"
                                    on:input=move |ev| {
                                        let v = event_target_value(&ev);
                                        input.update(|i| i.deadline = crate::format::local_input_to_rfc3339(&v, offset_west));
                                    }
                                />
                            </label>
                        })}
                        {matches!(kind, ActionKind::Taint | ActionKind::Untaint).then(|| view! {
                            <label>"Key" <input data-testid="action-key" prop:value=key on:input=on_key/></label>
                        })}
                        {(kind == ActionKind::Taint).then(|| view! {
                            <label>"Value" <input data-testid="action-value" prop:value=value on:input=on_value/></label>
                            <label class="inline">
                                <input
                                    type="checkbox"
                                    prop:checked=move || input.with(|i| i.prefer_no_schedule)
                                    on:change=move |ev| input.update(|i| i.prefer_no_schedule = event_target_checked(&ev))
                                />
                                "PreferNoSchedule (a hint: it does not keep work off the node)"
                            </label>
                        })}
                        {(kind == ActionKind::Label).then(|| view! {
                            <label>"Set (key=value, one per line)"
                                <textarea data-testid="action-set-labels" rows="3" prop:value=set_labels on:input=on_set_labels></textarea>
                            </label>
                            <label>"Remove (keys)"
                                <input data-testid="action-remove-labels" prop:value=remove_labels on:input=on_remove_labels/>
                            </label>
                        })}
                        <Show when=move || problem.with(Option::is_some)>
                            <p class="error">{move || problem.get().unwrap_or_default()}</p>
                        </Show>
                        <div class="buttons">
                            <button type="button" on:click=move |_| on_close.run(())>"Close"</button>
                            <button
                                type="submit"
                                data-testid="action-confirm"
                                class:danger=kind.destructive()
                                disabled=move || running.get()
                            >
                                {move || if running.get() { "Working…".to_owned() } else { heading() }}
                            </button>
                        </div>
                    </form>
                </Show>
                {move || outcomes.get().map(|results| view! {
                    <OutcomeList results=results on_retry=Callback::new(retry_conflicts) on_close=on_close/>
                })}
            </div>
        </div>
    }
}

#[component]
fn OutcomeList(
    results: Vec<Outcome>,
    on_retry: Callback<()>,
    on_close: Callback<()>,
) -> impl IntoView {
    let done = results.iter().filter(|o| o.result.is_ok()).count();
    let conflicts: Vec<Outcome> = results
        .iter()
        .filter(|o| o.result.as_ref().is_err_and(ApiError::is_conflict))
        .cloned()
        .collect();
    let failed: Vec<Outcome> = results
        .iter()
        .filter(|o| o.result.as_ref().is_err_and(|e| !e.is_conflict()))
        .cloned()
        .collect();
    let retryable = conflicts.iter().any(|o| o.now.is_some());
    let conflict_count = conflicts.len();
    view! {
        <div class="outcomes" data-testid="outcomes">
            <p data-testid="outcome-summary">
                {format!("{done} done, {} changed since you looked, {} failed.", conflicts.len(), failed.len())}
            </p>
            {(!conflicts.is_empty()).then(|| view! {
                <div class="conflicts" data-testid="conflicts">
                    <h3>"Changed since you looked"</h3>
                    {conflicts.into_iter().map(|o| {
                        let versions = format!(
                            "version {} → {}",
                            o.before.version,
                            o.now.as_ref().map_or_else(|| "?".to_owned(), |n| n.version.to_string())
                        );
                        view! {
                            <div class="conflict" data-testid="conflict">
                                <strong>{o.before.hostname.clone()}</strong>" "<span class="muted">{versions}</span>
                                <ul>
                                    {if o.changes.is_empty() {
                                        view! { <li>"Only its history changed (no column of the table differs)."</li> }.into_any()
                                    } else {
                                        o.changes.into_iter().map(|c| view! {
                                            <li data-testid="conflict-change">
                                                {format!("{}: {} → {}", c.fact, blank(&c.before), blank(&c.after))}
                                            </li>
                                        }).collect_view().into_any()
                                    }}
                                </ul>
                            </div>
                        }
                    }).collect_view()}
                </div>
            })}
            {(!failed.is_empty()).then(|| view! {
                <ul class="failures">
                    {failed.into_iter().map(|o| view! {
                        <li class="error">{format!("{}: {}", o.before.hostname, o.result.err().map(|e| e.to_string()).unwrap_or_default())}</li>
                    }).collect_view()}
                </ul>
            })}
            <div class="buttons">
                <button type="button" on:click=move |_| on_close.run(())>"Close"</button>
                {retryable.then(|| view! {
                    <button type="button" data-testid="retry-conflicts" on:click=move |_| on_retry.run(())>
                        {format!("Retry {conflict_count} with the current version")}
                    </button>
                })}
            </div>
        </div>
    }
}

fn blank(text: &str) -> String {
    if text.is_empty() {
        "(none)".to_owned()
    } else {
        text.to_owned()
    }
}

/// The command kinds, their wire names, and whether they interrupt work.
pub const COMMAND_KINDS: [(send_command::CommandKind, &str, bool); 6] = [
    (send_command::CommandKind::DIAG_NVML, "diag.nvml", false),
    (
        send_command::CommandKind::INVENTORY_REFRESH,
        "inventory.refresh",
        false,
    ),
    (
        send_command::CommandKind::LOGS_COLLECT,
        "logs.collect",
        false,
    ),
    (send_command::CommandKind::GPU_RESET, "gpu.reset", true),
    (send_command::CommandKind::NODE_REBOOT, "node.reboot", true),
    (send_command::CommandKind::DISK_WIPE, "disk.wipe", true),
];

/// Sends one command to one node or a selection. Destructive kinds need a confirmation, and
/// the server still refuses them on uncordoned nodes unless an admin forces it.
#[component]
pub fn CommandDialog(targets: Vec<Row>, on_close: Callback<()>) -> impl IntoView {
    let ctx = ctx();
    let is_admin = move || {
        ctx.operator
            .with(|o| o.as_ref().is_some_and(|o| o.is_admin()))
    };
    let kind = RwSignal::new(0usize);
    let params = RwSignal::new("{}".to_owned());
    let force = RwSignal::new(false);
    let confirmed = RwSignal::new(false);
    let problem = RwSignal::new(None::<String>);
    let sent = RwSignal::new(None::<usize>);
    let running = RwSignal::new(false);
    let count = targets.len();
    let ids = StoredValue::new(
        targets
            .iter()
            .map(|r| r.id.clone())
            .collect::<Vec<String>>(),
    );
    let destructive = move || COMMAND_KINDS[kind.get()].2;

    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let (command_kind, name, is_destructive) = COMMAND_KINDS[kind.get_untracked()].clone();
        if is_destructive && !confirmed.get_untracked() {
            problem.set(Some(format!(
                "{name} interrupts work: tick the confirmation first."
            )));
            return;
        }
        let parsed = match serde_json::from_str::<serde_json::Value>(&params.get_untracked()) {
            Ok(v) if v.is_object() => v,
            _ => {
                problem.set(Some(
                    "Parameters must be a JSON object, e.g. {\"level\": 2}.".to_owned(),
                ));
                return;
            }
        };
        problem.set(None);
        running.set(true);
        // Read before the task starts: the dialog (and its signals) may be gone by then.
        let input = send_command::SendCommandInput {
            node_ids: Some(ids.get_value()),
            filter: None,
            kind: command_kind,
            params: Some(parsed),
            timeout_seconds: None,
            not_before: None,
            expires_in_seconds: None,
            force: force.get_untracked(),
        };
        leptos::task::spawn_local(async move {
            let result = gql::run::<SendCommand>(send_command::Variables { input }).await;
            match result {
                Ok(data) => sent.set(Some(data.send_command.commands.len())),
                Err(err) => problem.set(Some(err.to_string())),
            }
            running.set(false);
        });
    };
    let heading = if count == 1 {
        format!("Send a command to {}", targets[0].hostname)
    } else {
        format!("Send a command to {count} nodes")
    };
    view! {
        <div class="modal" on:click=move |_| on_close.run(())>
            <div class="dialog" role="dialog" data-testid="command-dialog" on:click=|ev| ev.stop_propagation()>
                <h2>{heading}</h2>
                {move || match sent.get() {
                    Some(n) => view! {
                        <p data-testid="command-sent">{format!("Queued {n} command(s). Their progress shows on each node's page.")}</p>
                        <div class="buttons"><button type="button" on:click=move |_| on_close.run(())>"Close"</button></div>
                    }.into_any(),
                    None => view! {
                        <form on:submit=submit>
                            <label>"Kind"
                                <select data-testid="command-kind" on:change=move |ev| {
                                    kind.set(event_target_value(&ev).parse().unwrap_or(0));
                                    confirmed.set(false);
                                }>
                                    {COMMAND_KINDS.iter().enumerate().map(|(i, (_, name, d))| view! {
                                        <option value=i.to_string() selected=move || kind.get() == i>
                                            {if *d { format!("{name} (destructive)") } else { (*name).to_owned() }}
                                        </option>
                                    }).collect_view()}
                                </select>
                            </label>
                            <label>"Parameters (JSON)"
                                <textarea data-testid="command-params" rows="2" prop:value=move || params.get() on:input=move |ev| params.set(event_target_value(&ev))></textarea>
                            </label>
                            <Show when=destructive>
                                <p class="warning">
                                    "This command interrupts work on the node. The server refuses it on a node that is not cordoned unless an admin forces it."
                                </p>
                                <label class="inline">
                                    <input type="checkbox" data-testid="command-confirm-destructive"
                                        prop:checked=move || confirmed.get()
                                        on:change=move |ev| confirmed.set(event_target_checked(&ev))/>
                                    {format!("I understand this interrupts work on {count} node(s).")}
                                </label>
                                <Show when=is_admin>
                                    <label class="inline">
                                        <input type="checkbox" data-testid="command-force"
                                            prop:checked=move || force.get()
                                            on:change=move |ev| force.set(event_target_checked(&ev))/>
                                        "Force on uncordoned nodes (admin)"
                                    </label>
                                </Show>
                            </Show>
                            <Show when=move || problem.with(Option::is_some)>
                                <p class="error" data-testid="command-error">{move || problem.get().unwrap_or_default()}</p>
                            </Show>
                            <div class="buttons">
                                <button type="button" on:click=move |_| on_close.run(())>"Close"</button>
                                <button type="submit" data-testid="command-send" class:danger=destructive disabled=move || running.get()>"Send"</button>
                            </div>
                        </form>
                    }.into_any(),
                }}
            </div>
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_checked_per_kind() {
        let empty = ActionInput::default();
        let cases: &[(ActionKind, ActionInput, Result<NodeAction, &str>)] = &[
            (
                ActionKind::Uncordon,
                empty.clone(),
                Ok(NodeAction::Uncordon),
            ),
            (
                ActionKind::Cordon,
                empty.clone(),
                Err("Cordon needs a reason."),
            ),
            (
                ActionKind::Cordon,
                ActionInput {
                    reason: " rack move ".into(),
                    ..empty.clone()
                },
                Ok(NodeAction::Cordon {
                    reason: "rack move".into(),
                }),
            ),
            (
                ActionKind::Revoke,
                empty.clone(),
                Err("Revoke identity needs a reason."),
            ),
            (
                ActionKind::Taint,
                ActionInput {
                    reason: "x".into(),
                    ..empty.clone()
                },
                Err("A taint needs a key."),
            ),
            (
                ActionKind::Taint,
                ActionInput {
                    key: "gpu-burn".into(),
                    prefer_no_schedule: true,
                    ..empty.clone()
                },
                Ok(NodeAction::Taint {
                    key: "gpu-burn".into(),
                    value: String::new(),
                    prefer_no_schedule: true,
                }),
            ),
            (
                ActionKind::Label,
                empty.clone(),
                Err("Name labels to set or remove."),
            ),
            (
                ActionKind::Label,
                ActionInput {
                    set_labels: "rack=r1\n zone = a ,".into(),
                    remove_labels: "old, stale".into(),
                    ..empty.clone()
                },
                Ok(NodeAction::Label {
                    set: vec![("rack".into(), "r1".into()), ("zone".into(), "a".into())],
                    remove: vec!["old".into(), "stale".into()],
                }),
            ),
            (
                ActionKind::Label,
                ActionInput {
                    set_labels: "rack".into(),
                    ..empty.clone()
                },
                Err("`rack` is not key=value."),
            ),
            (
                ActionKind::Label,
                ActionInput {
                    set_labels: "=v".into(),
                    ..empty.clone()
                },
                Err("`=v` has no key."),
            ),
            (
                ActionKind::Drain,
                ActionInput {
                    reason: "swap".into(),
                    deadline: Some("2026-12-02T16:30:00Z".into()),
                    ..empty
                },
                Ok(NodeAction::Drain {
                    reason: "swap".into(),
                    deadline: Some("2026-12-02T16:30:00Z".into()),
                }),
            ),
        ];
        for (kind, input, expected) in cases {
            let got = NodeAction::from_input(*kind, input);
            assert_eq!(
                got,
                expected.clone().map_err(str::to_owned),
                "{kind:?} {input:?}"
            );
        }
    }

    #[test]
    fn only_drain_and_revoke_are_destructive() {
        let destructive: Vec<ActionKind> = [ActionKind::Revoke]
            .into_iter()
            .chain(ActionKind::BULK)
            .filter(|k| k.destructive())
            .collect();
        assert_eq!(destructive, [ActionKind::Revoke, ActionKind::Drain]);
    }
}
