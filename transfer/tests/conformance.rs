//! The conformance suite: the same user stories run against every backend this
//! build has. A holder (in this process, or in its own process where the test
//! kills it) holds pattern bytes; a reader pulls them and checks every byte.
//! Instantiated per backend by `conformance!` at the bottom.

#![allow(clippy::unwrap_used)]
// One test hands the holder caller-owned memory through `Region::raw`.
#![allow(unsafe_code)]

use connex_transfer::{
    pattern, BackendKind, BlockRef, ClientConfig, Faults, Holder, HolderConfig, Reader,
    ReaderConfig, Region, RegionId, ReleaseMode, TransferError,
};
use std::time::{Duration, Instant};

mod common;
use common::{create_hold, HolderProcess};

/// A holder of `kind` holding `blocks` blocks of `size` bytes of `pattern(seed)`
/// under `id`; returns the holder.
async fn holder(
    kind: BackendKind,
    config: HolderConfig,
    holds: &[(&str, u64, u64, u64)],
) -> Holder {
    let holder = Holder::start(HolderConfig {
        backend: kind,
        ..config
    })
    .await
    .unwrap();
    for &(id, seed, blocks, size) in holds {
        let bytes = pattern(seed, (blocks * size) as usize);
        let region = create_hold(&holder, &tid(id), bytes, blocks);
        // The holds keep the buffer alive; nobody else needs the region.
        assert!(holder.unregister_region(region));
    }
    holder
}

/// The transfer id of test hold `name`: holders refuse ids without 128
/// random bits' worth of hex at their end.
fn tid(name: &str) -> String {
    format!("{name}-5f3c9a1e7b2d4086a9c1e3f5b7d90246")
}

fn reader(kind: BackendKind) -> Reader {
    Reader::new(kind).unwrap()
}

/// Destination blocks for a hold of `blocks` x `size`, laid out in reverse
/// order with a gap between them, so that a wrong mapping cannot pass.
fn scattered(reader: &Reader, blocks: u64, size: u64) -> (RegionId, Vec<BlockRef>) {
    let stride = size + 3;
    let region = reader
        .register_region(Region::owned(vec![0xAA; (blocks * stride) as usize]))
        .unwrap();
    let refs = (0..blocks)
        .map(|b| BlockRef::new(region, (blocks - 1 - b) * stride + 1, size))
        .collect();
    (region, refs)
}

/// The bytes of `refs` in order, taken from the reader's region.
fn gather(reader: &Reader, region: RegionId, refs: &[BlockRef]) -> Vec<u8> {
    let bytes = reader.take_region(region).unwrap();
    refs.iter()
        .flat_map(|b| bytes[b.offset as usize..(b.offset + b.len) as usize].to_vec())
        .collect()
}

fn addr(holder: &Holder) -> String {
    holder.ctrl_addr().to_string()
}

pub async fn content_checksums_after_pull(kind: BackendKind) {
    let sizes = [
        (1u64, 1u64),
        (7, 4096),
        (33, 16 << 10),
        (3, 3 << 20),
        (1, 40 << 20),
    ];
    let holds: Vec<(String, u64, u64, u64)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &(blocks, size))| (format!("h{i}"), i as u64 + 1, blocks, size))
        .collect();
    let spec: Vec<(&str, u64, u64, u64)> = holds
        .iter()
        .map(|(id, s, b, z)| (id.as_str(), *s, *b, *z))
        .collect();
    let holder = holder(kind, HolderConfig::default(), &spec).await;
    let reader = reader(kind);
    for (id, seed, blocks, size) in &holds {
        let (region, refs) = scattered(&reader, *blocks, *size);
        let stats = reader
            .pull(&addr(&holder), &tid(id), 0, &refs)
            .await
            .unwrap();
        assert_eq!((stats.bytes, stats.blocks), (blocks * size, *blocks as u32));
        assert_eq!(
            gather(&reader, region, &refs),
            pattern(*seed, (blocks * size) as usize),
            "hold {id}"
        );
    }
    // Caller-owned memory on the holder side works the same way.
    let mut raw = pattern(99, 1 << 20);
    // SAFETY: `raw` outlives the holder (stopped below) and is not written meanwhile.
    let region = holder
        .register_region(unsafe { Region::raw(raw.as_mut_ptr(), raw.len()) })
        .unwrap();
    holder
        .create_hold(
            &tid("raw"),
            vec![
                BlockRef::new(region, 4096, 8192),
                BlockRef::new(region, 0, 100),
            ],
        )
        .unwrap();
    let (dest, refs) = scattered(&reader, 1, 8292);
    let one = [
        BlockRef::new(refs[0].region, 0, 8192),
        BlockRef::new(refs[0].region, 8192, 100),
    ];
    reader
        .pull(&addr(&holder), &tid("raw"), 0, &one)
        .await
        .unwrap();
    let got = reader.take_region(dest).unwrap();
    assert_eq!(&got[..8192], &raw[4096..4096 + 8192]);
    assert_eq!(&got[8192..8292], &raw[..100]);
    // Every hold is still there (on_release mode) and counted its pull.
    let stats = holder.stats();
    assert_eq!(
        (stats.holds, stats.pulls),
        (holds.len() as u64 + 1, holds.len() as u64 + 1)
    );
    holder.stop().await;
    drop(raw);
}

pub async fn big_pulls_use_several_streams(kind: BackendKind) {
    let holder = holder(kind, HolderConfig::default(), &[("big", 5, 32, 2 << 20)]).await;
    let reader = reader(kind);
    let (region, refs) = scattered(&reader, 32, 2 << 20);
    let stats = reader
        .pull(&addr(&holder), &tid("big"), 0, &refs)
        .await
        .unwrap();
    assert!(stats.streams > 1, "{stats:?}");
    assert_eq!(gather(&reader, region, &refs), pattern(5, 64 << 20));
}

/// A decoder with the start of a prompt cached pulls only the blocks it
/// lacks: per "layer" (a run of the hold's blocks) the last ones. Only those
/// bytes move and are counted, and a bad selection is refused.
pub async fn partial_pulls_move_only_the_selected_blocks(kind: BackendKind) {
    // Two "layers" of 6 blocks each; the decoder lacks blocks 2..6 of each.
    let (blocks, size) = (12u64, 4096u64);
    let holder = holder(kind, HolderConfig::default(), &[("part", 7, blocks, size)]).await;
    let reader = reader(kind);
    let select: Vec<u32> = (2..6).chain(8..12).collect();
    let (region, refs) = scattered(&reader, select.len() as u64, size);
    let stats = reader
        .pull_blocks(
            &addr(&holder),
            &tid("part"),
            0,
            Some(&select),
            &refs,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(
        (stats.bytes, stats.blocks),
        (select.len() as u64 * size, select.len() as u32)
    );
    let all = pattern(7, (blocks * size) as usize);
    let want: Vec<u8> = select
        .iter()
        .flat_map(|&b| all[b as usize * size as usize..(b as usize + 1) * size as usize].to_vec())
        .collect();
    assert_eq!(gather(&reader, region, &refs), want);
    // Not increasing, or past the hold's blocks: refused before any byte moves.
    for bad in [vec![3u32, 2], vec![11, 12]] {
        let (_, refs) = scattered(&reader, bad.len() as u64, size);
        let err = reader
            .pull_blocks(
                &addr(&holder),
                &tid("part"),
                0,
                Some(&bad),
                &refs,
                Duration::from_secs(10),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(err, TransferError::InvalidArgument(_)),
            "{bad:?}: {err:?}"
        );
    }
    // The hold is whole and still serves a full pull.
    let (region, refs) = scattered(&reader, blocks, size);
    reader
        .pull(&addr(&holder), &tid("part"), 0, &refs)
        .await
        .unwrap();
    assert_eq!(gather(&reader, region, &refs), all);
    holder.stop().await;
}

pub async fn expiry(kind: BackendKind) {
    let config = HolderConfig {
        retain: Duration::from_millis(600),
        ..Default::default()
    };
    let holder = holder(kind, config, &[("e", 1, 4, 1024), ("idle", 2, 1, 10)]).await;
    let reader = reader(kind);
    // Pulls and renews every 300 ms keep "e" alive well past its 600 ms lease.
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        if round % 2 == 0 {
            let (region, refs) = scattered(&reader, 4, 1024);
            reader
                .pull(&addr(&holder), &tid("e"), 0, &refs)
                .await
                .unwrap();
            reader.take_region(region).unwrap();
        } else {
            reader.renew(&addr(&holder), &tid("e"), 0).await.unwrap();
        }
    }
    assert!(reader
        .stat(&addr(&holder), &tid("e"))
        .await
        .unwrap()
        .is_some());
    // "idle" was never touched: gone.
    assert_eq!(
        reader.stat(&addr(&holder), &tid("idle")).await.unwrap(),
        None
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (_, refs) = scattered(&reader, 4, 1024);
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("e"), 0, &refs).await,
        Err(TransferError::HoldNotFound { .. })
    ));
    let stats = holder.stats();
    assert_eq!((stats.holds, stats.held_bytes, stats.expiries), (0, 0, 2));
    let mut freed = holder.freed();
    freed.sort();
    assert_eq!(freed, [tid("e"), tid("idle")]);
}

pub async fn release(kind: BackendKind) {
    let holder = holder(kind, HolderConfig::default(), &[("r", 1, 2, 100)]).await;
    let reader = reader(kind);
    assert!(reader.release(&addr(&holder), &tid("r")).await.unwrap());
    assert!(!reader.release(&addr(&holder), &tid("r")).await.unwrap());
    let (_, refs) = scattered(&reader, 2, 100);
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("r"), 0, &refs).await,
        Err(TransferError::HoldNotFound { .. })
    ));
    assert_eq!(holder.freed(), [tid("r")]);

    // after_pull: the first complete pull frees the hold.
    let config = HolderConfig {
        release: ReleaseMode::AfterPull,
        ..Default::default()
    };
    let holder = self::holder(kind, config, &[("once", 3, 2, 100)]).await;
    let (region, refs) = scattered(&reader, 2, 100);
    reader
        .pull(&addr(&holder), &tid("once"), 0, &refs)
        .await
        .unwrap();
    assert_eq!(gather(&reader, region, &refs), pattern(3, 200));
    let (_, refs) = scattered(&reader, 2, 100);
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("once"), 0, &refs).await,
        Err(TransferError::HoldNotFound { .. })
    ));
    let stats = holder.stats();
    assert_eq!((stats.pulls, stats.releases, stats.holds), (1, 1, 0));
}

pub async fn concurrent_pulls(kind: BackendKind) {
    let holds: Vec<(&str, u64, u64, u64)> = vec![
        ("c0", 10, 8, 64 << 10),
        ("c1", 11, 3, 1 << 20),
        ("c2", 12, 64, 4096),
        ("c3", 13, 1, 5 << 20),
    ];
    let holder = holder(kind, HolderConfig::default(), &holds).await;
    let reader = std::sync::Arc::new(reader(kind));
    let mut tasks = tokio::task::JoinSet::new();
    for round in 0..2 {
        for &(id, seed, blocks, size) in &holds {
            let (reader, addr) = (reader.clone(), addr(&holder));
            tasks.spawn(async move {
                let (region, refs) = scattered(&reader, blocks, size);
                reader.pull(&addr, &tid(id), 0, &refs).await.unwrap();
                assert_eq!(
                    gather(&reader, region, &refs),
                    pattern(seed, (blocks * size) as usize),
                    "{id} round {round}"
                );
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(holder.stats().pulls, 8);
}

pub async fn stale_epoch_and_mismatches(kind: BackendKind) {
    let holder = holder(kind, HolderConfig::default(), &[("s", 1, 4, 1000)]).await;
    let reader = reader(kind);
    let (region, refs) = scattered(&reader, 4, 1000);
    reader
        .pull(&addr(&holder), &tid("s"), 1, &refs)
        .await
        .unwrap();
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("s"), 0, &refs).await,
        Err(TransferError::StaleEpoch {
            served: 1,
            asked: 0
        })
    ));
    assert!(matches!(
        reader.renew(&addr(&holder), &tid("s"), 0).await,
        Err(TransferError::StaleEpoch {
            served: 1,
            asked: 0
        })
    ));
    // A newer epoch takes over; the destination was left as the good pull wrote it.
    assert_eq!(
        reader
            .renew(&addr(&holder), &tid("s"), 2)
            .await
            .unwrap()
            .epoch,
        2
    );
    assert_eq!(holder.stats().stale_epoch_refusals, 2);
    assert_eq!(gather(&reader, region, &refs), pattern(1, 4000));
    // Wrong block count or size: refused before any byte moves.
    let (_, refs) = scattered(&reader, 3, 1000);
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("s"), 2, &refs).await,
        Err(TransferError::SizeMismatch(_))
    ));
    let (_, refs) = scattered(&reader, 4, 999);
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("s"), 2, &refs).await,
        Err(TransferError::SizeMismatch(_))
    ));
    // Bad destinations never reach the holder.
    let bad = [BlockRef::new(RegionId(12345), 0, 1000)];
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("s"), 2, &bad).await,
        Err(TransferError::InvalidArgument(_))
    ));
    assert!(matches!(
        reader.pull(&addr(&holder), &tid("unknown"), 2, &refs).await,
        Err(TransferError::HoldNotFound { .. })
    ));
    assert_eq!(holder.stats().pulls, 1);
}

fn quick_reader(kind: BackendKind) -> Reader {
    let mut config = ReaderConfig::new(kind);
    config.client = ClientConfig {
        io_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    Reader::with_config(config).unwrap()
}

pub async fn holder_killed_mid_pull(kind: BackendKind) {
    let mut process = HolderProcess::start(
        kind,
        &[
            "--hold",
            &format!("{}:32:2097152", tid("k")),
            "--stall-after-bytes",
            "4194304",
        ],
    );
    let reader = std::sync::Arc::new(quick_reader(kind));
    let (region, refs) = scattered(&reader, 32, 2 << 20);
    let pull = {
        let (reader, addr) = (reader.clone(), process.addr.clone());
        tokio::spawn(async move { reader.pull(&addr, &tid("k"), 0, &refs).await })
    };
    // The holder is alive but stalled: the pull has not finished.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !pull.is_finished(),
        "the pull cannot finish while the holder stalls"
    );
    let killed = Instant::now();
    process.kill();
    let result = tokio::time::timeout(Duration::from_secs(10), pull)
        .await
        .expect("a dead holder gives an error, not a hang")
        .unwrap();
    let err = result.expect_err("a pull from a dead holder fails");
    assert!(
        matches!(
            err,
            TransferError::Io(_)
                | TransferError::Unreachable { .. }
                | TransferError::Timeout { .. }
                | TransferError::Backend { .. }
        ),
        "{err:?}"
    );
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "noticed in {:?}",
        killed.elapsed()
    );
    // The destination can be taken back once the failed pull is gone.
    reader.take_region(region).unwrap();
}

/// A holder that is alive but runs nothing (a stopped process here; in an
/// engine, a holder given no CPU while a TP 2 engine ran its first forward on
/// two cores) is waited for until the pull's deadline, past the I/O timeout;
/// one that stays so fails at that deadline.
pub async fn frozen_holder_is_waited_for_until_the_deadline(kind: BackendKind) {
    let process = HolderProcess::start(kind, &["--hold", &format!("{}:8:65536", tid("f"))]);
    let io = Duration::from_secs(1);
    let reader = reader_with(kind, io, Duration::from_secs(30));
    let (region, refs) = scattered(&reader, 8, 65536);
    process.signal("STOP");
    let started = Instant::now();
    let thaw = async {
        tokio::time::sleep(3 * io).await;
        process.signal("CONT");
    };
    let id = tid("f");
    let (pulled, ()) = tokio::join!(reader.pull(&process.addr, &id, 0, &refs), thaw);
    let stats = pulled.expect("a holder that runs again within the pull's deadline is read");
    assert_eq!(stats.bytes, 8 * 65536);
    assert!(started.elapsed() >= 3 * io, "{:?}", started.elapsed());
    // The process holds its first hold with seed 0.
    assert_eq!(gather(&reader, region, &refs), pattern(0, 8 * 65536));

    let reader = reader_with(kind, io, 4 * io);
    let (_, refs) = scattered(&reader, 8, 65536);
    process.signal("STOP");
    let started = Instant::now();
    let err = reader
        .pull(&process.addr, &id, 0, &refs)
        .await
        .expect_err("a holder that stays stopped fails the pull");
    process.signal("CONT");
    assert!(matches!(err, TransferError::Timeout { .. }), "{err:?}");
    let took = started.elapsed();
    assert!(took >= 4 * io && took < 8 * io, "{took:?}: {err:?}");
}

pub async fn stalled_holder_times_out(kind: BackendKind) {
    let process = HolderProcess::start(
        kind,
        &[
            "--hold",
            &format!("{}:8:1048576", tid("t")),
            "--stall-after-bytes",
            "0",
        ],
    );
    let reader = quick_reader(kind);
    let (_, refs) = scattered(&reader, 8, 1 << 20);
    let started = Instant::now();
    let id = tid("t");
    let mut stuck = std::pin::pin!(reader.pull(&process.addr, &id, 0, &refs));
    let outcome = tokio::time::timeout(Duration::from_millis(300), stuck.as_mut()).await;
    assert!(
        outcome.is_err(),
        "the pull cannot finish while the holder stalls"
    );
    // While it is stuck it owns its destination: a second pull into the same
    // bytes is refused at once, never interleaved.
    let second = reader.pull(&process.addr, &tid("t"), 0, &refs).await;
    assert!(
        matches!(second, Err(TransferError::InvalidArgument(_))),
        "{second:?}"
    );
    let err = stuck.await.unwrap_err();
    assert!(matches!(err, TransferError::Timeout { .. }), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

/// A reader whose waits are short: `io` per wait, `pull` per pull.
fn reader_with(kind: BackendKind, io: Duration, pull: Duration) -> Reader {
    let mut config = ReaderConfig::new(kind);
    config.client = ClientConfig {
        io_timeout: io,
        ..Default::default()
    };
    config.pull_timeout = pull;
    Reader::with_config(config).unwrap()
}

/// Caller-owned memory for a test to poke at while a transfer may run:
/// written and read through raw pointers only (never through a reference
/// while a transfer could write it).
struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a pointer to a leaked buffer; the tests only touch it through
// volatile accesses.
unsafe impl Send for RawBuf {}
// SAFETY: as above.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// Leaked on purpose: a buggy transfer may still write into it after
    /// the test ends, and must not write into freed memory.
    fn new(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        let ptr = Box::leak(bytes.into_boxed_slice()).as_mut_ptr();
        Self { ptr, len }
    }

    fn region(&self) -> Region {
        // SAFETY: the buffer is leaked, so valid for the rest of the process.
        unsafe { Region::raw(self.ptr, self.len) }
    }

    fn fill(&self, byte: u8) {
        for i in 0..self.len {
            // SAFETY: in bounds of the leaked buffer.
            unsafe { self.ptr.add(i).write_volatile(byte) };
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        // SAFETY: in bounds of the leaked buffer.
        (0..self.len)
            .map(|i| unsafe { self.ptr.add(i).read_volatile() })
            .collect()
    }
}

const GUARD: u8 = 0xEE;

/// A holder that serves slowly: on TCP it trickles one byte per `every`
/// (each well inside the reader's I/O timeout); a one-sided backend's reads
/// cannot be slowed by the holder, so it stops serving gets once the pull
/// has started (the stall fault) and the reader's waits decide.
fn slow(kind: BackendKind, every: Duration) -> Faults {
    match kind {
        BackendKind::Tcp => Faults {
            trickle: Some(every),
            ..Default::default()
        },
        _ => Faults {
            stall_after_bytes: Some(0),
            ..Default::default()
        },
    }
}

/// [`slow`] as flags of `connex-transfer-holder`.
fn slow_args(kind: BackendKind, every: Duration) -> Vec<String> {
    let faults = slow(kind, every);
    match (faults.trickle, faults.stall_after_bytes) {
        (Some(every), _) => vec!["--trickle-ms".into(), every.as_millis().to_string()],
        (_, Some(bytes)) => vec!["--stall-after-bytes".into(), bytes.to_string()],
        _ => Vec::new(),
    }
}

/// A release while a read streams the hold's blocks: the blocks are reported
/// freed only once the read has stopped, so the engine that reuses them then
/// (here: fills them with a guard pattern) never has a byte of theirs reach
/// the reader.
pub async fn release_during_a_read(kind: BackendKind) {
    let (blocks, size) = (64u64, 1024u64);
    let source = RawBuf::new(pattern(21, (blocks * size) as usize));
    let holder = Holder::start(HolderConfig {
        backend: kind,
        faults: slow(kind, Duration::from_millis(20)),
        ..Default::default()
    })
    .await
    .unwrap();
    let region = holder.register_region(source.region()).unwrap();
    let refs = (0..blocks)
        .map(|b| BlockRef::new(region, b * size, size))
        .collect();
    holder.create_hold(RD_ID, refs).unwrap();
    let reader = std::sync::Arc::new(reader_with(
        kind,
        Duration::from_secs(2),
        Duration::from_secs(4),
    ));
    let (dest, refs) = scattered(&reader, blocks, size);
    let pull = {
        let (reader, addr) = (reader.clone(), addr(&holder));
        tokio::spawn(async move { reader.pull(&addr, RD_ID, 0, &refs).await.map(|_| refs) })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pull.is_finished(), "the trickled read is in flight");
    assert!(holder.release(RD_ID));
    // The engine reuses the blocks as soon as they are reported freed.
    let released = Instant::now();
    loop {
        if holder.freed() == [RD_ID] {
            // A one-sided read cannot be fenced from here: the blocks wait
            // until the reader has given up (its gets stall; it stops them
            // at its 2 s I/O timeout and says so).
            assert!(
                kind == BackendKind::Tcp || released.elapsed() > Duration::from_secs(1),
                "freed while a one-sided pull still runs"
            );
            break;
        }
        assert!(
            released.elapsed() < Duration::from_secs(10),
            "a released hold is freed once its reads stopped"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    source.fill(GUARD);
    let result = tokio::time::timeout(Duration::from_secs(10), pull)
        .await
        .expect("the pull ends")
        .unwrap();
    assert!(result.is_err(), "a pull of a released hold fails");
    if kind == BackendKind::Mooncake {
        // Mooncake's reads cannot be cancelled: while the holder lives they may
        // still write (its one-sided reads serve whatever the blocks hold now),
        // so the reader keeps the destination claimed rather than hand it back.
        assert!(
            reader.take_region(dest).is_err(),
            "a destination a read may still write into was handed back"
        );
        assert_eq!(holder.draining(), 0);
        holder.stop().await;
        region_back(&reader, dest).await;
        return;
    }
    // Wait out what a writer still running could send, then look.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = reader.take_region(dest).unwrap();
    assert!(
        !got.contains(&GUARD),
        "bytes of reused blocks reached the reader"
    );
    assert_eq!(holder.draining(), 0);
    holder.stop().await;
}

/// Waits until `region` is handed back: once its holder is gone, a backend
/// that kept it claimed for reads that could not be cancelled (mooncake) sees
/// them end, at the latest when Mooncake's TCP transport gives up on a read
/// with no status frame (30 s).
async fn region_back(reader: &Reader, region: RegionId) -> Vec<u8> {
    let since = Instant::now();
    loop {
        match reader.take_region(region) {
            Ok(bytes) => return bytes,
            Err(err) => assert!(
                since.elapsed() < Duration::from_secs(45),
                "the region never came back after its holder died: {err}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pull past its time limit: when `pull_timeout` returns, its writers have
/// stopped, so blocks the caller gives back at once (and refills: the guard
/// pattern) are never written by it again.
pub async fn pull_past_its_timeout_never_writes_into_returned_blocks(kind: BackendKind) {
    let hold = format!("{T_ID}:8:4096");
    let mut args = vec!["--hold", &hold];
    let slow = slow_args(kind, Duration::from_millis(20));
    args.extend(slow.iter().map(String::as_str));
    let process = HolderProcess::start(kind, &args);
    let reader = reader_with(kind, Duration::from_secs(5), Duration::from_secs(30));
    let dest = RawBuf::new(vec![0xAA; 8 * 4096]);
    let region = reader.register_region(dest.region()).unwrap();
    let refs: Vec<BlockRef> = (0..8)
        .map(|b| BlockRef::new(region, b * 4096, 4096))
        .collect();
    let limit = Duration::from_millis(800);
    let started = Instant::now();
    let err = reader
        .pull_timeout(&process.addr, T_ID, 0, &refs, limit)
        .await
        .unwrap_err();
    assert!(matches!(err, TransferError::Timeout { .. }), "{err:?}");
    // Well before the 5 s I/O timeout could have ended it.
    assert!(
        started.elapsed() < limit + Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // The caller owns the blocks again: no pull claims them any more.
    assert!(reader.unregister_region(region));
    dest.fill(GUARD);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        dest.snapshot().iter().all(|&b| b == GUARD),
        "a timed-out pull wrote into blocks it had given back"
    );
}

/// A holder that sends one byte per 100 ms never lets a single wait reach the
/// 5 s I/O timeout; the pull's own 1.5 s deadline cuts it.
pub async fn trickling_holder_is_cut_at_the_deadline(kind: BackendKind) {
    let hold = format!("{T_ID}:4:65536");
    let mut args = vec!["--hold", &hold];
    let slow = slow_args(kind, Duration::from_millis(100));
    args.extend(slow.iter().map(String::as_str));
    let mut process = HolderProcess::start(kind, &args);
    let reader = reader_with(kind, Duration::from_secs(5), Duration::from_millis(1500));
    let (region, refs) = scattered(&reader, 4, 65536);
    let started = Instant::now();
    let result = tokio::time::timeout(
        Duration::from_secs(20),
        reader.pull(&process.addr, T_ID, 0, &refs),
    )
    .await
    .expect("a trickling holder is cut, not waited for byte by byte");
    let err = result.unwrap_err();
    assert!(matches!(err, TransferError::Timeout { .. }), "{err:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_millis(4500),
        "cut after {took:?}, deadline 1.5 s"
    );
    if kind == BackendKind::Mooncake {
        // Mooncake's C API cannot cancel a read: while the stalled holder
        // lives, its reads may still write, so the destination stays claimed
        // (handing it back is how a late write would reach reused blocks),
        // and the reader says so to a caller whose blocks are its engine's.
        assert!(
            reader.writing_into(&refs),
            "a failed pull's reads may still write, and the reader denies it"
        );
        assert!(
            reader.take_region(region).is_err(),
            "a destination a read may still write into was handed back"
        );
        process.kill();
        // Its death fails the reads: the blocks may go back.
        let since = Instant::now();
        while reader.writing_into(&refs) {
            assert!(
                since.elapsed() < Duration::from_secs(45),
                "reads never ended"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        region_back(&reader, region).await;
    } else {
        assert!(
            !reader.writing_into(&refs),
            "nothing writes after a failed pull"
        );
        reader.take_region(region).unwrap();
    }
}

/// Transfer ids of the tests above.
const RD_ID: &str = "rd-3f0c9a6e5b2d48c1a7e4f9b0c2d5e8a1";
const T_ID: &str = "t-5a1b2c3d4e5f60718293a4b5c6d7e8f9";

macro_rules! conformance {
    ($module:ident, $kind:expr) => {
        mod $module {
            use connex_transfer::BackendKind;
            const KIND: BackendKind = $kind;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn content_checksums_after_pull() {
                super::content_checksums_after_pull(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn big_pulls_use_several_streams() {
                super::big_pulls_use_several_streams(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn partial_pulls_move_only_the_selected_blocks() {
                super::partial_pulls_move_only_the_selected_blocks(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn expiry() {
                super::expiry(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn release() {
                super::release(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_pulls() {
                super::concurrent_pulls(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stale_epoch_and_mismatches() {
                super::stale_epoch_and_mismatches(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn holder_killed_mid_pull() {
                super::holder_killed_mid_pull(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn frozen_holder_is_waited_for_until_the_deadline() {
                super::frozen_holder_is_waited_for_until_the_deadline(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stalled_holder_times_out() {
                super::stalled_holder_times_out(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn release_during_a_read() {
                super::release_during_a_read(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn pull_past_its_timeout_never_writes_into_returned_blocks() {
                super::pull_past_its_timeout_never_writes_into_returned_blocks(KIND).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn trickling_holder_is_cut_at_the_deadline() {
                super::trickling_holder_is_cut_at_the_deadline(KIND).await
            }
        }
    };
}

conformance!(tcp, BackendKind::Tcp);
#[cfg(feature = "ucx")]
conformance!(ucx, BackendKind::Ucx);
#[cfg(feature = "mooncake")]
conformance!(mooncake, BackendKind::Mooncake);
