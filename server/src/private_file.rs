//! Files only their owner may read: the JWT secret and the CA's key.

use std::path::Path;

/// Writes `contents` to a new file at `path` (never over an existing one) that only its
/// owner can read and write.
pub(crate) fn write_private(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)?.write_all(contents)?;
    Ok(())
}
