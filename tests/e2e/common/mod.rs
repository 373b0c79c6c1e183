//! Harness for end-to-end tests: real router and mock-engine processes on
//! loopback ports, killed when the test ends.

#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ADMIN_TOKEN: &str = "test-admin-token";

/// A child process killed on drop.
pub struct Proc {
    child: Child,
    pub url: String,
    /// A router's internal listener (registration, admin, metrics); for other
    /// processes, their one URL.
    pub internal: String,
    /// Every line the process wrote to its stdout so far.
    pub stdout: LogLines,
}

/// The lines a process wrote to its stderr so far (see [`Proc::start_logged`]).
#[derive(Clone, Default)]
pub struct LogLines(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl LogLines {
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Proc {
    /// Starts `bin` with `args` and waits for its "listening on URL" line.
    pub fn start(bin: &str, args: &[String]) -> Proc {
        Self::spawn(bin, args, None)
    }

    /// [`Proc::start`], keeping every line of the process's stderr (its logs).
    pub fn start_logged(bin: &str, args: &[String]) -> (Proc, LogLines) {
        let logs = LogLines::default();
        (Self::spawn(bin, args, Some(logs.clone())), logs)
    }

    fn spawn(bin: &str, args: &[String], logs: Option<LogLines>) -> Proc {
        let stderr = if logs.is_some() {
            Stdio::piped()
        } else {
            Stdio::inherit()
        };
        let mut child = Command::new(bin)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn process");
        if let (Some(logs), Some(stderr)) = (logs, child.stderr.take()) {
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    logs.0.lock().unwrap_or_else(|p| p.into_inner()).push(line);
                }
            });
        }
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout_lines = LogLines::default();
        let seen = stdout_lines.clone();
        std::thread::spawn(move || {
            // A router prints its internal address first, then "listening on";
            // with `--log-format json`, one JSON line with `url` and
            // `internal_url`.
            let mut internal = None;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                seen.0
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(line.clone());
                if let Ok(json) = serde_json::from_str::<Value>(&line) {
                    if let Some(url) = json["url"].as_str() {
                        let internal = json["internal_url"].as_str().map(str::to_string);
                        let _ = tx.send((url.to_string(), internal));
                    }
                    continue;
                }
                if let Some(url) = line.split("internal API on ").nth(1) {
                    internal = Some(url.trim().to_string());
                }
                if let Some(url) = line.split("listening on ").nth(1) {
                    let _ = tx.send((url.trim().to_string(), internal.take()));
                }
            }
        });
        let (url, internal) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("process did not report its address");
        let internal = internal.unwrap_or_else(|| url.clone());
        Proc {
            child,
            url,
            internal,
            stdout: stdout_lines,
        }
    }

    /// Kills the process now (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The process id, for signals.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (e.g. "STOP", "CONT") to the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([format!("-{signal}"), self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Starts a router with the admin token and `extra` flags, both listeners on
/// free loopback ports; clients see the instance headers (tests check them).
pub fn router(extra: &[&str]) -> Proc {
    Proc::start(env!("CARGO_BIN_EXE_connex-router"), &router_args(extra))
}

/// [`router`], keeping its logs (stderr) for the test to read.
pub fn router_logged(extra: &[&str]) -> (Proc, LogLines) {
    Proc::start_logged(env!("CARGO_BIN_EXE_connex-router"), &router_args(extra))
}

fn router_args(extra: &[&str]) -> Vec<String> {
    let mut all = args(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--internal-listen",
        "127.0.0.1:0",
        "--admin-token",
        ADMIN_TOKEN,
    ]);
    if !extra.contains(&"--expose-instance-headers=false") {
        all.push("--expose-instance-headers".into());
    }
    all.extend(args(extra));
    all
}

/// Starts a mock engine of `role` registering with `router` (if given).
pub fn engine(router: Option<&Proc>, role: &str, extra: &[&str]) -> Proc {
    let mut all = args(&["--role", role]);
    if !extra.contains(&"--model") {
        all.extend(args(&["--model", "mock"]));
    }
    if let Some(router) = router {
        all.extend(args(&["--router", &router.internal]));
        // An engine restarted under the same id keeps its credential (as a
        // real agent may), so that it gets its id back at once.
        if let Some(at) = extra.iter().position(|a| *a == "--id") {
            if let Some(id) = extra.get(at + 1) {
                let dir = std::env::temp_dir().join(format!("connex-e2e-{}", std::process::id()));
                let _ = std::fs::create_dir_all(&dir);
                let port = router.internal.rsplit(':').next().unwrap_or("0");
                let file = dir.join(format!("{port}-{id}.credential"));
                all.extend(args(&["--credential-file", &file.to_string_lossy()]));
            }
        }
    }
    all.extend(args(extra));
    Proc::start(env!("CARGO_BIN_EXE_connex-mock-engine"), &all)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// The admin instance list.
pub async fn instances(router: &Proc) -> Vec<Value> {
    admin_list(router, "/admin/instances").await
}

/// Waits until `count` instances are registered and ready.
pub async fn wait_ready(router: &Proc, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ready = instances(router)
            .await
            .iter()
            .filter(|i| i["state"] == "ready")
            .count();
        if ready >= count {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {ready} of {count} instances became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The instance id registered for the engine at `url`.
pub async fn instance_id(router: &Proc, engine: &Proc) -> String {
    instances(router)
        .await
        .iter()
        .find(|i| i["url"] == engine.url.as_str())
        .and_then(|i| i["id"].as_str().map(str::to_string))
        .expect("engine is registered")
}

/// Asserts that the router still serves clients: a completions request for
/// a model nobody serves goes through the concurrency gate and gets 404.
pub async fn assert_still_serves(router: &Proc) {
    let (status, body) = post(
        router,
        "/v1/completions",
        &serde_json::json!({"model":"nope","prompt":"x","max_tokens":1}),
    )
    .await;
    assert_eq!(status, 404, "{body}");
}

/// POSTs `body` to `path` and returns (status, JSON body).
pub async fn post(router: &Proc, path: &str, body: &Value) -> (u16, Value) {
    let response = client()
        .post(format!("{}{path}", router.url))
        .json(body)
        .send()
        .await
        .expect("post");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// POSTs a completions request to the router at `url` on a client of its own
/// with `timeout` for the whole answer (a long stream outlives `client()`'s
/// 30 s); the response, its body not yet read.
pub async fn open_completion(url: &str, body: &Value, timeout: Duration) -> reqwest::Response {
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .unwrap()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// POSTs a streaming request and returns every `data:` payload parsed (the
/// final `[DONE]` as the string "[DONE]").
pub async fn stream(router: &Proc, path: &str, body: &Value) -> Vec<Value> {
    let response = client()
        .post(format!("{}{path}", router.url))
        .json(body)
        .send()
        .await
        .expect("post");
    assert_eq!(response.status().as_u16(), 200, "stream status");
    let text = response.text().await.expect("stream body");
    sse_events(&text)
}

/// Every `data:` payload of an SSE body, parsed (one that is not JSON, such as
/// the final `[DONE]`, as its text).
pub fn sse_events(text: &str) -> Vec<Value> {
    connex_router::SseParser::default()
        .push(bytes::Bytes::copy_from_slice(text.as_bytes()))
        .iter()
        .map(|data| event_value(data))
        .collect()
}

/// One SSE event's data, parsed (not JSON, such as `[DONE]`: as its text).
pub fn event_value(data: &[u8]) -> Value {
    serde_json::from_slice(data)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(data).into()))
}

/// Token ids of choice 0 across stream chunks.
pub fn streamed_token_ids(chunks: &[Value]) -> Vec<u32> {
    chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/token_ids").and_then(Value::as_array))
        .flatten()
        .filter_map(|id| id.as_u64().map(|id| id as u32))
        .collect()
}

/// A mock engine's request records.
pub async fn engine_requests(engine: &Proc) -> Vec<Value> {
    engine_stats(engine).await["requests"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The generation requests (completions, chat) a mock engine served, leaving
/// out the others it records (`/tokenize`, which a `cache_aware` router calls
/// before choosing, embeddings, ...).
pub async fn engine_generations(engine: &Proc) -> Vec<Value> {
    engine_requests(engine)
        .await
        .into_iter()
        .filter(|r| {
            r["path"]
                .as_str()
                .is_some_and(|p| p.ends_with("completions"))
        })
        .collect()
}

/// A mock engine's `/mock/stats`: its id, request records and hold counters.
pub async fn engine_stats(engine: &Proc) -> Value {
    client()
        .get(format!("{}/mock/stats", engine.url))
        .send()
        .await
        .expect("stats")
        .json()
        .await
        .expect("json")
}

/// The `data` list of an admin GET (`/admin/instances`, `/admin/requests`).
async fn admin_list(router: &Proc, path: &str) -> Vec<Value> {
    let reply: Value = client()
        .get(format!("{}{path}", router.internal))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("admin call")
        .json()
        .await
        .expect("json");
    reply["data"].as_array().cloned().unwrap_or_default()
}

/// Ids as JSON numbers.
pub fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect()
        })
        .unwrap_or_default()
}

/// The router's Prometheus text.
pub async fn metrics_text(router: &Proc) -> String {
    client()
        .get(format!("{}/metrics", router.internal))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

/// Sum of the samples of `name` whose labels contain every one of `labels`.
/// Panics when the router emits no sample of `name` at all: a misspelt or
/// missing metric must fail a test, not read as zero.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    let samples: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
        .collect();
    assert!(
        !samples.is_empty(),
        "the router emits no metric `{name}`:\n{text}"
    );
    samples
        .into_iter()
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The router's journal (`GET /admin/requests`).
pub async fn journal(router: &Proc, verbose: bool) -> Vec<Value> {
    admin_list(router, &format!("/admin/requests?verbose={verbose}")).await
}

/// Text of choice 0 across stream chunks (completions `text` or chat `delta.content`).
pub fn streamed_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/text")
                .or_else(|| c.pointer("/choices/0/delta/content"))
                .and_then(Value::as_str)
        })
        .collect()
}

/// A free loopback TCP port (bound, then released for the caller to use),
/// below the kernel's ephemeral range (`ip_local_port_range`, 32768 and up
/// on Linux). A port taken from that range with a bind to port 0 can be handed
/// to any other process binding port 0 before the caller's own process binds
/// it; with the suite's hundreds of routers and engines that happened (an
/// engine told `--listen` a port exited, its port taken). The ports here are
/// never handed out by the kernel, and this process walks them in turn from a
/// start of its own.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % COUNT,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..COUNT {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % COUNT;
        let port = u16::try_from(FIRST + offset).expect("a port");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {FIRST}..{}", FIRST + COUNT)
}

/// A real etcd server (Debian `etcd-server`) on free loopback ports with a
/// temporary data dir; it can be killed and restarted on the same ports and
/// data, and is killed (and its data removed) on drop.
pub struct Etcd {
    child: Option<Child>,
    pub url: String,
    peer: String,
    dir: std::path::PathBuf,
}

impl Etcd {
    pub fn start() -> Etcd {
        static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("connex-etcd-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("etcd temp dir");
        let mut etcd = Etcd {
            child: None,
            url: format!("http://127.0.0.1:{}", free_port()),
            peer: format!("http://127.0.0.1:{}", free_port()),
            dir,
        };
        etcd.spawn();
        etcd
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("etcd log");
        let child = Command::new("etcd")
            .args([
                "--name",
                "connex-test",
                "--data-dir",
                &self.dir.join("data").to_string_lossy(),
                "--listen-client-urls",
                &self.url,
                "--advertise-client-urls",
                &self.url,
                "--listen-peer-urls",
                &self.peer,
                "--initial-advertise-peer-urls",
                &self.peer,
                "--initial-cluster",
                &format!("connex-test={}", self.peer),
            ])
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log)
            .spawn()
            .expect("start etcd (Debian package etcd-server; tests/run installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.healthy() {
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy; see {}",
                self.dir.join("etcd.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `GET /health` answers `"health":"true"`.
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let addr = self.url.trim_start_matches("http://");
        let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        let mut reply = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut reply).is_ok()
            && reply.contains("\"health\":\"true\"")
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The current store revision (through etcd's JSON gateway).
    pub async fn revision(&self) -> i64 {
        let reply: Value = client()
            .post(format!("{}/v3/kv/range", self.url))
            .json(&serde_json::json!({"key": "AA=="}))
            .send()
            .await
            .expect("etcd range")
            .json()
            .await
            .expect("etcd range json");
        reply["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .expect("etcd revision")
    }

    /// Compacts the history up to the current revision: a watch resuming from an
    /// older revision must list again.
    pub async fn compact(&self) {
        let revision = self.revision().await;
        let status = client()
            .post(format!("{}/v3/kv/compaction", self.url))
            .json(&serde_json::json!({"revision": revision.to_string(), "physical": true}))
            .send()
            .await
            .expect("etcd compaction")
            .status();
        assert!(status.is_success(), "etcd compaction: {status}");
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TCP proxy on loopback that can cut every connection through it and refuse
/// new ones, to take a network path away from a live server.
pub struct Proxy {
    pub url: String,
    open: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forwards a new loopback port to `target` (`http://host:port`).
    pub async fn start(target: &str) -> Proxy {
        let target = target.trim_start_matches("http://").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("proxy bind");
        let url = format!("http://{}", listener.local_addr().expect("proxy addr"));
        let (open, watch) = tokio::sync::watch::channel(true);
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !*watch.borrow() {
                    continue; // dropped: refused
                }
                let target = target.clone();
                let mut watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watch.wait_for(|open| !open) => {}
                    }
                });
            }
        });
        Proxy { url, open, task }
    }

    /// Cuts (false) or restores (true) the path.
    pub fn set_open(&self, open: bool) {
        self.open.send_replace(open);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A router's `/ready` JSON (any status).
pub async fn ready(router: &Proc) -> Value {
    client()
        .get(format!("{}/ready", router.url))
        .send()
        .await
        .expect("ready")
        .json()
        .await
        .expect("ready json")
}

/// An admin call: (status, JSON body).
pub async fn admin(
    router: &Proc,
    method: reqwest::Method,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut request = client()
        .request(method, format!("{}{path}", router.internal))
        .bearer_auth(ADMIN_TOKEN);
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.expect("admin call");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Polls `check` every 20 ms until it holds; panics with `what` after `limit`.
/// Returns how long it took.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if check().await {
            return started.elapsed();
        }
        assert!(started.elapsed() < limit, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// POSTs `body` as JSON to `path` on the router's internal listener (the
/// registration routes), with an instance credential if given: (status, JSON).
pub async fn post_internal(
    router: &Proc,
    path: &str,
    body: &Value,
    credential: Option<&str>,
) -> (u16, Value) {
    let mut request = client()
        .post(format!("{}{path}", router.internal))
        .json(body);
    if let Some(credential) = credential {
        request = request.header("x-connex-credential", credential);
    }
    let response = request.send().await.expect("post");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Sends `n` registrations of the one new id `id` at once, each for its own
/// URL, spread over `routers` (replicas): exactly one may win. Checks that one
/// did, that the others got 409, and that the id points at the winner's URL
/// with the winner's credential. Returns the winner's URL.
pub async fn race_first_registrations(routers: &[&Proc], id: &str, n: usize) -> String {
    let attempts = (0..n).map(|i| {
        let router = routers[i % routers.len()];
        let url = format!("http://127.0.0.1:{}", 20000 + i);
        async move {
            let body = serde_json::json!({"id": id, "role": "decode", "url": url, "model": "mock"});
            let (status, reply) = post_internal(router, "/v1/instances", &body, None).await;
            (url, status, reply)
        }
    });
    let results = futures_util::future::join_all(attempts).await;
    let winners: Vec<_> = results.iter().filter(|(_, s, _)| *s < 300).collect();
    assert_eq!(
        winners.len(),
        1,
        "exactly one first registration wins: {results:?}"
    );
    assert!(
        results.iter().all(|(_, s, _)| *s < 300 || *s == 409),
        "the others are told the id is taken: {results:?}"
    );
    let (url, _, reply) = winners[0];
    let credential = reply["credential"]
        .as_str()
        .expect("the winner's credential");
    for router in routers {
        eventually(
            Duration::from_secs(5),
            "the id points at the winner",
            || async {
                instances(router)
                    .await
                    .iter()
                    .any(|i| i["id"] == id && i["url"] == url.as_str())
            },
        )
        .await;
        let (status, _) = post_internal(
            router,
            &format!("/v1/instances/{id}/heartbeat"),
            &serde_json::json!({}),
            Some(credential),
        )
        .await;
        assert_eq!(status, 200, "the winner's credential keeps its id alive");
    }
    url.clone()
}

/// Streamed completions whose clients count the tokens received so far, so
/// that a fault injector paces itself by the streams' progress, not by the
/// clock: on a loaded machine a wall-clock cadence hits a slowed stream more
/// often than its `--max-resumes` allows, and the test fails for the machine.
pub struct TrackedStreams {
    /// Tokens each client has received (whole SSE events), or `NOT_STARTED`.
    progress: std::sync::Arc<Vec<std::sync::atomic::AtomicUsize>>,
    handles: Vec<tokio::task::JoinHandle<(String, Vec<Value>)>>,
}

const NOT_STARTED: usize = usize::MAX;

impl TrackedStreams {
    /// Sends each `(prompt, body)` to the router's `/v1/completions`, the
    /// i-th after `stagger * i`.
    pub fn start(router: &Proc, requests: Vec<(String, Value)>, stagger: Duration) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let progress: std::sync::Arc<Vec<AtomicUsize>> = std::sync::Arc::new(
            requests
                .iter()
                .map(|_| AtomicUsize::new(NOT_STARTED))
                .collect(),
        );
        let handles = requests
            .into_iter()
            .enumerate()
            .map(|(i, (prompt, body))| {
                let url = router.url.clone();
                let progress = progress.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(stagger * i as u32).await;
                    progress[i].store(0, Ordering::SeqCst);
                    let mut response = open_completion(&url, &body, Duration::from_secs(90)).await;
                    // Parsed as the bytes come (each event once, a character
                    // split across chunks kept whole).
                    let mut parser = connex_router::SseParser::default();
                    let mut events: Vec<Value> = Vec::new();
                    while let Some(bytes) = response.chunk().await.unwrap() {
                        let new: Vec<Value> =
                            parser.push(bytes).iter().map(|d| event_value(d)).collect();
                        progress[i].fetch_add(streamed_token_ids(&new).len(), Ordering::SeqCst);
                        events.extend(new);
                    }
                    (prompt, events)
                })
            })
            .collect();
        TrackedStreams { progress, handles }
    }

    pub fn all_finished(&self) -> bool {
        self.handles.iter().all(|h| h.is_finished())
    }

    /// Per stream, the tokens it had received if it is live (started and not
    /// finished).
    pub fn live(&self) -> Vec<Option<usize>> {
        self.handles
            .iter()
            .zip(self.progress.iter())
            .map(|(h, p)| {
                let tokens = p.load(std::sync::atomic::Ordering::SeqCst);
                (tokens != NOT_STARTED && !h.is_finished()).then_some(tokens)
            })
            .collect()
    }

    /// Waits until every stream live at `since` (a `live()`) has received
    /// `tokens` more tokens or ended.
    pub async fn moved_on(&self, since: &[Option<usize>], tokens: usize) {
        loop {
            let now = self.live();
            let moved = since.iter().zip(&now).all(|(then, now)| match (then, now) {
                (Some(then), Some(now)) => *now >= then + tokens,
                _ => true,
            });
            if moved {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Each stream's prompt and SSE events, once all have ended.
    pub async fn results(self) -> Vec<(String, Vec<Value>)> {
        let mut results = Vec::new();
        for handle in self.handles {
            results.push(handle.await.unwrap());
        }
        results
    }
}

/// A router (`router_flags`) and its engines (role and flags each), every one
/// registered with it and all ready: the set-up most tests start from. The
/// router starts first, then the engines in the order given.
pub async fn pd_cluster<const N: usize>(
    router_flags: &[&str],
    engines: [(&str, &[&str]); N],
) -> (Proc, [Proc; N]) {
    let router = router(router_flags);
    let procs = engines.map(|(role, flags)| engine(Some(&router), role, flags));
    wait_ready(&router, N).await;
    (router, procs)
}

/// A router (`router_flags`), a prefill, and a decoder per item of `decoders`
/// (its flags), each registered and all ready, in that order. For the chaos
/// tests, which kill decoders and start them again as they go: the decoders
/// come in a `Vec` to replace them in, and their flags are built per id by the
/// function that builds the replacements' (owned strings, which
/// [`pd_cluster`]'s borrowed flags in a fixed-size array cannot take).
pub async fn chaos_cluster<S: AsRef<str>>(
    router_flags: &[&str],
    decoders: impl IntoIterator<Item = Vec<S>>,
) -> (Proc, Proc, Vec<Proc>) {
    let router = router(router_flags);
    let prefill = engine(Some(&router), "prefill", &[]);
    let decoders: Vec<Proc> = decoders
        .into_iter()
        .map(|flags| {
            let flags: Vec<&str> = flags.iter().map(AsRef::as_ref).collect();
            engine(Some(&router), "decode", &flags)
        })
        .collect();
    wait_ready(&router, 1 + decoders.len()).await;
    (router, prefill, decoders)
}

/// A router (round robin over decoders, `router_flags`), a prefill, a decoder
/// `d0` (`d0_flags`: most often its fault) and a decoder `d1` (`d1_flags`):
/// round robin over the sorted ids sends the first request to d0, and d1 takes
/// over what d0 drops. The router first, then the engines in that order.
pub async fn failover_cluster(
    router_flags: &[&str],
    d0_flags: &[&str],
    d1_flags: &[&str],
) -> (Proc, [Proc; 3]) {
    let flags = [&["--decode-policy", "round_robin"], router_flags].concat();
    let d0 = [&["--id", "d0"], d0_flags].concat();
    let d1 = [&["--id", "d1"], d1_flags].concat();
    pd_cluster(&flags, [("prefill", &[]), ("decode", &d0), ("decode", &d1)]).await
}

/// A [`failover_cluster`] whose decoders both have the tokens API
/// (`--enable-scale-out`: the resume path of reasoning and tool calls).
pub async fn scale_out_cluster(router_flags: &[&str], d0_flags: &[&str]) -> (Proc, [Proc; 3]) {
    let d0 = [&["--enable-scale-out"], d0_flags].concat();
    failover_cluster(router_flags, &d0, &["--enable-scale-out"]).await
}

/// What [`uninterrupted_then_resumed`] got: each answer's status and body,
/// and the second cluster, kept running for what the test reads of it after.
pub struct Resumed {
    pub uninterrupted: (u16, String),
    pub resumed: (u16, String),
    pub router: Proc,
    pub engines: [Proc; 3],
}

/// One request sent twice by `send`: through a fresh [`scale_out_cluster`],
/// then through one whose first decoder crashes after 10 tokens (1 ms each)
/// so that the second takes over.
pub async fn uninterrupted_then_resumed(send: impl AsyncFn(&Proc) -> (u16, String)) -> Resumed {
    let (router, _engines) = scale_out_cluster(&[], &[]).await;
    let uninterrupted = send(&router).await;
    drop(router);
    let crashing = [
        "--crash-after-tokens",
        "10",
        "--decode-us-per-token",
        "1000",
    ];
    let (router, engines) = scale_out_cluster(&[], &crashing).await;
    let resumed = send(&router).await;
    Resumed {
        uninterrupted,
        resumed,
        router,
        engines,
    }
}

/// A real Redis server (Debian `redis-server`) on a free loopback port,
/// without persistence; it can be killed and started again on the same port
/// (empty), and is killed on drop. [`Redis::start_tls`]: TLS and a password.
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    pub url: String,
    /// Arguments of the server besides its port.
    server_args: Vec<String>,
    /// Arguments of `redis-cli` to reach it.
    cli_args: Vec<String>,
}

impl Redis {
    pub fn start() -> Redis {
        let port = free_port();
        let mut redis = Redis {
            child: None,
            port,
            url: format!("redis://127.0.0.1:{port}"),
            server_args: args(&["--port", &port.to_string()]),
            cli_args: args(&["-p", &port.to_string()]),
        };
        redis.spawn();
        redis
    }

    /// Redis persisting every write to an append-only file in `dir`
    /// (`appendfsync always`): [`Redis::restart`] finds what it had, as a
    /// server restarted after a crash does.
    pub fn start_persistent(dir: &std::path::Path) -> Redis {
        let port = free_port();
        let dir = dir.to_string_lossy().into_owned();
        let mut redis = Redis {
            child: None,
            port,
            url: format!("redis://127.0.0.1:{port}"),
            server_args: args(&[
                "--port",
                &port.to_string(),
                "--dir",
                &dir,
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ]),
            cli_args: args(&["-p", &port.to_string()]),
        };
        redis.spawn();
        redis
    }

    /// Sends `signal` ("STOP", "CONT") to the server, as a frozen host would.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().map(Child::id).expect("redis running");
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Redis on TLS only (a certificate for 127.0.0.1 from a CA made in
    /// `dir`, whose certificate is `dir/ca.crt`), asking `password`.
    pub fn start_tls(dir: &std::path::Path, password: &str) -> Redis {
        let openssl = |argv: &[&str]| {
            let status = Command::new("openssl")
                .args(argv)
                .current_dir(dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("openssl");
            assert!(status.success(), "openssl {argv:?}");
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=connex-test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").expect("san");
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            "-out",
            "server.crt",
        ]);
        let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
        let port = free_port();
        let mut redis = Redis {
            child: None,
            port,
            url: format!("rediss://127.0.0.1:{port}"),
            server_args: args(&[
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &file("server.crt"),
                "--tls-key-file",
                &file("server.key"),
                "--tls-ca-cert-file",
                &file("ca.crt"),
                "--tls-auth-clients",
                "no",
                "--requirepass",
                password,
            ]),
            cli_args: args(&[
                "-p",
                &port.to_string(),
                "--tls",
                "--cacert",
                &file("ca.crt"),
                "--no-auth-warning",
                "-a",
                password,
            ]),
        };
        redis.spawn();
        redis
    }

    fn spawn(&mut self) {
        // The defaults first: a server's own arguments (persistence) win.
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(&self.server_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (Debian package redis-server; tests/run installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.cli(&["PING"]) != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What `redis-cli` prints for `command` against this server.
    pub fn cli(&self, command: &[&str]) -> String {
        Command::new("redis-cli")
            .args(&self.cli_args)
            .args(command)
            .output()
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
            .unwrap_or_default()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The events the store holds of background response `id` (its stream's
    /// length, under the router's default key prefix).
    pub fn events_of(&self, id: &str) -> u64 {
        self.cli(&["XLEN", &format!("connex:{{{id}}}:events")])
            .parse()
            .expect("XLEN")
    }

    /// Starts it again on the same port (with nothing in it, or, started
    /// [`Redis::start_persistent`], with what its file has).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `connex-router serve ARGS` expecting it to refuse to start: returns its
/// stderr. Fails if it is still running after 10 s.
pub fn refused_start(args: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_connex-router"))
        .arg("serve")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "router exited 0 with {args:?}");
            let mut stderr = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
            return stderr;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("router started with {args:?}; it must refuse");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
