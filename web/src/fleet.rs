//! The fleet table: every node with each axis as a column, a filter on each column, sorting,
//! a selection for bulk actions, and virtualised rows so 10,000 nodes scroll like 40.

use std::sync::Arc;

use leptos::prelude::*;
use leptos_router::components::A;

use crate::actions::{ActionDialog, ActionKind, CommandDialog};
use crate::app::ctx;
use crate::model::{Column, FilterKind, Filters, Names, Row, Sort, apply_changes, visible_rows};

/// Every row has this height (CSS `.fleet tr` agrees), which is what lets the table place the
/// window of rows it renders without measuring any of them.
const ROW_HEIGHT_PX: f64 = 30.0;
/// Rows rendered beyond each edge of the viewport, so a fast scroll shows rows, not gaps,
/// before the next window is rendered.
const OVERSCAN_ROWS: usize = 8;
/// Past this many changed rows in one batch (the snapshot arriving, a bulk action), one sort
/// of everything is cheaper than moving each row on its own (a scan of the table each).
const INCREMENTAL_LIMIT: usize = 500;

/// The dialog open on the fleet page, with the rows it acts on as they were when it opened.
#[derive(Clone)]
enum Dialog {
    Action(ActionKind, Vec<Row>),
    Command(Vec<Row>),
}

#[component]
pub fn FleetPage() -> impl IntoView {
    let ctx = ctx();
    let store = ctx.fleet;
    let scroller = NodeRef::<leptos::html::Div>::new();
    let scroll_top = RwSignal::new(0.0_f64);
    let viewport = RwSignal::new(900.0_f64);

    // Filtering and sorting run once per applied batch of changes (or a filter or sort
    // change), never per row rendered. A batch that follows the one already shown, under the
    // same filters, sort and names, moves only the rows it changed (`apply_changes`); anything
    // else recomputes the whole order.
    let visible = RwSignal::new(Arc::new(Vec::<Arc<Row>>::new()));
    let shown = StoredValue::new(None::<(u64, Filters, Sort, Names)>);
    Effect::new(move |_| {
        let revision = store.revision.get();
        let filters = ctx.filters.get();
        let sort = ctx.sort.get();
        let names = ctx.names.get();
        let follows = shown.with_value(|s| {
            s.as_ref().is_some_and(|(r, f, o, n)| {
                *r + 1 == revision && *f == filters && *o == sort && *n == names
            })
        });
        let changed = if follows {
            store.changed_in(revision)
        } else {
            None
        };
        let rows = match changed {
            Some(ids) if ids.len() <= INCREMENTAL_LIMIT => {
                let mut rows = (*visible.get_untracked()).clone();
                store.with_rows(|all| {
                    apply_changes(
                        &mut rows,
                        ids.iter().map(|id| (id.as_str(), all.get(id))),
                        &filters,
                        sort,
                        &names,
                    );
                });
                rows
            }
            _ => store.with_rows(|all| visible_rows(all.values(), &filters, sort, &names)),
        };
        shown.set_value(Some((revision, filters, sort, names)));
        visible.set(Arc::new(rows));
    });
    let total = Memo::new(move |_| {
        store.revision.track();
        store.with_rows(|rows| rows.len())
    });

    let window = Memo::new(move |_| {
        let rows = visible.get();
        let first = ((scroll_top.get() / ROW_HEIGHT_PX) as usize)
            .saturating_sub(OVERSCAN_ROWS)
            .min(rows.len());
        let count = (viewport.get() / ROW_HEIGHT_PX).ceil() as usize + 2 * OVERSCAN_ROWS;
        let last = (first + count).min(rows.len());
        (first, rows.len(), rows[first..last].to_vec())
    });
    let measure = move || {
        if let Some(el) = scroller.get_untracked() {
            viewport.set(f64::from(el.client_height()));
            scroll_top.set(f64::from(el.scroll_top()));
        }
    };
    Effect::new(move |_| {
        if scroller.get().is_some() {
            measure();
        }
    });
    // The listener reads this page's signals: it goes with the page. Left behind, the next
    // resize (a full-page screenshot is one) read a disposed node ref and panicked.
    let resize = window_event_listener(leptos::ev::resize, move |_| measure());
    on_cleanup(move || resize.remove());
    // A filter or sort change shows the top of the new order.
    Effect::new(move |_| {
        ctx.filters.track();
        ctx.sort.track();
        if let Some(el) = scroller.get_untracked() {
            el.set_scroll_top(0);
        }
    });

    let dialog = RwSignal::new(None::<Dialog>);
    let selected_rows = move || -> Vec<Row> {
        let ids = ctx.selection.get_untracked();
        let mut rows: Vec<Row> = ids
            .iter()
            .filter_map(|id| store.row(id))
            .map(|r| (*r).clone())
            .collect();
        rows.sort_by(|a, b| crate::model::natural(&a.hostname, &b.hostname));
        rows
    };
    let close = Callback::new(move |()| dialog.set(None));
    let all_visible_selected = move || {
        let rows = visible.get();
        !rows.is_empty()
            && ctx
                .selection
                .with(|s| rows.iter().all(|r| s.contains(&r.id)))
    };
    let toggle_all = move |ev| {
        let on = event_target_checked(&ev);
        let rows = visible.get_untracked();
        ctx.selection.update(|s| {
            for r in rows.iter() {
                if on {
                    s.insert(r.id.clone());
                } else {
                    s.remove(&r.id);
                }
            }
        });
    };

    view! {
        <section class="fleet-page">
            <div class="toolbar">
                <span data-testid="fleet-count">
                    {move || format!("{} of {} nodes", visible.with(|v| v.len()), total.get())}
                </span>
                <button class="link" data-testid="clear-filters" on:click=move |_| ctx.filters.set(Default::default())>
                    "Clear filters"
                </button>
                <Show when=move || ctx.selection.with(|s| !s.is_empty())>
                    <span class="selection" data-testid="selection-count">
                        {move || format!("{} selected", ctx.selection.with(|s| s.len()))}
                    </span>
                    <Show when=move || ctx.operator.with(|o| o.as_ref().is_some_and(|o| o.can_change()))>
                        {ActionKind::BULK.into_iter().map(|kind| view! {
                            <button
                                data-testid=format!("bulk-{}", kind.key())
                                on:click=move |_| dialog.set(Some(Dialog::Action(kind, selected_rows())))
                            >
                                {kind.title()}
                            </button>
                        }).collect_view()}
                        <button data-testid="bulk-command" on:click=move |_| dialog.set(Some(Dialog::Command(selected_rows())))>
                            "Send command"
                        </button>
                    </Show>
                    <button class="link" on:click=move |_| ctx.selection.update(|s| s.clear())>"Clear selection"</button>
                </Show>
            </div>
            <div
                class="table-scroll"
                node_ref=scroller
                on:scroll=move |_| {
                    if let Some(el) = scroller.get_untracked() {
                        scroll_top.set(f64::from(el.scroll_top()));
                    }
                }
            >
                <table class="fleet" data-testid="fleet-table">
                    <colgroup>
                        <col class="c-select"/>
                        {Column::ALL.into_iter().map(|c| view! { <col class=format!("c-{}", c.key())/> }).collect_view()}
                    </colgroup>
                    <thead>
                        <tr class="titles">
                            <th>
                                <input type="checkbox" data-testid="select-all" title="Select every node the filters show"
                                    prop:checked=all_visible_selected on:change=toggle_all/>
                            </th>
                            {Column::ALL.into_iter().map(|column| view! { <SortHeader column=column/> }).collect_view()}
                        </tr>
                        <tr class="filters">
                            <th></th>
                            {Column::ALL.into_iter().map(|column| view! { <th><ColumnFilter column=column/></th> }).collect_view()}
                        </tr>
                    </thead>
                    <tbody>
                        <tr class="spacer" style:height=move || format!("{}px", window.with(|w| w.0) as f64 * ROW_HEIGHT_PX)></tr>
                        <For
                            each=move || window.get().2
                            // Keyed by node alone: a row that changes keeps its element and
                            // updates its cells, so a click or a checkbox on it is not lost to
                            // a redraw (keyed by version, every change replaced the row, and a
                            // click that straddled one went nowhere).
                            key=|row| row.id.clone()
                            children=move |row| view! { <FleetRow row=row/> }
                        />
                        <tr class="spacer" style:height=move || window.with(|(first, len, shown)| {
                            format!("{}px", (len - first - shown.len()) as f64 * ROW_HEIGHT_PX)
                        })></tr>
                    </tbody>
                </table>
                <Show when=move || total.get() == 0>
                    <p class="empty" data-testid="fleet-empty">
                        {move || match store.state.get() {
                            crate::live::LiveState::Live => "No nodes yet. Nodes appear here as they join.",
                            _ => "Waiting for the live feed…",
                        }}
                    </p>
                </Show>
            </div>
            {move || dialog.get().map(|d| match d {
                Dialog::Action(kind, rows) => view! { <ActionDialog kind=kind targets=rows on_close=close/> }.into_any(),
                Dialog::Command(rows) => view! { <CommandDialog targets=rows on_close=close/> }.into_any(),
            })}
        </section>
    }
}

#[component]
fn SortHeader(column: Column) -> impl IntoView {
    let ctx = ctx();
    let arrow = move || {
        let sort = ctx.sort.get();
        match (sort.column == column, sort.descending) {
            (false, _) => "",
            (true, false) => " ▲",
            (true, true) => " ▼",
        }
    };
    view! {
        <th
            class="sortable"
            data-testid=format!("sort-{}", column.key())
            aria-sort=move || {
                let sort = ctx.sort.get();
                match (sort.column == column, sort.descending) {
                    (false, _) => "none",
                    (true, false) => "ascending",
                    (true, true) => "descending",
                }
            }
            on:click=move |_| ctx.sort.update(|s| *s = s.toggled(column))
        >
            {column.title()}{arrow}
        </th>
    }
}

/// The filter control of one column, by the kind of filter it takes.
#[component]
fn ColumnFilter(column: Column) -> impl IntoView {
    let ctx = ctx();
    let value = move || {
        ctx.filters
            .with(|f| f.get(&column).cloned().unwrap_or_default())
    };
    let set = move |v: String| {
        ctx.filters.update(|f| {
            if v.is_empty() {
                f.remove(&column);
            } else {
                f.insert(column, v);
            }
        });
    };
    let testid = format!("filter-{}", column.key());
    let options = move |choices: Vec<(String, String)>| {
        view! {
            <select data-testid=testid.clone() prop:value=value on:change=move |ev| set(event_target_value(&ev))>
                <option value="">"any"</option>
                {choices.into_iter().map(|(v, label)| view! { <option value=v>{label}</option> }).collect_view()}
            </select>
        }
        .into_any()
    };
    match column.filter_kind() {
        FilterKind::Text => view! {
            <input type="search" placeholder="filter" data-testid=format!("filter-{}", column.key())
                prop:value=value on:input=move |ev| set(event_target_value(&ev))/>
        }
        .into_any(),
        FilterKind::AtLeast => view! {
            <input type="number" min="0" placeholder="≥" data-testid=format!("filter-{}", column.key())
                prop:value=value on:input=move |ev| set(event_target_value(&ev))/>
        }
        .into_any(),
        FilterKind::Choice(choices) => {
            options(choices.iter().map(|c| ((*c).to_owned(), (*c).to_owned())).collect())
        }
        FilterKind::Flag => options(vec![
            ("yes".to_owned(), "yes".to_owned()),
            ("no".to_owned(), "no".to_owned()),
        ]),
        FilterKind::CatalogId => {
            // The catalog may load after the table: the choices follow it.
            let choices = move || match column {
                Column::Site => ctx.sites.get(),
                _ => ctx
                    .pools
                    .get()
                    .into_iter()
                    .map(|p| (p.id, p.name))
                    .collect(),
            };
            let testid = format!("filter-{}", column.key());
            view! {
                <select data-testid=testid prop:value=value on:change=move |ev| set(event_target_value(&ev))>
                    <option value="">"any"</option>
                    {move || choices().into_iter().map(|(v, label)| view! { <option value=v>{label}</option> }).collect_view()}
                </select>
            }
            .into_any()
        }
    }
}

#[component]
fn FleetRow(row: Arc<Row>) -> impl IntoView {
    let ctx = ctx();
    let id = row.id.clone();
    // The node as the store has it now; the row rendered first stands in only until then.
    let current = {
        let id = id.clone();
        Memo::new(move |_| {
            ctx.fleet.revision.track();
            ctx.fleet.row(&id).unwrap_or_else(|| row.clone())
        })
    };
    let checked = {
        let id = id.clone();
        move || ctx.selection.with(|s| s.contains(&id))
    };
    let toggle = {
        let id = id.clone();
        move |ev| {
            let on = event_target_checked(&ev);
            ctx.selection.update(|s| {
                if on {
                    s.insert(id.clone());
                } else {
                    s.remove(&id);
                }
            });
        }
    };
    let cells = Column::ALL
        .into_iter()
        .skip(1)
        .map(|column| {
            let class = move || current.with(|row| cell_class(column, row));
            // Site and pool names follow the catalog, which may arrive after the rows.
            let text = move || current.with(|row| ctx.names.with(|names| column.text(row, names)));
            view! { <td class=class data-col=column.key()>{text}</td> }
        })
        .collect_view();
    let hostname = move || current.with(|row| row.hostname.clone());
    let version = move || current.with(|row| row.version.to_string());
    view! {
        <tr data-testid="fleet-row" data-node=id.clone() data-version=version>
            <td><input type="checkbox" prop:checked=checked on:change=toggle aria-label="select"/></td>
            <td data-col="hostname"><A href=format!("/nodes/{id}")>{hostname}</A></td>
            {cells}
        </tr>
    }
}

/// Colour hints for states an operator scans for.
fn cell_class(column: Column, row: &Row) -> &'static str {
    match column {
        Column::Connectivity if row.connectivity != "connected" => "bad",
        Column::Schedulable if row.schedulable => "good",
        Column::Schedulable => "bad",
        Column::ProvisionState if row.provision_state == "failed" => "bad",
        Column::Cordoned | Column::Maintenance
            if column.text(row, &Default::default()) == "yes" =>
        {
            "warn"
        }
        Column::Conditions if !row.conditions.is_empty() => "warn",
        _ => "",
    }
}
