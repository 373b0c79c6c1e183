//! Who may talk to a holder: the transfer secret proven without sending it,
//! and transfer ids nobody can guess.
//!
//! The handshake is a mutual challenge-response. The reader (any client)
//! sends a fresh nonce; the holder answers with its own nonce and an
//! HMAC-SHA256 under the secret over both; the reader checks it (a holder
//! that cannot is refused before it hears anything else) and answers with its
//! own HMAC over both nonces in the other order and another label; the holder
//! checks that before it serves any op. The secret itself never crosses the
//! wire, so a fake holder learns nothing from a reader, and a fake reader
//! gets nothing from a holder; fresh nonces on both sides make every proof
//! good for one connection only.

use crate::config::Secret;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a proof (an HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; PROOF_LEN];

/// Random bytes from the operating system's CSPRNG.
fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    // The OS random source failing is not something a caller can handle:
    // std's own HashMap seeding panics the same way.
    #[allow(clippy::expect_used)]
    getrandom::fill(&mut out).expect("the operating system's random source failed");
    out
}

/// A fresh handshake nonce.
pub(crate) fn nonce() -> Nonce {
    random()
}

fn mac(secret: &Secret, label: &[u8], first: &Nonce, second: &Nonce) -> Proof {
    // HMAC takes keys of any length.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        unreachable!("HMAC accepts keys of any length")
    };
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac.finalize().into_bytes().into()
}

/// What the holder sends: proof over the reader's nonce, then its own.
pub(crate) fn holder_proof(secret: &Secret, reader: &Nonce, holder: &Nonce) -> Proof {
    mac(secret, b"connex-transfer v2 holder", reader, holder)
}

/// What the reader sends: proof over the holder's nonce, then its own.
pub(crate) fn reader_proof(secret: &Secret, holder: &Nonce, reader: &Nonce) -> Proof {
    mac(secret, b"connex-transfer v2 reader", holder, reader)
}

/// Compares a proof in constant time.
pub(crate) fn verify(expected: &Proof, offered: &Proof) -> bool {
    expected.ct_eq(offered).into()
}

/// Hex digits of randomness a transfer id must end with (128 bits).
pub const ID_RANDOM_HEX: usize = 32;

/// A transfer id nobody can guess: `cx-` and 128 bits from the operating
/// system's CSPRNG in lowercase hex. A draw that [`check_id_entropy`] would
/// refuse (fewer than 8 distinct digits: about 1 in 28 million) is drawn
/// again, so that every id made here passes the holders' check.
pub fn new_transfer_id() -> String {
    id_from_draws(random)
}

/// The first of `draw`'s draws whose id passes [`check_id_entropy`].
fn id_from_draws(mut draw: impl FnMut() -> [u8; ID_RANDOM_HEX / 2]) -> String {
    loop {
        let mut id = String::with_capacity(3 + ID_RANDOM_HEX);
        id.push_str("cx-");
        for b in draw() {
            id.push_str(&format!("{b:02x}"));
        }
        if check_id_entropy(&id).is_ok() {
            return id;
        }
    }
}

/// Whether `id` can carry 128 random bits: it must end with
/// [`ID_RANDOM_HEX`] hex digits (any label may come before them), and not a
/// degenerate run of few distinct digits. A check of form only (a string
/// cannot prove where it came from); [`new_transfer_id`] makes ids that pass.
pub fn check_id_entropy(id: &str) -> Result<(), String> {
    let tail = id
        .len()
        .checked_sub(ID_RANDOM_HEX)
        .and_then(|at| id.get(at..))
        .filter(|tail| tail.bytes().all(|b| b.is_ascii_hexdigit()));
    let Some(tail) = tail else {
        return Err(format!(
            "transfer id {id:?} must end with {ID_RANDOM_HEX} random hex digits (128 bits; \
             use connex_transfer::new_transfer_id)"
        ));
    };
    let mut seen = [false; 16];
    for b in tail.bytes() {
        let digit = (b as char).to_digit(16).unwrap_or(0) as usize;
        seen[digit] = true;
    }
    // 32 random hex digits show about 14 distinct ones; fewer than 8 is not chance.
    if seen.iter().filter(|s| **s).count() < 8 {
        return Err(format!(
            "transfer id {id:?} does not look random (too few distinct digits)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn proofs_depend_on_the_secret_both_nonces_and_the_side() {
        let (a, b) = (Secret::new("one").unwrap(), Secret::new("two").unwrap());
        let (r, h) = (nonce(), nonce());
        assert_ne!(r, h);
        let p = holder_proof(&a, &r, &h);
        assert!(verify(&p, &holder_proof(&a, &r, &h)));
        assert!(!verify(&p, &holder_proof(&b, &r, &h)));
        assert!(!verify(&p, &holder_proof(&a, &h, &r)));
        assert!(!verify(&p, &holder_proof(&a, &r, &nonce())));
        // A holder's proof is never a reader's proof (no reflection).
        assert!(!verify(&p, &reader_proof(&a, &r, &h)));
    }

    #[test]
    fn new_ids_pass_the_entropy_check_and_guessable_ones_do_not() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| new_transfer_id()).collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            assert_eq!(id.len(), 3 + ID_RANDOM_HEX);
            check_id_entropy(id).unwrap();
        }
        for weak in [
            "h1",
            "engine-1-deadbeef",
            "xfer-12345678",
            &"0".repeat(32),
            "cx-0101010101010101010101010101010101",
            "cx-0123456789abcdef0123456789abcdeg",
            "é",
        ] {
            assert!(check_id_entropy(weak).is_err(), "{weak}");
        }
        check_id_entropy("label-5f3c9a1e7b2d4086a9c1e3f5b7d90246").unwrap();
    }

    #[test]
    fn a_draw_the_entropy_check_would_refuse_is_drawn_again() {
        // The first draw has 2 distinct digits, the second is fine.
        let draws = [
            [0x01u8; ID_RANDOM_HEX / 2],
            *b"\x01\x23\x45\x67\x89\xab\xcd\xef\x01\x23\x45\x67\x89\xab\xcd\xef",
        ];
        let mut next = draws.into_iter();
        let id = id_from_draws(|| next.next().unwrap());
        assert_eq!(id, "cx-0123456789abcdef0123456789abcdef");
        assert!(next.next().is_none(), "both draws were taken");
    }
}
