//! The router's chained hash of full token blocks: block `i`'s hash covers
//! every token of blocks `0..=i`, so one hash names a whole prefix, as vLLM's
//! block hashes do. Stable across processes and versions (FNV-1a 64 and the
//! splitmix64 finaliser, written out here), so that tests and tools can
//! compute it too.

/// The parent of a prompt's first block.
pub const ROOT: u64 = 0x636f_6e6e_6578_2d30; // "connex-0"

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
/// as an engine caches only full blocks).
pub fn chain(ids: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = ROOT;
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
}
