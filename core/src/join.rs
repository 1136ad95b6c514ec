//! Join tokens and the admission rule JoinService applies to them.
//!
//! A join token's secret is 32 random bytes shown once; only its SHA-256 is kept. A slow hash
//! would add nothing for a random secret, and comparing in constant time keeps the hash from
//! being guessed byte by byte.

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::ids::{JoinTokenId, PoolId, SiteId};

/// A join token as the domain sees it (never the secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub id: JoinTokenId,
    pub secret_hash: String,
    pub site_id: SiteId,
    pub pool_id: Option<PoolId>,
    pub description: String,
    pub expires_at: DateTime<Utc>,
    pub max_uses: i64,
    pub uses: i64,
    pub revoked_at: Option<DateTime<Utc>>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
}

/// Why a join token did not admit a daemon. Each is reported to the daemon as
/// `UNAUTHENTICATED` with [`JoinRefusal::why`]; none of them creates anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum JoinRefusal {
    #[error("unknown token")]
    UnknownToken,
    #[error("wrong token secret")]
    WrongSecret,
    #[error("the token was revoked")]
    Revoked,
    #[error("the token has expired")]
    Expired,
    #[error("the token has been used up")]
    UsedUp,
}

/// The stored form of a secret: its SHA-256, hex.
pub fn secret_hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

impl JoinToken {
    /// Whether this token admits one more join at `now` by someone presenting `secret`.
    /// The secret is checked first, so a caller without it learns nothing about the
    /// token's state.
    pub fn admit(&self, secret: &str, now: DateTime<Utc>) -> Result<(), JoinRefusal> {
        if !bool::from(
            secret_hash(secret)
                .as_bytes()
                .ct_eq(self.secret_hash.as_bytes()),
        ) {
            return Err(JoinRefusal::WrongSecret);
        }
        if self.revoked_at.is_some() {
            return Err(JoinRefusal::Revoked);
        }
        if self.expires_at <= now {
            return Err(JoinRefusal::Expired);
        }
        if self.uses >= self.max_uses {
            return Err(JoinRefusal::UsedUp);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;

    fn token(now: DateTime<Utc>) -> JoinToken {
        JoinToken {
            id: JoinTokenId::generate(),
            secret_hash: secret_hash("s3cret"),
            site_id: SiteId::generate(),
            pool_id: None,
            description: String::new(),
            expires_at: now + Duration::hours(1),
            max_uses: 2,
            uses: 1,
            revoked_at: None,
            created_by: "user:alice".into(),
            created_at: now,
        }
    }

    /// A test case: its name, what it does to a valid token, and the admission it expects.
    type Case = (
        &'static str,
        Box<dyn Fn(&mut JoinToken)>,
        Result<(), JoinRefusal>,
    );

    #[test]
    fn admission_checks_secret_then_state() {
        let now = Utc::now();
        let cases: Vec<Case> = vec![
            ("valid", Box::new(|_| {}), Ok(())),
            (
                "revoked",
                Box::new(|t| t.revoked_at = Some(t.created_at)),
                Err(JoinRefusal::Revoked),
            ),
            (
                "expired",
                Box::new(move |t| t.expires_at = now),
                Err(JoinRefusal::Expired),
            ),
            (
                "used up",
                Box::new(|t| t.uses = 2),
                Err(JoinRefusal::UsedUp),
            ),
        ];
        for (name, mutate, expected) in cases {
            let mut t = token(now);
            mutate(&mut t);
            assert_eq!(t.admit("s3cret", now), expected, "{name}");
            assert_eq!(
                t.admit("guess", now),
                Err(JoinRefusal::WrongSecret),
                "{name}"
            );
        }
    }
}
