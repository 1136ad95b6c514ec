//! Leases: one server at a time holds a named lease (the controllers' is the only one), for a
//! bounded time it renews while it lives. Taking or renewing is one statement, so two servers
//! racing for an expired lease cannot both win: the row is inserted, or updated only if this
//! holder already holds it or it has expired.

use bc_entity::controller_lease;
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::{Expr, ExprTrait, OnConflict};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter};

/// Takes lease `name` for `holder` until `expires_at`, or renews it if `holder` already has
/// it. Returns whether `holder` holds it now (false: another holder's lease has not expired).
pub async fn hold(
    conn: &impl ConnectionTrait,
    name: &str,
    holder: &str,
    now: DateTime<Utc>,
    expires_at: DateTime<Utc>,
) -> anyhow::Result<bool> {
    use controller_lease::Column;
    let row = controller_lease::ActiveModel {
        name: Set(name.to_owned()),
        holder: Set(holder.to_owned()),
        since: Set(now),
        expires_at: Set(expires_at),
    };
    let table = "controller_leases";
    let result = controller_lease::Entity::insert(row)
        .on_conflict(
            OnConflict::column(Column::Name)
                .update_columns([Column::Holder, Column::ExpiresAt])
                // A renewal keeps the time the holder took the lease.
                .value(
                    Column::Since,
                    Expr::cust(format!(
                        "CASE WHEN {table}.holder = excluded.holder THEN {table}.since \
                         ELSE excluded.since END"
                    )),
                )
                .action_and_where(
                    Expr::col((controller_lease::Entity, Column::Holder))
                        .eq(holder)
                        .or(Expr::col((controller_lease::Entity, Column::ExpiresAt)).lt(now)),
                )
                .to_owned(),
        )
        .exec_without_returning(conn)
        .await?;
    Ok(result == 1)
}

/// Gives lease `name` up if `holder` has it (a server that stops), so another takes it at
/// once instead of after it expires.
pub async fn release(conn: &impl ConnectionTrait, name: &str, holder: &str) -> anyhow::Result<()> {
    controller_lease::Entity::delete_many()
        .filter(controller_lease::Column::Name.eq(name))
        .filter(controller_lease::Column::Holder.eq(holder))
        .exec(conn)
        .await?;
    Ok(())
}

/// Who holds lease `name` (expired or not), since when and until when.
pub async fn holder(
    conn: &impl ConnectionTrait,
    name: &str,
) -> anyhow::Result<Option<controller_lease::Model>> {
    Ok(controller_lease::Entity::find_by_id(name.to_owned())
        .one(conn)
        .await?)
}
