//! Reads the tenants file again on SIGHUP and when it changes (checked every
//! [`POLL`]: a Kubernetes Secret mounted as a file changes under the router
//! without a signal).

use super::Tenants;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

const POLL: Duration = Duration::from_secs(2);

/// What tells a file's new version from the last one read.
fn version(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// The reloader, owned by `tasks` and stopped by `stop` (nothing to do
/// without a tenants file).
pub fn spawn_reloader(tenants: &Arc<Tenants>, tasks: &mut JoinSet<()>, stop: CancellationToken) {
    let Some(path) = tenants.config.tenants_file.clone() else {
        return;
    };
    let tenants = tenants.clone();
    tasks.spawn(async move {
        let mut hangup = hangup_signal();
        let mut seen = version(&path);
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let why = tokio::select! {
                _ = stop.cancelled() => return,
                _ = next_hangup(&mut hangup) => "SIGHUP",
                _ = poll.tick() => {
                    let now = version(&path);
                    if now == seen {
                        continue;
                    }
                    seen = now;
                    "the file changed"
                }
            };
            match tenants.reload() {
                Ok(count) => tracing::info!(path = %path.display(), count, why, "tenants reloaded"),
                Err(err) => tracing::error!(
                    path = %path.display(),
                    %err,
                    why,
                    "tenants file refused; the tenants in force stay"
                ),
            }
        }
    });
}

/// SIGHUP, where it can be watched.
#[cfg(unix)]
type HangUp = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type HangUp = Option<()>;

fn hangup_signal() -> HangUp {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        signal(SignalKind::hangup())
            .map_err(|err| {
                tracing::warn!(%err, "cannot watch SIGHUP; the tenants file is still polled");
            })
            .ok()
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The next SIGHUP; never, where none can be watched.
async fn next_hangup(hangup: &mut HangUp) {
    #[cfg(unix)]
    if let Some(signal) = hangup.as_mut() {
        if signal.recv().await.is_some() {
            return;
        }
    }
    let _ = hangup;
    std::future::pending::<()>().await;
}
