//! The simulated fleet's integration tests, one binary: FakeDaemons joining a real server.

mod fleet;
mod lifecycle;
mod lock_order;
mod metal;
mod remediation;
mod restart_under_load;
mod workload;
