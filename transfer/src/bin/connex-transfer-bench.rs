//! `connex-transfer-bench`: pulls of a hold between two processes on loopback,
//! beside a plain TCP socket copy of the same bytes and a memcpy, in one run
//! (`bench/run transfer` drives it). Prints GB/s, the ratios, with mooncake
//! `mooncake_vs_socket_ratio=<x>` and the tcp backend against Mooncake per
//! block size, and last the line `tcp_backend_vs_socket_ratio=<x>` (each the
//! worst block size). Blocks are
//! scattered on both sides (reverse order in memory), as in a KV cache, so
//! each block is its own buffer to the transport.

use connex_transfer::{pattern, BackendKind, BlockRef, Reader, ReaderConfig, Region, RegionId};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const BLOCK_SIZES: [u64; 3] = [16 << 10, 256 << 10, 2 << 20];

struct Args {
    backends: Vec<BackendKind>,
    total: u64,
    rounds: usize,
    streams: usize,
    holder_bin: String,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        backends: vec![BackendKind::Tcp],
        total: 256 << 20,
        rounds: 5,
        streams: ReaderConfig::new(BackendKind::Tcp).max_streams,
        holder_bin: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--backends" => {
                args.backends = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--total-mib" => args.total = value()?.parse::<u64>().map_err(|e| e.to_string())? << 20,
            "--rounds" => {
                args.rounds = value()?
                    .parse()
                    .map_err(|e: std::num::ParseIntError| e.to_string())?
            }
            "--streams" => {
                args.streams = value()?
                    .parse()
                    .map_err(|e: std::num::ParseIntError| e.to_string())?
            }
            "--holder-bin" => args.holder_bin = value()?,
            "socket-source" => return Err("socket-source".into()),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if args.holder_bin.is_empty() {
        // The holder binary is built beside this one.
        let me = std::env::current_exe().map_err(|e| e.to_string())?;
        args.holder_bin = me
            .with_file_name("connex-transfer-holder")
            .to_string_lossy()
            .into_owned();
    }
    Ok(args)
}

fn gbps(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e9
}

/// A child process killed on drop.
/// The benchmark hold's transfer id (holders want 128 random bits' worth).
const BENCH_ID: &str = "bench-5f3c9a1e7b2d4086a9c1e3f5b7d90246";

struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd`; returns it and the address on its first stdout line after `prefix`.
fn spawn(mut cmd: Command, prefix: &str) -> Result<(Kid, String), String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let kid = Kid(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let addr = line
        .strip_prefix(prefix)
        .ok_or(format!("unexpected first line {line:?}"))?
        .trim()
        .to_string();
    Ok((kid, addr))
}

/// The socket baseline's source: serves `u64 len` requests with the pattern bytes.
fn socket_source() -> ExitCode {
    let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
        return ExitCode::FAILURE;
    };
    let Ok(addr) = listener.local_addr() else {
        return ExitCode::FAILURE;
    };
    println!("listening {addr}");
    let _ = std::io::stdout().flush();
    let mut data: Vec<u8> = Vec::new();
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        let mut len = [0u8; 8];
        while stream.read_exact(&mut len).is_ok() {
            let len = u64::from_le_bytes(len) as usize;
            if data.len() != len {
                data = pattern(0, len);
            }
            if stream.write_all(&data).is_err() {
                break;
            }
        }
    }
    ExitCode::SUCCESS
}

/// One thing being measured; every round runs each target once, in turn, so
/// the machine's noise hits all of them alike.
enum Target {
    Memcpy {
        src: Vec<u8>,
        dst: Vec<u8>,
    },
    Socket {
        stream: TcpStream,
        buf: Vec<u8>,
    },
    Pull {
        kind: BackendKind,
        block: u64,
        _holder: Kid,
        addr: String,
        reader: Reader,
        region: RegionId,
        dest: Vec<BlockRef>,
    },
}

impl Target {
    fn label(&self) -> String {
        match self {
            Target::Memcpy { .. } => "memcpy".into(),
            Target::Socket { .. } => "tcp socket copy (1 conn)".into(),
            Target::Pull { kind, block, .. } => {
                format!("{kind} backend, {} KiB blocks", block >> 10)
            }
        }
    }

    async fn once(&mut self, total: u64) -> Result<Duration, String> {
        let start = Instant::now();
        match self {
            Target::Memcpy { src, dst } => {
                dst.copy_from_slice(std::hint::black_box(src));
                std::hint::black_box(dst);
            }
            Target::Socket { stream, buf } => {
                stream
                    .write_all(&total.to_le_bytes())
                    .map_err(|e| e.to_string())?;
                stream.read_exact(buf).map_err(|e| e.to_string())?;
            }
            Target::Pull {
                kind,
                addr,
                reader,
                dest,
                ..
            } => {
                reader
                    .pull(addr, BENCH_ID, 0, dest)
                    .await
                    .map_err(|e| format!("{kind} pull: {e}"))?;
            }
        }
        Ok(start.elapsed())
    }

    /// Checks the bytes the target moved last.
    fn verify(self, want: &[u8]) -> Result<(), String> {
        let ok = match self {
            Target::Memcpy { dst, .. } => dst == want,
            Target::Socket { buf, .. } => buf == want,
            Target::Pull {
                reader,
                region,
                dest,
                ..
            } => {
                let got = reader.take_region(region).map_err(|e| e.to_string())?;
                let mut at = 0usize;
                dest.iter().all(|b| {
                    let (o, l) = (b.offset as usize, b.len as usize);
                    let same = got[o..o + l] == want[at..at + l];
                    at += l;
                    same
                })
            }
        };
        if ok {
            Ok(())
        } else {
            Err("wrong bytes after the copy".into())
        }
    }
}

fn pull_target(args: &Args, kind: BackendKind, block: u64) -> Result<Target, String> {
    let count = args.total / block;
    let mut cmd = Command::new(&args.holder_bin);
    cmd.args([
        "--backend",
        kind.name(),
        "--scatter",
        "--hold",
        &format!("{BENCH_ID}:{count}:{block}"),
    ]);
    let (holder, addr) = spawn(cmd, "ctrl ")?;
    let mut config = ReaderConfig::new(kind);
    config.max_streams = args.streams;
    let reader = Reader::with_config(config).map_err(|e| e.to_string())?;
    let region = reader
        .register_region(Region::owned(vec![0u8; args.total as usize]))
        .map_err(|e| e.to_string())?;
    // Scattered like the holder's: block b lies at the mirror position.
    let dest = (0..count)
        .map(|b| BlockRef::new(region, (count - 1 - b) * block, block))
        .collect();
    Ok(Target::Pull {
        kind,
        block,
        _holder: holder,
        addr,
        reader,
        region,
        dest,
    })
}

async fn run(args: Args) -> Result<(), String> {
    let total = args.total;
    let want = pattern(0, total as usize);
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut source = Command::new(me);
    source.arg("socket-source");
    let (_source, source_addr) = spawn(source, "listening ")?;
    let stream = TcpStream::connect(&source_addr).map_err(|e| e.to_string())?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut targets = vec![
        Target::Memcpy {
            src: want.clone(),
            dst: vec![0u8; total as usize],
        },
        Target::Socket {
            stream,
            buf: vec![0u8; total as usize],
        },
    ];
    for &kind in &args.backends {
        for block in BLOCK_SIZES {
            targets.push(pull_target(&args, kind, block)?);
        }
    }
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); targets.len()];
    // Round 0 warms up (page faults, connections) and is not counted.
    for round in 0..=args.rounds.max(1) {
        for (i, target) in targets.iter_mut().enumerate() {
            let took = target.once(total).await?;
            if round > 0 {
                times[i].push(took);
            }
        }
    }
    let rates: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort();
            gbps(total, t[t.len() / 2])
        })
        .collect();
    let (mem, socket) = (rates[0], rates[1]);
    println!(
        "transfer: {} MiB per pull, reader and holder in two processes on loopback, median of {} rounds",
        total >> 20,
        args.rounds
    );
    let mut worst_tcp = f64::INFINITY;
    // Per block size: the tcp backend's and Mooncake's rates (Mooncake's TCP
    // transport is the anchor the tcp backend is compared with).
    let mut by_block: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
    for (target, rate) in targets.iter().zip(&rates) {
        let label = target.label();
        match target {
            Target::Pull { kind, block, .. } => {
                println!(
                    "  {label:<33} {rate:6.2} GB/s   {:.2}x socket   {:.2}x memcpy",
                    rate / socket,
                    rate / mem
                );
                let pair = by_block.entry(*block).or_insert((f64::NAN, f64::NAN));
                match kind {
                    BackendKind::Tcp => {
                        worst_tcp = worst_tcp.min(rate / socket);
                        pair.0 = *rate;
                    }
                    BackendKind::Mooncake => pair.1 = *rate,
                    BackendKind::Ucx => {}
                }
            }
            _ => println!("  {label:<33} {rate:6.2} GB/s"),
        }
    }
    for target in targets {
        let label = target.label();
        target.verify(&want).map_err(|e| format!("{label}: {e}"))?;
    }
    if args.backends.contains(&BackendKind::Mooncake) {
        let worst = by_block
            .values()
            .map(|p| p.1 / socket)
            .fold(f64::INFINITY, f64::min);
        for (block, (tcp, mooncake)) in &by_block {
            if tcp.is_finite() {
                println!(
                    "  tcp backend vs mooncake, {} KiB blocks: {:.2}x",
                    block >> 10,
                    tcp / mooncake
                );
            }
        }
        println!("mooncake_vs_socket_ratio={worst:.3}");
    }
    if worst_tcp.is_finite() {
        println!("tcp_backend_vs_socket_ratio={worst_tcp:.3}");
    } else {
        println!("(the tcp backend was not among --backends: no tcp_backend_vs_socket_ratio)");
    }
    Ok(())
}

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("socket-source") {
        return socket_source();
    }
    let args = match parse() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("connex-transfer-bench: {err}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("connex-transfer-bench: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("connex-transfer-bench: {err}");
            ExitCode::FAILURE
        }
    }
}
