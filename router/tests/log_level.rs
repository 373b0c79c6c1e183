//! The process-wide subscriber keeps the `log` crate's own level check
//! closed below INFO (the trace spans are INFO and ERROR), so that a
//! dependency's `log::trace!` in an inner loop (the tokenizers crate's) is
//! one atomic load, not a trip through tracing-log and every filter. Its own
//! test binary: the subscriber is installed once per process.

use connex_router::config::LogFormat;

#[test]
fn a_dependencys_trace_logs_stop_at_the_log_crates_level_check() {
    let _telemetry =
        connex_router::logs::init(LogFormat::Text, Some("warn"), "info", None).expect("installed");
    assert!(
        log::max_level() <= log::LevelFilter::Info,
        "log's max level is {}",
        log::max_level()
    );
    assert!(!log::log_enabled!(target: "tokenizers", log::Level::Trace));
}
