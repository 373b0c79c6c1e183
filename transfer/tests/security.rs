//! Attacks on a holder's control listener and on its clients, each of which
//! worked before the handshake (issue 12): a fake holder that sniffs what
//! clients send, a fake reader, guessed transfer ids, an epoch pushed to
//! lock a hold out, silent connections and one peer taking every slot.

#![allow(clippy::unwrap_used)]

use connex_transfer::proto::{self, Header, ReadRange, Reply, Request, HEADER_LEN};
use connex_transfer::{
    new_transfer_id, BackendKind, BlockRef, ClientConfig, ConnectionCounts, CtrlClient, Holder,
    HolderConfig, Reader, ReaderConfig, Region, Secret, TransferError,
};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod common;
use common::create_hold;

const SECRET: &str = "the-cluster-transfer-secret";

fn secret() -> Option<Secret> {
    Secret::new(SECRET)
}

fn client(secret: Option<Secret>) -> CtrlClient {
    CtrlClient::with_config(ClientConfig {
        secret,
        io_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    })
}

/// A holder with `config`'s secret and one 4 KiB hold; returns it and the id.
async fn holder(config: HolderConfig) -> (Holder, String) {
    let holder = Holder::start(config).await.unwrap();
    let id = new_transfer_id();
    create_hold(&holder, &id, connex_transfer::pattern(1, 4096), 1);
    (holder, id)
}

/// Reads one reply frame; `None` when the peer closed the connection.
async fn read_reply(stream: &mut TcpStream) -> Option<Reply> {
    let mut raw = [0u8; HEADER_LEN];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut raw))
        .await
        .expect("the holder answers or closes, never hangs");
    read.ok()?;
    let header = Header::parse(&raw).unwrap();
    let mut payload = vec![0; header.len as usize];
    stream.read_exact(&mut payload).await.ok()?;
    Some(Reply::decode(header.op, &payload).unwrap())
}

/// A fake holder: accepts one connection, answers a `hello` as `answer`
/// says (or not at all), and records every byte the client sends for 1.5 s.
async fn fake_holder(answer: Option<Reply>) -> (String, tokio::task::JoinHandle<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut seen = Vec::new();
        let mut answered = false;
        let until = tokio::time::Instant::now() + Duration::from_millis(1500);
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) = tokio::time::timeout_at(until, stream.read(&mut buf)).await {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
            if let (false, Some(reply)) = (answered, &answer) {
                if seen.len() >= HEADER_LEN {
                    let seq = u32::from_le_bytes(seen[4..8].try_into().unwrap());
                    stream.write_all(&reply.encode(seq)).await.unwrap();
                    answered = true;
                }
            }
        }
        seen
    });
    (addr, task)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sniffing_holder_never_learns_the_secret_nor_the_request() {
    let id = new_transfer_id();
    // A fake holder that says nothing, one that claims to need no secret,
    // and one that answers with a challenge it cannot back.
    let answers = [
        None,
        Some(Reply::Welcome),
        Some(Reply::Challenge {
            nonce: [3; 32],
            proof: [4; 32],
        }),
    ];
    for answer in answers {
        let (addr, seen) = fake_holder(answer.clone()).await;
        let err = client(secret()).release(&addr, &id).await.unwrap_err();
        let seen = seen.await.unwrap();
        assert!(
            !contains(&seen, SECRET.as_bytes()),
            "the secret crossed the wire to a fake holder ({answer:?})"
        );
        assert!(
            !contains(&seen, id.as_bytes()),
            "the request reached a holder that never proved the secret ({answer:?})"
        );
        if answer.is_some() {
            assert!(matches!(err, TransferError::Unauthorized(_)), "{err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_reader_gets_nothing() {
    let (holder, id) = holder(HolderConfig {
        secret: secret(),
        ..HolderConfig::default()
    })
    .await;
    let addr = holder.ctrl_addr().to_string();
    // A reader with another secret, or none, pulls nothing.
    for other in [None, Secret::new("a-guess")] {
        let mut config = ReaderConfig::new(BackendKind::Tcp);
        config.client.secret = other;
        let reader = Reader::with_config(config).unwrap();
        let dest = reader
            .register_region(Region::owned(vec![0; 4096]))
            .unwrap();
        let err = reader
            .pull(&addr, &id, 0, &[BlockRef::new(dest, 0, 4096)])
            .await
            .unwrap_err();
        assert!(matches!(err, TransferError::Unauthorized(_)), "{err}");
        assert_eq!(reader.take_region(dest).unwrap(), vec![0; 4096]);
    }
    // Replaying the holder's own proof as a reader's proof (reflection) fails.
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    stream
        .write_all(&Request::Hello { nonce: [5; 32] }.encode(1))
        .await
        .unwrap();
    let Some(Reply::Challenge { proof, .. }) = read_reply(&mut stream).await else {
        panic!("challenged");
    };
    stream
        .write_all(&Request::Proof { proof }.encode(2))
        .await
        .unwrap();
    assert!(matches!(
        read_reply(&mut stream).await,
        Some(Reply::Error { code, .. }) if code == proto::ErrorCode::Unauthorized as u16
    ));
    assert!(read_reply(&mut stream).await.is_none(), "closed");
    assert_eq!(holder.stats().pulls, 0);
    assert!(holder.stat(&id).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessable_transfer_ids_are_refused() {
    let holder = Holder::start(HolderConfig::default()).await.unwrap();
    let region = holder.register_region(Region::owned(vec![1; 64])).unwrap();
    let block = || vec![BlockRef::new(region, 0, 64)];
    // What the vLLM connector made before (32 random bits), a counter, a
    // UUID-less label: a peer could guess them and pull or release the KV.
    for weak in ["engine-0-7-1a2b3c4d", "xfer-1", "req-42", &"0".repeat(32)] {
        let err = holder.create_hold(weak, block()).unwrap_err();
        assert!(
            matches!(err, TransferError::InvalidArgument(_)),
            "{weak}: {err}"
        );
    }
    let id = new_transfer_id();
    holder.create_hold(&id, block()).unwrap();
    assert!(holder.stat(&id).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_pushes_an_epoch_to_lock_a_hold_out() {
    // With a secret, a peer that did not prove it changes nothing.
    let (guarded, id) = holder(HolderConfig {
        secret: secret(),
        max_epoch: 8,
        ..HolderConfig::default()
    })
    .await;
    let addr = guarded.ctrl_addr().to_string();
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    let push = Request::Renew {
        id: id.clone(),
        epoch: u32::MAX,
    };
    stream.write_all(&push.encode(1)).await.unwrap();
    assert!(matches!(
        read_reply(&mut stream).await,
        Some(Reply::Error { code, .. }) if code == proto::ErrorCode::Unauthorized as u16
    ));
    assert_eq!(guarded.stat(&id).unwrap().epoch, 0);
    // Even a peer that proved it cannot go past the resume bound; the hold
    // stays usable by the resumes that follow.
    let trusted = client(secret());
    let err = trusted.renew(&addr, &id, u32::MAX).await.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::EpochOutOfRange {
                asked: u32::MAX,
                max: 8
            }
        ),
        "{err}"
    );
    assert!(err.is_hold_lost());
    assert_eq!(trusted.renew(&addr, &id, 1).await.unwrap().epoch, 1);
    assert_eq!(trusted.renew(&addr, &id, 8).await.unwrap().epoch, 8);

    // Without a secret (an open holder), the bound still holds.
    let (open, id) = holder(HolderConfig {
        secret: None,
        ..HolderConfig::default()
    })
    .await;
    let anyone = client(None);
    let addr = open.ctrl_addr().to_string();
    assert!(matches!(
        anyone.renew(&addr, &id, u32::MAX).await,
        Err(TransferError::EpochOutOfRange { .. })
    ));
    assert_eq!(anyone.renew(&addr, &id, 1).await.unwrap().epoch, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_after_two_seconds() {
    let (holder, _id) = holder(HolderConfig {
        secret: secret(),
        ..HolderConfig::default()
    })
    .await;
    let addr = holder.ctrl_addr();
    // One that says nothing, one that starts the handshake and stops.
    let silent = TcpStream::connect(addr).await.unwrap();
    let mut halfway = TcpStream::connect(addr).await.unwrap();
    halfway
        .write_all(&Request::Hello { nonce: [1; 32] }.encode(1))
        .await
        .unwrap();
    assert!(matches!(
        read_reply(&mut halfway).await,
        Some(Reply::Challenge { .. })
    ));
    let started = Instant::now();
    for mut stream in [silent, halfway] {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(6), stream.read(&mut buf))
            .await
            .expect("closed by the holder, not kept for minutes");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(4), "{took:?}");
    // The listener serves the next peer as ever.
    assert_eq!(
        client(secret())
            .stats(&addr.to_string())
            .await
            .unwrap()
            .holds,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_every_connection() {
    let (holder, id) = holder(HolderConfig {
        secret: None,
        max_connections_per_peer: 4,
        ..HolderConfig::default()
    })
    .await;
    let addr = holder.ctrl_addr();
    let mut hogs = Vec::new();
    for _ in 0..4 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        // Served: the connection is really open.
        stream
            .write_all(&Request::Stat { id: id.clone() }.encode(1))
            .await
            .unwrap();
        assert!(matches!(
            read_reply(&mut stream).await,
            Some(Reply::Stat(Some(_)))
        ));
        hogs.push(stream);
    }
    // The fifth from the same address is closed at once.
    let mut fifth = TcpStream::connect(addr).await.unwrap();
    let _ = fifth
        .write_all(&Request::Stat { id: id.clone() }.encode(1))
        .await;
    assert!(
        read_reply(&mut fifth).await.is_none(),
        "over the per-peer cap"
    );
    // One goes, one more may come.
    drop(hogs.pop());
    let started = Instant::now();
    loop {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let _ = stream
            .write_all(&Request::Stat { id: id.clone() }.encode(1))
            .await;
        if matches!(read_reply(&mut stream).await, Some(Reply::Stat(Some(_)))) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "slot given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_addresses_without_the_secret_cannot_keep_a_reader_out() {
    // Two source addresses, each at its per-peer cap, filled every slot with
    // connections that never prove anything, and a reader waited for their
    // handshake timeout (2 s), past its own deadline, again and again as
    // they reconnected. Unproven past a short grace, they give slots up.
    let (holder, id) = holder(HolderConfig {
        secret: secret(),
        max_connections: 4,
        max_connections_per_peer: 2,
        ..HolderConfig::default()
    })
    .await;
    let addr = holder.ctrl_addr();
    let mut hogs = Vec::new();
    for source in ["127.0.0.2", "127.0.0.3"] {
        for _ in 0..2 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
            hogs.push(socket.connect(addr).await.unwrap());
        }
    }
    until(|| holder.connections().open == 4).await;
    let reader = CtrlClient::with_config(ClientConfig {
        secret: secret(),
        io_timeout: Duration::from_secs(1),
        connect_timeout: Duration::from_secs(1),
        ..ClientConfig::default()
    });
    let started = Instant::now();
    let stat = reader.stat(&addr.to_string(), &id).await;
    assert!(matches!(stat, Ok(Some(_))), "{stat:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // A hog's connection was the one closed.
    let mut closed = 0;
    for hog in &mut hogs {
        let mut buf = [0u8; 1];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(100), hog.read(&mut buf)).await
        {
            closed += 1;
        }
    }
    assert!(closed >= 1, "no unproven connection gave its slot up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_limit_a_connection_waits_instead_of_failing() {
    // A burst of pulls larger than the holder serves at once (10k streams
    // through one prefill in `bench/run scale`) must queue, not fail.
    let (holder, id) = holder(HolderConfig {
        secret: None,
        max_connections: 2,
        ..HolderConfig::default()
    })
    .await;
    let addr = holder.ctrl_addr();
    let stat = Request::Stat { id: id.clone() }.encode(1);
    // Two connections served once (idle), then in the middle of a frame:
    // busy, so none can be closed for a new one.
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(&stat).await.unwrap();
        assert!(read_reply(&mut stream).await.is_some());
        busy.push(stream);
    }
    until(|| holder.connections() == ConnectionCounts { open: 2, idle: 2 }).await;
    for stream in &mut busy {
        stream.write_all(&stat[..HEADER_LEN / 2]).await.unwrap();
    }
    until(|| holder.connections() == ConnectionCounts { open: 2, idle: 0 }).await;
    let mut third = TcpStream::connect(addr).await.unwrap();
    third.write_all(&stat).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), read_reply(&mut third))
            .await
            .is_err(),
        "at the limit: neither served nor closed"
    );
    drop(busy.pop());
    let reply = tokio::time::timeout(Duration::from_secs(5), read_reply(&mut third))
        .await
        .expect("served once a connection ends");
    assert!(matches!(reply, Some(Reply::Stat(Some(_)))), "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pooled_connections_make_room_for_a_new_reader() {
    // Decode processes pool their idle control connections to a prefill's
    // holder (16 each, for a minute): enough of them filled every slot, and
    // a new reader's pull then waited for one to time out, past its
    // deadline. At the limit the holder closes the connection idle longest.
    let (holder, id) = holder(HolderConfig {
        secret: None,
        max_connections: 2,
        ..HolderConfig::default()
    })
    .await;
    let addr = holder.ctrl_addr().to_string();
    // A reader's pooled connection and another peer's, both served and now
    // idle: every slot taken.
    let pooled = client(None);
    assert!(pooled.stat(&addr, &id).await.unwrap().is_some());
    let mut other = TcpStream::connect(&addr).await.unwrap();
    other
        .write_all(&Request::Stat { id: id.clone() }.encode(1))
        .await
        .unwrap();
    assert!(read_reply(&mut other).await.is_some());
    let idle_counts = ConnectionCounts { open: 2, idle: 2 };
    until(|| holder.connections() == idle_counts).await;
    // New readers are served at once, each closing the connection idle
    // longest (each keeps its own pooled).
    let mut newcomers = Vec::new();
    for _ in 0..3 {
        let newcomer = client(None);
        let started = Instant::now();
        let stat = tokio::time::timeout(Duration::from_secs(2), newcomer.stat(&addr, &id))
            .await
            .expect("served without waiting for an idle connection to time out");
        assert!(stat.unwrap().is_some());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        newcomers.push(newcomer);
    }
    // The other peer's connection was among those closed.
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(2), other.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0) | Err(_))), "{read:?}");
    // So was the pooled reader's: its next request goes on a new
    // connection, transparently.
    for _ in 0..3 {
        assert!(pooled.stat(&addr, &id).await.unwrap().is_some());
    }
    assert_eq!(holder.connections().open, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_limit_a_new_connection_is_not_closed_between_its_handshake_and_its_request() {
    // With a secret, a reader's first request follows its handshake on a
    // new connection, which it does not retry: a holder at its limit that
    // took a just-proven connection for an idle one failed that request.
    let (holder, id) = holder(HolderConfig {
        secret: secret(),
        max_connections: 2,
        ..HolderConfig::default()
    })
    .await;
    let addr = holder.ctrl_addr().to_string();
    // Two readers whose connections are proven and whose requests are held
    // back on the way: both slots taken, neither connection has served an op.
    let mut readers = Vec::new();
    let mut releases = Vec::new();
    for _ in 0..2 {
        let (proxy, held, release) = frame_holding_proxy(&addr, 3).await;
        let id = id.clone();
        readers.push(tokio::spawn(async move {
            client(secret()).stat(&proxy, &id).await
        }));
        tokio::time::timeout(Duration::from_secs(5), held)
            .await
            .unwrap()
            .unwrap();
        releases.push(release);
    }
    assert_eq!(holder.connections(), ConnectionCounts { open: 2, idle: 0 });
    // A newcomer at the limit; the holder has time to close one, if it would.
    let _newcomer = TcpStream::connect(&addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    for release in releases {
        release.send(()).unwrap();
    }
    for reader in readers {
        let stat = reader.await.unwrap();
        assert!(matches!(stat, Ok(Some(_))), "{stat:?}");
    }
}

/// A proxy to `holder` for one client that holds back the client's frame
/// number `nth` (from 1) until told: returns its address, a signal that the
/// frame is held and the sender that lets it through.
async fn frame_holding_proxy(
    holder: &str,
    nth: usize,
) -> (
    String,
    tokio::sync::oneshot::Receiver<()>,
    tokio::sync::oneshot::Sender<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let holder = holder.to_string();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let upstream = TcpStream::connect(&holder).await.unwrap();
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_holder, mut to_holder) = upstream.into_split();
        tokio::spawn(async move { tokio::io::copy(&mut from_holder, &mut to_client).await });
        let (mut held_tx, mut release_rx) = (Some(held_tx), Some(release_rx));
        for frame in 1.. {
            let mut header = [0u8; HEADER_LEN];
            if from_client.read_exact(&mut header).await.is_err() {
                return;
            }
            let mut payload = vec![0; Header::parse(&header).unwrap().len as usize];
            from_client.read_exact(&mut payload).await.unwrap();
            if frame == nth {
                held_tx.take().unwrap().send(()).unwrap();
                let _ = release_rx.take().unwrap().await;
            }
            to_holder.write_all(&header).await.unwrap();
            to_holder.write_all(&payload).await.unwrap();
        }
    });
    (addr, held_rx, release_tx)
}

/// Waits (up to 5 s) until `done` holds: for a state of the holder's tasks
/// that shows in no reply.
async fn until(done: impl Fn() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < Duration::from_secs(5), "not reached");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_reader_cannot_hold_a_writer_for_ever() {
    // 32 MiB at no less than one 4 MiB piece per I/O timeout (1 s): the
    // holder gives the read 9 s, however steadily the reader trickles
    // (taking it all at this pace would take 16 s; the socket buffers hold
    // a few MiB of it).
    const LEN: usize = 32 << 20;
    let holder = Holder::start(HolderConfig {
        secret: None,
        io_timeout: Duration::from_secs(1),
        ..HolderConfig::default()
    })
    .await
    .unwrap();
    let id = new_transfer_id();
    create_hold(&holder, &id, vec![7; LEN], 1);
    let mut stream = TcpStream::connect(holder.ctrl_addr()).await.unwrap();
    let read = Request::Read(ReadRange {
        id: id.clone(),
        epoch: 0,
        offset: 0,
        len: LEN as u64,
    });
    stream.write_all(&read.encode(1)).await.unwrap();
    let started = Instant::now();
    let mut got = 0usize;
    let mut buf = vec![0u8; 512 << 10];
    loop {
        // 512 KiB per 250 ms: every single write of the holder goes through
        // well within its I/O timeout, once the socket buffers are full.
        tokio::time::sleep(Duration::from_millis(250)).await;
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got += n,
            Err(_) => panic!("the holder neither sent nor closed"),
        }
        if got >= LEN {
            break; // all of it came: the holder never cut the read
        }
        assert!(started.elapsed() < Duration::from_secs(60), "never cut");
    }
    // Read to the end at this pace, it would all have come (in 16 s).
    assert!(got < LEN, "cut before the end ({got} bytes)");
    // The read stopped: a release is reported freed at once.
    assert!(holder.release(&id));
    assert_eq!(holder.freed(), [id]);
}

/// The largest read a holder writes on its async socket (`conn::ASYNC_MAX`).
const SMALL_READ: usize = 256 << 10;

/// A holder with one hold of [`SMALL_READ`] bytes, and a connection to it
/// with a tiny receive buffer that has asked for that hold 64 times over
/// (16 MiB, far more than the socket buffers hold) and reads nothing.
async fn small_reads_nobody_takes(io_timeout: Duration) -> (Holder, String, TcpStream) {
    let holder = Holder::start(HolderConfig {
        secret: None,
        io_timeout,
        ..HolderConfig::default()
    })
    .await
    .unwrap();
    let id = new_transfer_id();
    create_hold(&holder, &id, vec![7; SMALL_READ], 1);
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(holder.ctrl_addr()).await.unwrap();
    for seq in 0..64 {
        let read = Request::Read(ReadRange {
            id: id.clone(),
            epoch: 0,
            offset: 0,
            len: SMALL_READ as u64,
        });
        stream.write_all(&read.encode(seq)).await.unwrap();
    }
    (holder, id, stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_takes_nothing_cannot_hold_a_small_write() {
    let (holder, id, mut stream) = small_reads_nobody_takes(Duration::from_secs(1)).await;
    // Past the I/O timeout the holder gives up on the write and closes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got += n,
            Err(_) => panic!("the holder kept the connection ({got} bytes so far)"),
        }
    }
    assert!(got < 64 * SMALL_READ, "cut before the end ({got} bytes)");
    // The write stopped: a release is reported freed at once.
    assert!(holder.release(&id));
    assert_eq!(holder.freed(), [id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_stops_a_small_write_the_reader_does_not_take() {
    // A 30 s I/O timeout: only the release can end the write in time.
    let (holder, id, _stream) = small_reads_nobody_takes(Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(holder.release(&id));
    let released = Instant::now();
    while holder.freed() != [id.clone()] {
        assert!(
            released.elapsed() < Duration::from_secs(2),
            "a released hold waits for a write nobody takes"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
