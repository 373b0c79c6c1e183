//! A request body for an engine, in pieces: the few bytes the router writes
//! itself (the fields it sets or changes) between slices of the client's own
//! body (its large fields, as it sent them). The pieces share the client's
//! body buffer instead of copying it, so that a 30 MB prompt costs the
//! router 30 MB once, however many prefill and decode calls send it
//! (`protocols::openai::patch`); they are written to the socket in order,
//! never joined.

use bytes::{Buf, Bytes};
use std::io::IoSlice;

/// A request body: its pieces in order (none empty).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    pieces: Vec<Bytes>,
    len: usize,
}

impl Payload {
    /// An empty body.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `piece` (an empty one is left out).
    pub fn push(&mut self, piece: Bytes) {
        if !piece.is_empty() {
            self.len += piece.len();
            self.pieces.push(piece);
        }
    }

    /// Bytes in all.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces, in order.
    pub fn pieces(&self) -> &[Bytes] {
        &self.pieces
    }

    /// The body in one buffer (a copy when it has several pieces: for tests
    /// and small bodies, never on a request's path).
    pub fn to_bytes(&self) -> Bytes {
        match self.pieces.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            pieces => Bytes::from(pieces.concat()),
        }
    }

    /// A reader of the body for writing it out (the pieces are shared, not
    /// copied).
    pub fn reader(&self) -> PayloadReader {
        PayloadReader {
            pieces: self.pieces.clone(),
            at: 0,
            remaining: self.len,
        }
    }
}

impl From<Bytes> for Payload {
    fn from(bytes: Bytes) -> Self {
        let mut payload = Self::new();
        payload.push(bytes);
        payload
    }
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Self {
        Bytes::from(bytes).into()
    }
}

/// A [`Payload`] as a [`Buf`], consumed as it is written.
#[derive(Debug)]
pub struct PayloadReader {
    pieces: Vec<Bytes>,
    /// The first piece not wholly consumed.
    at: usize,
    remaining: usize,
}

impl Buf for PayloadReader {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.pieces.get(self.at).map_or(&[], |piece| piece.as_ref())
    }

    fn advance(&mut self, mut count: usize) {
        count = count.min(self.remaining);
        self.remaining -= count;
        while count > 0 {
            let Some(piece) = self.pieces.get_mut(self.at) else {
                return;
            };
            let step = count.min(piece.len());
            piece.advance(step);
            count -= step;
            if piece.is_empty() {
                // Consumed: its share of the buffer is let go at once.
                *piece = Bytes::new();
                self.at += 1;
            }
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let pieces = self.pieces.get(self.at..).unwrap_or_default();
        let mut filled = 0;
        for (slot, piece) in dst.iter_mut().zip(pieces) {
            *slot = IoSlice::new(piece);
            filled += 1;
        }
        filled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_read_in_order_and_empty_ones_are_left_out() {
        let shared = Bytes::from_static(b"[1,2,3]");
        let mut payload = Payload::new();
        payload.push(Bytes::from_static(b"{\"prompt\":"));
        payload.push(Bytes::new());
        payload.push(shared.clone());
        payload.push(Bytes::from_static(b"}"));
        assert_eq!(payload.pieces().len(), 3);
        assert_eq!(payload.len(), 18);
        assert_eq!(
            payload.to_bytes(),
            Bytes::from_static(b"{\"prompt\":[1,2,3]}")
        );
        // The client's slice is shared, not copied.
        assert_eq!(payload.pieces()[1].as_ptr(), shared.as_ptr());
        let mut reader = payload.reader();
        let mut read = Vec::new();
        while reader.has_remaining() {
            let step = reader.chunk().len().min(4);
            read.extend_from_slice(&reader.chunk()[..step]);
            reader.advance(step);
        }
        assert_eq!(read, b"{\"prompt\":[1,2,3]}");
        assert_eq!(reader.remaining(), 0);
        assert!(reader.chunk().is_empty());
    }

    #[test]
    fn a_vectored_write_sees_every_piece_left() {
        let mut payload = Payload::from(Bytes::from_static(b"ab"));
        payload.push(Bytes::from_static(b"cd"));
        let mut reader = payload.reader();
        reader.advance(1);
        let mut slots = [IoSlice::new(&[]); 4];
        let filled = reader.chunks_vectored(&mut slots);
        let seen: Vec<u8> = slots[..filled].iter().flat_map(|s| s.to_vec()).collect();
        assert_eq!(seen, b"bcd");
    }
}
