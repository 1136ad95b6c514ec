//! Test support for Better Compute: a real server on a throwaway database, reached over
//! real HTTP, on SQLite and on PostgreSQL; and the daemon side of `bcd/v1` for real
//! ([`FakeDaemon`]) with a fleet simulator ([`Fleet`], [`run_sim`]) on top, and a workload of
//! reservations for a simulated fleet ([`run_workload`]).
//!
//! Every API test goes through [`each_backend`], which runs the same test body once per
//! database backend, so the two can never drift apart unnoticed.

/// The support code of the benchmarks (`fleet-bench`, `subscription-bench`): the server as a
/// child process, its GraphQL API, `/proc` measurements and the results table.
pub mod bench;
/// BMCs for tests: the Redfish emulator (`sushy-emulator`) and a stub for its faults.
pub mod bmc;
pub mod daemon;
pub mod inventory;
/// Simulated bare metal (`dev --sim-metal N`): machines behind simulated Redfish BMCs.
pub mod metal;
pub mod server;
pub mod sim;
/// A simulated fleet as several `better-compute sim` processes (`fleet-bench` at 100,000 nodes).
pub mod simulator_processes;
pub mod subscription;
pub mod workload;

pub use daemon::{
    CaTrust, DaemonError, DaemonErrorKind, DaemonKnobs, DaemonStatus, ErrorCounts, FakeDaemon,
    GatewayContext, Phase,
};
pub use metal::{MetalFleet, MetalOptions, MetalPlace, MetalProgress};
pub use server::{Backend, Gql, TestServer, each_backend, each_backend_with};
pub use sim::{Fleet, KnobOverride, Progress, SimOptions, run_sim};
pub use workload::{WorkloadCounts, WorkloadOptions, WorkloadReport, run_workload};
