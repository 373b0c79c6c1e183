//! The etcd backend against a real etcd (Debian `etcd-server`, as the e2e cluster tests):
//! records written straight into etcd, past the API, are held to a
//! registration's checks by the watch and by a re-list alike.

use super::EtcdStore;
use crate::engines::addresses::UpstreamPolicy;
use crate::membership::etcd_config::EtcdConfig;
use crate::membership::view::View;
use etcd_client::Client;
use serde_json::json;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// An etcd on free loopback ports, killed (and its data removed) on drop.
struct Etcd {
    child: Child,
    url: String,
    dir: std::path::PathBuf,
}

/// A loopback port free now, below the kernel's ephemeral range (32768 and
/// up here): this binary's other tests bind port 0 while etcd starts, and one
/// of them could be handed a port taken from that range before etcd binds it.
/// Walked from a start of this process's own (32000-32767; the e2e tests walk
/// 20000-31999).
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 32_000;
    const COUNT: u32 = 768;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id() % COUNT;
    (0..COUNT)
        .filter_map(|_| {
            let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % COUNT;
            u16::try_from(FIRST + offset).ok()
        })
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port in 32000..32768")
}

impl Etcd {
    fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "connex-watch-etcd-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("etcd dir");
        let (url, peer) = (
            format!("http://127.0.0.1:{}", free_port()),
            format!("http://127.0.0.1:{}", free_port()),
        );
        let log = std::fs::File::create(dir.join("etcd.log")).expect("etcd log");
        let child = Command::new("etcd")
            .args(["--name", "watch-test", "--data-dir"])
            .arg(dir.join("data"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("watch-test={peer}")])
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log)
            .spawn()
            .expect("start etcd (Debian package etcd-server; tests/run installs it)");
        Self { child, url, dir }
    }

    async fn client(&self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut client) = Client::connect([self.url.as_str()], None).await {
                if client.get("/", None).await.is_ok() {
                    return client;
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not start: {:?}",
                self.dir
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A replica's store and view on `etcd` (allowed upstreams 10.0.0.0/8, at
/// most three instances), its watch running until the token is cancelled.
async fn replica(etcd: &Etcd, tasks: &mut JoinSet<()>, stop: &CancellationToken) -> Arc<View> {
    let config = EtcdConfig {
        endpoints: etcd.url.clone(),
        prefix: "/admit".into(),
        timeout: Duration::from_secs(2),
        ca_file: None,
        identity: None,
        user: None,
        upstreams: UpstreamPolicy::parse(Some("10.0.0.0/8")).expect("policy"),
    };
    let view = Arc::new(View::new(None));
    let store = EtcdStore::connect(&config, Duration::from_secs(10), 3, view.clone())
        .await
        .expect("connect");
    crate::membership::store::Store::spawn(&store, tasks, stop.clone());
    view
}

async fn put(client: &mut Client, id: &str, url: &str, ctrl: Option<&str>) {
    let record = json!({"id": id, "role": "prefill", "url": url, "ctrl": ctrl,
                        "model": "m", "state": "ready"});
    client
        .put(format!("/admit/instances/{id}"), record.to_string(), None)
        .await
        .expect("etcd put");
}

async fn eventually_ids(view: &View, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ids: Vec<String> = view.list().iter().map(|i| i.id.clone()).collect();
        if ids == want {
            return;
        }
        assert!(Instant::now() < deadline, "view {ids:?}, want {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_that_would_fail_a_registration_never_reach_the_view() {
    let etcd = Etcd::start();
    let mut client = etcd.client().await;
    let (mut tasks, stop) = (JoinSet::new(), CancellationToken::new());
    let watching = replica(&etcd, &mut tasks, &stop).await;
    // Through the watch: each bad record is refused, the good ones apply.
    for (id, url, ctrl) in [
        ("good-1", "http://10.0.0.1:8000", Some("10.0.0.1:14579")),
        ("outside", "http://192.168.1.9:8000", None),
        ("metadata", "http://169.254.169.254:80", None),
        (
            "ctrl-out",
            "http://10.0.0.2:8000",
            Some("192.168.1.9:14579"),
        ),
        ("with-path", "http://10.0.0.3:8000/steal", None),
        ("bad%id", "http://10.0.0.4:8000", None),
        ("good-2", "http://10.0.0.5:8000/", None),
    ] {
        put(&mut client, id, url, ctrl).await;
    }
    eventually_ids(&watching, &["good-1", "good-2"]).await;
    // The URL is the bare origin a registration stores.
    let good = watching.get("good-2").expect("good-2");
    assert_eq!(good.url, "http://10.0.0.5:8000");
    // --max-instances (3): the fourth new id is refused, a known one updates.
    put(&mut client, "good-3", "http://10.0.0.6:8000", None).await;
    put(&mut client, "good-4", "http://10.0.0.7:8000", None).await;
    put(&mut client, "good-1", "http://10.0.0.8:8000", None).await;
    eventually_ids(&watching, &["good-1", "good-2", "good-3"]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while watching.get("good-1").expect("good-1").url != "http://10.0.0.8:8000" {
        assert!(Instant::now() < deadline, "good-1 was not updated");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A known instance rewritten to a place outside the policy leaves the view.
    put(&mut client, "good-2", "http://192.168.1.9:8000", None).await;
    eventually_ids(&watching, &["good-1", "good-3"]).await;
    // A replica starting now lists the same records: good-4 fits under the
    // cap there (good-2 is gone); the watching replica applies it at its
    // key's next change or its next re-list, as it would a registration
    // retried after a 503.
    let listing = replica(&etcd, &mut tasks, &stop).await;
    eventually_ids(&listing, &["good-1", "good-3", "good-4"]).await;
    stop.cancel();
    while tasks.join_next().await.is_some() {}
}
