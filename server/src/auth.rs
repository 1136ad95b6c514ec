//! Who is calling: JWT bearer tokens for people and agents.
//!
//! Tokens are HS256-signed with the configured secret and carry the subject, roles and an
//! optional tenant. The server checks signature, audience, expiry (to the second), and that
//! neither `nbf` nor `iat` lies in the future beyond a small leeway; a token that fails any
//! of them is `UNAUTHENTICATED`. Time is the server's injected clock, so tests move it.
//! A principal's expiry holds for as long as it is used: every operation checks it
//! ([`Principal::check_live`]), and a subscription socket is closed when it passes.

use bc_core::Actor;
use bc_core::ids::TenantId;
use chrono::{DateTime, Duration, Utc};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use strum::{Display, EnumString};

use crate::error::ApiError;

/// What a principal may do. Ordered: every role includes the ones below it.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    Display,
    EnumString,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Role {
    /// Reads everything it may see.
    Viewer,
    /// Also changes nodes: cordon, drain, taint, label, lifecycle moves, commands.
    Operator,
    /// Also manages tenants, sites, pools and join tokens.
    Admin,
}

/// The claims of a Better Compute token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub aud: String,
    pub iat: i64,
    pub exp: i64,
    /// Not valid before this (seconds since the epoch), when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<i64>,
    pub roles: Vec<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub subject: String,
    pub role: Role,
    /// `Some` for a tenant-scoped token: it sees and changes only what that tenant owns.
    pub tenant: Option<TenantId>,
    pub expires_at: DateTime<Utc>,
}

impl Principal {
    pub fn actor(&self) -> Actor {
        Actor::User(self.subject.clone())
    }

    /// `FORBIDDEN` unless the principal holds at least `role`.
    pub fn require(&self, role: Role) -> Result<(), ApiError> {
        if self.role >= role {
            Ok(())
        } else {
            Err(ApiError::Forbidden(format!(
                "this needs the {role} role; the token has {}",
                self.role
            )))
        }
    }

    /// `FORBIDDEN` unless the principal is a platform (not tenant-scoped) admin.
    pub fn require_platform_admin(&self) -> Result<(), ApiError> {
        self.require(Role::Admin)?;
        match self.tenant {
            None => Ok(()),
            Some(_) => Err(ApiError::Forbidden(
                "this needs a platform admin, not a tenant token".into(),
            )),
        }
    }

    /// `UNAUTHENTICATED` once the token has expired: `now` is at or past its `exp`.
    pub fn check_live(&self, now: DateTime<Utc>) -> Result<(), ApiError> {
        if now < self.expires_at {
            Ok(())
        } else {
            Err(ApiError::Unauthenticated(
                "the token expired; sign in again".into(),
            ))
        }
    }

    /// Whether the principal may see something owned by `owner` (`None`: the platform's).
    pub fn can_see(&self, owner: Option<&TenantId>) -> bool {
        match &self.tenant {
            None => true,
            Some(tenant) => owner == Some(tenant),
        }
    }
}

/// Signs and verifies tokens with one shared secret.
#[derive(Clone)]
pub struct TokenKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
    audience: String,
    /// How far `nbf` and `iat` may lie ahead of the server's clock.
    leeway: Duration,
}

/// The shortest secret we accept: HS256 is only as strong as its key.
pub const MIN_SECRET_LEN: usize = 32;
/// `nbf` and `iat` leeway unless configured (`auth.leeway_secs`).
const DEFAULT_LEEWAY_SECS: i64 = crate::config::DEFAULT_AUTH_LEEWAY_SECS as i64;

impl TokenKeys {
    pub fn new(secret: &[u8], audience: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(
            secret.len() >= MIN_SECRET_LEN,
            "the JWT secret must be at least {MIN_SECRET_LEN} bytes"
        );
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "aud", "sub"]);
        // jsonwebtoken reads the system clock and has no `iat` check: `exp`, `nbf` and
        // `iat` are checked in `verify` against the server's clock instead.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.leeway = 0;
        Ok(TokenKeys {
            encoding: EncodingKey::from_secret(secret)?,
            decoding: DecodingKey::from_secret(secret)?,
            validation,
            audience: audience.to_owned(),
            leeway: Duration::seconds(DEFAULT_LEEWAY_SECS),
        })
    }

    /// The leeway for `nbf` and `iat` (`auth.leeway_secs`).
    pub fn with_leeway(mut self, leeway_secs: u64) -> TokenKeys {
        self.leeway = Duration::seconds(i64::try_from(leeway_secs).unwrap_or(i64::MAX));
        self
    }

    /// Mints a token (the `token` CLI subcommand, the dev command, tests).
    pub fn mint(
        &self,
        subject: &str,
        roles: &[Role],
        tenant: Option<&TenantId>,
        ttl: Duration,
        now: DateTime<Utc>,
    ) -> anyhow::Result<String> {
        let claims = Claims {
            sub: subject.to_owned(),
            aud: self.audience.clone(),
            iat: now.timestamp(),
            exp: (now + ttl).timestamp(),
            nbf: None,
            roles: roles.to_vec(),
            tenant: tenant.map(|t| t.to_string()),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Verifies a bearer token at `now` and turns it into a principal.
    pub fn verify(&self, token: &str, now: DateTime<Utc>) -> Result<Principal, ApiError> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|err| ApiError::Unauthenticated(format!("invalid token: {err}")))?;
        let claims = data.claims;
        let now_secs = now.timestamp();
        let ahead = self.leeway.num_seconds();
        if now_secs >= claims.exp {
            return Err(ApiError::Unauthenticated("the token expired".into()));
        }
        if claims
            .nbf
            .is_some_and(|nbf| nbf > now_secs.saturating_add(ahead))
        {
            return Err(ApiError::Unauthenticated(
                "the token is not valid yet (nbf)".into(),
            ));
        }
        if claims.iat > now_secs.saturating_add(ahead) {
            return Err(ApiError::Unauthenticated(
                "the token is issued in the future (iat)".into(),
            ));
        }
        let role = claims
            .roles
            .iter()
            .copied()
            .max()
            .ok_or_else(|| ApiError::Unauthenticated("the token carries no role".into()))?;
        let tenant = claims
            .tenant
            .as_deref()
            .map(TenantId::parse)
            .transpose()
            .map_err(|_| {
                ApiError::Unauthenticated("the token's tenant is not a tenant id".into())
            })?;
        let expires_at = DateTime::from_timestamp(claims.exp, 0).ok_or_else(|| {
            ApiError::Unauthenticated("the token's expiry is out of range".into())
        })?;
        Ok(Principal {
            subject: claims.sub,
            role,
            tenant,
            expires_at,
        })
    }

    /// Reads `Authorization: Bearer <token>` and verifies it at `now`.
    pub fn from_header(
        &self,
        header: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<Principal, ApiError> {
        let header = header.ok_or_else(|| {
            ApiError::Unauthenticated("missing Authorization: Bearer token".into())
        })?;
        let token = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .ok_or_else(|| {
                ApiError::Unauthenticated("the Authorization header is not a Bearer token".into())
            })?;
        self.verify(token.trim(), now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> TokenKeys {
        TokenKeys::new(&[7u8; 32], "better-compute").expect("valid secret")
    }

    #[test]
    fn minted_tokens_verify_with_their_highest_role() {
        let now = Utc::now();
        let tenant = TenantId::parse("ten_acme").expect("id");
        let token = keys()
            .mint(
                "alice",
                &[Role::Viewer, Role::Operator],
                Some(&tenant),
                Duration::hours(1),
                now,
            )
            .expect("mints");
        let principal = keys().verify(&token, now).expect("valid");
        assert_eq!(principal.role, Role::Operator);
        assert_eq!(principal.tenant, Some(tenant));
        assert!(principal.require(Role::Admin).is_err());
    }

    #[test]
    fn expired_forged_and_foreign_tokens_are_refused() {
        let now = Utc::now();
        let expired = keys()
            .mint("a", &[Role::Admin], None, Duration::seconds(-10), now)
            .expect("mints");
        assert!(matches!(
            keys().verify(&expired, now),
            Err(ApiError::Unauthenticated(_))
        ));

        let forged = TokenKeys::new(&[8u8; 32], "better-compute")
            .expect("valid")
            .mint("a", &[Role::Admin], None, Duration::hours(1), now)
            .expect("mints");
        assert!(matches!(
            keys().verify(&forged, now),
            Err(ApiError::Unauthenticated(_))
        ));

        let other_audience = TokenKeys::new(&[7u8; 32], "someone-else")
            .expect("valid")
            .mint("a", &[Role::Admin], None, Duration::hours(1), now)
            .expect("mints");
        assert!(matches!(
            keys().verify(&other_audience, now),
            Err(ApiError::Unauthenticated(_))
        ));

        let no_roles = keys()
            .mint("a", &[], None, Duration::hours(1), now)
            .expect("mints");
        assert!(matches!(
            keys().verify(&no_roles, now),
            Err(ApiError::Unauthenticated(_))
        ));
        assert!(matches!(
            keys().from_header(Some("Basic abc"), now),
            Err(ApiError::Unauthenticated(_))
        ));
        assert!(matches!(
            keys().from_header(None, now),
            Err(ApiError::Unauthenticated(_))
        ));
    }

    /// Signs `claims` as the server would.
    fn signed(claims: &serde_json::Value) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(&[7u8; 32]).expect("a key"),
        )
        .expect("signs")
    }

    #[test]
    fn expiry_nbf_and_iat_are_checked_against_the_given_time() {
        let now = Utc::now();
        let t = now.timestamp();
        let claims = |iat: i64, exp: i64, nbf: Option<i64>| {
            let mut c = serde_json::json!({
                "sub": "a", "aud": "better-compute", "iat": iat, "exp": exp, "roles": ["admin"],
            });
            if let Some(nbf) = nbf {
                c["nbf"] = nbf.into();
            }
            signed(&c)
        };
        let keys = keys().with_leeway(30);
        assert!(keys.verify(&claims(t, t + 60, None), now).is_ok());
        // `exp` has no leeway: dead at the second it names.
        assert!(keys.verify(&claims(t - 60, t, None), now).is_err());
        let principal = keys
            .verify(&claims(t, t + 60, None), now)
            .expect("valid now");
        assert!(principal.check_live(now).is_ok());
        assert!(principal.check_live(now + Duration::seconds(60)).is_err());
        // `nbf` and `iat` may lie ahead by the leeway, not more.
        assert!(keys.verify(&claims(t, t + 600, Some(t + 30)), now).is_ok());
        assert!(keys.verify(&claims(t, t + 600, Some(t + 31)), now).is_err());
        assert!(keys.verify(&claims(t + 30, t + 600, None), now).is_ok());
        assert!(keys.verify(&claims(t + 31, t + 600, None), now).is_err());
        // Once `nbf` has passed the token is good.
        assert!(
            keys.verify(
                &claims(t, t + 600, Some(t + 300)),
                now + Duration::seconds(300)
            )
            .is_ok()
        );
        // Time is the caller's: the same token is expired later on.
        assert!(
            keys.verify(&claims(t, t + 60, None), now + Duration::seconds(61))
                .is_err()
        );
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(TokenKeys::new(b"short", "x").is_err());
    }
}
