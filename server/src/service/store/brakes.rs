//! The fleet brake's episodes (`liveness_brakes`, one row per site whose brake tripped) and
//! the explicit mapping between those rows and [`LivenessBrake`].

use anyhow::anyhow;
use bc_core::brake::{BrakeNumbers, BrakeRelease, BrakeStatus, LivenessBrake};
use bc_core::ids::SiteId;
use bc_entity::liveness_brake;
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::OnConflict;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder};

fn corrupt(column: &str, value: &str) -> anyhow::Error {
    anyhow!("corrupt row: liveness_brakes.{column} = `{value}`")
}

fn count(column: &str, raw: i64) -> anyhow::Result<u64> {
    u64::try_from(raw).map_err(|_| corrupt(column, &raw.to_string()))
}

fn brake_from(row: liveness_brake::Model) -> anyhow::Result<LivenessBrake> {
    let release = match (row.released_by, row.release_reason, row.released_at) {
        (Some(by), Some(reason), Some(at)) => Some(BrakeRelease { by, reason, at }),
        (None, None, None) => None,
        (by, _, _) => return Err(corrupt("released_by", by.as_deref().unwrap_or("NULL"))),
    };
    Ok(LivenessBrake {
        site_id: SiteId::parse(&row.site_id).map_err(|_| corrupt("site_id", &row.site_id))?,
        status: row
            .status
            .parse::<BrakeStatus>()
            .map_err(|_| corrupt("status", &row.status))?,
        tripped_with: BrakeNumbers {
            silent: count("silent", row.silent)?,
            recently_unreachable: count("recently_unreachable", row.recently_unreachable)?,
            watched: count("watched", row.watched)?,
        },
        tripped_at: row.tripped_at,
        release,
    })
}

fn row(b: &LivenessBrake) -> anyhow::Result<liveness_brake::ActiveModel> {
    Ok(liveness_brake::ActiveModel {
        site_id: Set(b.site_id.to_string()),
        status: Set(b.status.to_string()),
        silent: Set(i64::try_from(b.tripped_with.silent)?),
        recently_unreachable: Set(i64::try_from(b.tripped_with.recently_unreachable)?),
        watched: Set(i64::try_from(b.tripped_with.watched)?),
        tripped_at: Set(b.tripped_at),
        released_by: Set(b.release.as_ref().map(|r| r.by.clone())),
        release_reason: Set(b.release.as_ref().map(|r| r.reason.clone())),
        released_at: Set(b.release.as_ref().map(|r| r.at)),
    })
}

/// Every stored brake, by site id.
pub async fn all(conn: &impl ConnectionTrait) -> anyhow::Result<Vec<LivenessBrake>> {
    liveness_brake::Entity::find()
        .order_by_asc(liveness_brake::Column::SiteId)
        .all(conn)
        .await?
        .into_iter()
        .map(brake_from)
        .collect()
}

/// The brake of `site`, if one is stored.
pub async fn of_site(
    conn: &impl ConnectionTrait,
    site: &SiteId,
) -> anyhow::Result<Option<LivenessBrake>> {
    liveness_brake::Entity::find_by_id(site.to_string())
        .one(conn)
        .await?
        .map(brake_from)
        .transpose()
}

/// Stores a brake that tripped. Returns false when the site has one already (another
/// controller stored it first), which is then left as it is.
pub async fn insert(conn: &impl ConnectionTrait, brake: &LivenessBrake) -> anyhow::Result<bool> {
    let inserted = liveness_brake::Entity::insert(row(brake)?)
        .on_conflict(
            OnConflict::column(liveness_brake::Column::SiteId)
                .do_nothing()
                .to_owned(),
        )
        .exec_without_returning(conn)
        .await?;
    Ok(inserted == 1)
}

/// Writes a released brake, only if it is still paused. Returns whether it was.
pub async fn save_release(
    conn: &impl ConnectionTrait,
    brake: &LivenessBrake,
) -> anyhow::Result<bool> {
    let result = liveness_brake::Entity::update_many()
        .set(row(brake)?)
        .filter(liveness_brake::Column::SiteId.eq(brake.site_id.to_string()))
        .filter(liveness_brake::Column::Status.eq(BrakeStatus::Paused.as_static_str()))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// Forgets the brake of `site` if it is still in `status`. Returns whether it was.
pub async fn delete(
    conn: &impl ConnectionTrait,
    site: &SiteId,
    status: BrakeStatus,
) -> anyhow::Result<bool> {
    let result = liveness_brake::Entity::delete_many()
        .filter(liveness_brake::Column::SiteId.eq(site.to_string()))
        .filter(liveness_brake::Column::Status.eq(status.as_static_str()))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}
