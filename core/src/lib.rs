//! The pure domain of Better Compute: no IO, no async, no database.
//!
//! Everything here follows `shared/seed/nodes.md`: a node's state is a set of independent
//! axes ([`axes`]), `provisionState` moves only along [`provision::PROVISION_STATE_TABLE`],
//! schedulability is the seven ordered checks of [`schedule`], the API view of a node is
//! [`view::NodeDetail`], and every change a transition makes is returned as a list of
//! [`event::Change`]s (typed by [`event::EventType`]) so the storage layer can write the
//! matching events in the same transaction.
//!
//! Time enters only through the [`clock::Clock`] trait (or an explicit `now` argument), so
//! every rule is testable without sleeping.

pub mod acceptance;
pub mod actor;
pub mod axes;
pub mod bare_metal;
pub mod brake;
pub mod catalog;
pub mod clear;
pub mod clock;
pub mod command;
pub mod error;
pub mod event;
pub mod hardware;
pub mod health;
pub mod history;
pub mod ids;
pub mod join;
pub mod node;
pub mod placement;
pub mod protocol;
pub mod provision;
pub mod reason;
pub mod remediation;
pub mod schedule;
pub mod view;
pub mod workflow;

pub use actor::Actor;
pub use error::DomainError;
