//! Tokenizers the router runs itself (`--tokenizer MODEL=PATH`, the model's
//! Hugging Face `tokenizer.json`): `cache_aware` gets a completions text
//! prompt's token ids in process, without the round trip to an engine's
//! `/tokenize` (2-5 ms per request measured, `docs/bench.md`, "prefix").
//!
//! The ids must be the engine's, or the prompt's block hashes match nothing
//! the engines cached: the file must be the one the engines load (the
//! model's own), and the router tokenizes as vLLM's completions do (special
//! tokens added unless the request says `add_special_tokens: false`, no
//! truncation). Only `tokenizer.json` is read: an engine whose tokenizer
//! departs from it (`tokenizer_config.json`'s `add_bos_token` against the
//! file's post-processor, vLLM's mistral tokenizer mode) needs the engine's
//! `/tokenize` (docs/routing.md). Chat prompts still go through an engine's
//! `/tokenize`: their ids depend on the model's chat template, rendered by
//! the engine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenizers::Tokenizer;
use tokio::sync::Semaphore;

/// Prompts longer than this many bytes are tokenized on a blocking thread,
/// so that they do not hold up the runtime's other requests: a Hugging Face
/// tokenizer takes ~0.2 us per character (0.45 ms for 2 k characters of
/// byte-level BPE, measured), far longer than a request's other work on the
/// runtime between two awaits.
const INLINE_BYTES: usize = 1024;
/// Longest prompt tokenized here, in bytes (about 250 k tokens of English):
/// an encoding costs tens of bytes a token (ids, offsets, token strings) and
/// cannot be stopped half-way, so a 32 MB prompt would hold a permit and
/// half a GB for seconds, its caller long gone. A longer prompt is routed by
/// load alone (`cache_aware` misses nothing it could have found cheaply).
pub const MAX_TOKENIZED_BYTES: usize = 1024 * 1024;

/// Why the tokenizers could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("--tokenizer `{0}`: expected MODEL=PATH (the model's tokenizer.json)")]
    Spec(String),
    #[error("--tokenizer: model `{0}` is given twice")]
    Twice(String),
    #[error("cannot load the tokenizer of model `{model}` from {}: {message}", path.display())]
    Load {
        model: String,
        path: PathBuf,
        message: String,
    },
}

/// The tokenizers of the models that have one here.
#[derive(Clone)]
pub struct Tokenizers {
    by_model: HashMap<String, Arc<Tokenizer>>,
    /// Prompts tokenized at once, one per core: past that, a burst of long
    /// prompts waits here (within the caller's time limit) instead of
    /// filling the blocking pool with threads that share the same cores.
    permits: Arc<Semaphore>,
}

impl Default for Tokenizers {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Self {
            by_model: HashMap::new(),
            permits: Arc::new(Semaphore::new(cores)),
        }
    }
}

impl std::fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.by_model.keys()).finish()
    }
}

impl Tokenizers {
    /// Loads each `MODEL=PATH` of `specs`.
    pub fn load(specs: &[String]) -> Result<Self, TokenizerError> {
        let mut by_model = HashMap::new();
        for spec in specs {
            let (model, path) = spec
                .split_once('=')
                .filter(|(m, p)| !m.is_empty() && !p.is_empty())
                .ok_or_else(|| TokenizerError::Spec(spec.clone()))?;
            let tokenizer = load_file(model, Path::new(path))?;
            if by_model
                .insert(model.to_string(), Arc::new(tokenizer))
                .is_some()
            {
                return Err(TokenizerError::Twice(model.to_string()));
            }
            tracing::info!(
                model,
                path,
                "tokenizer loaded: text prompts are tokenized here"
            );
        }
        Ok(Self {
            by_model,
            ..Self::default()
        })
    }

    /// These tokenizers with `permits` prompts tokenized at once (tests).
    #[cfg(test)]
    pub(crate) fn with_permits(self, permits: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(permits)),
            ..self
        }
    }

    /// The permits of prompts tokenized at once, for a test to take them.
    #[cfg(test)]
    pub(crate) fn permits(&self) -> Arc<Semaphore> {
        self.permits.clone()
    }

    /// Whether `model` has a tokenizer here.
    pub fn has(&self, model: &str) -> bool {
        self.by_model.contains_key(model)
    }

    /// The token ids of `text` for `model`, as vLLM's completions tokenize a
    /// text prompt; `None` when the model has no tokenizer here or the text
    /// cannot be encoded. The caller bounds the time (the wait for a turn
    /// included).
    pub async fn encode(&self, model: &str, text: &str, special_tokens: bool) -> Option<Vec<u32>> {
        let tokenizer = self.by_model.get(model)?.clone();
        if text.len() > MAX_TOKENIZED_BYTES {
            tracing::debug!(bytes = text.len(), "prompt too long to tokenize here");
            return None;
        }
        // Held until the encoding is done, even when the caller gave up
        // (bounded: at most MAX_TOKENIZED_BYTES of text).
        let turn = self.permits.clone().acquire_owned().await.ok()?;
        if text.len() <= INLINE_BYTES {
            return encode(&tokenizer, text, special_tokens);
        }
        let text = text.to_string();
        tokio::task::spawn_blocking(move || {
            let ids = encode(&tokenizer, &text, special_tokens);
            drop(turn);
            ids
        })
        .await
        .ok()
        .flatten()
    }
}

fn load_file(model: &str, path: &Path) -> Result<Tokenizer, TokenizerError> {
    let failed = |message: String| TokenizerError::Load {
        model: model.to_string(),
        path: path.to_path_buf(),
        message,
    };
    let mut tokenizer = Tokenizer::from_file(path).map_err(|e| failed(e.to_string()))?;
    // vLLM tokenizes a prompt whole: a file's own truncation or padding
    // settings (left from training) would change the ids.
    tokenizer
        .with_truncation(None)
        .map_err(|e| failed(e.to_string()))?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

fn encode(tokenizer: &Tokenizer, text: &str, special_tokens: bool) -> Option<Vec<u32>> {
    match tokenizer.encode_fast(text, special_tokens) {
        Ok(encoding) => Some(encoding.get_ids().to_vec()),
        Err(err) => {
            tracing::debug!(%err, "the router's tokenizer failed; the engine's is asked");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file in the temp dir, removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn file(json: &serde_json::Value) -> TempFile {
        let path =
            std::env::temp_dir().join(format!("connex-tokenizer-{}.json", uuid::Uuid::new_v4()));
        std::fs::write(&path, json.to_string()).expect("write");
        TempFile(path)
    }

    #[tokio::test]
    async fn the_mock_engines_tokenizer_file_gives_its_ids() {
        let file = file(&connex_mock_engine::model::tokenizer_json());
        let spec = format!("mock={}", file.path().display());
        let tokenizers = Tokenizers::load(&[spec]).expect("loaded");
        for text in ["plain ascii", "héllo wörld ✓ 🦀", "  spaces\n\tand tabs  "] {
            assert_eq!(
                tokenizers.encode("mock", text, true).await,
                Some(connex_mock_engine::model::tokenize(text)),
                "{text:?}"
            );
        }
        let long = "long prompt ".repeat(200);
        assert_eq!(
            tokenizers.encode("mock", &long, true).await,
            Some(connex_mock_engine::model::tokenize(&long)),
            "on a blocking thread"
        );
        assert_eq!(tokenizers.encode("other", "x", true).await, None);
        // Past the bound, nothing is tokenized here (and no permit is taken).
        let huge = "x".repeat(MAX_TOKENIZED_BYTES + 1);
        let tokenizers = tokenizers.with_permits(0);
        let encoded = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            tokenizers.encode("mock", &huge, true),
        )
        .await;
        assert_eq!(encoded, Ok(None));
    }

    /// One prompt per permit: while every permit is taken (long prompts being
    /// tokenized), another waits its turn instead of taking a thread, and is
    /// tokenized as soon as one is given back.
    #[tokio::test]
    async fn a_prompt_waits_for_a_free_permit() {
        let file = file(&connex_mock_engine::model::tokenizer_json());
        let tokenizers = Tokenizers::load(&[format!("mock={}", file.path().display())])
            .expect("loaded")
            .with_permits(1);
        let busy = tokenizers.permits().acquire_owned().await.expect("permit");
        let long = "long prompt ".repeat(200);
        let waiting = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            tokenizers.encode("mock", &long, true),
        )
        .await;
        assert!(waiting.is_err(), "tokenized without a permit");
        drop(busy);
        assert_eq!(
            tokenizers.encode("mock", &long, true).await,
            Some(connex_mock_engine::model::tokenize(&long))
        );
        assert_eq!(
            tokenizers.permits.available_permits(),
            1,
            "the permit came back"
        );
    }

    #[test]
    fn bad_specs_and_files_are_clear_errors() {
        let bad = |spec: &str| {
            Tokenizers::load(&[spec.to_string()])
                .expect_err(spec)
                .to_string()
        };
        assert!(bad("no-equals").contains("expected MODEL=PATH"));
        assert!(bad("m=").contains("expected MODEL=PATH"));
        assert!(
            bad("m=/nonexistent/tokenizer.json").contains("cannot load the tokenizer of model `m`")
        );
        let not_one = file(&serde_json::json!({"not": "a tokenizer"}));
        assert!(bad(&format!("m={}", not_one.path().display())).contains("cannot load"));
        let good = file(&connex_mock_engine::model::tokenizer_json());
        let spec = format!("m={}", good.path().display());
        let twice = Tokenizers::load(&[spec.clone(), spec]).expect_err("twice");
        assert!(twice.to_string().contains("given twice"));
    }
}
