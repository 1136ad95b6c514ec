//! Join tokens: the rows behind `createJoinToken`, `revokeJoinToken` and JoinService's
//! admission check. The secret itself is never stored, only its SHA-256.

use bc_core::ids::{JoinTokenId, PoolId, SiteId};
use bc_core::join::JoinToken;
use bc_entity::join_token;
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::{
    ColumnTrait, ConnectionTrait, EntityTrait, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect,
};

fn from_row(row: join_token::Model) -> anyhow::Result<JoinToken> {
    let corrupt = |c: &str, v: &str| anyhow::anyhow!("corrupt row: join_tokens.{c} = `{v}`");
    Ok(JoinToken {
        id: JoinTokenId::parse(&row.id).map_err(|_| corrupt("id", &row.id))?,
        site_id: SiteId::parse(&row.site_id).map_err(|_| corrupt("site_id", &row.site_id))?,
        pool_id: row
            .pool_id
            .as_deref()
            .map(|p| PoolId::parse(p).map_err(|_| corrupt("pool_id", p)))
            .transpose()?,
        secret_hash: row.secret_hash,
        description: row.description,
        expires_at: row.expires_at,
        max_uses: row.max_uses,
        uses: row.uses,
        revoked_at: row.revoked_at,
        created_by: row.created_by,
        created_at: row.created_at,
    })
}

pub async fn insert(conn: &impl ConnectionTrait, t: &JoinToken) -> anyhow::Result<()> {
    let row = join_token::ActiveModel {
        id: Set(t.id.to_string()),
        secret_hash: Set(t.secret_hash.clone()),
        site_id: Set(t.site_id.to_string()),
        pool_id: Set(t.pool_id.as_ref().map(ToString::to_string)),
        description: Set(t.description.clone()),
        expires_at: Set(t.expires_at),
        max_uses: Set(t.max_uses),
        uses: Set(t.uses),
        revoked_at: Set(t.revoked_at),
        created_by: Set(t.created_by.clone()),
        created_at: Set(t.created_at),
    };
    join_token::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// One token, locked for the rest of the transaction where the database has row locks.
pub async fn get(
    conn: &impl ConnectionTrait,
    id: &JoinTokenId,
    for_update: bool,
) -> anyhow::Result<Option<JoinToken>> {
    let mut select = join_token::Entity::find_by_id(id.to_string());
    if for_update {
        select = super::lock_for_update(select, conn);
    }
    select.one(conn).await?.map(from_row).transpose()
}

/// At most `limit` tokens, newest first, after (older than) the token `after`. Ids are
/// UUIDv7, so id order is creation order, as for commands.
pub async fn page(
    conn: &impl ConnectionTrait,
    after: Option<&JoinTokenId>,
    limit: u64,
) -> anyhow::Result<Vec<JoinToken>> {
    let mut select = join_token::Entity::find();
    if let Some(after) = after {
        select = select.filter(join_token::Column::Id.lt(after.to_string()));
    }
    select
        .order_by_desc(join_token::Column::Id)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(from_row)
        .collect()
}

pub async fn count(conn: &impl ConnectionTrait) -> anyhow::Result<u64> {
    Ok(join_token::Entity::find().count(conn).await?)
}

/// Counts `uses` more uses of the token if it still admits that many at `now`, and says
/// whether it did. The condition is [`JoinToken::admit`]'s but the secret (which the caller
/// checked on the row it read before): not revoked, not expired, `uses` left. One statement,
/// which locks the row for the rest of the transaction: joins through one token queue on that
/// row from here to their commit, so the check and the count are one round trip, not a locked
/// read and a write.
pub async fn spend_uses(
    conn: &impl ConnectionTrait,
    id: &JoinTokenId,
    uses: i64,
    now: DateTime<Utc>,
) -> anyhow::Result<bool> {
    use sea_orm::sea_query::{Expr, ExprTrait};
    let spent = join_token::Entity::update_many()
        .col_expr(
            join_token::Column::Uses,
            Expr::col(join_token::Column::Uses).add(uses),
        )
        .filter(join_token::Column::Id.eq(id.to_string()))
        .filter(join_token::Column::RevokedAt.is_null())
        .filter(join_token::Column::ExpiresAt.gt(now))
        .filter(
            Expr::col(join_token::Column::Uses)
                .add(uses)
                .lte(Expr::col(join_token::Column::MaxUses)),
        )
        .exec(conn)
        .await?;
    Ok(spent.rows_affected == 1)
}

/// Marks the token revoked at `at`.
pub async fn revoke(
    conn: &impl ConnectionTrait,
    id: &JoinTokenId,
    at: DateTime<Utc>,
) -> anyhow::Result<()> {
    join_token::Entity::update_many()
        .col_expr(
            join_token::Column::RevokedAt,
            sea_orm::sea_query::Expr::val(at),
        )
        .filter(join_token::Column::Id.eq(id.to_string()))
        .exec(conn)
        .await?;
    Ok(())
}
