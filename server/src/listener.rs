//! Accepting connections within limits, for both listeners: a cap on open connections per
//! listener and per peer address, enforced at accept ([`ConnectionGate`]: a connection over
//! it is closed at once and counted), HTTP/1.1 with a header timeout that also closes idle
//! keep-alive connections ([`serve_http`]), an idle timeout on the socket itself
//! ([`IdleTimeout`]) and a graceful stop. What a listener serves on a connection is its
//! own: `app.rs` for the API, `gateway/mod.rs` for daemons (which adds the TLS handshake).
//!
//! Metrics: `bc_connections{listener}` (open now), `bc_connections_refused_total{listener,
//! reason}` (`listener_full`, `peer_full`), `bc_connection_timeouts_total{listener, stage}`
//! (`tls_handshake`, `header`, `idle`).

use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

/// The soft limit of open files of this process (`RLIMIT_NOFILE`), from which unset
/// connection caps are derived. Unknown (not Unix, or the call failed): 1,024, the usual
/// default.
pub fn open_file_limit() -> u64 {
    const USUAL_DEFAULT: u64 = 1024;
    match rlimit::getrlimit(rlimit::Resource::NOFILE) {
        Ok((soft, _hard)) if soft > 0 => soft,
        Ok(_) => USUAL_DEFAULT,
        Err(err) => {
            tracing::warn!(error = %err, "could not read the open-file limit; assuming 1,024");
            USUAL_DEFAULT
        }
    }
}

/// Who a per-peer cap counts: an IPv4 address, or an IPv6 /64 (one host commonly holds a
/// whole /64, so counting single IPv6 addresses would cap nothing). IPv4-mapped IPv6
/// addresses count as their IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerKey(IpAddr);

impl PeerKey {
    pub fn of(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(v4) => PeerKey(IpAddr::V4(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey(IpAddr::V4(v4)),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    PeerKey(IpAddr::V6(prefix.into()))
                }
            },
        }
    }
}

/// Why a connection was closed at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener holds its cap.
    ListenerFull,
    /// The peer address holds its cap.
    PeerFull,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::ListenerFull => "listener_full",
            Refusal::PeerFull => "peer_full",
        }
    }
}

/// The caps of one listener and the connections it holds.
pub struct ConnectionGate {
    /// `api` or `gateway`, for metrics and logs.
    listener: &'static str,
    /// Most connections open at once, reserved ones included.
    max: usize,
    /// Of `max`, how many only a reserved admission may take.
    reserved: usize,
    /// Most connections one [`PeerKey`] may hold.
    per_peer: usize,
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    open: usize,
    reserved_open: usize,
    peers: HashMap<PeerKey, PeerSlots>,
}

#[derive(Default)]
struct PeerSlots {
    open: usize,
    reserved: usize,
}

impl ConnectionGate {
    /// A gate of `max` connections, `per_peer` per address, of which `reserved` are held
    /// back for [`Admission::is_reserved`] connections (0: none).
    pub fn new(
        listener: &'static str,
        max: usize,
        per_peer: usize,
        reserved: usize,
    ) -> Arc<ConnectionGate> {
        Arc::new(ConnectionGate {
            listener,
            max,
            reserved: reserved.min(max),
            per_peer,
            state: Mutex::new(GateState::default()),
        })
    }

    /// Lets a connection from `peer` in, or says why not. A connection takes an ordinary
    /// slot while there is one; when there is none, a reserved slot, but only one per
    /// address at a time, so the addresses that filled the listener cannot fill the reserve
    /// too. The per-peer cap counts both.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Admission, Refusal> {
        let key = PeerKey::of(peer);
        let mut state = self.lock();
        let ordinary_open = state.open - state.reserved_open;
        let slots = state.peers.get(&key);
        let peer_open = slots.map_or(0, |s| s.open);
        let peer_reserved = slots.map_or(0, |s| s.reserved);
        if peer_open >= self.per_peer {
            return Err(Refusal::PeerFull);
        }
        let reserved = if ordinary_open < self.max - self.reserved {
            false
        } else if state.reserved_open < self.reserved && peer_reserved == 0 {
            true
        } else {
            return Err(Refusal::ListenerFull);
        };
        state.open += 1;
        let slots = state.peers.entry(key).or_default();
        slots.open += 1;
        if reserved {
            slots.reserved += 1;
            state.reserved_open += 1;
        }
        metrics::gauge!("bc_connections", "listener" => self.listener).set(state.open as f64);
        Ok(Admission {
            gate: self.clone(),
            peer: key,
            reserved,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().open
    }

    fn release(&self, peer: PeerKey, reserved: bool) {
        let mut state = self.lock();
        state.open = state.open.saturating_sub(1);
        if reserved {
            state.reserved_open = state.reserved_open.saturating_sub(1);
        }
        if let Some(slots) = state.peers.get_mut(&peer) {
            slots.open = slots.open.saturating_sub(1);
            if reserved {
                slots.reserved = slots.reserved.saturating_sub(1);
            }
            if slots.open == 0 {
                state.peers.remove(&peer);
            }
        }
        metrics::gauge!("bc_connections", "listener" => self.listener).set(state.open as f64);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A connection's place in its listener's cap, given back when dropped (with the
/// connection).
pub struct Admission {
    gate: Arc<ConnectionGate>,
    peer: PeerKey,
    reserved: bool,
}

impl Admission {
    /// Whether the connection holds one of the reserved slots.
    pub fn is_reserved(&self) -> bool {
        self.reserved
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.gate.release(self.peer, self.reserved);
    }
}

/// Accepts connections on `listener` until `stop` resolves, lets each through `gate`, and
/// hands the admitted ones to `handle` (on a task of their own) with a [`StopSignal`] for
/// the graceful stop; refused ones are closed at once (with a reset, so they cost no
/// `TIME_WAIT`) and counted. After `stop`, signals every connection and waits until all
/// have dropped their signal: requests under way finish, idle connections close.
pub async fn accept_loop<H, F>(
    listener: TcpListener,
    gate: Arc<ConnectionGate>,
    stop: impl Future<Output = ()>,
    mut handle: H,
) where
    H: FnMut(Admitted<TcpStream>, SocketAddr, StopSignal) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let (stopping, signal) = watch::channel(false);
    tokio::pin!(stop);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(listener = gate.listener, error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        match gate.admit(peer.ip()) {
            Ok(admission) => {
                let _ = tcp.set_nodelay(true);
                let admitted = Admitted { io: tcp, admission };
                let signal = StopSignal(signal.clone());
                tokio::spawn(handle(admitted, peer, signal));
            }
            Err(refusal) => {
                metrics::counter!(
                    "bc_connections_refused_total",
                    "listener" => gate.listener,
                    "reason" => refusal.label()
                )
                .increment(1);
                tracing::debug!(listener = gate.listener, %peer, ?refusal, "connection refused at accept");
                let _ = tcp.set_zero_linger();
                drop(tcp);
            }
        }
    }
    drop(listener);
    drop(signal);
    let _ = stopping.send(true);
    stopping.closed().await;
}

/// Tells a connection that its listener is stopping; the listener waits until every
/// connection has dropped its signal.
pub struct StopSignal(watch::Receiver<bool>);

impl StopSignal {
    /// Resolves once the listener is stopping.
    pub async fn stopping(&mut self) {
        let _ = self.0.wait_for(|stopping| *stopping).await;
    }
}

/// A socket with its place in the listener's cap, which it gives back when it is dropped:
/// after an upgrade too, because the upgraded session owns the socket from then on.
pub struct Admitted<IO> {
    io: IO,
    admission: Admission,
}

impl<IO> Admitted<IO> {
    pub fn admission(&self) -> &Admission {
        &self.admission
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Serves HTTP/1.1 (with upgrades, for WebSockets) on `io` until the peer ends it or the
/// listener stops (then the request under way finishes first). A request's headers must
/// arrive within `header_timeout` of hyper starting to wait for them, which it does from
/// the connection's start and again after every response: silent and slowloris clients and
/// idle keep-alive connections are closed by the same timer.
///
/// hyper's own HTTP/1 connection, not hyper-util's `auto` one: `auto` first reads bytes to
/// tell HTTP/1 from HTTP/2, with no timer at all, so a connection that sends nothing would
/// never reach the header timeout. HTTP/1.1 only: the header timeout exists only there,
/// and neither browsers (over plain HTTP) nor daemons use HTTP/2.
pub async fn serve_http<I, S, B>(
    listener: &'static str,
    io: I,
    service: S,
    header_timeout: Duration,
    mut stop: StopSignal,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = stop.stopping() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(err) = result {
        if err.is_timeout() {
            count_timeout(listener, "header");
        }
        tracing::debug!(listener, error = %err, "connection ended with an error");
    }
}

pub(crate) fn count_timeout(listener: &'static str, stage: &'static str) {
    metrics::counter!("bc_connection_timeouts_total", "listener" => listener, "stage" => stage)
        .increment(1);
}

/// A socket that fails with `TimedOut` once nothing was read from or written to it for
/// `timeout`, noticed the next time it is read or written (a WebSocket session always waits
/// for a read, so a silent peer is noticed in time). This is the idle timeout of
/// connections that outlive HTTP's own timers, such as upgraded sessions.
pub struct IdleTimeout<IO> {
    io: IO,
    listener: &'static str,
    timeout: Duration,
    last_active: Instant,
    /// Fires at `last_active + timeout` or earlier; moved on lazily, only when it fires,
    /// so that busy sockets do not touch the timer on every read.
    check: Pin<Box<Sleep>>,
}

impl<IO> IdleTimeout<IO> {
    pub fn new(io: IO, listener: &'static str, timeout: Duration) -> IdleTimeout<IO> {
        let now = Instant::now();
        IdleTimeout {
            io,
            listener,
            timeout,
            last_active: now,
            check: Box::pin(tokio::time::sleep_until(now + timeout)),
        }
    }

    /// `Ready(error)` once the socket has been idle for the timeout; otherwise arms the
    /// timer for the moment it would be.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            if self.check.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let due = self.last_active + self.timeout;
            if Instant::now() >= due {
                count_timeout(self.listener, "idle");
                return Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the connection was idle too long",
                ));
            }
            self.check.as_mut().reset(due);
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for IdleTimeout<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    self.last_active = Instant::now();
                }
                Poll::Ready(result)
            }
            Poll::Pending => self.poll_idle(cx).map(Err),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write(cx, data) {
            Poll::Ready(result) => {
                if matches!(result, Ok(n) if n > 0) {
                    self.last_active = Instant::now();
                }
                Poll::Ready(result)
            }
            // A peer that stopped reading is as gone as one that stopped writing.
            Poll::Pending => self.poll_idle(cx).map(Err),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(result) => {
                if matches!(result, Ok(n) if n > 0) {
                    self.last_active = Instant::now();
                }
                Poll::Ready(result)
            }
            Poll::Pending => self.poll_idle(cx).map(Err),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn the_gate_caps_the_listener_and_each_peer() {
        let gate = ConnectionGate::new("test", 4, 2, 0);
        let a1 = gate.admit(ip("10.0.0.1")).expect("first");
        let _a2 = gate.admit(ip("10.0.0.1")).expect("second");
        assert_eq!(gate.admit(ip("10.0.0.1")).err(), Some(Refusal::PeerFull));
        let _b1 = gate.admit(ip("10.0.0.2")).expect("another peer");
        let _b2 = gate.admit(ip("10.0.0.2")).expect("another peer");
        assert_eq!(
            gate.admit(ip("10.0.0.3")).err(),
            Some(Refusal::ListenerFull)
        );
        drop(a1);
        assert_eq!(gate.open(), 3);
        let _c = gate.admit(ip("10.0.0.3")).expect("a freed slot");
    }

    #[test]
    fn reserved_slots_go_one_per_peer_once_the_rest_are_taken() {
        let gate = ConnectionGate::new("test", 5, 5, 2);
        let ordinary: Vec<_> = (0..3)
            .map(|_| gate.admit(ip("10.0.0.1")).expect("ordinary"))
            .collect();
        assert!(ordinary.iter().all(|a| !a.is_reserved()));
        let r1 = gate.admit(ip("10.0.0.1")).expect("a reserved slot");
        assert!(r1.is_reserved());
        assert_eq!(
            gate.admit(ip("10.0.0.1")).err(),
            Some(Refusal::ListenerFull),
            "one reserved slot per peer"
        );
        let r2 = gate.admit(ip("10.0.0.2")).expect("a reserved slot");
        assert!(r2.is_reserved());
        assert_eq!(
            gate.admit(ip("10.0.0.3")).err(),
            Some(Refusal::ListenerFull)
        );
        drop(r1);
        assert!(gate.admit(ip("10.0.0.3")).expect("freed").is_reserved());
    }

    #[test]
    fn ipv6_peers_count_by_their_64() {
        assert_eq!(
            PeerKey::of(ip("2001:db8:1:2::1")),
            PeerKey::of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            PeerKey::of(ip("2001:db8:1:2::1")),
            PeerKey::of(ip("2001:db8:1:3::1"))
        );
        assert_eq!(
            PeerKey::of(ip("::ffff:10.0.0.1")),
            PeerKey::of(ip("10.0.0.1"))
        );
    }
}
