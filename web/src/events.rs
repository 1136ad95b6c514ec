//! The fleet's event log: every change to every node visible, command status changes,
//! remediation, placement and catalog events, newest first, filtered by node, type, actor
//! and time, a page at a time, and live: new events matching the filter appear on top.

use leptos::prelude::*;
use leptos_router::components::A;

use crate::app::ctx;
use crate::format::{local_input_to_rfc3339, since};
use crate::gql::{self, ApiError, EventLog, EventLogLive, event_log, event_log_live};
use crate::live::{LiveState, follow};

/// Events per page.
const PAGE: i64 = 50;

/// Every `EventType`, in the schema's order (a test checks each is one the schema knows).
pub const EVENT_TYPES: [&str; 66] = [
    "NODE_JOINED",
    "NODE_REJOINED",
    "NODE_ENROLLED",
    "NODE_DELETED",
    "NODE_PROVISION_STATE_CHANGED",
    "NODE_MAINTENANCE_ON",
    "NODE_MAINTENANCE_OFF",
    "NODE_CORDONED",
    "NODE_UNCORDONED",
    "NODE_DRAIN_STARTED",
    "NODE_DRAIN_FINISHED",
    "NODE_DRAINED",
    "NODE_CONNECTIVITY_CHANGED",
    "NODE_CONDITION_CHANGED",
    "NODE_NO_SCHEDULE_REASON_ADDED",
    "NODE_NO_SCHEDULE_REASON_REMOVED",
    "NODE_CONDITION_PROOF_STEP",
    "NODE_CONDITION_PROOF_RESTARTED",
    "NODE_CONDITION_EVIDENCE_GONE",
    "NODE_POWER_CHANGED",
    "NODE_POWER_ACTION",
    "WORKFLOW_STARTED",
    "WORKFLOW_STEP_CHANGED",
    "WORKFLOW_FINISHED",
    "NODE_TAINTED",
    "NODE_UNTAINTED",
    "NODE_LABEL_SET",
    "NODE_LABEL_REMOVED",
    "NODE_INVENTORY_LABELS_CHANGED",
    "NODE_GPU_COUNT_CHANGED",
    "NODE_HARDWARE_KEY_CHANGED",
    "NODE_SPEC_GENERATION",
    "NODE_OBSERVED_GENERATION",
    "NODE_IDENTITY_REVOKED",
    "COMMAND_QUEUED",
    "COMMAND_DISPATCHED",
    "COMMAND_RUNNING",
    "COMMAND_SUCCEEDED",
    "COMMAND_FAILED",
    "COMMAND_TIMED_OUT",
    "COMMAND_CANCELLED",
    "COMMAND_EXPIRED",
    "REMEDIATION_WAITING",
    "REMEDIATION_ACTING",
    "REMEDIATION_VERIFYING",
    "REMEDIATION_SUCCEEDED",
    "REMEDIATION_FAILED",
    "REMEDIATION_GAVE_UP",
    "REMEDIATION_CANCELLED",
    "TENANT_CREATED",
    "SITE_CREATED",
    "POOL_CREATED",
    "POOL_OFFERED",
    "POOL_UPDATED",
    "JOIN_TOKEN_CREATED",
    "JOIN_TOKEN_REVOKED",
    "RESERVATION_CREATED",
    "RESERVATION_PLACED",
    "RESERVATION_EVICTED",
    "RESERVATION_RELEASED",
    "RESERVATION_FAILED",
    "ALLOCATION_BOOKED",
    "ALLOCATION_RELEASED",
    "SITE_LIVENESS_PAUSED",
    "SITE_LIVENESS_RESUMED",
    "SITE_LIVENESS_RELEASED",
];

type LogEvent = event_log::LogEvent;

/// The filter as applied (what the list below it shows).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filter {
    pub node_ids: Vec<String>,
    pub types: Vec<String>,
    pub actors: Vec<String>,
    pub since: Option<String>,
    pub until: Option<String>,
}

/// The filter as one operation's generated input type (each operation has its own).
macro_rules! filter_input {
    ($filter:expr, $op:ident) => {{
        let f: &Filter = $filter;
        if f.is_empty() {
            None
        } else {
            let list = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
            Some($op::EventFilterInput {
                node_ids: list(&f.node_ids),
                types: (!f.types.is_empty()).then(|| {
                    f.types
                        .iter()
                        .filter_map(|t| {
                            serde_json::from_value(serde_json::Value::String(t.clone())).ok()
                        })
                        .collect()
                }),
                actors: list(&f.actors),
                since: f.since.clone(),
                until: f.until.clone(),
            })
        }
    }};
}

impl Filter {
    fn is_empty(&self) -> bool {
        *self == Filter::default()
    }

    fn input(&self) -> Option<event_log::EventFilterInput> {
        filter_input!(self, event_log)
    }

    /// The same filter for the live feed (its generated input type is its own).
    fn live_input(&self) -> Option<event_log_live::EventFilterInput> {
        filter_input!(self, event_log_live)
    }
}

/// Words separated by commas or spaces.
pub fn words(text: &str) -> Vec<String> {
    text.split([',', ' ', '\n'])
        .map(str::trim)
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The event type whose `from` and `to` list many keys (`key=value, …`): a report's
/// inventory labels, about twenty on a machine's first report.
const MANY_KEYS_TYPE: &str = "node.inventory_labels_changed";

/// An event's "from → to" cell. A report's inventory labels fold into a line that says how
/// many changed and opens to the whole list, so that one event does not make its row a page
/// tall; every other change shows as it is.
pub fn from_to(event_type: &str, from: Option<String>, to: Option<String>) -> AnyView {
    let text = match (&from, &to) {
        (None, None) => return ().into_any(),
        _ => format!(
            "{} → {}",
            from.as_deref().unwrap_or_default(),
            to.as_deref().unwrap_or_default()
        ),
    };
    match (event_type == MANY_KEYS_TYPE).then(|| keys_changed(from.as_deref(), to.as_deref())) {
        Some(summary) => view! {
            <details class="from-to"><summary>{summary}</summary>{text}</details>
        }
        .into_any(),
        None => text.into_any(),
    }
}

/// How many keys a many-keys change lists (`set`, `changed` or `removed`), in a line: from
/// `a=1, b=2` to `b=3, c=4` is one changed, one set and one removed.
fn keys_changed(from: Option<&str>, to: Option<&str>) -> String {
    let keys = |side: Option<&str>| -> std::collections::BTreeSet<String> {
        side.into_iter()
            .flat_map(|s| s.split(", "))
            .filter_map(|pair| pair.split_once('=').map(|(key, _)| key.to_owned()))
            .collect()
    };
    let (before, after) = (keys(from), keys(to));
    let changed = before.intersection(&after).count();
    let set = after.len() - changed;
    let removed = before.len() - changed;
    let parts: Vec<String> = [(set, "set"), (changed, "changed"), (removed, "removed")]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
    format!("labels: {}", parts.join(", "))
}

/// `evt_42` → 42: events sort newest first by it.
fn sequence(id: &str) -> u64 {
    id.rsplit('_')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Adds `fresh` to `known` (no duplicates), newest first.
pub fn merge<T: Clone>(
    known: &mut Vec<T>,
    fresh: impl IntoIterator<Item = T>,
    id: impl Fn(&T) -> &str,
) {
    for e in fresh {
        if !known.iter().any(|k| id(k) == id(&e)) {
            known.push(e);
        }
    }
    known.sort_by_key(|e| std::cmp::Reverse(sequence(id(e))));
}

#[component]
pub fn EventsPage() -> impl IntoView {
    let ctx = ctx();
    let node_text = RwSignal::new(String::new());
    let types = RwSignal::new(Vec::<String>::new());
    let actor_text = RwSignal::new(String::new());
    let since_text = RwSignal::new(String::new());
    let until_text = RwSignal::new(String::new());
    let applied = RwSignal::new(Filter::default());
    let problem = RwSignal::new(None::<String>);
    let offset_west = js_sys::Date::new_0().get_timezone_offset() as i32;

    let apply = move || {
        // Nodes by hostname (as the fleet table knows them) or by id.
        let mut node_ids = Vec::new();
        for word in words(&node_text.get_untracked()) {
            let by_name = ctx.fleet.with_rows(|rows| {
                rows.values()
                    .find(|r| r.hostname == word)
                    .map(|r| r.id.clone())
            });
            match by_name {
                Some(id) => node_ids.push(id),
                None if word.starts_with("node_") => node_ids.push(word),
                None => {
                    problem.set(Some(format!("No node is called {word}.")));
                    return;
                }
            }
        }
        let time = |text: String| {
            (!text.is_empty())
                .then(|| local_input_to_rfc3339(&text, offset_west))
                .flatten()
        };
        problem.set(None);
        applied.set(Filter {
            node_ids,
            types: types.get_untracked(),
            actors: words(&actor_text.get_untracked()),
            since: time(since_text.get_untracked()),
            until: time(until_text.get_untracked()),
        });
    };
    let reset = move |_| {
        node_text.set(String::new());
        types.set(Vec::new());
        actor_text.set(String::new());
        since_text.set(String::new());
        until_text.set(String::new());
        problem.set(None);
        applied.set(Filter::default());
    };
    let on_types = move |ev: leptos::ev::Event| {
        use wasm_bindgen::JsCast;
        let Some(select) = ev
            .target()
            .and_then(|t| t.dyn_into::<web_sys::HtmlSelectElement>().ok())
        else {
            return;
        };
        let options = select.selected_options();
        let chosen = (0..options.length())
            .filter_map(|i| options.item(i))
            .filter_map(|o| o.get_attribute("value"))
            .collect();
        types.set(chosen);
    };

    view! {
        <section class="events-page">
            <h1>"Event log"</h1>
            <form class="event-filters" data-testid="event-filters" on:submit=move |ev| { ev.prevent_default(); apply(); }>
                <label>"Nodes"
                    <input data-testid="log-filter-node" placeholder="hostnames or node ids" prop:value=move || node_text.get()
                        on:input=move |ev| node_text.set(event_target_value(&ev))/>
                </label>
                <label>"Types"
                    <select multiple=true size="6" data-testid="log-filter-types" on:change=on_types>
                        {EVENT_TYPES.into_iter().map(|t| view! {
                            <option value=t prop:selected=move || types.with(|s| s.iter().any(|x| x == t))>{t.to_ascii_lowercase().replacen('_', ".", 1)}</option>
                        }).collect_view()}
                    </select>
                </label>
                <label>"Actors"
                    <input data-testid="log-filter-actor" placeholder="user:ann, controller:health" prop:value=move || actor_text.get()
                        on:input=move |ev| actor_text.set(event_target_value(&ev))/>
                </label>
                <label>"Since"
                    <input type="datetime-local" step="1" data-testid="log-filter-since" prop:value=move || since_text.get()
                        on:input=move |ev| since_text.set(event_target_value(&ev))/>
                </label>
                <label>"Until"
                    <input type="datetime-local" step="1" data-testid="log-filter-until" prop:value=move || until_text.get()
                        on:input=move |ev| until_text.set(event_target_value(&ev))/>
                </label>
                <div class="filter-buttons">
                    <button type="submit" data-testid="log-filter-apply">"Apply"</button>
                    <button type="button" data-testid="log-filter-reset" on:click=reset>"Reset"</button>
                </div>
            </form>
            <Show when=move || problem.with(Option::is_some)>
                <p class="error" data-testid="log-filter-error">{move || problem.get().unwrap_or_default()}</p>
            </Show>
            // A new list (and live feed) per filter applied: the old feed ends with its list.
            {move || view! { <EventList filter=applied.get()/> }}
        </section>
    }
}

#[component]
fn EventList(filter: Filter) -> impl IntoView {
    let ctx = ctx();
    let events = RwSignal::new(Vec::<LogEvent>::new());
    let total = RwSignal::new(None::<i64>);
    let more = RwSignal::new(false);
    let loading = RwSignal::new(false);
    let error = RwSignal::new(None::<ApiError>);
    let live = RwSignal::new(LiveState::Connecting);

    // One page, `after` the oldest event shown (none: the newest page).
    let load = {
        let filter = filter.clone();
        move |after: Option<String>| {
            let variables = event_log::Variables {
                filter: filter.input(),
                first: PAGE,
                after: after.clone(),
            };
            loading.set(true);
            leptos::task::spawn_local(async move {
                let answer = gql::run::<EventLog>(variables).await;
                // The list may be gone (another filter applied) by the time it answers.
                let _ = loading.try_set(false);
                match answer {
                    Ok(data) => {
                        let page = data.events;
                        if after.is_none() {
                            let _ = total.try_set(Some(page.total_count));
                        }
                        let _ = more.try_set(page.page_info.has_next_page);
                        let _ = events.try_update(|known| merge(known, page.nodes, |e| &e.id));
                    }
                    Err(err) => {
                        let _ = error.try_set(Some(err));
                    }
                }
            });
        }
    };
    load(None);

    // The newest page again, then each new event, with no gap between the two.
    let feed = {
        let filter = filter.clone();
        follow::<EventLogLive>(
            move |after| event_log_live::Variables {
                filter: filter.live_input(),
                last: after.is_none().then_some(PAGE),
                after,
            },
            |d| Some(d.events.id.clone()),
            move |d| {
                let fresh: LogEvent =
                    match serde_json::to_value(d.events).and_then(serde_json::from_value) {
                        Ok(e) => e,
                        Err(_) => return,
                    };
                let _ = events.try_update(|known| {
                    let before = known.len();
                    merge(known, [fresh], |e| &e.id);
                    if known.len() > before {
                        let _ = total.try_update(|t| {
                            if let Some(t) = t {
                                *t = (*t).max(known.len() as i64);
                            }
                        });
                    }
                });
            },
            live,
        )
    };
    on_cleanup(move || feed.stop());

    let older = {
        let load = load.clone();
        move |_| {
            let oldest = events.with_untracked(|e| e.last().map(|e| e.id.clone()));
            load(oldest);
        }
    };
    let host = move |id: &str| {
        ctx.fleet
            .row(id)
            .map(|r| r.hostname.clone())
            .unwrap_or_else(|| id.to_owned())
    };

    view! {
        <div class="event-list">
            <div class="toolbar">
                <span data-testid="event-count">{move || {
                    let shown = events.with(Vec::len);
                    match total.get() {
                        Some(t) => format!("{shown} of {} events", t.max(shown as i64)),
                        None => format!("{shown} events"),
                    }
                }}</span>
                <span class=move || format!("live-state {}", if live.get() == LiveState::Live { "live" } else { "connecting" }) data-testid="event-live">
                    {move || if live.get() == LiveState::Live { "live" } else { "connecting…" }}
                </span>
            </div>
            <Show when=move || error.with(Option::is_some)>
                <p class="error" data-testid="event-error">{move || error.get().map(|e| e.to_string()).unwrap_or_default()}</p>
            </Show>
            <table class="log" data-testid="event-log">
                <thead><tr><th>"When"</th><th>"Event"</th><th>"Node"</th><th>"Axis"</th><th>"From → to"</th><th>"Actor"</th><th>"Cause"</th><th></th></tr></thead>
                <tbody>
                    <For
                        each=move || events.get()
                        key=|e| e.id.clone()
                        children=move |e| view! {
                            <tr data-testid="log-row" data-event=e.id.clone() data-type=e.type_.clone() data-node=e.node_id.clone().unwrap_or_default() data-actor=e.actor.clone()>
                                <td class="nowrap">{since(&e.at)}</td>
                                <td>{e.type_.clone()}</td>
                                <td class="breaks">{e.node_id.clone().map(|id| view! {
                                    <A href=format!("/nodes/{id}")><span data-testid="log-node">{host(&id)}</span></A>
                                })}</td>
                                <td>{e.axis.clone().unwrap_or_default()}</td>
                                <td>{from_to(&e.type_, e.from.clone(), e.to.clone())}</td>
                                <td class="breaks">{e.actor.clone()}</td>
                                <td class="breaks">{e.cause.clone().unwrap_or_default()}</td>
                                <td>{match (e.node_id.clone(), e.node_version) {
                                    (Some(id), Some(v)) => Some(view! {
                                        <A href=format!("/nodes/{id}?version={v}")><span data-testid="log-as-of" title="The node right after this change">{format!("as of v{v}")}</span></A>
                                    }),
                                    _ => None,
                                }}</td>
                            </tr>
                        }
                    />
                </tbody>
            </table>
            <Show when=move || events.with(Vec::is_empty) && !loading.get()>
                <p class="empty" data-testid="event-empty">"No events match."</p>
            </Show>
            <Show when=move || more.get()>
                <button data-testid="event-more" disabled=move || loading.get() on:click=older.clone()>"Older events"</button>
            </Show>
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_many_keys_change_says_how_many_were_set_changed_and_removed() {
        assert_eq!(keys_changed(None, Some("a=1, b=2, c=3")), "labels: 3 set");
        assert_eq!(
            keys_changed(Some("a=1, b=2"), Some("b=3, c=4")),
            "labels: 1 set, 1 changed, 1 removed"
        );
        assert_eq!(keys_changed(Some("a=1"), None), "labels: 1 removed");
    }

    #[test]
    fn every_type_offered_is_one_the_schema_knows() {
        for t in EVENT_TYPES {
            let parsed: event_log::EventType =
                serde_json::from_value(serde_json::Value::String(t.to_owned())).expect("parses");
            assert!(!matches!(parsed, event_log::EventType::Other(_)), "{t}");
        }
        let filter = Filter {
            types: vec!["NODE_CORDONED".to_owned()],
            actors: words("user:ann, controller:health"),
            ..Filter::default()
        };
        let live = filter.live_input().expect("a filter");
        assert_eq!(
            live.actors.as_deref(),
            Some(&["user:ann".to_owned(), "controller:health".to_owned()][..])
        );
        assert_eq!(live.types.map(|t| t.len()), Some(1));
        assert!(Filter::default().input().is_none());
    }

    #[test]
    fn pages_and_live_events_merge_newest_first() {
        let mut known = vec!["evt_9".to_owned(), "evt_5".to_owned()];
        merge(
            &mut known,
            ["evt_12".to_owned(), "evt_5".to_owned(), "evt_3".to_owned()],
            |e| e,
        );
        assert_eq!(known, ["evt_12", "evt_9", "evt_5", "evt_3"]);
    }
}
