//! The shell: sign-in, the header, the routes, and what every page shares ([`Ctx`]).

use std::collections::{HashMap, HashSet};

use leptos::prelude::*;
use leptos_router::components::{A, Route, Router, Routes};
use leptos_router::path;

use crate::gql::{
    self, ApiError, CatalogPools, CatalogSites, Viewer, catalog_pools, catalog_sites, viewer,
};
use crate::live::LiveState;
use crate::model::{Filters, Names, Sort, seed_spelling};
use crate::session;
use crate::store::FleetStore;

/// Who is signed in, as the server sees the token.
#[derive(Clone, Debug, PartialEq)]
pub struct Operator {
    pub subject: String,
    pub role: String,
    pub tenant: Option<String>,
}

impl Operator {
    pub fn is_admin(&self) -> bool {
        self.role == "admin"
    }
    pub fn can_change(&self) -> bool {
        self.role == "admin" || self.role == "operator"
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct PoolInfo {
    pub id: String,
    pub name: String,
    pub site_id: String,
    pub kind: String,
    /// Its `drivers.power` (`redfish` for machines enrolled by their BMC), if it binds one.
    pub power_driver: Option<String>,
}

impl PoolInfo {
    /// Whether machines are enrolled into it by their BMC (`enrollBareMetalNode`).
    pub fn is_bare_metal(&self) -> bool {
        self.power_driver.as_deref() == Some(crate::metal::REDFISH)
    }
}

/// Shared by every page. The fleet table's filters, sort and selection live here so they
/// survive a visit to a node's page and back.
#[derive(Clone, Copy)]
pub struct Ctx {
    pub operator: RwSignal<Option<Operator>>,
    pub fleet: FleetStore,
    pub names: RwSignal<Names>,
    pub sites: RwSignal<Vec<(String, String)>>,
    pub pools: RwSignal<Vec<PoolInfo>>,
    pub filters: RwSignal<Filters>,
    pub sort: RwSignal<Sort>,
    pub selection: RwSignal<HashSet<String>>,
}

pub fn ctx() -> Ctx {
    expect_context::<Ctx>()
}

impl Ctx {
    /// Signs in with `token` if the server accepts it.
    pub async fn sign_in(self, token: String) -> Result<(), ApiError> {
        let data = gql::run_with_token::<Viewer>(&token, viewer::Variables {}).await?;
        session::store(&token);
        self.operator.set(Some(Operator {
            subject: data.viewer.subject,
            role: data.viewer.role,
            tenant: data.viewer.tenant_id,
        }));
        self.fleet.start();
        self.load_catalog().await;
        Ok(())
    }

    pub fn sign_out(self) {
        session::forget();
        self.fleet.stop();
        self.selection.update(HashSet::clear);
        self.operator.set(None);
    }

    /// Site and pool names, for the table and the capacity chart.
    pub async fn load_catalog(self) {
        match catalog().await {
            Ok((sites, pools)) => {
                let mut names = HashMap::new();
                for site in &sites {
                    names.insert(site.id.clone(), site.name.clone());
                }
                for pool in &pools {
                    names.insert(pool.id.clone(), pool.name.clone());
                }
                self.names.set(Names(names));
                self.sites
                    .set(sites.into_iter().map(|s| (s.id, s.name)).collect());
                self.pools.set(
                    pools
                        .into_iter()
                        .map(|p| PoolInfo {
                            kind: seed_spelling(&gql::wire(&p.kind)),
                            power_driver: p
                                .drivers
                                .iter()
                                .find(|d| d.key == crate::metal::POWER_DRIVER_KEY)
                                .map(|d| d.value.clone()),
                            id: p.id,
                            name: p.name,
                            site_id: p.site_id,
                        })
                        .collect(),
                );
            }
            Err(err) => leptos::logging::warn!("loading sites and pools failed: {err}"),
        }
    }
}

/// Every site and every pool the operator may see, page after page.
async fn catalog() -> Result<
    (
        Vec<catalog_sites::CatalogSitesSitesNodes>,
        Vec<catalog_pools::CatalogPoolsPoolsNodes>,
    ),
    ApiError,
> {
    let mut sites = Vec::new();
    let mut after = None;
    loop {
        let page = gql::run::<CatalogSites>(catalog_sites::Variables { after })
            .await?
            .sites;
        sites.extend(page.nodes);
        after = page.page_info.end_cursor;
        if !page.page_info.has_next_page || after.is_none() {
            break;
        }
    }
    let mut pools = Vec::new();
    let mut after = None;
    loop {
        let page = gql::run::<CatalogPools>(catalog_pools::Variables { after })
            .await?
            .pools;
        pools.extend(page.nodes);
        after = page.page_info.end_cursor;
        if !page.page_info.has_next_page || after.is_none() {
            break;
        }
    }
    Ok((sites, pools))
}

#[component]
pub fn App() -> impl IntoView {
    let ctx = Ctx {
        operator: RwSignal::new(None),
        fleet: FleetStore::new(),
        names: RwSignal::new(Names::default()),
        sites: RwSignal::new(Vec::new()),
        pools: RwSignal::new(Vec::new()),
        filters: RwSignal::new(Filters::new()),
        sort: RwSignal::new(Sort::default()),
        selection: RwSignal::new(HashSet::new()),
    };
    provide_context(ctx);

    // Checking the stored token (or a link's) takes a round trip; until it is answered the
    // page shows neither the console nor the sign-in form.
    let checked = RwSignal::new(false);
    let sign_in_error = RwSignal::new(None::<String>);
    let try_token = move |token: Option<String>| {
        leptos::task::spawn_local(async move {
            if let Some(token) = token
                && let Err(err) = ctx.sign_in(token).await
            {
                session::forget();
                sign_in_error.set(Some(refusal(&err)));
            }
            checked.set(true);
        });
    };
    try_token(session::take_link_token().or_else(session::token));
    // A sign-in link opened in a tab that already shows the dashboard changes only the
    // fragment: no reload happens, so the new token is taken from here.
    // The app lives as long as the page, and so does this listener.
    let _ = window_event_listener(leptos::ev::hashchange, move |_| {
        if let Some(token) = session::take_link_token() {
            ctx.fleet.stop();
            try_token(Some(token));
        }
    });
    // A token that expires while the page is open shows as a refused feed.
    Effect::new(move |_| {
        if let LiveState::Refused(err) = ctx.fleet.state.get()
            && ctx.operator.get_untracked().is_some()
        {
            ctx.sign_out();
            sign_in_error.set(Some(refusal(&err)));
        }
    });

    view! {
        <Router>
            <Show
                when=move || checked.get()
                fallback=|| view! { <p class="loading">"Loading…"</p> }
            >
                <Show
                    when=move || ctx.operator.with(Option::is_some)
                    fallback=move || view! { <SignIn error=sign_in_error/> }
                >
                    <Header/>
                    <main>
                        <Routes fallback=|| view! { <p class="empty">"No such page."</p> }>
                            <Route path=path!("/") view=crate::fleet::FleetPage/>
                            <Route path=path!("/nodes/:id") view=crate::node::NodePage/>
                            <Route path=path!("/capacity") view=crate::capacity::CapacityPage/>
                            <Route path=path!("/events") view=crate::events::EventsPage/>
                            <Route path=path!("/reservations") view=crate::reservations::ReservationsPage/>
                            <Route path=path!("/reservations/:id") view=crate::reservations::ReservationPage/>
                            <Route path=path!("/enrol") view=crate::bare_metal::EnrolPage/>
                        </Routes>
                    </main>
                </Show>
            </Show>
        </Router>
    }
}

fn refusal(err: &ApiError) -> String {
    if err.code == "UNAUTHENTICATED" {
        format!("The server refused the token: {}", err.message)
    } else {
        format!("Signing in failed: {err}")
    }
}

#[component]
fn SignIn(error: RwSignal<Option<String>>) -> impl IntoView {
    let ctx = ctx();
    let token = RwSignal::new(String::new());
    let busy = RwSignal::new(false);
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let value = token.get_untracked().trim().to_owned();
        if value.is_empty() {
            error.set(Some("Paste a token first.".to_owned()));
            return;
        }
        busy.set(true);
        leptos::task::spawn_local(async move {
            match ctx.sign_in(value).await {
                Ok(()) => error.set(None),
                Err(err) => error.set(Some(refusal(&err))),
            }
            busy.set(false);
        });
    };
    view! {
        <div class="signin">
            <h1>"Better Compute"</h1>
            <form on:submit=submit>
                <label for="token">"Token"</label>
                <textarea
                    id="token"
                    data-testid="token-input"
                    rows="5"
                    placeholder="eyJ… (better-compute token --subject you --role operator)"
                    prop:value=move || token.get()
                    on:input=move |ev| token.set(event_target_value(&ev))
                ></textarea>
                <button type="submit" data-testid="sign-in" disabled=move || busy.get()>
                    "Sign in"
                </button>
                <Show when=move || error.with(Option::is_some)>
                    <p class="error" data-testid="sign-in-error">
                        {move || error.get().unwrap_or_default()}
                    </p>
                </Show>
                <p class="hint">
                    "`better-compute dev` prints a link that signs in; `better-compute token` mints a token."
                </p>
            </form>
        </div>
    }
}

#[component]
fn Header() -> impl IntoView {
    let ctx = ctx();
    let who = move || {
        ctx.operator
            .get()
            .map(|o| match o.tenant {
                Some(t) => format!("{} ({}, {t})", o.subject, o.role),
                None => format!("{} ({})", o.subject, o.role),
            })
            .unwrap_or_default()
    };
    let live = move || match ctx.fleet.state.get() {
        LiveState::Live => ("live", "Live".to_owned()),
        LiveState::Connecting => ("connecting", "Connecting…".to_owned()),
        LiveState::Reconnecting(why) => ("reconnecting", format!("Reconnecting ({why})")),
        LiveState::Refused(err) => ("refused", format!("Refused: {}", err.message)),
    };
    view! {
        <header class="top">
            <span class="brand">"Better Compute"</span>
            <nav>
                <A href="/" exact=true>"Fleet"</A>
                <A href="/capacity">"Capacity"</A>
                <A href="/reservations">"Reservations"</A>
                <A href="/events">"Events"</A>
                <A href="/enrol">"Enrol"</A>
            </nav>
            <span class=move || format!("live-state {}", live().0) data-testid="live-state">
                {move || live().1}
            </span>
            <span class="who" data-testid="who">{who}</span>
            <button class="link" data-testid="sign-out" on:click=move |_| ctx.sign_out()>
                "Sign out"
            </button>
        </header>
    }
}
