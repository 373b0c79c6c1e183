//! Frame I/O on one TCP connection, every read and write under a time limit.
//!
//! Shared by the listener and the client so both sides read headers, payloads
//! and raw block bytes the same way.

use crate::error::{Result, TransferError};
use crate::proto::{FrameError, Header, HEADER_LEN, MAX_PAYLOAD, VERSION};
use std::future::Future;
use std::io::{IoSlice, IoSliceMut};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest piece of block bytes moved by one timed read or write, so that a
/// dead peer is noticed within one I/O timeout whatever the transfer size.
pub(crate) const IO_PIECE: usize = 4 << 20;
/// Most buffers handed to one vectored read or write (Linux allows 1024).
const MAX_IOVECS: usize = 512;
/// Largest transfer whose bytes move on the async socket: for a small one the
/// blocking pool's thread hand-off and the socket's mode switches (about ten
/// system calls on each side) cost more than readiness-driven I/O does;
/// bulk bytes still go through [`blocking`] (see there).
pub(crate) const ASYNC_MAX: u64 = 256 << 10;

/// Runs `fut` under `limit`, naming `what` in the timeout error.
pub(crate) async fn timed<T>(
    what: &'static str,
    limit: Duration,
    fut: impl Future<Output = std::io::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result.map_err(TransferError::Io),
        Err(_) => Err(TransferError::Timeout { what, after: limit }),
    }
}

/// Reads one frame header. `Ok(None)`: the peer closed cleanly between frames.
/// Waits up to `idle` for the first byte, then `io` for the rest.
pub(crate) async fn read_header<S: AsyncRead + Unpin>(
    stream: &mut S,
    idle: Duration,
    io: Duration,
) -> Result<Option<[u8; HEADER_LEN]>> {
    let mut buf = [0u8; HEADER_LEN];
    let first = timed("waiting for a frame", idle, stream.read(&mut buf)).await?;
    if first == 0 {
        return Ok(None);
    }
    timed(
        "reading a frame header",
        io,
        stream.read_exact(&mut buf[first..]),
    )
    .await?;
    Ok(Some(buf))
}

/// Why a header cannot be followed: answered with an error, then the
/// connection is closed (its byte stream cannot be trusted any more).
pub(crate) fn check_header(
    raw: &[u8; HEADER_LEN],
) -> std::result::Result<Header, (crate::proto::ErrorCode, FrameError)> {
    use crate::proto::ErrorCode;
    let header = Header::parse(raw).map_err(|e| (ErrorCode::BadFrame, e))?;
    if header.version != VERSION {
        return Err((
            ErrorCode::BadVersion,
            FrameError(format!(
                "protocol version {} is not supported; this peer speaks {VERSION}",
                header.version
            )),
        ));
    }
    if header.len > MAX_PAYLOAD {
        return Err((
            ErrorCode::TooLarge,
            FrameError(format!(
                "payload of {} bytes over the limit {MAX_PAYLOAD}",
                header.len
            )),
        ));
    }
    Ok(header)
}

/// Reads a payload of `len` bytes (already checked against the limit).
pub(crate) async fn read_payload<S: AsyncRead + Unpin>(
    stream: &mut S,
    len: u32,
    io: Duration,
) -> Result<Vec<u8>> {
    let mut payload = vec![0u8; len as usize];
    timed(
        "reading a frame payload",
        io,
        stream.read_exact(&mut payload),
    )
    .await?;
    Ok(payload)
}

/// Writes a whole frame (or block bytes), piece by piece, each under `io`.
pub(crate) async fn write_all<S: AsyncWrite + Unpin>(
    stream: &mut S,
    bytes: &[u8],
    io: Duration,
) -> Result<()> {
    for piece in bytes.chunks(IO_PIECE) {
        timed("writing", io, stream.write_all(piece)).await?;
    }
    Ok(())
}

/// A blocking socket whose every read and write ends by `deadline`: each
/// system call waits at most the I/O timeout, and in the last stretch before
/// the deadline only what is left of it. A peer that trickles one byte per
/// I/O timeout is therefore cut at the deadline, not kept alive by each byte.
pub(crate) struct DeadlineStream<'a> {
    inner: &'a mut std::net::TcpStream,
    io: Duration,
    deadline: Instant,
    /// The timeout the socket has now (a system call to change it).
    current: Duration,
}

impl DeadlineStream<'_> {
    /// The time the next system call may wait, or `TimedOut` past the deadline.
    fn arm(&mut self) -> std::io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "deadline passed",
            ));
        }
        let wait = left.min(self.io);
        if wait < self.current {
            self.inner.set_read_timeout(Some(wait))?;
            self.inner.set_write_timeout(Some(wait))?;
            self.current = wait;
        }
        Ok(())
    }
}

impl std::io::Read for DeadlineStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.inner.read(buf)
    }
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> std::io::Result<usize> {
        self.arm()?;
        self.inner.read_vectored(bufs)
    }
}

impl std::io::Write for DeadlineStream<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.inner.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.arm()?;
        self.inner.write_vectored(bufs)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs blocking I/O `f` on `stream` in tokio's blocking pool, each system
/// call bounded by `io` and the whole by `deadline`, and hands the stream back.
/// `fence` gets a handle of the socket before any byte moves: shutting it
/// down (a release on the holder, a pull cut at its deadline or dropped on
/// the reader) makes the blocked call return at once.
///
/// Bulk block bytes move this way: a thread sleeping in `readv`/`writev`
/// costs one system call per buffer-full, where readiness-driven async I/O
/// adds an `epoll_wait` and a task wake-up to each, which on loopback costs a
/// quarter of the throughput. The closure owns what it touches (spans keep
/// their memory alive, guards their counts), so an abandoned transfer stays
/// memory-safe and ends at the latest at its deadline.
pub(crate) async fn blocking<T, F>(
    stream: TcpStream,
    io: Duration,
    deadline: Instant,
    fence: impl FnOnce(std::net::TcpStream) -> Result<()>,
    f: F,
) -> Result<(TcpStream, T)>
where
    T: Send + 'static,
    F: FnOnce(&mut DeadlineStream<'_>) -> std::io::Result<T> + Send + 'static,
{
    let mut std_stream = stream.into_std()?;
    std_stream.set_nonblocking(false)?;
    std_stream.set_read_timeout(Some(io))?;
    std_stream.set_write_timeout(Some(io))?;
    fence(std_stream.try_clone()?)?;
    let (std_stream, result) = tokio::task::spawn_blocking(move || {
        let mut timed = DeadlineStream {
            inner: &mut std_stream,
            io,
            deadline,
            current: io,
        };
        let result = f(&mut timed);
        (std_stream, result)
    })
    .await
    .map_err(|e| TransferError::Protocol(format!("blocking transfer task: {e}")))?;
    let value = result.map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => TransferError::Timeout {
            what: "moving block bytes",
            after: io,
        },
        _ => TransferError::Io(e),
    })?;
    std_stream.set_nonblocking(true)?;
    Ok((TcpStream::from_std(std_stream)?, value))
}

/// Where a vectored transfer over several buffers stands: the buffer and the
/// offset in it the next system call starts at. Empty buffers are skipped.
struct Cursor {
    lens: Vec<usize>,
    idx: usize,
    off: usize,
}

impl Cursor {
    fn new(lens: Vec<usize>) -> Self {
        let mut cursor = Self {
            lens,
            idx: 0,
            off: 0,
        };
        cursor.advance(0);
        cursor
    }

    fn done(&self) -> bool {
        self.idx >= self.lens.len()
    }

    /// Moves on by `n` bytes.
    fn advance(&mut self, mut n: usize) {
        while self.idx < self.lens.len() {
            let left = self.lens[self.idx] - self.off;
            if n >= left {
                n -= left;
                self.idx += 1;
                self.off = 0;
            } else {
                self.off += n;
                return;
            }
        }
    }

    /// The next write's buffers: the rest of the current one and up to
    /// [`MAX_IOVECS`] in all.
    fn write_slices<'a>(&self, bufs: &'a [&[u8]]) -> Vec<IoSlice<'a>> {
        std::iter::once(IoSlice::new(&bufs[self.idx][self.off..]))
            .chain(
                bufs[self.idx + 1..]
                    .iter()
                    .take(MAX_IOVECS - 1)
                    .map(|b| IoSlice::new(b)),
            )
            .collect()
    }

    /// The next read's buffers, as for [`Cursor::write_slices`].
    fn read_slices<'a>(&self, bufs: &'a mut [&mut [u8]]) -> Vec<IoSliceMut<'a>> {
        let (first, rest) = bufs[self.idx..].split_at_mut(1);
        std::iter::once(IoSliceMut::new(&mut first[0][self.off..]))
            .chain(
                rest.iter_mut()
                    .take(MAX_IOVECS - 1)
                    .map(|b| IoSliceMut::new(b)),
            )
            .collect()
    }

    /// Takes in one system call's outcome: moved on, or to be called again
    /// (interrupted), or the transfer's error (`WouldBlock` included: the
    /// async callers wait for readiness before they get here).
    fn moved(
        &mut self,
        outcome: std::io::Result<usize>,
        direction: Direction,
    ) -> std::io::Result<()> {
        match outcome {
            Ok(0) => Err(direction.nothing_moved()),
            Ok(n) => {
                self.advance(n);
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Which way a transfer's bytes go, for what a call that moved none means.
#[derive(Clone, Copy)]
enum Direction {
    Write,
    Read,
}

impl Direction {
    fn nothing_moved(self) -> std::io::Error {
        match self {
            Direction::Write => std::io::ErrorKind::WriteZero.into(),
            Direction::Read => std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "peer closed the connection mid-transfer",
            ),
        }
    }
}

/// Writes `bufs` in order with vectored writes (many scattered blocks per
/// system call).
pub(crate) fn write_gather(
    stream: &mut impl std::io::Write,
    bufs: &[&[u8]],
) -> std::io::Result<()> {
    let mut cursor = Cursor::new(bufs.iter().map(|b| b.len()).collect());
    while !cursor.done() {
        let written = stream.write_vectored(&cursor.write_slices(bufs));
        cursor.moved(written, Direction::Write)?;
    }
    Ok(())
}

/// Fills `bufs` in order with vectored reads.
pub(crate) fn read_scatter(
    stream: &mut impl std::io::Read,
    bufs: &mut [&mut [u8]],
) -> std::io::Result<()> {
    let mut cursor = Cursor::new(bufs.iter().map(|b| b.len()).collect());
    while !cursor.done() {
        let read = stream.read_vectored(&mut cursor.read_slices(bufs));
        cursor.moved(read, Direction::Read)?;
    }
    Ok(())
}

/// [`write_gather`] on the async socket (for transfers up to [`ASYNC_MAX`]);
/// the caller bounds the time and fences it.
pub(crate) async fn write_gather_async(stream: &TcpStream, bufs: &[&[u8]]) -> std::io::Result<()> {
    let mut cursor = Cursor::new(bufs.iter().map(|b| b.len()).collect());
    while !cursor.done() {
        match stream.try_write_vectored(&cursor.write_slices(bufs)) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => stream.writable().await?,
            written => cursor.moved(written, Direction::Write)?,
        }
    }
    Ok(())
}

/// [`read_scatter`] on the async socket (for transfers up to [`ASYNC_MAX`]);
/// the caller bounds the time and fences it.
pub(crate) async fn read_scatter_async(
    stream: &TcpStream,
    bufs: &mut [&mut [u8]],
) -> std::io::Result<()> {
    let mut cursor = Cursor::new(bufs.iter().map(|b| b.len()).collect());
    while !cursor.done() {
        match stream.try_read_vectored(&mut cursor.read_slices(bufs)) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => stream.readable().await?,
            read => cursor.moved(read, Direction::Read)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A stream that moves at most 5 bytes per call, to exercise partial I/O.
    struct Trickle(std::io::Cursor<Vec<u8>>);

    impl std::io::Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(5);
            std::io::Read::read(&mut self.0, &mut buf[..n])
        }
    }

    impl std::io::Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = buf.len().min(5);
            std::io::Write::write(&mut self.0, &buf[..n])
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn gather_and_scatter_survive_partial_io_and_empty_buffers() {
        let data: Vec<u8> = (0..200u8).collect();
        let parts: Vec<&[u8]> = vec![
            &data[..0],
            &data[..13],
            &data[13..13],
            &data[13..150],
            &data[150..],
        ];
        let mut out = Trickle(std::io::Cursor::new(Vec::new()));
        write_gather(&mut out, &parts).unwrap();
        assert_eq!(out.0.get_ref(), &data);

        let mut input = Trickle(std::io::Cursor::new(data.clone()));
        let (mut a, mut b, mut c) = (vec![0u8; 7], vec![0u8; 0], vec![0u8; 193]);
        read_scatter(&mut input, &mut [&mut a, &mut b, &mut c]).unwrap();
        assert_eq!([a, c].concat(), data);
        let mut short = Trickle(std::io::Cursor::new(vec![1, 2, 3]));
        let err = read_scatter(&mut short, &mut [&mut [0u8; 4]]).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
