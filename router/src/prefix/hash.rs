//! The router's chained hash of full token blocks: block `i`'s hash covers
//! every token of blocks `0..=i`, so one hash names a whole prefix, as vLLM's
//! block hashes do. Stable across processes and versions (FNV-1a 64 and the
//! splitmix64 finaliser, written out here), so that tests and tools can
//! compute it too.

/// The parent of a prompt's first block (a prompt without a `cache_salt`).
pub const ROOT: u64 = 0x636f_6e6e_6578_2d30; // "connex-0"

/// The parent of the first block of a prompt sent with `salt` (vLLM's
/// `cache_salt`, which it mixes into the first block's hash): one prompt
/// under two salts is two unrelated chains, in the engine's cache as in the
/// router's index.
pub fn root(salt: Option<&str>) -> u64 {
    match salt {
        None => ROOT,
        // The salt's bytes folded into a block of their own after ROOT (as
        // token-sized pieces; its length is in the hash, so no two salts
        // fold alike by padding).
        Some(salt) => {
            let mut words: Vec<u32> = salt
                .as_bytes()
                .chunks(4)
                .map(|c| {
                    let mut w = [0u8; 4];
                    w[..c.len()].copy_from_slice(c);
                    u32::from_le_bytes(w)
                })
                .collect();
            words.push(u32::try_from(salt.len()).unwrap_or(u32::MAX));
            block(ROOT ^ 0x7361_6c74, &words)
        }
    }
}

/// A prompt as the prefix index reads it: its token ids and the root of its
/// chain ([`root`] of its `cache_salt`).
#[derive(Debug, Clone, Copy)]
pub struct Prompt<'a> {
    pub ids: &'a [u32],
    pub root: u64,
}

impl<'a> Prompt<'a> {
    pub fn new(ids: &'a [u32], root: u64) -> Self {
        Self { ids, root }
    }
}

/// The hash of one full block of `tokens` following the block `parent`.
pub fn block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut absorb = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    absorb(&parent.to_le_bytes());
    absorb(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        absorb(&t.to_le_bytes());
    }
    // FNV alone mixes its last bytes poorly into the high bits.
    let mut z = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hashes of every full block of `ids` (a partial last block has none,
/// as an engine caches only full blocks), unsalted.
#[cfg(test)]
pub fn chain(ids: &[u32], block_size: usize) -> Vec<u64> {
    chain_from(ROOT, ids, block_size)
}

/// The hashes of every full block of `ids` (a partial last block has none,
/// as an engine caches only full blocks), from `root` (a salted prompt's,
/// [`root`]; unsalted, [`ROOT`]).
pub fn chain_from(root: u64, ids: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = root;
    ids.chunks_exact(block_size)
        .map(|tokens| {
            parent = block(parent, tokens);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_hash_names_its_whole_prefix() {
        let a = chain(&[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3, "the partial last block has no hash");
        let b = chain(&[1, 2, 3, 4, 9, 9], 2);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // The same tokens after another prefix are another block.
        assert_ne!(chain(&[3, 4], 2)[0], a[1]);
        assert!(chain(&[1, 2], 0).is_empty());
    }

    #[test]
    fn a_salt_makes_another_chain_of_the_same_tokens() {
        let ids = [1, 2, 3, 4];
        assert_eq!(chain_from(root(None), &ids, 2), chain(&ids, 2));
        let a = chain_from(root(Some("tenant:a")), &ids, 2);
        let b = chain_from(root(Some("tenant:b")), &ids, 2);
        assert_ne!(a, b);
        assert_ne!(a, chain(&ids, 2));
        assert_ne!(a[1], chain(&ids, 2)[1]);
        // Salts that differ only by trailing zero bytes are not one.
        assert_ne!(root(Some("a")), root(Some("a\0")));
    }
}
