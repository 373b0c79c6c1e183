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
}

impl Proc {
    /// Starts `bin` with `args` and waits for its "listening on URL" line.
    pub fn start(bin: &str, args: &[String]) -> Proc {
        let mut child = Command::new(bin)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn process");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.split("listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        let url = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("process did not report its address");
        Proc { child, url }
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

/// Starts a router with the admin token and `extra` flags.
pub fn router(extra: &[&str]) -> Proc {
    let mut all = args(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-token",
        ADMIN_TOKEN,
    ]);
    all.extend(args(extra));
    Proc::start(env!("CARGO_BIN_EXE_connex-router"), &all)
}

/// Starts a mock engine of `role` registering with `router` (if given).
pub fn engine(router: Option<&Proc>, role: &str, extra: &[&str]) -> Proc {
    let mut all = args(&["--role", role]);
    if !extra.contains(&"--model") {
        all.extend(args(&["--model", "mock"]));
    }
    if let Some(router) = router {
        all.extend(args(&["--router", &router.url]));
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
    let reply: Value = client()
        .get(format!("{}/admin/instances", router.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("admin instances")
        .json()
        .await
        .expect("json");
    reply["data"].as_array().cloned().unwrap_or_default()
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
    let mut parser = connex_router::sse::SseParser::default();
    parser
        .push(text.as_bytes())
        .iter()
        .map(|data| {
            serde_json::from_slice(data)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(data).into()))
        })
        .collect()
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
    let stats: Value = client()
        .get(format!("{}/mock/stats", engine.url))
        .send()
        .await
        .expect("stats")
        .json()
        .await
        .expect("json");
    stats["requests"].as_array().cloned().unwrap_or_default()
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
        .get(format!("{}/metrics", router.url))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

/// Sum of the samples of `name` whose labels contain every one of `labels`.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The router's journal (`GET /admin/requests`).
pub async fn journal(router: &Proc, verbose: bool) -> Vec<Value> {
    let reply: Value = client()
        .get(format!("{}/admin/requests?verbose={verbose}", router.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("admin requests")
        .json()
        .await
        .expect("json");
    reply["data"].as_array().cloned().unwrap_or_default()
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
