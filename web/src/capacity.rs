//! Capacity of each pool by bucket (the bucket of a node is that of its first failing
//! schedulability check), as a stacked bar per pool and a table. It rereads the server's
//! `capacity` whenever the live fleet feed has applied changes.
//!
//! Placement: the schedulable part of each bar shows how much of it reservations have booked
//! (allocated) and how much they could still book (free), also by GPU model; the page follows
//! `reservationUpdates` too, since a booking changes no node.

use std::time::Duration;

use leptos::prelude::*;

use crate::app::ctx;
use crate::gql::{
    self, ApiError, Capacity, ReservationUpdatesLive, capacity, reservation_updates_live, wire,
};
use crate::live::{LiveState, follow};
use crate::model::seed_spelling;
use crate::refresh::Refresher;

/// The least time between two rereads: the fleet feed applies changes up to ten times a
/// second, and a capacity chart that moves once a second reads better and costs the server
/// one aggregate query per second per open chart.
const REREAD_GAP: Duration = Duration::from_secs(1);

/// The buckets in the order the chart stacks them, with their colours (CSS classes).
const BUCKETS: [&str; 6] = [
    "SCHEDULABLE",
    "PROVISIONING",
    "MAINTENANCE",
    "UNHEALTHY",
    "UNREACHABLE",
    "EXCLUDED",
];

/// Chart geometry, in SVG user units.
const LABEL_WIDTH: f64 = 160.0;
const BAR_WIDTH: f64 = 600.0;
const BAR_HEIGHT: f64 = 22.0;
const BAR_GAP: f64 = 12.0;
/// Room right of the longest bar for its totals ("64 GPUs · 16 allocated, 40 free").
const TOTALS_WIDTH: f64 = 230.0;

#[derive(Clone, Debug, PartialEq)]
struct PoolBars {
    pool: String,
    total_nodes: i64,
    total_gpus: i64,
    /// (bucket, nodes, gpus), in [`BUCKETS`] order.
    buckets: Vec<(&'static str, i64, i64)>,
    /// Of the schedulable GPUs: booked by allocations, and bookable now.
    allocated: i64,
    free: i64,
    /// (model, allocated, free) of the schedulable GPUs.
    by_model: Vec<(String, i64, i64)>,
}

fn bars(pools: Vec<capacity::CapacityCapacityNodes>) -> Vec<PoolBars> {
    pools
        .into_iter()
        .map(|pool| PoolBars {
            pool: pool.pool_id,
            total_nodes: pool.total_nodes,
            total_gpus: pool.total_gpus,
            buckets: BUCKETS
                .iter()
                .map(|&b| {
                    let count = pool.buckets.iter().find(|c| wire(&c.bucket) == b);
                    (b, count.map_or(0, |c| c.nodes), count.map_or(0, |c| c.gpus))
                })
                .collect(),
            allocated: pool.allocated_gpus,
            free: pool.free_gpus,
            by_model: pool
                .schedulable_by_model
                .into_iter()
                .map(|m| (m.model, m.allocated, m.free))
                .collect(),
        })
        .collect()
}

/// Every pool's capacity, page after page.
pub async fn every_pool() -> Result<Vec<capacity::CapacityCapacityNodes>, ApiError> {
    let mut pools = Vec::new();
    let mut after = None;
    loop {
        let page = gql::run::<Capacity>(capacity::Variables { after })
            .await?
            .capacity;
        pools.extend(page.nodes);
        after = page.page_info.end_cursor;
        if !page.page_info.has_next_page || after.is_none() {
            return Ok(pools);
        }
    }
}

#[component]
pub fn CapacityPage() -> impl IntoView {
    let ctx = ctx();
    let data = RwSignal::new(None::<Result<Vec<PoolBars>, ApiError>>);
    let reread = Refresher::new(REREAD_GAP, move || async move {
        let result = every_pool().await.map(bars);
        data.set(Some(result));
    });
    Effect::new(move |_| {
        ctx.fleet.revision.track();
        reread.trigger();
    });
    // Bookings and releases change allocated and free without changing a node.
    let placement_live = RwSignal::new(LiveState::Connecting);
    let placement_feed = follow::<ReservationUpdatesLive>(
        |after| reservation_updates_live::Variables {
            after,
            pool_id: None,
            reservation_id: None,
        },
        |d| Some(d.reservation_updates.cursor.clone()),
        move |_| reread.trigger(),
        placement_live,
    );
    on_cleanup(move || placement_feed.stop());

    view! {
        <section class="capacity-page" data-testid="capacity">
            <h1>"Capacity by pool"</h1>
            <p class="muted">"GPUs of each pool by bucket: a node counts in the bucket of the first schedulability check it fails."</p>
            <div class="legend">
                {BUCKETS.iter().map(|b| view! {
                    <span class="legend-item"><span class=format!("swatch b-{}", b.to_ascii_lowercase())></span>{seed_spelling(b)}</span>
                }).collect_view()}
                <span class="legend-item"><span class="swatch allocated"></span>"allocated (of schedulable)"</span>
            </div>
            {move || match data.get() {
                None => view! { <p class="loading">"Loading…"</p> }.into_any(),
                Some(Err(err)) => view! { <p class="error">{err.to_string()}</p> }.into_any(),
                Some(Ok(pools)) if pools.is_empty() => view! { <p class="empty">"No pools yet."</p> }.into_any(),
                Some(Ok(pools)) => {
                    let names = ctx.names.get();
                    let widest = pools.iter().map(|p| p.total_gpus).max().unwrap_or(0).max(1) as f64;
                    let height = pools.len() as f64 * (BAR_HEIGHT + BAR_GAP);
                    view! {
                        <svg
                            class="chart"
                            data-testid="capacity-chart"
                            viewBox=format!("0 0 {} {height}", LABEL_WIDTH + BAR_WIDTH + TOTALS_WIDTH)
                            role="img"
                        >
                            {pools.iter().enumerate().map(|(i, p)| {
                                let y = i as f64 * (BAR_HEIGHT + BAR_GAP);
                                let mut x = LABEL_WIDTH;
                                let segments = p.buckets.iter().filter(|(_, _, gpus)| *gpus > 0).map(|(b, nodes, gpus)| {
                                    let w = *gpus as f64 / widest * BAR_WIDTH;
                                    let seg = view! {
                                        <rect
                                            class=format!("b-{}", b.to_ascii_lowercase())
                                            data-bucket=*b
                                            x=x y=y width=w height=BAR_HEIGHT
                                        >
                                            <title>{format!("{}: {gpus} GPUs on {nodes} nodes", seed_spelling(b))}</title>
                                        </rect>
                                    };
                                    x += w;
                                    seg
                                }).collect_view();
                                // The schedulable segment comes first; its booked part is
                                // drawn over its start.
                                let allocated = (p.allocated > 0).then(|| view! {
                                    <rect
                                        class="allocated"
                                        data-part="allocated"
                                        x=LABEL_WIDTH y=y width=p.allocated as f64 / widest * BAR_WIDTH height=BAR_HEIGHT
                                    >
                                        <title>{format!("allocated: {} GPUs ({} free)", p.allocated, p.free)}</title>
                                    </rect>
                                });
                                view! {
                                    <g data-testid="capacity-bar" data-pool=p.pool.clone()>
                                        <text x="0" y=y + BAR_HEIGHT * 0.7>{names.name(&p.pool).to_owned()}</text>
                                        {segments}
                                        {allocated}
                                        <text x=x + 6.0 y=y + BAR_HEIGHT * 0.7 class="muted">
                                            {format!("{} GPUs · {} allocated, {} free", p.total_gpus, p.allocated, p.free)}
                                        </text>
                                    </g>
                                }
                            }).collect_view()}
                        </svg>
                        <table class="capacity-table">
                            <thead>
                                <tr>
                                    <th>"Pool"</th>
                                    {BUCKETS.iter().map(|b| view! { <th>{seed_spelling(b)}</th> }).collect_view()}
                                    <th>"Total"</th>
                                    <th>"Allocated"</th>
                                    <th>"Free"</th>
                                </tr>
                            </thead>
                            <tbody>
                                {pools.iter().map(|p| view! {
                                    <tr data-testid="capacity-row" data-pool=p.pool.clone()>
                                        <td>{names.name(&p.pool).to_owned()}</td>
                                        {p.buckets.iter().map(|(b, nodes, gpus)| view! {
                                            <td data-bucket=*b>{format!("{gpus} GPUs / {nodes} nodes")}</td>
                                        }).collect_view()}
                                        <td>{format!("{} GPUs / {} nodes", p.total_gpus, p.total_nodes)}</td>
                                        <td data-testid="capacity-allocated">{format!("{} GPUs", p.allocated)}</td>
                                        <td data-testid="capacity-free">{format!("{} GPUs", p.free)}</td>
                                    </tr>
                                }).collect_view()}
                            </tbody>
                        </table>
                        <h2 class="subhead">"Schedulable GPUs by model"</h2>
                        <table class="capacity-table" data-testid="capacity-models">
                            <thead><tr><th>"Pool"</th><th>"Model"</th><th>"Allocated"</th><th>"Free"</th></tr></thead>
                            <tbody>
                                {pools.iter().flat_map(|p| p.by_model.iter().map(|(model, allocated, free)| view! {
                                    <tr data-testid="capacity-model-row" data-pool=p.pool.clone() data-model=model.clone()>
                                        <td>{names.name(&p.pool).to_owned()}</td>
                                        <td>{model.clone()}</td>
                                        <td data-col="allocated">{format!("{allocated} GPUs")}</td>
                                        <td data-col="free">{format!("{free} GPUs")}</td>
                                    </tr>
                                })).collect_view()}
                            </tbody>
                        </table>
                    }.into_any()
                }
            }}
        </section>
    }
}
