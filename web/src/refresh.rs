//! Refetching on live signals without refetching once per signal. A node's acceptance writes
//! a burst of events; each would otherwise start its own read of the whole node page.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use leptos::prelude::*;

type Fetch = Box<dyn Fn() -> Pin<Box<dyn Future<Output = ()>>>>;

#[derive(Default)]
struct Flags {
    in_flight: bool,
    again: bool,
}

/// Runs a fetch when triggered: at most one at a time, and a trigger during a fetch runs it
/// once more afterwards (so the last signal is always followed by a fresh read), with at
/// least `gap` between the starts of two fetches.
#[derive(Clone, Copy)]
pub struct Refresher {
    flags: StoredValue<Flags>,
    fetch: StoredValue<Fetch, LocalStorage>,
    gap: Duration,
}

impl Refresher {
    pub fn new<F, Fut>(gap: Duration, fetch: F) -> Refresher
    where
        F: Fn() -> Fut + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let fetch: Fetch = Box::new(move || Box::pin(fetch()));
        Refresher {
            flags: StoredValue::new(Flags::default()),
            fetch: StoredValue::new_local(fetch),
            gap,
        }
    }

    pub fn trigger(self) {
        let busy = self
            .flags
            .try_update_value(|f| {
                if f.in_flight {
                    f.again = true;
                    true
                } else {
                    f.in_flight = true;
                    false
                }
            })
            // A disposed refresher (its page is gone) does nothing.
            .unwrap_or(true);
        if busy {
            return;
        }
        leptos::task::spawn_local(async move {
            loop {
                let Some(fetch) = self.fetch.try_with_value(|f| f()) else {
                    return;
                };
                fetch.await;
                gloo_timers::future::sleep(self.gap).await;
                let again = self
                    .flags
                    .try_update_value(|f| std::mem::take(&mut f.again))
                    .unwrap_or(false);
                if !again {
                    break;
                }
            }
            let _ = self.flags.try_update_value(|f| f.in_flight = false);
        });
    }
}
