//! The units a flag's value is written in: the duration parsers, the flags
//! that had their unit in their name before durations took units (their old
//! names still work), and the help text that says both once for every flag.

use std::time::Duration;

/// Flags renamed when durations took units: (old id, new id). The old id's
/// ending (`_ms`, `_s`) is the unit of a bare number, and `CONNEX_<OLD ID>` is
/// the old env name.
pub const RENAMED: &[(&str, &str)] = &[
    ("tokenize_timeout_ms", "tokenize_timeout"),
    ("heartbeat_ttl_s", "heartbeat_ttl"),
    ("body_read_timeout_ms", "body_read_timeout"),
    ("connect_timeout_ms", "connect_timeout"),
    ("prefill_timeout_ms", "prefill_timeout"),
    ("etcd_timeout_ms", "etcd_timeout"),
    ("stall_timeout_ms", "stall_timeout"),
    ("ctrl_timeout_ms", "ctrl_timeout"),
    ("resume_wait_ms", "resume_wait"),
    ("health_check_interval_ms", "health_check_interval"),
    ("health_check_timeout_ms", "health_check_timeout"),
    ("decode_open_timeout_ms", "decode_open_timeout"),
    ("first_token_timeout_ms", "first_token_timeout"),
    ("suspect_ms", "suspect_for"),
    ("dead_instance_grace_s", "dead_instance_grace"),
    ("shutdown_grace_s", "shutdown_grace"),
    ("header_read_timeout_ms", "header_read_timeout"),
    ("metrics_idle_timeout_s", "metrics_idle_timeout"),
    ("http2_idle_timeout_s", "http2_idle_timeout"),
    ("max_queue_wait_ms", "max_queue_wait"),
    ("response_store_ttl_s", "response_store_ttl"),
    ("response_store_timeout_ms", "response_store_timeout"),
    ("response_lease_ms", "response_lease"),
];

/// The old env name of a renamed flag's id (`stall_timeout_ms` ->
/// `CONNEX_STALL_TIMEOUT_MS`).
pub fn env_name(id: &str) -> String {
    format!("CONNEX_{}", id.to_ascii_uppercase())
}

/// What `serve --help` says after the flags: how DURATION and BYTES are
/// written, and which flags read a bare number as seconds (from [`RENAMED`]).
pub fn help() -> String {
    let seconds: Vec<String> = RENAMED
        .iter()
        .filter(|(old, _)| old.ends_with("_s"))
        .map(|(_, new)| format!("--{}", new.replace('_', "-")))
        .collect();
    format!(
        "DURATION: a number with its unit (250ms, 30s, 5m, 1h) or a sum (1m30s). \
         A bare number is in the unit of the flag's old name (--stall-timeout-ms, \
         --heartbeat-ttl-s, ..., still accepted, as are their env names): seconds for \
         {}; milliseconds for the others.\n\
         BYTES: a number of bytes.",
        seconds.join(", ")
    )
}

/// A duration with its unit (`250ms`, `30s`, `5m`, `1h`, or a sum such as
/// `1m30s`), or a bare number of `unit`s.
fn duration(text: &str, unit: Duration) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(count) = text.parse::<u64>() {
        return count
            .checked_mul(unit.as_millis() as u64)
            .map(Duration::from_millis)
            .ok_or_else(|| format!("{text} is too long a duration"));
    }
    let bad =
        || format!("`{text}` is not a duration: write it with a unit, as 250ms, 30s, 5m or 1h");
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let count: u64 = rest[..digits].parse().map_err(|_| bad())?;
        let after = &rest[digits..];
        let letters = after
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(after.len());
        let millis = match &after[..letters] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return Err(bad()),
        };
        let part = count.checked_mul(millis).ok_or_else(bad)?;
        total = total
            .checked_add(Duration::from_millis(part))
            .ok_or_else(bad)?;
        rest = &after[letters..];
    }
    Ok(total)
}

/// A duration flag whose bare numbers are seconds (its old name ended `-s`).
pub fn secs(text: &str) -> Result<Duration, String> {
    duration(text, Duration::from_secs(1))
}

/// A duration flag whose bare numbers are milliseconds (its old name ended `-ms`).
pub fn millis(text: &str) -> Result<Duration, String> {
    duration(text, Duration::from_millis(1))
}

/// Seconds, from 1 s to a day (the HTTP/2 idle timeout).
pub fn within_a_day(text: &str) -> Result<Duration, String> {
    let value = secs(text)?;
    if value < Duration::from_secs(1) || value > Duration::from_secs(86_400) {
        return Err(format!("`{text}` is not between 1s and 24h"));
    }
    Ok(value)
}
