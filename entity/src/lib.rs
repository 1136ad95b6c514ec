//! sea-orm entities for Better Compute's storage rows.
//!
//! One module per table. Storage rows only: enum-like values are plain
//! `String` columns, JSON columns are `serde_json::Value`, timestamps are
//! `DateTime<Utc>`. The schema itself is owned by `bc-migration`.

pub mod allocation;
pub mod atom_booking;
pub mod bare_metal_workflow;
pub mod command;
pub mod controller_lease;
pub mod event;
pub mod join_token;
pub mod liveness_brake;
pub mod node;
pub mod node_bmc;
pub mod node_condition;
pub mod node_device;
pub mod node_enrolled_identifier;
pub mod node_free_atom;
pub mod node_inventory_section;
pub mod node_label;
pub mod node_no_schedule_reason;
pub mod node_session;
pub mod node_taint;
pub mod pool;
pub mod pool_offer;
pub mod remediation_attempt;
pub mod reservation;
pub mod site;
pub mod tenant;

pub mod prelude;
