//! Test support for Better Compute: a real server on a throwaway database, reached over
//! real HTTP, on SQLite and on PostgreSQL.
//!
//! Every API test goes through [`each_backend`], which runs the same test body once per
//! database backend, so the two can never drift apart unnoticed.

pub mod server;

pub use server::{Backend, Gql, TestServer, each_backend};
