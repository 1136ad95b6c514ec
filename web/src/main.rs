//! The Better Compute dashboard: a Leptos app rendered in the browser (WebAssembly), served by
//! the control plane at `/`, talking to it only through the GraphQL API at `/graphql`.
//! ARCHITECTURE.md ("web/") has the map.

mod actions;
mod allocations;
mod app;
mod bare_metal;
mod capacity;
mod events;
mod fleet;
mod format;
mod gql;
mod history;
mod live;
mod metal;
mod model;
mod node;
mod placement;
mod refresh;
mod reservations;
mod session;
mod store;

fn main() {
    console_error_panic_hook::set_once();
    leptos::mount::mount_to_body(app::App);
}
