//! The server's integration tests, one binary (so the server links once for all of them):
//! each module is one subject, run against a real server on SQLite and PostgreSQL through
//! `bc_testing::each_backend`. `common` and `raw_daemon` are the helpers they share.

mod common;
mod raw_daemon;

mod abuse;
mod bad_input;
mod bare_metal;
mod batched_writes;
mod commands;
mod dashboard;
mod fuzz;
mod gateway;
mod history;
mod leadership;
mod lifecycle;
mod listeners;
mod liveness;
mod node_mutations;
mod node_queries;
mod placement;
mod placement_races;
mod pools;
mod proof;
mod query_limits;
mod remediation;
mod schedulable_sql;
mod schema;
mod state_table;
mod subscriptions;
mod tenancy_and_limits;
mod workflows;
