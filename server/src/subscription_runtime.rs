//! The runtime that subscription sockets run on, apart from the one that serves requests.
//!
//! With 10,000 subscribers an event wakes 10,000 socket tasks, each of which writes one frame
//! (about 11 µs of CPU each, most of it the `send` system call: BENCHMARKS.md,
//! "Subscriptions"). On the runtime that serves requests those tasks fill every worker's run
//! queue, and a mutation's next step waits behind a whole event's fan-out: 144 ms at p99
//! with 10 events a second per subscriber, against a goal of 20 ms (issue 16). On their own
//! runtime the sockets compete with requests only for the cores, which the operating system
//! shares by time slices of a few milliseconds, and never for a place in one run queue.
//!
//! Its threads also run at a lower priority than the rest of the process ([`NICENESS`]), so
//! that when the cores are busy a request's next step runs as soon as it is ready and the
//! fan-out takes what is left: at 10 events a second to 10,000 subscribers, with the
//! benchmark's clients on the same two cores, a 16-way burst of mutations answered in 1.5 s
//! at p99 at the same priority and in 0.15 s at this one, while its events reached the
//! subscribers later (BENCHMARKS.md, "Subscriptions"). Operators' writes come first; the
//! events they cause follow as soon as there is CPU for them.
//!
//! One runtime per process, started on first use and never stopped: a socket's task ends by
//! itself when its server stops (the feed closes its streams) or its connection drops, and
//! a process may run several servers (the tests do). Its threads are named
//! [`THREAD_NAME`], so per-thread CPU in `/proc/<pid>/task/*/stat` shows the fan-out's share
//! (README, "Profiling").

use std::future::Future;
use std::sync::LazyLock;

/// The name of the runtime's worker threads.
pub const THREAD_NAME: &str = "bc-subscription";
/// How much lower the runtime's threads run than the process that starts them, in nice
/// steps (each about 1.25 times less CPU when the cores are contended; at 10, a busy fan-out
/// thread yields about nine tenths of a core to a runnable request thread).
pub const NICENESS: i32 = 10;

/// `None` if the runtime could not be started (no threads to be had), in which case sockets
/// run on the caller's runtime as they did before this one existed.
static RUNTIME: LazyLock<Option<tokio::runtime::Runtime>> = LazyLock::new(|| {
    // One worker per core, as the request runtime has: a fan-out spread over every core
    // reaches the last subscriber soonest.
    let workers = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(THREAD_NAME)
        .on_thread_start(|| {
            // Linux sets a thread's nice value, not the process's: this lowers only this
            // runtime's threads. Raising it needs no privilege; where even that is refused,
            // the fan-out runs at the process's priority, as it did before.
            if let Err(err) = rustix::process::nice(NICENESS) {
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

/// Runs a subscription socket's task on the subscription runtime. Its socket stays
/// registered with the runtime that accepted it, whose I/O driver tells this one when the
/// socket is ready; the reads, writes and everything the task spawns (a hub's execution) run
/// here.
pub fn spawn(task: impl Future<Output = ()> + Send + 'static) {
    match &*RUNTIME {
        Some(runtime) => {
            runtime.spawn(task);
        }
        None => {
            tokio::spawn(task);
        }
    }
}
