//! The runtime that subscription sockets' loops run on, apart from the one that serves
//! requests, at a lower priority.
//!
//! With 10,000 subscribers an event wakes 10,000 socket loops, each of which writes one
//! frame (most of its CPU the `send` system call: BENCHMARKS.md, "Subscriptions"). On the
//! runtime that serves requests those loops fill every worker's run queue, and a mutation's
//! next step waits behind a whole event's fan-out: at 10 events a second to each of 10,000
//! subscribers, 213 to 236 ms at p99 paced and 1.9 to 2.4 s in a 16-way burst, against a
//! goal of 20 ms (issue 16). Here the loops compete with requests only for the cores, and at
//! [`NICENESS`] the operating system gives a runnable request thread the larger share of a
//! contended core: operators' writes come first (39 to 40 ms paced, 0.1 to 0.2 s in the
//! burst), and the events they cause follow as soon as there is CPU for them.
//!
//! **Nothing that touches storage runs here.** sqlx opens a pool connection inside the task
//! that asks for one, and that connection then serves every request: opened from this
//! runtime, a PostgreSQL connection's socket would belong to this runtime's I/O driver, and a
//! SQLite connection's worker thread would inherit this runtime's priority. So a socket's
//! loop ([`crate::graphql_ws`]) sends frames, keeps time and follows hubs, while the engine
//! that runs the client's operations, and the hubs the socket joins, run on the request
//! runtime and hand the loop what to send.
//!
//! One runtime per process, started on first use and never stopped: a socket's loop ends by
//! itself when its server stops (it watches the server's shutdown) or its connection drops,
//! and a process may run several servers (the tests do). Its threads are named
//! [`THREAD_NAME`], so per-thread CPU in `/proc/<pid>/task/*/stat` shows the fan-out's share
//! (README, "Profiling"; subscription-bench reports it).

use std::future::Future;
use std::sync::LazyLock;
use tokio_util::task::AbortOnDropHandle;

/// The name of the runtime's worker threads.
pub const THREAD_NAME: &str = "bc-subscription";
// Linux keeps at most 15 bytes of a thread's name: a longer one would not be found again.
const _: () = assert!(THREAD_NAME.len() <= 15);

/// How much lower the runtime's threads run than the thread that first uses it, in nice
/// steps: each step gives a thread about 1.25 times less CPU than a thread one step above it
/// when a core is contended, so at 5 a busy socket thread gets about a quarter of a core
/// against a runnable request thread. Measured at 10 events a second to 10,000 subscribers
/// (BENCHMARKS.md, "Subscriptions", session 37): at 10 the paced mutations' p99 was 28 to
/// 31 ms but the events reached subscribers 1.0 to 1.2 s after them (p99); at 0, 131 ms and
/// 0.25 s; at 5, 36 to 49 ms and 0.29 to 1.06 s over five runs, against 213 to 286 ms and
/// 0.32 to 0.50 s before this runtime existed. Those mutation figures include a wait in the
/// bench itself, which then read the mutations' answers on the runtime of its 10,000
/// subscribers; without it (session 39), 16 to 19 ms at 5: the niceness is worth measuring
/// again the same way.
pub const NICENESS: i32 = 5;

/// `None` if the runtime could not be started (no threads to be had), in which case sockets'
/// loops run on the caller's runtime.
static RUNTIME: LazyLock<Option<tokio::runtime::Runtime>> = LazyLock::new(|| {
    // One worker per core, as the request runtime has: a fan-out spread over every core
    // reaches the last subscriber soonest.
    let workers = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    // Set, not added: a thread starts with the nice value of the thread that spawned it, which
    // for a blocking-pool thread may be one of these.
    let niceness = rustix::process::getpriority_process(None).unwrap_or(0) + NICENESS;
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(THREAD_NAME)
        .on_thread_start(move || {
            // Linux keeps a nice value per thread, so this lowers only this runtime's
            // threads. Lowering it needs no privilege; where it is refused all the same, the
            // fan-out runs at the process's priority.
            if let Err(err) = rustix::process::setpriority_process(None, niceness) {
                tracing::warn!(error = %err, "could not lower the priority of a subscription thread");
            }
        })
        .enable_all()
        .build()
    {
        Ok(runtime) => Some(runtime),
        Err(err) => {
            tracing::warn!(error = %err, "the subscription runtime did not start; subscription sockets share the request runtime");
            None
        }
    }
});

/// Whether the calling thread is one of the subscription runtime's, where nothing may touch
/// storage (checked on every statement in debug builds).
pub fn is_current_thread() -> bool {
    std::thread::current().name() == Some(THREAD_NAME)
}

/// Starts a socket's loop on the subscription runtime, now, and returns what waits for it to
/// end; dropping that ends the loop. The socket stays registered with the runtime that
/// accepted it, whose I/O driver tells this one when it can be written. A panic in the loop
/// is resumed in the waiter. (Where the runtime could not be started, the loop runs in the
/// waiter, on the caller's runtime.)
///
/// Not an `async fn`: one would hold the loop's future (several KiB) inside the caller's
/// task as well as in the spawned one, for the socket's whole life.
pub fn run(
    socket_loop: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = ()> + Send {
    let started = match &*RUNTIME {
        Some(runtime) => Started::Spawned(AbortOnDropHandle::new(runtime.spawn(socket_loop))),
        None => Started::InTheWaiter(Box::pin(socket_loop)),
    };
    async move {
        match started {
            Started::Spawned(spawned) => {
                if let Err(err) = spawned.await
                    && err.is_panic()
                {
                    std::panic::resume_unwind(err.into_panic());
                }
            }
            Started::InTheWaiter(socket_loop) => socket_loop.await,
        }
    }
}

/// Where [`run`] started a loop. The loop is boxed when it runs in the waiter, so that the
/// waiter stays small when it only holds a handle.
enum Started<F> {
    Spawned(AbortOnDropHandle<()>),
    InTheWaiter(std::pin::Pin<Box<F>>),
}

#[cfg(test)]
mod tests {
    /// A socket's loop runs on the runtime's threads, below the caller's priority.
    #[tokio::test]
    async fn a_socket_loop_runs_on_the_subscription_threads_at_a_lower_priority() {
        let callers = rustix::process::getpriority_process(None).expect("the caller's nice value");
        let (sender, seen) = tokio::sync::oneshot::channel();
        super::run(async move {
            let thread = std::thread::current().name().map(str::to_owned);
            let nice = rustix::process::getpriority_process(None).expect("the loop's nice value");
            sender.send((thread, nice)).expect("the test waits");
        })
        .await;
        let (thread, nice) = seen.await.expect("the loop ran");
        assert_eq!(thread.as_deref(), Some(super::THREAD_NAME));
        assert!(
            !super::is_current_thread(),
            "the test's own thread is not one of them"
        );
        assert_eq!(nice, (callers + super::NICENESS).min(19));
    }
}
