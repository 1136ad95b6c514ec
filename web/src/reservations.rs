//! Reservations: the list with its filters and live state, the create form, a reservation's
//! own page, and releasing one at the version the operator saw (a `CONFLICT` shows what moved
//! and offers a retry at the current version).

use std::time::Duration;

use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use crate::app::ctx;
use crate::format::since;
use crate::gql::{
    self, ApiError, CreateReservation, ReleaseReservation, ReservationById, ReservationUpdatesLive,
    Reservations, Tenants, create_reservation, release_reservation, reservation_by_id,
    reservation_updates_live, reservations, tenants,
};
use crate::live::{LiveState, follow};
use crate::model::{FactChange, Names};
use crate::placement::{
    EXPIRY_UNITS, ListFilter, POLICIES, Reservation, ReservationForm, STATES, apply_update,
    reservation_changes, state_text,
};
use crate::refresh::Refresher;
use crate::store::FleetStore;

/// Reservations read per page (and per "More").
const PAGE_SIZE: i64 = 100;
/// The most a reread asks for at once, so that pages the operator loaded stay after a
/// reread: 500 reservations with their allocations stay within the server's query
/// complexity bound (20,000; a reservation costs about 30).
const MAX_REREAD: i64 = 500;
/// The least time between two rereads of the list. Live updates apply at once; the reread
/// that follows them fixes the count and the membership of the page, and a burst of updates
/// (a gang of 64 nodes books 64 allocations) costs one.
const REREAD_GAP: Duration = Duration::from_secs(1);

/// Tenant names by id, for the tables and the create form. A principal that may not list
/// tenants sees ids.
async fn load_tenants() -> Names {
    let mut names = Vec::new();
    let mut after = None;
    loop {
        match gql::run::<Tenants>(tenants::Variables { after }).await {
            Ok(data) => {
                names.extend(data.tenants.nodes.into_iter().map(|t| (t.id, t.name)));
                if !data.tenants.page_info.has_next_page {
                    break;
                }
                after = data.tenants.page_info.end_cursor;
            }
            Err(err) => {
                leptos::logging::warn!("loading tenants failed: {err}");
                break;
            }
        }
    }
    Names(names.into_iter().collect())
}

/// A node's hostname from the live fleet, or its id while the fleet does not know it. The
/// store is passed, not taken from the context: tasks (a release's answer) run without one.
fn hostname(fleet: FleetStore, id: &str) -> String {
    fleet
        .row(id)
        .map_or_else(|| id.to_owned(), |r| r.hostname.clone())
}

fn list_variables(
    filter: &ListFilter,
    first: i64,
    after: Option<String>,
) -> reservations::Variables {
    let some = |v: &str| (!v.is_empty()).then(|| v.to_owned());
    reservations::Variables {
        filter: Some(reservations::ReservationFilterInput {
            pool_ids: some(&filter.pool).map(|p| vec![p]),
            states: some(&filter.state).map(|s| {
                vec![match s.as_str() {
                    "PENDING" => reservations::ReservationState::PENDING,
                    "PLACED" => reservations::ReservationState::PLACED,
                    "RELEASED" => reservations::ReservationState::RELEASED,
                    _ => reservations::ReservationState::FAILED,
                }]
            }),
        }),
        first: Some(first),
        after,
    }
}

/// The reservations page: the list, newest first, with filters; live; create and release.
#[component]
pub fn ReservationsPage() -> impl IntoView {
    let ctx = ctx();
    let filter = RwSignal::new(ListFilter::default());
    let list = RwSignal::new(Vec::<Reservation>::new());
    let total = RwSignal::new(None::<u64>);
    let next_page = RwSignal::new(None::<String>);
    let problem = RwSignal::new(None::<ApiError>);
    let loaded = RwSignal::new(false);
    let tenant_names = RwSignal::new(Names::default());
    let live = RwSignal::new(LiveState::Connecting);
    leptos::task::spawn_local(async move { tenant_names.set(load_tenants().await) });

    // Rereads what is shown (at least the first page), keeping any newer version a live
    // update brought meanwhile.
    let reread = Refresher::new(REREAD_GAP, move || async move {
        let asked = filter.get_untracked();
        let first = (list.with_untracked(Vec::len) as i64).clamp(PAGE_SIZE, MAX_REREAD);
        let result = gql::run::<Reservations>(list_variables(&asked, first, None)).await;
        if filter.get_untracked() != asked {
            return; // The filter changed meanwhile; the reread it triggered follows.
        }
        match result {
            Ok(data) => {
                let page = data.reservations;
                let fresh: Vec<Reservation> =
                    page.nodes.iter().filter_map(Reservation::of).collect();
                list.update(|shown| {
                    let merged = fresh
                        .into_iter()
                        .map(|r| match shown.iter().find(|s| s.id == r.id) {
                            Some(s) if s.version > r.version => s.clone(),
                            _ => r,
                        })
                        .collect();
                    *shown = merged;
                });
                total.set(Some(u64::try_from(page.total_count).unwrap_or(0)));
                next_page.set(
                    page.page_info
                        .has_next_page
                        .then_some(page.page_info.end_cursor)
                        .flatten(),
                );
                problem.set(None);
            }
            Err(err) => problem.set(Some(err)),
        }
        loaded.set(true);
    });
    Effect::new(move |_| {
        filter.track();
        list.set(Vec::new());
        reread.trigger();
    });
    let on_update = move |r: Reservation| {
        list.maybe_update(|l| apply_update(l, r, &filter.get_untracked()));
        reread.trigger();
    };
    let feed = follow::<ReservationUpdatesLive>(
        |after| reservation_updates_live::Variables {
            after,
            pool_id: None,
            reservation_id: None,
        },
        |d| Some(d.reservation_updates.cursor.clone()),
        move |d| {
            if let Some(r) = Reservation::of(&d.reservation_updates.reservation) {
                on_update(r);
            }
        },
        live,
    );
    on_cleanup(move || feed.stop());
    // The feed starts from the moment it connects: what changed between the first read and
    // then (or while it was reconnecting) is read again.
    Effect::new(move |_| {
        if live.get() == LiveState::Live {
            reread.trigger();
        }
    });

    let load_more = move |_| {
        let Some(after) = next_page.get_untracked() else {
            return;
        };
        let asked = filter.get_untracked();
        leptos::task::spawn_local(async move {
            match gql::run::<Reservations>(list_variables(&asked, PAGE_SIZE, Some(after))).await {
                Ok(data) if filter.get_untracked() == asked => {
                    let page = data.reservations;
                    list.update(|l| {
                        for r in page.nodes.iter().filter_map(Reservation::of) {
                            apply_update(l, r, &asked);
                        }
                    });
                    next_page.set(
                        page.page_info
                            .has_next_page
                            .then_some(page.page_info.end_cursor)
                            .flatten(),
                    );
                }
                Ok(_) => {}
                Err(err) => problem.set(Some(err)),
            }
        });
    };

    let can_change = move || {
        ctx.operator
            .with(|o| o.as_ref().is_some_and(|o| o.can_change()))
    };
    let creating = RwSignal::new(false);
    let releasing = RwSignal::new(None::<Reservation>);
    let count_text = move || {
        let shown = list.with(Vec::len);
        match total.get() {
            Some(t) => format!("{shown} of {t} reservations"),
            None => String::new(),
        }
    };

    view! {
        <section class="reservations-page" data-testid="reservations">
            <div class="page-head">
                <h1>"Reservations"</h1>
                <span class=move || format!("live-state {}", if live.get() == LiveState::Live { "live" } else { "connecting" })
                    data-testid="reservations-live">
                    {move || if live.get() == LiveState::Live { "live" } else { "connecting…" }}
                </span>
            </div>
            <div class="toolbar">
                <label>"Pool "
                    <select data-testid="filter-reservation-pool" on:change=move |ev| {
                        let v = event_target_value(&ev);
                        filter.update(|f| f.pool = v);
                    }>
                        <option value="" selected=move || filter.with(|f| f.pool.is_empty())>"any"</option>
                        {move || ctx.pools.get().into_iter().map(|p| {
                            let id = p.id.clone();
                            view! { <option value=p.id.clone() selected=move || filter.with(|f| f.pool == id)>{p.name}</option> }
                        }).collect_view()}
                    </select>
                </label>
                <label>"State "
                    <select data-testid="filter-reservation-state" on:change=move |ev| {
                        let v = event_target_value(&ev);
                        filter.update(|f| f.state = v);
                    }>
                        <option value="">"any"</option>
                        {STATES.iter().map(|s| view! {
                            <option value=*s selected=move || filter.with(|f| f.state == *s)>{state_text(s)}</option>
                        }).collect_view()}
                    </select>
                </label>
                <span class="muted" data-testid="reservations-count">{count_text}</span>
                <Show when=can_change>
                    <button data-testid="reservation-new" on:click=move |_| creating.set(true)>"New reservation"</button>
                </Show>
            </div>
            <Show when=move || problem.with(Option::is_some)>
                <p class="error" data-testid="reservations-error">{move || problem.get().map(|e| e.to_string()).unwrap_or_default()}</p>
            </Show>
            <div class="card">
                <table class="reservations">
                    <thead>
                        <tr>
                            <th>"Id"</th><th>"Tenant"</th><th>"Pool"</th><th>"Shape"</th><th>"Policy"</th>
                            <th>"State"</th><th>"Reason"</th><th>"Nodes"</th><th>"Created"</th><th></th>
                        </tr>
                    </thead>
                    <tbody>
                        <For
                            each=move || list.get()
                            // Keyed by reservation alone, like the fleet table: a row that
                            // changes keeps its element and updates its cells, so a click on
                            // its Release button is not lost to a redraw.
                            key=|r| r.id.clone()
                            children=move |r| view! {
                                <ReservationRow
                                    reservation=r
                                    list=list
                                    tenants=tenant_names
                                    can_change=Signal::derive(can_change)
                                    on_release=Callback::new(move |r| releasing.set(Some(r)))
                                />
                            }
                        />
                    </tbody>
                </table>
                <Show when=move || loaded.get() && list.with(Vec::is_empty)>
                    <p class="empty" data-testid="reservations-empty">"No reservations match."</p>
                </Show>
                <Show when=move || next_page.with(Option::is_some)>
                    <button data-testid="reservations-more" on:click=load_more>"More"</button>
                </Show>
            </div>
            {move || creating.get().then(|| view! {
                <CreateDialog
                    tenants=tenant_names
                    on_created=Callback::new(on_update)
                    on_close=Callback::new(move |()| creating.set(false))
                />
            })}
            {move || releasing.get().map(|r| view! {
                <ReleaseDialog
                    reservation=r
                    on_released=Callback::new(on_update)
                    on_close=Callback::new(move |()| releasing.set(None))
                />
            })}
        </section>
    }
}

#[component]
fn ReservationRow(
    /// The reservation as the row was first rendered.
    reservation: Reservation,
    /// The list the row shows a reservation of: the row reads its reservation from it, so
    /// each cell follows that reservation's changes.
    list: RwSignal<Vec<Reservation>>,
    tenants: RwSignal<Names>,
    can_change: Signal<bool>,
    on_release: Callback<Reservation>,
) -> impl IntoView {
    let ctx = ctx();
    let id = reservation.id.clone();
    // The reservation as the list has it now; once it has left the list (and until the row
    // is removed), the last one shown.
    let current = {
        let id = id.clone();
        Memo::new(move |previous: Option<&Reservation>| {
            list.with(|l| l.iter().find(|r| r.id == id).cloned())
                .or_else(|| previous.cloned())
                .unwrap_or_else(|| reservation.clone())
        })
    };
    let tenant = move || {
        let tenant = current.with(|r| r.tenant_id.clone());
        tenants.with(|t| t.name(&tenant).to_owned())
    };
    let pool = move || {
        let pool = current.with(|r| r.pool_id.clone());
        ctx.names.with(|n| n.name(&pool).to_owned())
    };
    let link = format!("/reservations/{id}");
    let id_text = id.clone();
    view! {
        <tr data-testid="reservation-row" data-reservation=id
            data-state=move || current.with(|r| r.state.clone())
            data-version=move || current.with(|r| r.version)>
            <td data-col="id"><A href=link><code>{id_text}</code></A></td>
            <td data-col="tenant" class="nowrap">{tenant}</td>
            <td data-col="pool" class="nowrap">{pool}</td>
            <td data-col="shape" class="nowrap">{move || current.with(Reservation::shape)}</td>
            <td data-col="policy" class="nowrap">{move || current.with(|r| state_text(&r.policy))}</td>
            <td data-col="state" class=move || current.with(|r| format!("state {}", r.state.to_ascii_lowercase()))>
                {move || current.with(|r| state_text(&r.state))}
            </td>
            <td data-col="reason" class="reason">{move || current.with(|r| r.reason.clone().unwrap_or_default())}</td>
            <td data-col="nodes">
                {move || {
                    ctx.fleet.revision.track();
                    current.with(|r| {
                        r.active_nodes().into_iter().map(|id| {
                            let link = format!("/nodes/{id}");
                            let host = hostname(ctx.fleet, id);
                            view! { <A href=link>{host}</A>" " }
                        }).collect_view()
                    })
                }}
            </td>
            <td data-col="created" class="nowrap">{move || current.with(|r| since(&r.created_at))}</td>
            <td>
                // `Show` memoizes its condition: the button is replaced only when it appears
                // or goes, not on every change of the reservation.
                <Show when=move || can_change.get() && current.with(Reservation::is_live)>
                    <button data-testid="reservation-release"
                        on:click=move |_| on_release.run(current.get_untracked())>"Release"</button>
                </Show>
            </td>
        </tr>
    }
}

/// A random key for one create form: a retried submit of it returns the first reservation.
fn new_idempotency_key() -> String {
    let part = || {
        format!(
            "{:08x}",
            (js_sys::Math::random() * f64::from(u32::MAX)) as u32
        )
    };
    format!("web-{}{}", part(), part())
}

/// The create form. `on_created` gets the reservation the server answered (PLACED if it fit,
/// else PENDING with the reason); the dialog then says which.
#[component]
fn CreateDialog(
    tenants: RwSignal<Names>,
    on_created: Callback<Reservation>,
    on_close: Callback<()>,
) -> impl IntoView {
    let ctx = ctx();
    let needs_tenant = ctx
        .operator
        .with_untracked(|o| o.as_ref().is_some_and(|o| o.tenant.is_none()));
    let form = RwSignal::new(ReservationForm {
        idempotency_key: new_idempotency_key(),
        ..ReservationForm::default()
    });
    let problem = RwSignal::new(None::<String>);
    let running = RwSignal::new(false);
    let created = RwSignal::new(None::<Reservation>);
    // The GPU models schedulable nodes report, offered as suggestions.
    let models = RwSignal::new(Vec::<String>::new());
    leptos::task::spawn_local(async move {
        if let Ok(pools) = crate::capacity::every_pool().await {
            let mut all: Vec<String> = pools
                .into_iter()
                .flat_map(|p| p.schedulable_by_model.into_iter().map(|m| m.model))
                .collect();
            all.sort();
            all.dedup();
            models.set(all);
        }
    });

    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let input = match form.get_untracked().check(needs_tenant, chrono::Utc::now()) {
            Ok(input) => input,
            Err(why) => {
                problem.set(Some(why));
                return;
            }
        };
        problem.set(None);
        running.set(true);
        leptos::task::spawn_local(async move {
            let result =
                gql::run::<CreateReservation>(create_reservation::Variables { input }).await;
            match result {
                Ok(data) => {
                    if let Some(r) = Reservation::of(&data.create_reservation.reservation) {
                        on_created.run(r.clone());
                        created.set(Some(r));
                    }
                }
                Err(err) => problem.set(Some(err.to_string())),
            }
            running.set(false);
        });
    };
    let text = move |get: fn(&ReservationForm) -> String, set: fn(&mut ReservationForm, String)| {
        (
            move || form.with(get),
            move |ev| form.update(|f| set(f, event_target_value(&ev))),
        )
    };
    let (gpus, on_gpus) = text(|f| f.gpus_per_node.clone(), |f, v| f.gpus_per_node = v);
    let (nodes, on_nodes) = text(|f| f.node_count.clone(), |f, v| f.node_count = v);
    let (model, on_model) = text(|f| f.gpu_model.clone(), |f, v| f.gpu_model = v);
    let (tolerations, on_tolerations) = text(|f| f.tolerations.clone(), |f, v| f.tolerations = v);
    let (selector, on_selector) = text(|f| f.selector.clone(), |f, v| f.selector = v);
    let (expires, on_expires) = text(|f| f.expires_in.clone(), |f, v| f.expires_in = v);

    view! {
        <div class="modal" on:click=move |_| on_close.run(())>
            <div class="dialog" role="dialog" data-testid="reservation-dialog" on:click=|ev| ev.stop_propagation()>
                <h2>"New reservation"</h2>
                {move || match created.get() {
                    Some(r) => {
                        let outcome = if r.state == "PLACED" {
                            let hosts: Vec<String> = r.active_nodes().into_iter().map(|id| hostname(ctx.fleet, id)).collect();
                            format!("{} is placed on {}.", r.id, hosts.join(", "))
                        } else {
                            format!("{} is {}: {}", r.id, state_text(&r.state), r.reason.clone().unwrap_or_default())
                        };
                        view! {
                            <p data-testid="reservation-created" data-reservation=r.id.clone() data-state=r.state.clone()>{outcome}</p>
                            <div class="buttons"><button type="button" on:click=move |_| on_close.run(())>"Close"</button></div>
                        }.into_any()
                    }
                    None => view! {
                        <form on:submit=submit>
                            {needs_tenant.then(|| view! {
                                <label>"Tenant"
                                    <select data-testid="reservation-tenant" required on:change=move |ev| {
                                        let v = event_target_value(&ev);
                                        form.update(|f| f.tenant = v);
                                    }>
                                        <option value="">"Choose…"</option>
                                        {move || {
                                            let mut all: Vec<(String, String)> = tenants.get().0.into_iter().collect();
                                            all.sort_by(|a, b| a.1.cmp(&b.1));
                                            all.into_iter().map(|(id, name)| {
                                                let chosen = id.clone();
                                                view! { <option value=id selected=move || form.with(|f| f.tenant == chosen)>{name}</option> }
                                            }).collect_view()
                                        }}
                                    </select>
                                </label>
                            })}
                            <label>"Pool"
                                <select data-testid="reservation-pool" required on:change=move |ev| {
                                    let v = event_target_value(&ev);
                                    form.update(|f| f.pool = v);
                                }>
                                    <option value="">"Choose…"</option>
                                    {move || ctx.pools.get().into_iter().map(|p| {
                                        let chosen = p.id.clone();
                                        view! { <option value=p.id.clone() selected=move || form.with(|f| f.pool == chosen)>{p.name}</option> }
                                    }).collect_view()}
                                </select>
                            </label>
                            <div class="form-row">
                                <label>"GPUs per node"
                                    <input type="number" min="1" max="64" data-testid="reservation-gpus" prop:value=gpus on:input=on_gpus/>
                                </label>
                                <label>"Nodes"
                                    <input type="number" min="1" max="1024" data-testid="reservation-nodes" prop:value=nodes on:input=on_nodes/>
                                </label>
                                <label>"Policy"
                                    <select data-testid="reservation-policy" on:change=move |ev| {
                                        let v = event_target_value(&ev).parse().unwrap_or(0);
                                        form.update(|f| f.policy = v);
                                    }>
                                        {POLICIES.iter().enumerate().map(|(i, (_, text))| view! {
                                            <option value=i.to_string() selected=move || form.with(|f| f.policy == i)>{*text}</option>
                                        }).collect_view()}
                                    </select>
                                </label>
                            </div>
                            <label>"GPU model (optional: any)"
                                <input list="gpu-models" data-testid="reservation-model" prop:value=model on:input=on_model/>
                                <datalist id="gpu-models">
                                    {move || models.get().into_iter().map(|m| view! { <option value=m/> }).collect_view()}
                                </datalist>
                            </label>
                            <label>"Tolerated taints (keys, comma separated)"
                                <input data-testid="reservation-tolerations" prop:value=tolerations on:input=on_tolerations/>
                            </label>
                            <label>"Node labels required (key or key=value, comma separated)"
                                <input data-testid="reservation-selector" prop:value=selector on:input=on_selector/>
                            </label>
                            <div class="form-row">
                                <label>"Expires in (optional: never)"
                                    <input type="number" min="1" data-testid="reservation-expires" prop:value=expires on:input=on_expires/>
                                </label>
                                <label>"Unit"
                                    <select data-testid="reservation-expires-unit" on:change=move |ev| {
                                        let v = event_target_value(&ev).parse().unwrap_or(1);
                                        form.update(|f| f.expires_unit = v);
                                    }>
                                        {EXPIRY_UNITS.iter().enumerate().map(|(i, (unit, _))| view! {
                                            <option value=i.to_string() selected=move || form.with(|f| f.expires_unit == i)>{*unit}</option>
                                        }).collect_view()}
                                    </select>
                                </label>
                            </div>
                            <Show when=move || problem.with(Option::is_some)>
                                <p class="error" data-testid="reservation-error">{move || problem.get().unwrap_or_default()}</p>
                            </Show>
                            <div class="buttons">
                                <button type="button" on:click=move |_| on_close.run(())>"Close"</button>
                                <button type="submit" data-testid="reservation-create" disabled=move || running.get()>
                                    {move || if running.get() { "Working…" } else { "Create" }}
                                </button>
                            </div>
                        </form>
                    }.into_any(),
                }}
            </div>
        </div>
    }
}

/// How a release went.
#[derive(Clone, Debug, PartialEq)]
enum Released {
    Done(Reservation),
    /// It moved since the operator saw it: as it is now, and what differs.
    Conflict(Reservation, Vec<FactChange>),
    Failed(String),
}

/// Releases one reservation at the version the operator saw when the dialog opened.
#[component]
pub fn ReleaseDialog(
    reservation: Reservation,
    on_released: Callback<Reservation>,
    on_close: Callback<()>,
) -> impl IntoView {
    let ctx = ctx();
    let fleet = ctx.fleet;
    // What the operator saw; a retry after a conflict moves it to what is stored now.
    let seen = RwSignal::new(reservation);
    let outcome = RwSignal::new(None::<Released>);
    let running = RwSignal::new(false);
    let release = move || {
        let r = seen.get_untracked();
        running.set(true);
        leptos::task::spawn_local(async move {
            let input = release_reservation::ReleaseReservationInput {
                id: r.id.clone(),
                version: r.version,
            };
            let result =
                gql::run::<ReleaseReservation>(release_reservation::Variables { input }).await;
            let done = match result {
                Ok(data) => match Reservation::of(&data.release_reservation.reservation) {
                    Some(now) => {
                        on_released.run(now.clone());
                        Released::Done(now)
                    }
                    None => Released::Failed("the answer did not read as a reservation".into()),
                },
                Err(err) if err.is_conflict() => {
                    match gql::run::<ReservationById>(reservation_by_id::Variables {
                        id: r.id.clone(),
                    })
                    .await
                    .ok()
                    .and_then(|d| Reservation::of(&d.reservation))
                    {
                        Some(now) => {
                            let changes = reservation_changes(&r, &now, |id| hostname(fleet, id));
                            on_released.run(now.clone());
                            Released::Conflict(now, changes)
                        }
                        None => Released::Failed(err.to_string()),
                    }
                }
                Err(err) => Released::Failed(err.to_string()),
            };
            outcome.set(Some(done));
            running.set(false);
        });
    };
    let heading = move || format!("Release {}", seen.with(|r| r.id.clone()));
    let summary = move || {
        seen.with(|r| {
            let pool = ctx.names.with(|n| n.name(&r.pool_id).to_owned());
            format!(
                "{} in {pool}, {} (version {}).",
                r.shape(),
                state_text(&r.state),
                r.version
            )
        })
    };
    view! {
        <div class="modal" on:click=move |_| on_close.run(())>
            <div class="dialog" role="dialog" data-testid="release-dialog" on:click=|ev| ev.stop_propagation()>
                <h2>{heading}</h2>
                {move || match outcome.get() {
                    None => view! {
                        <p>{summary}</p>
                        <p class="warning">"Its GPUs are free at once, and the work on them loses its booking."</p>
                        <div class="buttons">
                            <button type="button" on:click=move |_| on_close.run(())>"Close"</button>
                            <button type="button" class="danger" data-testid="release-confirm" disabled=move || running.get() on:click=move |_| release()>
                                {move || if running.get() { "Working…".to_owned() } else { heading() }}
                            </button>
                        </div>
                    }.into_any(),
                    Some(Released::Done(now)) => view! {
                        <p data-testid="release-outcome">{format!("{} is {}.", now.id, state_text(&now.state))}</p>
                        <div class="buttons"><button type="button" on:click=move |_| on_close.run(())>"Close"</button></div>
                    }.into_any(),
                    Some(Released::Conflict(now, changes)) => {
                        let live = now.is_live();
                        let versions = format!("version {} → {}", seen.with_untracked(|r| r.version), now.version);
                        view! {
                            <div class="conflict" data-testid="release-conflict">
                                <strong>"Changed since you looked"</strong>" "<span class="muted">{versions}</span>
                                <ul>
                                    {changes.into_iter().map(|c| view! {
                                        <li data-testid="conflict-change">{format!("{}: {} → {}", c.fact, blank(&c.before), blank(&c.after))}</li>
                                    }).collect_view()}
                                </ul>
                            </div>
                            <div class="buttons">
                                <button type="button" on:click=move |_| on_close.run(())>"Close"</button>
                                {live.then(|| {
                                    let version = now.version;
                                    view! {
                                        <button type="button" class="danger" data-testid="release-retry" on:click=move |_| {
                                            seen.set(now.clone());
                                            outcome.set(None);
                                            release();
                                        }>{format!("Release at version {version}")}</button>
                                    }
                                })}
                            </div>
                        }.into_any()
                    }
                    Some(Released::Failed(why)) => view! {
                        <p class="error" data-testid="release-error">{why}</p>
                        <div class="buttons"><button type="button" on:click=move |_| on_close.run(())>"Close"</button></div>
                    }.into_any(),
                }}
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

/// One reservation's page: what it asks for, its state and reason, its allocations (active
/// and ended), live; release.
#[component]
pub fn ReservationPage() -> impl IntoView {
    let params = use_params_map();
    let id = move || params.with(|p| p.get("id").unwrap_or_default());
    // A new view per id: its feed ends with it.
    move || view! { <ReservationView id=id()/> }
}

#[component]
fn ReservationView(id: String) -> impl IntoView {
    let ctx = ctx();
    let shown = RwSignal::new(None::<Result<Reservation, ApiError>>);
    let live = RwSignal::new(LiveState::Connecting);
    let tenant_names = RwSignal::new(Names::default());
    leptos::task::spawn_local(async move { tenant_names.set(load_tenants().await) });
    let apply = move |r: Reservation| {
        shown.maybe_update(|s| match s {
            Some(Ok(old)) if old.version > r.version || *old == r => false,
            _ => {
                *s = Some(Ok(r));
                true
            }
        });
    };
    let reread = {
        let id = id.clone();
        Refresher::new(REREAD_GAP, move || {
            let id = id.clone();
            async move {
                match gql::run::<ReservationById>(reservation_by_id::Variables { id }).await {
                    Ok(d) => {
                        if let Some(r) = Reservation::of(&d.reservation) {
                            apply(r);
                        }
                    }
                    Err(err) => shown.set(Some(Err(err))),
                }
            }
        })
    };
    let feed = {
        let id = id.clone();
        follow::<ReservationUpdatesLive>(
            move |after| reservation_updates_live::Variables {
                after,
                pool_id: None,
                reservation_id: Some(id.clone()),
            },
            |d| Some(d.reservation_updates.cursor.clone()),
            move |d| {
                if let Some(r) = Reservation::of(&d.reservation_updates.reservation) {
                    apply(r);
                }
            },
            live,
        )
    };
    on_cleanup(move || feed.stop());
    Effect::new(move |_| {
        if live.get() == LiveState::Live {
            reread.trigger();
        }
    });
    reread.trigger();

    let can_change = move || {
        ctx.operator
            .with(|o| o.as_ref().is_some_and(|o| o.can_change()))
    };
    let releasing = RwSignal::new(None::<Reservation>);

    view! {
        <section class="reservation-page">
            {move || match shown.get() {
                None => view! { <p class="loading">"Loading…"</p> }.into_any(),
                Some(Err(err)) => view! { <p class="error" data-testid="reservation-page-error">{err.to_string()}</p> }.into_any(),
                Some(Ok(r)) => {
                    let pool = ctx.names.with(|n| n.name(&r.pool_id).to_owned());
                    let tenant = tenant_names.with(|n| n.name(&r.tenant_id).to_owned());
                    let releasable = can_change() && r.is_live();
                    let for_release = r.clone();
                    let selector = r.selector.iter().map(|s| match &s.value {
                        Some(v) => format!("{}={v}", s.key),
                        None => s.key.clone(),
                    }).collect::<Vec<_>>().join(", ");
                    let facts: Vec<(&'static str, String)> = vec![
                        ("Tenant", tenant),
                        ("Pool", pool),
                        ("Shape", r.shape()),
                        ("Policy", state_text(&r.policy)),
                        ("Node labels", if selector.is_empty() { "any".to_owned() } else { selector }),
                        ("Tolerates", if r.tolerations.is_empty() { "no taints".to_owned() } else { r.tolerations.join(", ") }),
                        ("Expires", r.expires_at.as_deref().map_or_else(|| "never".to_owned(), crate::format::timestamp)),
                        ("Idempotency key", r.idempotency_key.clone().unwrap_or_default()),
                        ("Created", format!("{} by {}", since(&r.created_at), r.created_by)),
                        ("Updated", since(&r.updated_at)),
                    ];
                    view! {
                        <div class="node-head">
                            <h1 data-testid="reservation-id">{r.id.clone()}</h1>
                            <span class=format!("state {}", r.state.to_ascii_lowercase()) data-testid="reservation-state">{state_text(&r.state)}</span>
                            <span class="muted" data-testid="reservation-version">{format!("version {}", r.version)}</span>
                            <span class=move || format!("live-state {}", if live.get() == LiveState::Live { "live" } else { "connecting" })>
                                {move || if live.get() == LiveState::Live { "live" } else { "connecting…" }}
                            </span>
                        </div>
                        {releasable.then(|| view! {
                            <div class="actions">
                                <button data-testid="reservation-release" on:click=move |_| releasing.set(Some(for_release.clone()))>"Release"</button>
                            </div>
                        })}
                        {r.reason.clone().map(|why| view! { <p class="warning" data-testid="reservation-reason">{why}</p> })}
                        <div class="cards">
                            <div class="card" data-testid="reservation-request">
                                <h2>"Request"</h2>
                                <dl>
                                    {facts.into_iter().map(|(k, v)| view! { <dt>{k}</dt><dd data-fact=k>{v}</dd> }).collect_view()}
                                </dl>
                            </div>
                        </div>
                        <section class="card wide" data-testid="reservation-allocations">
                            <h2>{format!("Allocations ({} active)", r.active_nodes().len())}</h2>
                            {if r.allocations.is_empty() {
                                view! { <p class="muted">"None yet."</p> }.into_any()
                            } else {
                                view! {
                                    <table>
                                        <thead><tr><th>"Node"</th><th>"Atoms"</th><th>"Booked"</th><th>"Ended"</th><th>"Why"</th></tr></thead>
                                        <tbody>
                                            {r.allocations.iter().map(|a| {
                                                let node = a.node_id.clone();
                                                let link = format!("/nodes/{}", a.node_id);
                                                view! {
                                                    <tr data-testid="reservation-allocation" data-node=a.node_id.clone() data-active=a.active.to_string()>
                                                        <td><A href=link>{move || { ctx.fleet.revision.track(); hostname(ctx.fleet, &node) }}</A></td>
                                                        <td><code>{a.atoms.join(" ")}</code></td>
                                                        <td class="nowrap">{since(&a.booked_at)}</td>
                                                        <td class="nowrap">{a.released_at.as_deref().map(since).unwrap_or_else(|| "active".to_owned())}</td>
                                                        <td>{a.release_reason.clone().unwrap_or_default()}</td>
                                                    </tr>
                                                }
                                            }).collect_view()}
                                        </tbody>
                                    </table>
                                }.into_any()
                            }}
                        </section>
                    }.into_any()
                }
            }}
            {move || releasing.get().map(|r| view! {
                <ReleaseDialog
                    reservation=r
                    on_released=Callback::new(apply)
                    on_close=Callback::new(move |()| releasing.set(None))
                />
            })}
            <p><A href="/reservations">"All reservations"</A></p>
        </section>
    }
}
