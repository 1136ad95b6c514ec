//! Test support for the futures and streams a server holds for as long as a connection lives:
//! with 10,000 sessions or subscribers, each byte of one is 10 KB of the server's memory
//! (issue 16), and a storage call's future awaited inline is kilobytes of it.

/// The size of what `f` returns, computed from its type, without calling it.
pub fn size_returned_by<A, B, C, F, R>(_: F) -> usize
where
    F: FnOnce(A, B, C) -> R,
{
    size_of::<R>()
}
