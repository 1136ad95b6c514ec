//! Who is calling: JWT bearer tokens for people and agents.
//!
//! Tokens are HS256-signed with the configured secret and carry the subject, roles and an
//! optional tenant. The server checks signature, expiry and audience; a token that fails any
//! of them is `UNAUTHENTICATED`.

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
}

/// The shortest secret we accept: HS256 is only as strong as its key.
pub const MIN_SECRET_LEN: usize = 32;

impl TokenKeys {
    pub fn new(secret: &[u8], audience: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(
            secret.len() >= MIN_SECRET_LEN,
            "the JWT secret must be at least {MIN_SECRET_LEN} bytes"
        );
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "aud", "sub"]);
        // Expiry is checked to the second: a token is dead when it says it is.
        validation.leeway = 0;
        Ok(TokenKeys {
            encoding: EncodingKey::from_secret(secret)?,
            decoding: DecodingKey::from_secret(secret)?,
            validation,
            audience: audience.to_owned(),
        })
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
            roles: roles.to_vec(),
            tenant: tenant.map(|t| t.to_string()),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Verifies a bearer token and turns it into a principal.
    pub fn verify(&self, token: &str) -> Result<Principal, ApiError> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|err| ApiError::Unauthenticated(format!("invalid token: {err}")))?;
        let claims = data.claims;
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

    /// Reads `Authorization: Bearer <token>`.
    pub fn from_header(&self, header: Option<&str>) -> Result<Principal, ApiError> {
        let header = header.ok_or_else(|| {
            ApiError::Unauthenticated("missing Authorization: Bearer token".into())
        })?;
        let token = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .ok_or_else(|| {
                ApiError::Unauthenticated("the Authorization header is not a Bearer token".into())
            })?;
        self.verify(token.trim())
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
        let principal = keys().verify(&token).expect("valid");
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
            keys().verify(&expired),
            Err(ApiError::Unauthenticated(_))
        ));

        let forged = TokenKeys::new(&[8u8; 32], "better-compute")
            .expect("valid")
            .mint("a", &[Role::Admin], None, Duration::hours(1), now)
            .expect("mints");
        assert!(matches!(
            keys().verify(&forged),
            Err(ApiError::Unauthenticated(_))
        ));

        let other_audience = TokenKeys::new(&[7u8; 32], "someone-else")
            .expect("valid")
            .mint("a", &[Role::Admin], None, Duration::hours(1), now)
            .expect("mints");
        assert!(matches!(
            keys().verify(&other_audience),
            Err(ApiError::Unauthenticated(_))
        ));

        let no_roles = keys()
            .mint("a", &[], None, Duration::hours(1), now)
            .expect("mints");
        assert!(matches!(
            keys().verify(&no_roles),
            Err(ApiError::Unauthenticated(_))
        ));
        assert!(matches!(
            keys().from_header(Some("Basic abc")),
            Err(ApiError::Unauthenticated(_))
        ));
        assert!(matches!(
            keys().from_header(None),
            Err(ApiError::Unauthenticated(_))
        ));
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(TokenKeys::new(b"short", "x").is_err());
    }
}
