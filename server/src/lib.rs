//! The Better Compute control plane server. See ARCHITECTURE.md for the map.

pub mod app;
pub mod auth;
pub mod bmc;
pub mod config;
pub mod controllers;
pub mod credentials;
pub mod error;
pub mod feed;
pub mod gateway;
pub mod graphiql;
pub mod graphql;
pub mod graphql_ws;
#[cfg(test)]
mod held_sizes;
pub mod http;
pub mod listener;
pub mod pki;
pub mod private_file;
pub mod service;
pub mod subscription_hubs;
pub mod subscription_runtime;
pub mod telemetry;
