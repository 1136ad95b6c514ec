//! The simulated fleet's integration tests, one binary: FakeDaemons joining a real server.

mod fleet;
mod lifecycle;
