//! `schedulableSql`: the seven checks of `bc_core::schedule` as SQL, built with sea-query so
//! the same expression runs on SQLite and PostgreSQL. The placer applies it to rows it has
//! locked; list filters and capacity use the bucket expression.
//!
//! A property test (`tests/schedulable_sql.rs`) keeps this in agreement with the Rust
//! predicate on both databases.

use bc_core::axes::{Connectivity, Role, Trust};
use bc_core::schedule::{CapacityBucket, Check, SCHEDULABLE_PROVISION_STATES};
use bc_entity::{node, pool};
use sea_orm::sea_query::{Alias, CaseStatement, Expr, ExprTrait, Query};

fn col(column: node::Column) -> Expr {
    Expr::col((node::Entity, column))
}

/// The SQL spelling of `noScheduleReasons` being empty (the column is canonical JSON).
const NO_REASONS: &str = "[]";

/// The SQL condition that `check` passes, for the row of `nodes` in scope.
pub fn passes(check: Check) -> Expr {
    match check {
        Check::RoleIsHost => col(node::Column::Role).eq(Role::Host.as_static_str()),
        Check::TrustAllowsPool => {
            let pool_alias = Alias::new("owner_pool");
            let owners_pool = Query::select()
                .expr(Expr::val(1))
                .from_as(pool::Entity, pool_alias.clone())
                .and_where(
                    Expr::col((pool_alias.clone(), pool::Column::Id))
                        .equals((node::Entity, node::Column::PoolId)),
                )
                .and_where(
                    Expr::col((pool_alias, pool::Column::OwnerTenantId))
                        .equals((node::Entity, node::Column::OwnerTenantId)),
                )
                .to_owned();
            col(node::Column::Trust)
                .eq(Trust::Platform.as_static_str())
                .or(col(node::Column::Trust)
                    .eq(Trust::TenantOwned.as_static_str())
                    .and(col(node::Column::OwnerTenantId).is_not_null())
                    .and(Expr::exists(owners_pool)))
        }
        Check::InService => col(node::Column::Maintenance)
            .eq(false)
            .and(col(node::Column::Cordoned).eq(false)),
        Check::Provisioned => col(node::Column::ProvisionState).is_in(
            SCHEDULABLE_PROVISION_STATES
                .iter()
                .map(|s| s.as_static_str()),
        ),
        Check::ConvergedFirstSpec => col(node::Column::ObservedGeneration).gte(1),
        Check::Connected => {
            col(node::Column::Connectivity).eq(Connectivity::Connected.as_static_str())
        }
        Check::NoReasons => col(node::Column::NoScheduleReasons).eq(NO_REASONS),
    }
}

/// `schedulableSql`: every check passes.
pub fn schedulable() -> Expr {
    Check::ORDER
        .into_iter()
        .map(passes)
        .reduce(ExprTrait::and)
        .unwrap_or_else(|| Expr::val(true))
}

/// The capacity bucket as a SQL `CASE`: the bucket of the first failing check, in order.
pub fn bucket() -> Expr {
    let mut case = CaseStatement::new();
    for check in Check::ORDER {
        case = case.case(passes(check).not(), Expr::val(check.bucket().as_ref()));
    }
    case.finally(Expr::val(CapacityBucket::Schedulable.as_ref()))
        .into()
}
