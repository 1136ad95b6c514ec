//! Secrets at rest: the key that seals BMC credentials before they are stored, and the
//! credentials themselves, whose `Debug` never shows them.
//!
//! XChaCha20-Poly1305 (RustCrypto's `chacha20poly1305`): a random 192-bit nonce per seal, so
//! nonces never repeat in practice without a counter to keep; the node's id is the associated
//! data, so a sealed blob copied onto another node's row does not open. The key is 32 random
//! bytes in a file of its own (hex), created owner-only on first start like the CA's key
//! (`bare_metal.credential_key_file`, by default `data_dir/bmc-credentials.key`).

use anyhow::{Context, anyhow};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;

const KEY_BYTES: usize = 32;
const NONCE_BYTES: usize = 24;

/// The key that seals and opens BMC credentials.
pub struct CredentialKey {
    cipher: XChaCha20Poly1305,
    id: String,
}

impl std::fmt::Debug for CredentialKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl CredentialKey {
    fn from_bytes(key: &[u8; KEY_BYTES]) -> CredentialKey {
        let mut fingerprint = Sha256::new();
        fingerprint.update(b"bc-bmc-credential-key\0");
        fingerprint.update(key);
        CredentialKey {
            cipher: XChaCha20Poly1305::new(&Key::from(*key)),
            id: hex::encode(&fingerprint.finalize()[..8]),
        }
    }

    /// Loads the key from `path`, creating it there (owner-only) on first start.
    pub fn load_or_create(path: &Path) -> anyhow::Result<CredentialKey> {
        if !path.exists() {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let key: [u8; KEY_BYTES] = rand::random();
            crate::private_file::write_private(path, hex::encode(key).as_bytes())
                .with_context(|| format!("creating the BMC credential key {}", path.display()))?;
            tracing::info!(path = %path.display(), "created the BMC credential key");
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the BMC credential key {}", path.display()))?;
        let bytes = hex::decode(text.trim())
            .ok()
            .and_then(|b| <[u8; KEY_BYTES]>::try_from(b).ok())
            .ok_or_else(|| {
                anyhow!(
                    "{} is not a BMC credential key (64 hex digits)",
                    path.display()
                )
            })?;
        Ok(CredentialKey::from_bytes(&bytes))
    }

    /// A key that lives only as long as this process: for services built without a
    /// configuration (unit tests). Credentials it sealed do not survive a restart.
    pub fn ephemeral() -> CredentialKey {
        CredentialKey::from_bytes(&rand::random())
    }

    /// A fingerprint of the key (not the key), stored beside what it sealed: a row sealed
    /// with another key is reported as such instead of as corrupt.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Seals `plaintext` bound to `context` (the node's id): base64 of nonce and ciphertext.
    pub fn seal(&self, context: &str, plaintext: &[u8]) -> anyhow::Result<String> {
        let nonce: [u8; NONCE_BYTES] = rand::random();
        let sealed = self
            .cipher
            .encrypt(
                &XNonce::from(nonce),
                Payload {
                    msg: plaintext,
                    aad: context.as_bytes(),
                },
            )
            .map_err(|_| anyhow!("sealing failed"))?;
        let mut out = nonce.to_vec();
        out.extend(sealed);
        Ok(BASE64.encode(out))
    }

    /// Opens what [`CredentialKey::seal`] sealed for the same `context`.
    pub fn open(&self, context: &str, sealed: &str) -> anyhow::Result<Vec<u8>> {
        let bytes = BASE64
            .decode(sealed)
            .map_err(|_| anyhow!("sealed credentials are not base64"))?;
        if bytes.len() < NONCE_BYTES {
            return Err(anyhow!("sealed credentials are too short"));
        }
        let (nonce, ciphertext) = bytes.split_at(NONCE_BYTES);
        let nonce = <[u8; NONCE_BYTES]>::try_from(nonce)
            .map_err(|_| anyhow!("sealed credentials are too short"))?;
        self.cipher
            .decrypt(
                &XNonce::from(nonce),
                Payload {
                    msg: ciphertext,
                    aad: context.as_bytes(),
                },
            )
            .map_err(|_| anyhow!("sealed credentials do not open with this key and node"))
    }
}

/// A BMC's user name and password. `Debug` shows neither; serialising them is only for
/// sealing ([`BmcCredentials::seal`]).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcCredentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for BmcCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BmcCredentials { <redacted> }")
    }
}

impl BmcCredentials {
    pub fn seal(&self, key: &CredentialKey, node_id: &str) -> anyhow::Result<String> {
        key.seal(node_id, &serde_json::to_vec(self)?)
    }

    pub fn open(key: &CredentialKey, node_id: &str, sealed: &str) -> anyhow::Result<Self> {
        Ok(serde_json::from_slice(&key.open(node_id, sealed)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credentials() -> BmcCredentials {
        BmcCredentials {
            username: "admin".into(),
            password: "s3cret-pa55".into(),
        }
    }

    #[test]
    fn sealed_credentials_open_only_with_their_key_and_node() {
        let key = CredentialKey::ephemeral();
        let sealed = credentials().seal(&key, "node_a").expect("sealed");
        assert!(
            !sealed.contains("s3cret"),
            "the password is not in the blob"
        );
        assert_ne!(
            sealed,
            credentials().seal(&key, "node_a").expect("sealed"),
            "a fresh nonce each time"
        );
        assert_eq!(
            BmcCredentials::open(&key, "node_a", &sealed).ok(),
            Some(credentials())
        );
        assert!(BmcCredentials::open(&key, "node_b", &sealed).is_err());
        assert!(BmcCredentials::open(&CredentialKey::ephemeral(), "node_a", &sealed).is_err());
        let mut tampered = BASE64.decode(&sealed).expect("base64");
        if let Some(last) = tampered.last_mut() {
            *last ^= 1;
        }
        assert!(BmcCredentials::open(&key, "node_a", &BASE64.encode(tampered)).is_err());
    }

    #[test]
    fn debug_never_shows_secrets() {
        let shown = format!("{:?} {:?}", credentials(), CredentialKey::ephemeral());
        assert!(
            !shown.contains("s3cret") && !shown.contains("admin"),
            "{shown}"
        );
    }

    #[test]
    fn the_key_file_is_created_owner_only_and_read_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keys").join("bmc.key");
        let key = CredentialKey::load_or_create(&path).expect("created");
        let again = CredentialKey::load_or_create(&path).expect("loaded");
        assert_eq!(key.id(), again.id());
        let sealed = key.seal("n", b"x").expect("sealed");
        assert_eq!(again.open("n", &sealed).ok(), Some(b"x".to_vec()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path)
                .expect("exists")
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "owner-only: {mode:o}");
        }
        std::fs::write(&path, "not a key").expect("written");
        assert!(CredentialKey::load_or_create(&path).is_err());
    }
}
