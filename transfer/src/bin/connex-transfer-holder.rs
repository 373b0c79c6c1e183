//! `connex-transfer-holder`: a holder in its own process, for the conformance
//! suite (which kills it mid-pull) and the transfer benchmark.
//!
//! Each `--hold ID:BLOCKS:BLOCK_BYTES` holds `BLOCKS` blocks of `BLOCK_BYTES`
//! filled with `connex_transfer::pattern(SEED, ..)` (one region per hold,
//! blocks laid end to end, SEED = the hold's index). `--stall-after-bytes N`
//! and `--trickle-ms MS` make it misbehave (see `Faults`). Prints `ctrl ADDR` once
//! serving, then runs until stdin closes or it is killed. With `--scatter` the
//! blocks lie in reverse order in memory (as a KV cache's blocks are
//! scattered), so no two neighbours can be sent as one buffer.

use connex_transfer::{pattern, BackendKind, BlockRef, Holder, HolderConfig, Region, ReleaseMode};
use std::process::ExitCode;
use std::time::Duration;
use tokio::io::AsyncReadExt;

struct Args {
    config: HolderConfig,
    holds: Vec<(String, u64, u64)>,
    scatter: bool,
}

fn parse() -> Result<Args, String> {
    let mut config = HolderConfig::default();
    let mut holds = Vec::new();
    let mut scatter = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => config.backend = value()?.parse()?,
            "--listen" => config.listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?,
            "--retain-ms" => {
                let ms: u64 = value()?.parse().map_err(|e| format!("--retain-ms: {e}"))?;
                config.retain = Duration::from_millis(ms);
            }
            "--release" => config.release = value()?.parse::<ReleaseMode>()?,
            "--stall-after-bytes" => {
                let n = value()?
                    .parse()
                    .map_err(|e| format!("--stall-after-bytes: {e}"))?;
                config.faults.stall_after_bytes = Some(n);
            }
            "--trickle-ms" => {
                let ms: u64 = value()?.parse().map_err(|e| format!("--trickle-ms: {e}"))?;
                config.faults.trickle = Some(Duration::from_millis(ms));
            }
            "--scatter" => scatter = true,
            "--hold" => {
                let spec = value()?;
                let parts: Vec<&str> = spec.split(':').collect();
                let [id, blocks, size] = parts[..] else {
                    return Err(format!("--hold wants ID:BLOCKS:BLOCK_BYTES, got {spec}"));
                };
                let blocks = blocks.parse().map_err(|e| format!("--hold blocks: {e}"))?;
                let size = size.parse().map_err(|e| format!("--hold size: {e}"))?;
                holds.push((id.to_string(), blocks, size));
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(Args {
        config,
        holds,
        scatter,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("connex-transfer-holder: {err}");
            return ExitCode::from(2);
        }
    };
    let backend: BackendKind = args.config.backend;
    let holder = match Holder::start(args.config).await {
        Ok(holder) => holder,
        Err(err) => {
            eprintln!("connex-transfer-holder: cannot start the {backend} holder: {err}");
            return ExitCode::FAILURE;
        }
    };
    for (seed, (id, blocks, size)) in args.holds.iter().enumerate() {
        let (blocks, size) = (*blocks, *size);
        let logical = pattern(seed as u64, (blocks * size) as usize);
        let at = |b: u64| if args.scatter { blocks - 1 - b } else { b } * size;
        let mut bytes = vec![0u8; logical.len()];
        for b in 0..blocks {
            let (from, to) = ((b * size) as usize, at(b) as usize);
            bytes[to..to + size as usize].copy_from_slice(&logical[from..from + size as usize]);
        }
        let made = holder
            .register_region(Region::owned(bytes))
            .and_then(|region| {
                let refs = (0..blocks)
                    .map(|b| BlockRef::new(region, at(b), size))
                    .collect();
                holder.create_hold(id, refs)
            });
        if let Err(err) = made {
            eprintln!("connex-transfer-holder: hold {id}: {err}");
            return ExitCode::FAILURE;
        }
    }
    println!("ctrl {}", holder.ctrl_addr());
    // Serve until whoever started us closes our stdin (or kills us).
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    holder.stop().await;
    ExitCode::SUCCESS
}
