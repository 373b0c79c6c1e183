//! What only the mooncake backend has to prove: Mooncake's C API cannot cancel
//! a read, so a pull that gives up while its reads are in flight must keep its
//! destination (no one may take or reuse the bytes) until the engine reports
//! them ended, and then hand it back. The common stories are in conformance.rs.
#![cfg(feature = "mooncake")]
#![allow(clippy::unwrap_used)]

use connex_transfer::{
    BackendKind, BlockRef, ClientConfig, Reader, ReaderConfig, Region, TransferError,
};
use std::time::{Duration, Instant};

mod common;
use common::HolderProcess;

/// The hold's transfer id (128 random bits, as the holder requires).
const ID: &str = "m-7c1e4a9b2d5f60838a4b1c2d3e4f5a6b";

/// A mooncake holder process whose engine stops serving once a pull starts
/// (its handshake still answers, so the reads are submitted and hang).
fn stalled_holder() -> HolderProcess {
    HolderProcess::start(
        BackendKind::Mooncake,
        &[
            "--hold",
            &format!("{ID}:8:1048576"),
            "--stall-after-bytes",
            "0",
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_that_gave_up_keeps_its_destination_until_the_reads_end() {
    let mut holder = stalled_holder();
    let mut config = ReaderConfig::new(BackendKind::Mooncake);
    config.client = ClientConfig {
        io_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let reader = Reader::with_config(config).unwrap();
    let region = reader
        .register_region(Region::owned(vec![0u8; 8 << 20]))
        .unwrap();
    let dest: Vec<BlockRef> = (0..8)
        .map(|b| BlockRef::new(region, (7 - b) << 20, 1 << 20))
        .collect();

    let err = reader.pull(&holder.addr, ID, 0, &dest).await.unwrap_err();
    // The reads were submitted (the segment opened) and never ended.
    assert!(
        matches!(
            err,
            TransferError::Timeout {
                what: "waiting for mooncake reads",
                ..
            }
        ),
        "{err:?}"
    );
    // The engine may still write into the destination: it is not handed out.
    let busy = reader.take_region(region).unwrap_err();
    assert!(
        matches!(busy, TransferError::InvalidArgument(_)),
        "{busy:?}"
    );
    assert!(
        matches!(
            reader.pull(&holder.addr, ID, 0, &dest).await,
            Err(TransferError::InvalidArgument(_))
        ),
        "a second pull into bytes still being read is refused"
    );

    // Once the holder is gone its reads fail, and the destination comes back.
    holder.kill();
    let killed = Instant::now();
    let bytes = loop {
        match reader.take_region(region) {
            Ok(bytes) => break bytes,
            Err(_) if killed.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(err) => panic!("destination still claimed after the holder died: {err}"),
        }
    };
    assert_eq!(bytes.len(), 8 << 20);
}
