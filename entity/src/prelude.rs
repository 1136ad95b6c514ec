//! `use bc_entity::prelude::*;` for the entity types under short names.

pub use crate::event::Entity as Event;
pub use crate::node::Entity as Node;
pub use crate::node_condition::Entity as NodeCondition;
pub use crate::node_label::Entity as NodeLabel;
pub use crate::node_no_schedule_reason::Entity as NodeNoScheduleReason;
pub use crate::node_session::Entity as NodeSession;
pub use crate::node_taint::Entity as NodeTaint;
pub use crate::pool::Entity as Pool;
pub use crate::site::Entity as Site;
pub use crate::tenant::Entity as Tenant;
