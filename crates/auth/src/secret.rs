//! The deployment secret: loading it, checking it is fit, and the per-user default.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Environment variable holding the secret itself (at least [`MIN_SECRET_BYTES`] bytes).
pub const ENV_SECRET: &str = "MORI_SECRET";
/// Environment variable naming a file that holds the secret (mode 0600, owned by the user).
pub const ENV_SECRET_FILE: &str = "MORI_SECRET_FILE";
/// Shortest secret accepted (128 bits).
pub const MIN_SECRET_BYTES: usize = 16;

/// A deployment secret. Its bytes never appear in `Debug`, logs or errors; [`fingerprint`]
/// (Self::fingerprint) tells two secrets apart without revealing either.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(fingerprint {})", self.fingerprint())
    }
}

impl Secret {
    /// A secret from bytes (at least [`MIN_SECRET_BYTES`]).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self> {
        let bytes = bytes.into();
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(Error::Secret(format!(
                "a secret must have at least {MIN_SECRET_BYTES} bytes (got {})",
                bytes.len()
            )));
        }
        Ok(Self(bytes))
    }

    /// 32 fresh random bytes.
    pub fn random() -> Result<Self> {
        let mut b = vec![0u8; 32];
        getrandom::fill(&mut b)
            .map_err(|e| Error::Secret(format!("no random bytes from the OS: {e}")))?;
        Ok(Self(b))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// 8 bytes only holders of this secret can compute: the first 8 bytes of
    /// HMAC-SHA256(secret, label | 0 | context), little-endian. For masking values sent
    /// alongside a descriptor (e.g. a fabric memory key), so the descriptor alone is not enough.
    pub fn derive_u64(&self, label: &str, context: &[u8]) -> u64 {
        use hmac::{Hmac, Mac};
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(label.as_bytes());
        m.update(&[0]);
        m.update(context);
        let out = m.finalize().into_bytes();
        u64::from_le_bytes(out[..8].try_into().expect("an HMAC-SHA256 has 32 bytes"))
    }

    /// The first 8 bytes of SHA-256("mori-secret-fingerprint" | secret), in hex.
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"mori-secret-fingerprint");
        h.update(&self.0);
        hex::encode(&h.finalize()[..8])
    }

    /// Reads a secret file: owned by this user, not readable or writable by anyone else,
    /// surrounding whitespace ignored.
    pub fn from_file(path: &Path) -> Result<Self> {
        let shown = path.display();
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::Secret(format!("secret file {shown}: {e}")))?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(Error::Secret(format!(
                "secret file {shown} belongs to uid {}, not to this user ({me})",
                meta.uid()
            )));
        }
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(Error::Secret(format!(
                "secret file {shown} is accessible by other users (mode {:o}): chmod 600 it",
                meta.permissions().mode() & 0o777
            )));
        }
        let raw = std::fs::read(path)
            .map_err(|e| Error::Secret(format!("reading secret file {shown}: {e}")))?;
        Self::new(raw.trim_ascii().to_vec())
            .map_err(|e| Error::Secret(format!("secret file {shown}: {e}")))
    }

    /// `MORI_SECRET_FILE`, else `MORI_SECRET`; `None` when neither is set.
    pub fn from_env() -> Result<Option<Self>> {
        if let Some(path) = std::env::var_os(ENV_SECRET_FILE).filter(|p| !p.is_empty()) {
            return Self::from_file(Path::new(&path)).map(Some);
        }
        match std::env::var_os(ENV_SECRET).filter(|s| !s.is_empty()) {
            Some(s) => Self::new(s.into_encoded_bytes())
                .map(Some)
                .map_err(|e| Error::Secret(format!("{ENV_SECRET}: {e}"))),
            None => Ok(None),
        }
    }

    /// The deployment's secret: from the environment, else the per-user default file
    /// (created with a random secret on first use).
    pub fn deployment() -> Result<Self> {
        match Self::from_env()? {
            Some(s) => Ok(s),
            None => Self::user_default(),
        }
    }

    /// Where the per-user default secret lives: `$XDG_CONFIG_HOME/mori/secret`, else
    /// `$HOME/.config/mori/secret`.
    pub fn user_default_path() -> Result<PathBuf> {
        let base = std::env::var_os("XDG_CONFIG_HOME")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|p| !p.is_empty())
                    .map(|h| PathBuf::from(h).join(".config"))
            })
            .ok_or_else(|| {
                Error::Secret(format!(
                    "no HOME or XDG_CONFIG_HOME for the default secret: set {ENV_SECRET_FILE}"
                ))
            })?;
        Ok(base.join("mori").join("secret"))
    }

    /// Reads the per-user default secret, creating it (atomically, mode 0600) if missing.
    pub fn user_default() -> Result<Self> {
        let path = Self::user_default_path()?;
        if !path.exists() {
            create_secret_file(&path)?;
        }
        Self::from_file(&path)
    }
}

/// Writes a new random secret to `path` unless another process got there first: the secret
/// is written to a private temporary file which is then hard-linked into place (the link
/// fails if `path` exists, so every process ends up reading the same secret).
fn create_secret_file(path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| Error::Secret(format!("bad secret path {}", path.display())))?;
    let ctx = |what: &str, e: std::io::Error| {
        Error::Secret(format!(
            "{what} for the default secret {}: {e} (or set {ENV_SECRET_FILE})",
            path.display()
        ))
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| ctx("creating the directory", e))?;
    let tmp = tempfile_in(dir).map_err(|e| ctx("creating a temporary file", e))?;
    let secret = Secret::random()?;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(hex::encode(secret.bytes()).as_bytes())?;
            f.sync_all()
        });
    let linked = written.and_then(|()| match std::fs::hard_link(&tmp, path) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        other => other,
    });
    let _ = std::fs::remove_file(&tmp);
    linked.map_err(|e| ctx("writing", e))?;
    tracing::info!("created the default mori secret {}", path.display());
    Ok(())
}

/// A new empty file of mode 0600 in `dir` with a random name.
fn tempfile_in(dir: &Path) -> std::io::Result<PathBuf> {
    let mut r = [0u8; 8];
    getrandom::fill(&mut r).map_err(|e| std::io::Error::other(e.to_string()))?;
    let p = dir.join(format!(".secret-{}", hex::encode(r)));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&p)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_secrets_are_refused_and_debug_hides_the_bytes() {
        assert!(Secret::new(b"short".to_vec()).is_err());
        let s = Secret::new(b"0123456789abcdef-secret".to_vec()).unwrap();
        let shown = format!("{s:?}");
        assert!(!shown.contains("0123456789"), "{shown}");
        assert_eq!(shown, format!("Secret(fingerprint {})", s.fingerprint()));
        assert_ne!(s.fingerprint(), Secret::random().unwrap().fingerprint());
    }

    #[test]
    fn secret_files_must_be_private() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, "  a-long-enough-secret-value \n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Secret::from_file(&p).unwrap_err().to_string();
        assert!(err.contains("accessible by other users"), "{err}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = Secret::from_file(&p).unwrap();
        assert_eq!(s.bytes(), b"a-long-enough-secret-value");
    }

    #[test]
    fn the_default_file_is_created_once_and_shared() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mori").join("secret");
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let p = path.clone();
                std::thread::spawn(move || {
                    if !p.exists() {
                        create_secret_file(&p).unwrap();
                    }
                    Secret::from_file(&p).unwrap()
                })
            })
            .collect();
        let secrets: Vec<Secret> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(secrets.windows(2).all(|w| w[0] == w[1]));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);
    }
}
