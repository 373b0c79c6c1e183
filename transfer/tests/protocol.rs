//! The control listener against well-formed and malformed frames: every bad
//! frame gets an error reply, the listener keeps serving, connections are
//! reused.

#![allow(clippy::unwrap_used)]

use connex_transfer::proto::{self, Header, ReadRange, Reply, Request, HEADER_LEN, MAX_PAYLOAD};
use connex_transfer::{
    BackendKind, BlockRef, ClientConfig, CtrlClient, Holder, HolderConfig, Reader, ReaderConfig,
    Region, RegionId, Secret, TransferError,
};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;
use common::create_hold;

/// The test hold's transfer id (128 random bits' worth of hex at its end).
const H1: &str = "h1-5f3c9a1e7b2d4086a9c1e3f5b7d90246";

async fn holder_with_hold() -> Holder {
    let holder = Holder::start(HolderConfig::default()).await.unwrap();
    create_hold(&holder, H1, vec![5; 4096], 1);
    holder
}

/// Reads one reply frame, or `None` when the holder closed the connection.
async fn read_reply(stream: &mut TcpStream) -> Option<(Header, Reply)> {
    let mut raw = [0u8; HEADER_LEN];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut raw))
        .await
        .expect("holder answers or closes, never hangs");
    read.ok()?;
    let header = Header::parse(&raw).unwrap();
    let mut payload = vec![0; header.len as usize];
    stream.read_exact(&mut payload).await.unwrap();
    Some((header, Reply::decode(header.op, &payload).unwrap()))
}

fn error_code(reply: &Reply) -> u16 {
    match reply {
        Reply::Error { code, .. } => *code,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

fn frame(version: u8, op: u8, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = b"CX".to_vec();
    out.push(version);
    out.push(op);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_payloads_get_an_error_and_the_connection_goes_on() {
    let holder = holder_with_hold().await;
    let mut stream = TcpStream::connect(holder.ctrl_addr()).await.unwrap();
    let cases: Vec<(Vec<u8>, proto::ErrorCode)> = vec![
        // Renew with a payload cut short.
        (
            frame(proto::VERSION, 0x01, 7, &[2, 0, b'h']),
            proto::ErrorCode::BadFrame,
        ),
        // Release with trailing bytes.
        (
            frame(proto::VERSION, 0x02, 8, &[2, 0, b'h', b'1', 0]),
            proto::ErrorCode::BadFrame,
        ),
        // A transfer id with a space in it.
        (
            frame(proto::VERSION, 0x03, 9, &[2, 0, b'h', b' ']),
            proto::ErrorCode::BadFrame,
        ),
        // An op nobody knows.
        (
            frame(proto::VERSION, 0x42, 10, &[]),
            proto::ErrorCode::UnknownOp,
        ),
        // A read far past the end of the hold.
        (
            Request::Read(ReadRange {
                id: H1.into(),
                epoch: 0,
                offset: 4000,
                len: 200,
            })
            .encode(11)
            .to_vec(),
            proto::ErrorCode::BadRange,
        ),
        // A reply op sent as a request.
        (
            frame(proto::VERSION, 0x80, 12, &[]),
            proto::ErrorCode::UnknownOp,
        ),
    ];
    for (bytes, want) in cases {
        stream.write_all(&bytes).await.unwrap();
        let (header, reply) = read_reply(&mut stream).await.expect("an error reply");
        assert_eq!(
            header.seq,
            u32::from_le_bytes(bytes[4..8].try_into().unwrap())
        );
        assert_eq!(error_code(&reply), want as u16, "{reply:?}");
    }
    // The same connection still answers a good request.
    stream
        .write_all(&Request::Stat { id: H1.into() }.encode(99))
        .await
        .unwrap();
    let (header, reply) = read_reply(&mut stream).await.unwrap();
    assert_eq!(header.seq, 99);
    assert!(matches!(reply, Reply::Stat(Some(info)) if info.bytes == 4096));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrustworthy_headers_get_an_error_then_the_connection_closes() {
    let holder = holder_with_hold().await;
    let cases: Vec<(Vec<u8>, proto::ErrorCode)> = vec![
        (
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            proto::ErrorCode::BadFrame,
        ),
        (
            frame(proto::VERSION + 1, 0x04, 1, &[]),
            proto::ErrorCode::BadVersion,
        ),
        (
            {
                let mut f = frame(proto::VERSION, 0x04, 1, &[]);
                f[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
                f
            },
            proto::ErrorCode::TooLarge,
        ),
    ];
    for (bytes, want) in cases {
        let mut stream = TcpStream::connect(holder.ctrl_addr()).await.unwrap();
        stream.write_all(&bytes).await.unwrap();
        let (_, reply) = read_reply(&mut stream).await.expect("an error reply");
        assert_eq!(error_code(&reply), want as u16, "{reply:?}");
        assert!(read_reply(&mut stream).await.is_none(), "connection closed");
    }
    // A frame cut short by the peer's close: an error reply to its half-closed
    // socket, and the listener goes on.
    let mut stream = TcpStream::connect(holder.ctrl_addr()).await.unwrap();
    let full = Request::Renew {
        id: H1.into(),
        epoch: 0,
    }
    .encode(3);
    stream.write_all(&full[..full.len() - 2]).await.unwrap();
    stream.shutdown().await.unwrap();
    let (_, reply) = read_reply(&mut stream).await.expect("an error reply");
    assert_eq!(error_code(&reply), proto::ErrorCode::BadFrame as u16);
    let ctrl = CtrlClient::new();
    assert_eq!(
        ctrl.stats(&holder.ctrl_addr().to_string())
            .await
            .unwrap()
            .holds,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_never_stops_the_listener() {
    let holder = holder_with_hold().await;
    let addr = holder.ctrl_addr();
    // A fixed-seed generator: the same garbage on every run.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..300 {
        let mut bytes: Vec<u8> = (0..(next() % 64)).map(|_| next() as u8).collect();
        match round % 3 {
            // A valid header around a random payload of any op.
            0 => bytes = frame(proto::VERSION, (next() % 10) as u8, round, &bytes),
            // A valid request with random bytes flipped.
            1 => {
                bytes = Request::Read(ReadRange {
                    id: H1.into(),
                    epoch: 0,
                    offset: 0,
                    len: 4096,
                })
                .encode(round)
                .to_vec();
                let at = (next() as usize) % bytes.len();
                bytes[at] ^= (next() as u8) | 1;
            }
            // Raw noise.
            _ => {}
        }
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(&bytes).await.unwrap();
        stream.shutdown().await.unwrap();
        // Whatever comes back (error, data, nothing) must come back promptly.
        let mut sink = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut sink))
            .await
            .expect("holder answered or closed")
            .ok();
    }
    let ctrl = CtrlClient::new();
    let info = ctrl.stat(&addr.to_string(), H1).await.unwrap().unwrap();
    assert_eq!(info.bytes, 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_client_reuses_connections_and_maps_errors() {
    let holder = holder_with_hold().await;
    let addr = holder.ctrl_addr().to_string();
    let ctrl = CtrlClient::new();
    for _ in 0..50 {
        assert!(ctrl.stat(&addr, H1).await.unwrap().is_some());
    }
    assert_eq!(
        ctrl.idle_connections(&addr),
        1,
        "sequential calls share one connection"
    );
    let calls = (0..8).map(|_| {
        let (ctrl, addr) = (ctrl.clone(), addr.clone());
        tokio::spawn(async move { ctrl.renew(&addr, H1, 0).await })
    });
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap().transfer_id, H1);
    }
    assert!(ctrl.idle_connections(&addr) <= 8);
    assert!(matches!(
        ctrl.renew(&addr, "nope", 0).await,
        Err(TransferError::HoldNotFound { transfer_id }) if transfer_id == "nope"
    ));
    ctrl.renew(&addr, H1, 3).await.unwrap();
    assert!(matches!(
        ctrl.renew(&addr, H1, 2).await,
        Err(TransferError::StaleEpoch {
            served: 3,
            asked: 2
        })
    ));
    assert!(ctrl.release(&addr, H1).await.unwrap());
    assert!(!ctrl.release(&addr, H1).await.unwrap());
    assert_eq!(ctrl.stat(&addr, H1).await.unwrap(), None);
    let stats = ctrl.stats(&addr).await.unwrap();
    assert_eq!(
        (stats.holds, stats.releases, stats.stale_epoch_refusals),
        (0, 1, 1)
    );
    // An error reply leaves the connection usable: still one idle per caller.
    assert!(ctrl.idle_connections(&addr) <= 8);

    // Nobody listening: Unreachable, quickly.
    holder.stop().await;
    let started = std::time::Instant::now();
    assert!(matches!(
        ctrl.stats(&addr).await,
        Err(TransferError::Unreachable { .. })
    ));
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// HMAC-SHA256 under `secret` over `label`, `first`, `second`: the proofs of
/// the handshake as docs/transfer.md specifies them, computed independently.
fn hmac(secret: &str, label: &[u8], first: &[u8; 32], second: &[u8; 32]) -> [u8; 32] {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac.finalize().into_bytes().into()
}

/// A TCP reader that proves `secret`, with a 4 KiB destination region.
fn reader_with(secret: Option<Secret>) -> (Reader, RegionId) {
    let mut config = ReaderConfig::new(BackendKind::Tcp);
    config.client.secret = secret;
    let reader = Reader::with_config(config).unwrap();
    let dest = reader
        .register_region(Region::owned(vec![0; 4096]))
        .unwrap();
    (reader, dest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_with_a_secret_serves_only_peers_that_prove_it() {
    let secret = Secret::new("s3cret");
    let wrong = Secret::new("guess");
    let (secret_text, wrong_text) = ("s3cret", "guess");
    let holder = Holder::start(HolderConfig {
        secret: secret.clone(),
        ..HolderConfig::default()
    })
    .await
    .unwrap();
    let held = connex_transfer::pattern(3, 4096);
    create_hold(&holder, H1, held.clone(), 1);
    let addr = holder.ctrl_addr().to_string();
    let unauthorized = proto::ErrorCode::Unauthorized as u16;

    // On the wire: an op before the handshake, or a wrong proof, is refused
    // and the connection closed; the right proof is welcome, then ops are
    // served.
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    stream
        .write_all(&Request::Stat { id: H1.into() }.encode(1))
        .await
        .unwrap();
    let (_, reply) = read_reply(&mut stream).await.unwrap();
    assert_eq!(error_code(&reply), unauthorized);
    assert!(read_reply(&mut stream).await.is_none(), "closed");
    for (proof_secret, welcome) in [(wrong_text, false), (secret_text, true)] {
        let mut stream = TcpStream::connect(&addr).await.unwrap();
        let reader_nonce = [7u8; 32];
        stream
            .write_all(
                &Request::Hello {
                    nonce: reader_nonce,
                }
                .encode(1),
            )
            .await
            .unwrap();
        let Some((_, Reply::Challenge { nonce, .. })) = read_reply(&mut stream).await else {
            panic!("a holder with a secret challenges a hello");
        };
        let proof = hmac(
            proof_secret,
            b"connex-transfer v2 reader",
            &nonce,
            &reader_nonce,
        );
        stream
            .write_all(&Request::Proof { proof }.encode(2))
            .await
            .unwrap();
        let (_, reply) = read_reply(&mut stream).await.unwrap();
        if !welcome {
            assert_eq!(error_code(&reply), unauthorized);
            assert!(read_reply(&mut stream).await.is_none(), "closed");
            continue;
        }
        assert_eq!(reply, Reply::Welcome);
        stream
            .write_all(&Request::Stat { id: H1.into() }.encode(3))
            .await
            .unwrap();
        assert!(matches!(
            read_reply(&mut stream).await.unwrap().1,
            Reply::Stat(Some(_))
        ));
    }

    // Clients and readers: without the secret or with a wrong one, a clear
    // error (never a hang); with it, everything works.
    let client = |secret: Option<Secret>| {
        CtrlClient::with_config(ClientConfig {
            secret,
            ..ClientConfig::default()
        })
    };
    for other in [None, wrong.clone()] {
        let err = client(other.clone()).stats(&addr).await.unwrap_err();
        assert!(matches!(err, TransferError::Unauthorized(_)), "{err}");
        assert!(err.to_string().contains("CONNEX_TRANSFER_SECRET"), "{err}");
        let (reader, dest) = reader_with(other);
        let err = reader
            .pull_timeout(
                &addr,
                H1,
                0,
                &[BlockRef::new(dest, 0, 4096)],
                Duration::from_secs(5),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, TransferError::Unauthorized(_)), "{err}");
    }
    assert_eq!(client(secret.clone()).stats(&addr).await.unwrap().holds, 1);
    let (reader, dest) = reader_with(secret);
    reader
        .pull(&addr, H1, 0, &[BlockRef::new(dest, 0, 4096)])
        .await
        .unwrap();
    assert_eq!(reader.take_region(dest).unwrap(), held);
    assert_eq!(holder.stats().pulls, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_limit_past_what_the_clock_holds_is_just_long() {
    let holder = holder_with_hold().await;
    let (reader, dest) = reader_with(None);
    let stats = reader
        .pull_timeout(
            &holder.ctrl_addr().to_string(),
            H1,
            0,
            &[BlockRef::new(dest, 0, 4096)],
            Duration::MAX,
        )
        .await
        .unwrap();
    assert_eq!(stats.bytes, 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_many_frees_several_holds_in_one_call() {
    let holder = holder_with_hold().await;
    let h2 = connex_transfer::new_transfer_id();
    create_hold(&holder, &h2, vec![6; 4096], 1);
    let addr = holder.ctrl_addr().to_string();
    let ctrl = CtrlClient::new();
    let ids = vec![H1.to_string(), "cx-never-held".to_string(), h2.clone()];
    assert_eq!(
        ctrl.release_many(&addr, &ids).await.unwrap(),
        vec![true, false, true],
        "per id, in order, whether it was held"
    );
    assert_eq!(ctrl.stat(&addr, H1).await.unwrap(), None);
    assert_eq!(ctrl.stat(&addr, &h2).await.unwrap(), None);
    assert_eq!(ctrl.stats(&addr).await.unwrap().releases, 2);
    // Idempotent, like a single release.
    assert_eq!(
        ctrl.release_many(&addr, &ids).await.unwrap(),
        vec![false, false, false]
    );
    // Past the batch limit: refused by the client before anything is sent.
    let too_many = vec![H1.to_string(); connex_transfer::proto::MAX_RELEASE_BATCH + 1];
    assert!(matches!(
        ctrl.release_many(&addr, &too_many).await,
        Err(TransferError::InvalidArgument(_))
    ));
}
