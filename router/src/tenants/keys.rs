//! Client keys: which tenant a request's key belongs to, compared in
//! constant time (every key is compared, whichever matches).

use axum::http::HeaderMap;
use subtle::ConstantTimeEq;

/// The keys of every tenant, each with its tenant's index.
#[derive(Debug, Default)]
pub struct KeyRing {
    keys: Vec<(Box<[u8]>, usize)>,
}

impl KeyRing {
    pub fn new(keys: impl IntoIterator<Item = (String, usize)>) -> Self {
        Self {
            keys: keys
                .into_iter()
                .map(|(key, tenant)| (key.into_bytes().into_boxed_slice(), tenant))
                .collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tenant whose key `given` is. No early exit: the time taken does
    /// not say how many keys were tried, nor how much of one matched.
    pub fn find(&self, given: &[u8]) -> Option<usize> {
        let mut found = None;
        for (key, tenant) in &self.keys {
            if bool::from(key.as_ref().ct_eq(given)) {
                found = Some(*tenant);
            }
        }
        found
    }
}

/// The key a request presents: `Authorization: Bearer KEY` (OpenAI clients),
/// or `x-api-key: KEY` (Anthropic clients).
pub fn presented(headers: &HeaderMap) -> Option<&[u8]> {
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(|v| v.strip_prefix(b"Bearer "));
    bearer
        .or_else(|| headers.get("x-api-key").map(|v| v.as_bytes()))
        .filter(|key| !key.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_find_their_tenant_and_nothing_else() {
        let ring = KeyRing::new([("sk-alpha-1".to_string(), 0), ("sk-beta-22".to_string(), 1)]);
        assert_eq!(ring.find(b"sk-alpha-1"), Some(0));
        assert_eq!(ring.find(b"sk-beta-22"), Some(1));
        assert_eq!(ring.find(b"sk-alpha-"), None);
        assert_eq!(ring.find(b"sk-alpha-12"), None);
        assert_eq!(ring.find(b""), None);
    }

    #[test]
    fn the_key_comes_from_either_header() {
        let mut headers = HeaderMap::new();
        assert_eq!(presented(&headers), None);
        headers.insert(
            "x-api-key",
            "sk-anthropic".parse().unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(presented(&headers), Some(&b"sk-anthropic"[..]));
        headers.insert(
            "authorization",
            "Bearer sk-openai"
                .parse()
                .unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(presented(&headers), Some(&b"sk-openai"[..]));
        headers.insert(
            "authorization",
            "Basic abc".parse().unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(presented(&headers), Some(&b"sk-anthropic"[..]));
    }
}
