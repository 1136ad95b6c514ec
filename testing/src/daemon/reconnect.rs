//! The daemon's life: settle on the gateway and its CA, join, hold a session, and when it
//! ends, back off and go again (with the same identity, or joining anew).

use super::identity::Identity;
use super::session::SessionEnd;
use super::tls::GatewayContext;
use super::{DaemonError, FakeDaemon, Source};
use crate::inventory;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The first reconnect delay: PROTOCOL.md's "1 s doubling to 60 s".
pub const RECONNECT_BACKOFF_BASE: Duration = Duration::from_secs(1);
/// The longest reconnect delay.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(60);
/// The share of each backoff delay that is random: a delay `d` becomes uniform in
/// `(d × (1 − RECONNECT_JITTER), d]`, so a fleet that lost its gateway at once does not come
/// back at once.
pub const RECONNECT_JITTER: f64 = 0.5;
/// A session that lasted this long was healthy: the next reconnect starts the backoff over.
/// Shorter sessions keep escalating it, so a gateway that accepts and then drops a daemon is
/// not hammered once a second.
const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// Exponential backoff: `base` doubling to `max`, each delay jittered down by up to
/// `jitter` of itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    pub jitter: f64,
    attempt: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: RECONNECT_BACKOFF_BASE,
            max: RECONNECT_BACKOFF_MAX,
            jitter: RECONNECT_JITTER,
            attempt: 0,
        }
    }
}

impl Backoff {
    /// The delay before try `attempt` (0-based) without jitter.
    pub fn nominal(&self, attempt: u32) -> Duration {
        self.base
            .saturating_mul(2u32.saturating_pow(attempt))
            .min(self.max)
    }

    /// The next delay, jittered; each call doubles the following one.
    pub fn next_delay(&mut self) -> Duration {
        let nominal = self.nominal(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let random: f64 = rand::random();
        nominal.mul_f64(1.0 - self.jitter.clamp(0.0, 1.0) * random)
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// What follows a session.
enum AfterSession {
    /// The daemon stops (`Ok`) or gives up (the error).
    Done(Result<(), DaemonError>),
    /// Wait `delay`, then open another session: with the same identity if `keep_identity`,
    /// else after joining again.
    Retry {
        delay: Duration,
        keep_identity: bool,
    },
}

impl FakeDaemon {
    pub(super) async fn run_until_done(&self) -> Result<(), DaemonError> {
        let Some(context) = self.resolve_context().await? else {
            return Ok(());
        };
        let mut trust = context.trust.clone();
        let mut identity: Option<Identity> = None;
        let mut backoff = Backoff::default();
        loop {
            if self.is_stopped() {
                return Ok(());
            }
            let mut current = match identity.take() {
                Some(current) if !current.expired() => current,
                expired => {
                    if let Some(expired) = expired {
                        tracing::warn!(hostname = %self.hostname(), node = %expired.issued.node_id, "the node certificate expired; joining again");
                    }
                    match self.join(&context, &mut trust).await {
                        None => return Ok(()),
                        Some(Ok(joined)) => joined,
                        Some(Err(err)) if err.is_permanent() => return Err(err),
                        Some(Err(err)) => {
                            tracing::info!(hostname = %self.hostname(), error = %err, "join failed; retrying");
                            self.record_error(&err);
                            self.next_gateway(context.gateways());
                            if !self.back_off(backoff.next_delay()).await {
                                return Ok(());
                            }
                            continue;
                        }
                    }
                }
            };
            // The inventory as the machine is now (a reset or reboot may have cleared a fault,
            // or one may have appeared), announced by its hashes in `hello`.
            let inventory = self.inventory();
            let hashes = inventory::hashes(&inventory);
            let started = Instant::now();
            let end = self
                .session(&context, &mut trust, &mut current, &hashes, inventory)
                .await;
            self.set_connected(false);
            let healthy = started.elapsed() >= HEALTHY_SESSION;
            match self.after_session(end, healthy, context.gateways(), &mut backoff) {
                AfterSession::Done(result) => return result,
                AfterSession::Retry {
                    delay,
                    keep_identity,
                } => {
                    if keep_identity {
                        identity = Some(current);
                    }
                    if !self.back_off(delay).await {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// The gateway context: the fleet's, or resolved here, retrying what may pass. None if
    /// the daemon was stopped first.
    async fn resolve_context(&self) -> Result<Option<Arc<GatewayContext>>, DaemonError> {
        let (gateway_url, ca) = match &self.shared.source {
            Source::Resolved(context) => return Ok(Some(context.clone())),
            Source::Unresolved { gateway_url, ca } => (gateway_url, ca),
        };
        let mut backoff = Backoff::default();
        loop {
            match self
                .unless_stopped(GatewayContext::resolve(gateway_url, ca))
                .await
            {
                None => return Ok(None),
                Some(Ok(context)) => return Ok(Some(Arc::new(context))),
                Some(Err(err)) if err.is_permanent() => return Err(err),
                Some(Err(err)) => {
                    tracing::info!(hostname = %self.hostname(), error = %err, "cannot reach the gateway yet");
                    self.record_error(&err);
                    if !self.back_off(backoff.next_delay()).await {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Records how a session ended and decides what follows. The backoff starts over after a
    /// healthy session, and after a flap or a reboot: the daemon dropped those itself, the
    /// gateway is not the trouble.
    fn after_session(
        &self,
        end: SessionEnd,
        healthy: bool,
        gateways: usize,
        backoff: &mut Backoff,
    ) -> AfterSession {
        match end {
            SessionEnd::Stopped => AfterSession::Done(Ok(())),
            SessionEnd::Revoked(reason) => {
                self.update(|s| s.last_close_reason = Some(reason.clone()));
                if !self.shared.knobs.rejoin_when_revoked {
                    return AfterSession::Done(Err(DaemonError::IdentityRevoked(reason)));
                }
                tracing::info!(hostname = %self.hostname(), %reason, "identity revoked; joining again");
                AfterSession::Retry {
                    delay: backoff.next_delay(),
                    keep_identity: false,
                }
            }
            SessionEnd::Closed { reason, reconnect } => {
                self.update(|s| s.last_close_reason = Some(reason.clone()));
                if !reconnect {
                    tracing::info!(hostname = %self.hostname(), %reason, "the gateway said not to reconnect");
                    return AfterSession::Done(Ok(()));
                }
                tracing::debug!(hostname = %self.hostname(), %reason, "the gateway closed the session");
                // A gateway that closes a session is going away, shedding load or was
                // superseded: the next try (after the backoff) goes to another replica, if
                // there is one; any replica takes any node.
                self.next_gateway(gateways);
                if healthy {
                    backoff.reset();
                }
                AfterSession::Retry {
                    delay: backoff.next_delay(),
                    keep_identity: true,
                }
            }
            SessionEnd::Flapped => {
                self.update(|s| s.last_close_reason = Some("flapping".to_owned()));
                backoff.reset();
                AfterSession::Retry {
                    delay: backoff.next_delay(),
                    keep_identity: true,
                }
            }
            SessionEnd::Failed(err) => {
                tracing::debug!(hostname = %self.hostname(), error = %err, "session failed");
                let message = err.to_string();
                self.record_error(&err);
                self.update(|s| s.last_close_reason = Some(message));
                // The gateway could not be reached or broke the session: the next try goes to
                // another replica, if there is one.
                self.next_gateway(gateways);
                if healthy {
                    backoff.reset();
                }
                AfterSession::Retry {
                    delay: backoff.next_delay(),
                    keep_identity: true,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_one_second_to_sixty_with_jitter() {
        let mut backoff = Backoff::default();
        let nominal: Vec<u64> = (0..9).map(|n| backoff.nominal(n).as_secs()).collect();
        assert_eq!(nominal, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff.nominal(u32::MAX), RECONNECT_BACKOFF_MAX);
        for attempt in 0..12 {
            let delay = backoff.next_delay();
            let top = backoff.nominal(attempt);
            assert!(
                delay <= top && delay >= top.mul_f64(1.0 - RECONNECT_JITTER),
                "attempt {attempt}: {delay:?} vs {top:?}"
            );
        }
        backoff.reset();
        assert!(backoff.next_delay() <= RECONNECT_BACKOFF_BASE);
        // Jitter spreads a fleet: a hundred first delays are not all equal.
        let delays: std::collections::BTreeSet<Duration> =
            (0..100).map(|_| Backoff::default().next_delay()).collect();
        assert!(delays.len() > 50);
    }
}
