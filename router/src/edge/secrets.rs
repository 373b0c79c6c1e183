//! Tokens and secrets: read from a flag, the environment or a file (never only
//! argv, which `ps` shows), refused when empty, compared in constant time.

use crate::config::RouterConfig;
use std::path::{Path, PathBuf};
use subtle::ConstantTimeEq;

/// Why a secret could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("--{name} and --{name}-file are both set; give one")]
    Both { name: &'static str },
    #[error("--{name} is empty: an empty token would let anyone in")]
    Empty { name: &'static str },
    #[error("cannot read --{name}-file {path}: {source}")]
    Read {
        name: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Fills each secret of `config` from its file when one is named, and refuses
/// empty values.
pub fn resolve(config: &mut RouterConfig) -> Result<(), SecretError> {
    resolve_one(
        "admin-token",
        &mut config.access.admin_token,
        config.access.admin_token_file.as_deref(),
    )?;
    resolve_one(
        "register-token",
        &mut config.access.register_token,
        config.access.register_token_file.as_deref(),
    )?;
    resolve_one(
        "transfer-secret",
        &mut config.access.transfer_secret,
        config.access.transfer_secret_file.as_deref(),
    )?;
    resolve_one(
        "api-key",
        &mut config.tenants.api_key,
        config.tenants.api_key_file.as_deref(),
    )?;
    resolve_one(
        "etcd-password",
        &mut config.etcd.etcd_password,
        config.etcd.etcd_password_file.as_deref(),
    )?;
    resolve_one(
        "response-store-password",
        &mut config.responses.response_store_password,
        config.responses.response_store_password_file.as_deref(),
    )?;
    Ok(())
}

fn resolve_one(
    name: &'static str,
    value: &mut Option<String>,
    file: Option<&Path>,
) -> Result<(), SecretError> {
    if let Some(path) = file {
        if value.is_some() {
            return Err(SecretError::Both { name });
        }
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
            name,
            path: path.to_path_buf(),
            source,
        })?;
        // Files written by `echo` or mounted from a Kubernetes secret often end
        // with a newline that is not part of the token.
        *value = Some(text.trim_end_matches(['\n', '\r']).to_string());
    }
    if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
        return Err(SecretError::Empty { name });
    }
    Ok(())
}

/// Whether `headers` carry `Authorization: Bearer <expected>`, compared in
/// constant time (the length of `expected` is not secret).
pub fn bearer_matches(headers: &axum::http::HeaderMap, expected: &str) -> bool {
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given) if !expected.is_empty() => {
            bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use axum::http::HeaderMap;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", auth.parse().unwrap());
        h
    }

    #[test]
    fn bearer_needs_the_exact_token() {
        assert!(bearer_matches(&headers("Bearer s3cret"), "s3cret"));
        for wrong in [
            "Bearer s3cre",
            "Bearer s3cret2",
            "Bearer ",
            "s3cret",
            "Basic s3cret",
        ] {
            assert!(!bearer_matches(&headers(wrong), "s3cret"), "{wrong}");
        }
        assert!(!bearer_matches(&headers("Bearer "), ""));
        assert!(!bearer_matches(&HeaderMap::new(), "s3cret"));
    }

    #[test]
    fn files_are_read_and_empty_values_refused() {
        let dir = std::env::temp_dir().join(format!("connex-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        let mut value = None;
        resolve_one("admin-token", &mut value, Some(&file)).unwrap();
        assert_eq!(value.as_deref(), Some("from-file"));
        let mut both = Some("x".to_string());
        assert!(matches!(
            resolve_one("admin-token", &mut both, Some(&file)),
            Err(SecretError::Both { .. })
        ));
        std::fs::write(&file, "\n").unwrap();
        let mut empty = None;
        assert!(matches!(
            resolve_one("admin-token", &mut empty, Some(&file)),
            Err(SecretError::Empty { .. })
        ));
        let mut blank = Some(String::new());
        assert!(matches!(
            resolve_one("register-token", &mut blank, None),
            Err(SecretError::Empty { .. })
        ));
    }
}
