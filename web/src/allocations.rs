//! Placement on a node's page: the atoms booked on it, by reservation, and how far a drain
//! has come ("3 allocations left, deadline in 12 min"). The node page rereads the node on
//! each of its events, allocation bookings and releases included, and these parts are built
//! again from each read.

use std::time::Duration;

use leptos::prelude::*;
use leptos_router::components::A;

use crate::format::since;
use crate::gql::node_page;
use crate::placement::drain_progress;

type Node = node_page::NodePageNode;

/// How often the drain's countdown is redrawn: it counts in minutes (seconds in its last
/// minute), so a few seconds late is never a wrong minute for long.
const COUNTDOWN_TICK: Duration = Duration::from_secs(5);

/// "Draining: N allocations left, deadline in M min", while the node drains.
#[component]
pub fn DrainProgress(node: Node) -> impl IntoView {
    let left = node.allocations.iter().filter(|a| a.active).count();
    node.drain.map(|d| {
        let now = RwSignal::new(chrono::Utc::now());
        let tick_ms = u32::try_from(COUNTDOWN_TICK.as_millis()).unwrap_or(5_000);
        // Owned by this view: dropped, and so stopped, when the view is.
        StoredValue::new_local(gloo_timers::callback::Interval::new(tick_ms, move || {
            let _ = now.try_set(chrono::Utc::now());
        }));
        let deadline = d.deadline.clone();
        view! {
            <p class="warning drain-progress" data-testid="drain-progress">
                <strong>"Draining: "</strong>
                <span data-testid="drain-progress-text">{move || drain_progress(left, deadline.as_deref(), now.get())}</span>
                <span class="muted">{format!(" (since {})", since(&d.started_at))}</span>
            </p>
        }
    })
}

/// The node's active allocations: which reservation, which atoms, since when.
#[component]
pub fn NodeAllocations(node: Node) -> impl IntoView {
    let active: Vec<_> = node.allocations.into_iter().filter(|a| a.active).collect();
    let booked: i64 = active.iter().map(|a| a.gpus).sum();
    view! {
        <section class="card wide" data-testid="node-allocations">
            <h2>{format!("Allocations ({booked} of {} GPUs booked)", node.gpu_count)}</h2>
            {if active.is_empty() {
                view! { <p class="muted" data-testid="no-allocations">"Nothing is booked on this node."</p> }.into_any()
            } else {
                view! {
                    <table>
                        <thead><tr><th>"Reservation"</th><th>"Tenant"</th><th>"Atoms"</th><th>"GPUs"</th><th>"Booked"</th></tr></thead>
                        <tbody>
                            {active.into_iter().map(|a| {
                                let link = format!("/reservations/{}", a.reservation_id);
                                let id_text = a.reservation_id.clone();
                                view! {
                                <tr data-testid="allocation-row" data-reservation=a.reservation_id.clone()>
                                    <td><A href=link><code>{id_text}</code></A></td>
                                    <td>{a.tenant_id.clone()}</td>
                                    <td data-testid="allocation-atoms"><code>{a.atoms.join(" ")}</code></td>
                                    <td>{a.gpus}</td>
                                    <td class="nowrap">{since(&a.booked_at)}</td>
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
