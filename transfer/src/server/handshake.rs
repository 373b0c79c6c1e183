//! The transfer handshake's rules, one connection at a time: with a secret,
//! a `hello` and a `proof` before any op (`crate::auth` has the proofs).

use crate::auth::{self, Nonce};
use crate::config::Secret;
use crate::proto::{Reply, Request};

/// Where a connection stands in the handshake.
pub(super) enum Auth {
    /// The holder has no secret: every op is served (and a `hello` answered
    /// with a plain welcome, which a client with a secret refuses).
    Open,
    AwaitHello,
    AwaitProof {
        reader: Nonce,
        holder: Nonce,
    },
    Proven,
}

/// What to do with a request.
pub(super) enum Admit {
    Serve(Request),
    /// A handshake step: send this and read the next frame.
    Answer(Reply),
}

impl Auth {
    pub(super) fn done(&self) -> bool {
        matches!(self, Self::Open | Self::Proven)
    }

    /// The handshake's rules; an error ends the connection.
    pub(super) fn admit(
        &mut self,
        secret: Option<&Secret>,
        request: Request,
    ) -> Result<Admit, &'static str> {
        match (&*self, request, secret) {
            (Self::Open, Request::Hello { .. }, _) => Ok(Admit::Answer(Reply::Welcome)),
            (Self::Open | Self::Proven, Request::Proof { .. }, _) => Err("unexpected proof"),
            (Self::Proven, Request::Hello { .. }, _) => Err("handshake already done"),
            (Self::Open | Self::Proven, request, _) => Ok(Admit::Serve(request)),
            (Self::AwaitHello, Request::Hello { nonce: reader }, Some(secret)) => {
                let holder = auth::nonce();
                let proof = auth::holder_proof(secret, &reader, &holder);
                *self = Self::AwaitProof { reader, holder };
                Ok(Admit::Answer(Reply::Challenge {
                    nonce: holder,
                    proof,
                }))
            }
            (Self::AwaitProof { reader, holder }, Request::Proof { proof }, Some(secret)) => {
                if auth::verify(&auth::reader_proof(secret, holder, reader), &proof) {
                    *self = Self::Proven;
                    Ok(Admit::Answer(Reply::Welcome))
                } else {
                    Err("wrong transfer secret")
                }
            }
            _ => Err("this holder requires the transfer handshake first"),
        }
    }
}
