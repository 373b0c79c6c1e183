//! The attack suite of the router's edge (issue 12), on real processes: each
//! test is an attack that succeeded before the edge was closed.

use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

async fn send(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn registration(id: &str, url: &str) -> Value {
    json!({"id": id, "role": "decode", "url": url, "model": "mock"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_the_openai_port_cannot_register_administer_or_scrape() {
    let router = router(&[]);
    let (status, _) = send(
        client()
            .post(format!("{}/v1/instances", router.url))
            .json(&registration("evil", "http://127.0.0.1:9")),
    )
    .await;
    assert_eq!(status, 404, "registration on the client listener");
    for path in ["/admin/instances", "/admin/requests", "/metrics"] {
        let (status, _) = send(
            client()
                .get(format!("{}{path}", router.url))
                .bearer_auth(ADMIN_TOKEN),
        )
        .await;
        assert_eq!(status, 404, "{path} on the client listener");
    }
    assert!(instances(&router).await.is_empty());
    // The internal listener serves them; the client one keeps the probes.
    let (status, _) = send(client().get(format!("{}/ready", router.url))).await;
    assert_eq!(status, 503);
    let (status, _) = send(client().get(format!("{}/metrics", router.internal))).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_instance_cannot_be_hijacked_by_re_registration() {
    let (router, [_prefill, real]) =
        pd_cluster(&[], [("prefill", &[]), ("decode", &["--id", "d0"])]).await;
    let attacker = engine(None, "decode", &[]);

    // Re-registering d0 at another URL, without its credential: refused.
    let (status, reply) = post_internal(
        &router,
        "/v1/instances",
        &registration("d0", &attacker.url),
        None,
    )
    .await;
    assert_eq!(status, 409, "{reply}");
    let (status, _) = post_internal(
        &router,
        "/v1/instances",
        &registration("d0", &attacker.url),
        Some("guessed-credential"),
    )
    .await;
    assert_eq!(status, 409);
    // Keeping it alive or removing it needs the credential too.
    let (status, _) = post_internal(&router, "/v1/instances/d0/heartbeat", &json!({}), None).await;
    assert_eq!(status, 403);
    let (status, _) = send(
        client()
            .delete(format!("{}/v1/instances/d0", router.internal))
            .header("x-connex-credential", "guessed-credential"),
    )
    .await;
    assert_eq!(status, 403);
    // d0 still points at the real engine and gets the traffic.
    let listed = instances(&router).await;
    let d0 = listed.iter().find(|i| i["id"] == "d0").unwrap();
    assert_eq!(d0["url"], real.url.as_str());
    let (status, _) = post(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":"hi","max_tokens":2}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(engine_requests(&attacker).await.len(), 0);
    assert_eq!(engine_requests(&real).await.len(), 1);

    // The admin API may replace it: a new credential, the old one dead.
    let (status, replaced) = admin(
        &router,
        reqwest::Method::POST,
        "/admin/instances",
        Some(&registration("d0", &attacker.url)),
    )
    .await;
    assert_eq!(status, 201, "{replaced}");
    assert!(replaced["credential"]
        .as_str()
        .is_some_and(|c| c.len() >= 32));
}

/// Two registrants racing for one new id: a check followed by a write let
/// both win, the later silently replacing the earlier (whose engine then got
/// 403 on every heartbeat while the other took its traffic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_first_registrations_of_one_id_have_one_winner() {
    let router = router(&[]);
    for round in 0..5 {
        race_first_registrations(&[&router], &format!("contested-{round}"), 16).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_credential_lets_its_holder_back_in_and_an_expired_id_is_free() {
    let router = router(&[
        "--heartbeat-ttl-s",
        "1",
        "--dead-instance-grace-s",
        "1",
        "--health-check-interval-ms",
        "0",
    ]);
    let (status, first) = post_internal(
        &router,
        "/v1/instances",
        &registration("x", "http://127.0.0.1:9"),
        None,
    )
    .await;
    assert_eq!(status, 201, "{first}");
    let credential = first["credential"].as_str().unwrap().to_string();
    assert!(credential.len() >= 32, "{credential}");
    // Its holder re-registers at once (a restarted agent that kept it).
    let (status, again) = post_internal(
        &router,
        "/v1/instances",
        &registration("x", "http://127.0.0.1:10"),
        Some(&credential),
    )
    .await;
    assert_eq!(status, 201, "{again}");
    assert_eq!(again["credential"], credential.as_str());
    // Once its heartbeats have stopped for the TTL, anyone may take the id.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let (status, taken) = post_internal(
        &router,
        "/v1/instances",
        &registration("x", "http://127.0.0.1:11"),
        None,
    )
    .await;
    assert_eq!(status, 201, "{taken}");
    assert_ne!(taken["credential"], credential.as_str());
    // The old credential no longer works.
    let (status, _) = post_internal(
        &router,
        "/v1/instances/x/heartbeat",
        &json!({}),
        Some(&credential),
    )
    .await;
    assert_eq!(status, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_flood_is_bounded_and_dead_instances_are_evicted() {
    let router = router(&[
        "--max-instances",
        "5",
        "--heartbeat-ttl-s",
        "1",
        "--dead-instance-grace-s",
        "1",
        "--health-check-interval-ms",
        "0",
    ]);
    for i in 0..5 {
        let (status, reply) = post_internal(
            &router,
            "/v1/instances",
            &registration(&format!("f{i}"), "http://127.0.0.1:9"),
            None,
        )
        .await;
        assert_eq!(status, 201, "{reply}");
    }
    let (status, reply) = post_internal(
        &router,
        "/v1/instances",
        &registration("f5", "http://127.0.0.1:9"),
        None,
    )
    .await;
    assert_eq!(status, 503, "{reply}");
    assert!(reply["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum"));
    // Silent for TTL + grace: evicted, and there is room again.
    eventually(Duration::from_secs(6), "dead instances evicted", || async {
        instances(&router).await.is_empty()
    })
    .await;
    let (status, _) = post_internal(
        &router,
        "/v1/instances",
        &registration("f5", "http://127.0.0.1:9"),
        None,
    )
    .await;
    assert_eq!(status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_plain_registration_or_admin_body_is_refused() {
    let router = router(&[]);
    let body = registration("tp", "http://127.0.0.1:9").to_string();
    let (status, reply) = send(
        client()
            .post(format!("{}/v1/instances", router.internal))
            .header("content-type", "text/plain")
            .body(body.clone()),
    )
    .await;
    assert_eq!(status, 415, "{reply}");
    let (status, _) = send(
        client()
            .post(format!("{}/admin/instances", router.internal))
            .bearer_auth(ADMIN_TOKEN)
            .body(body),
    )
    .await;
    assert_eq!(status, 415);
    assert!(instances(&router).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urls_that_are_not_bare_origins_or_point_inward_are_refused() {
    let router = router(&[]);
    let own = router.url.clone();
    let internal = router.internal.clone();
    for url in [
        "http://127.0.0.1:9?",
        "http://127.0.0.1:9#",
        "http://127.0.0.1:9/latest/meta-data",
        "http://127.0.0.1:9/?a=b",
        "http://user:pw@127.0.0.1:9",
        "http://169.254.169.254",
        "http://[fe80::1]:80",
        own.as_str(),
        internal.as_str(),
    ] {
        let (status, reply) =
            post_internal(&router, "/v1/instances", &registration("u", url), None).await;
        assert_eq!(status, 400, "{url}: {reply}");
    }
    let mut with_ctrl = registration("u", "http://127.0.0.1:9");
    with_ctrl["ctrl"] = json!("169.254.169.254:80");
    let (status, _) = post_internal(&router, "/v1/instances", &with_ctrl, None).await;
    assert_eq!(status, 400);
    assert!(instances(&router).await.is_empty());
    // A router limited to other networks refuses loopback engines.
    let narrow = crate::common::router(&["--allowed-upstreams", "10.0.0.0/8"]);
    let (status, _) = post_internal(
        &narrow,
        "/v1/instances",
        &registration("u", "http://127.0.0.1:9"),
        None,
    )
    .await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_tokens_are_refused_and_near_misses_get_401() {
    for flag in ["--admin-token", "--register-token", "--transfer-secret"] {
        let stderr = refused_start(&[
            "--listen",
            "127.0.0.1:0",
            "--internal-listen",
            "127.0.0.1:0",
            flag,
            "",
        ]);
        assert!(stderr.contains("empty"), "{flag}: {stderr}");
    }
    let router = router(&["--register-token", "reg-token-1234"]);
    for given in [
        None,
        Some("Bearer "),
        Some("Bearer reg-token-123"),
        Some("Bearer reg-token-12345"),
        Some("Bearer REG-TOKEN-1234"),
        Some("reg-token-1234"),
    ] {
        let mut request = client()
            .post(format!("{}/v1/instances", router.internal))
            .json(&registration("n", "http://127.0.0.1:9"));
        if let Some(given) = given {
            request = request.header("authorization", given);
        }
        let (status, _) = send(request).await;
        assert_eq!(status, 401, "{given:?}");
        let mut admin_call = client().get(format!("{}/admin/instances", router.internal));
        if let Some(given) = given {
            admin_call = admin_call.header("authorization", given.replace("reg", "test-admin"));
        }
        let (status, _) = send(admin_call).await;
        assert_eq!(status, 401, "admin {given:?}");
    }
    let (status, _) = send(
        client()
            .post(format!("{}/v1/instances", router.internal))
            .bearer_auth("reg-token-1234")
            .json(&registration("n", "http://127.0.0.1:9")),
    )
    .await;
    assert_eq!(status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_come_from_files_and_engines_register_with_them() {
    let dir = std::env::temp_dir().join(format!("connex-sec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("register-token");
    std::fs::write(&file, "file-token-5678\n").unwrap();
    let (router, [_prefill, _decode]) = pd_cluster(
        &["--register-token-file", file.to_str().unwrap()],
        [
            ("prefill", &["--register-token", "file-token-5678"]),
            ("decode", &["--register-token", "file-token-5678"]),
        ],
    )
    .await;
    let (status, _) = post_internal(
        &router,
        "/v1/instances",
        &registration("n", "http://127.0.0.1:9"),
        None,
    )
    .await;
    assert_eq!(status, 401);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_registration_on_a_non_loopback_listener_needs_consent() {
    // Refused before anything is bound.
    let stderr = refused_start(&["--listen", "127.0.0.1:0", "--internal-listen", "0.0.0.0:0"]);
    assert!(stderr.contains("--allow-open-registration"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_ids_reach_clients_only_when_exposed() {
    let (hidden, [_p, _d]) = pd_cluster(
        &["--expose-instance-headers=false"],
        [
            ("prefill", &["--id", "secret-prefill"]),
            ("decode", &["--id", "secret-decoder"]),
        ],
    )
    .await;
    for stream in [false, true] {
        let response = client()
            .post(format!("{}/v1/completions", hidden.url))
            .json(&json!({"model":"mock","prompt":"hi","max_tokens":2,"stream":stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.headers().get("x-connex-prefill").is_none());
        assert!(response.headers().get("x-connex-decoder").is_none());
        let text = response.text().await.unwrap();
        assert!(!text.contains("secret-"), "{text}");
    }
}

/// KV events from a caller without the instance's credential are refused
/// before their body is read. Before, the router read and parsed up to 4 MiB
/// of JSON for each such request (here: it waited for a body that never
/// comes) before it looked at the credential.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_without_the_credential_are_refused_before_their_body_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (router, [_d0]) = pd_cluster(&[], [("decode", &["--id", "d0"])]).await;
    let addr = router.internal.trim_start_matches("http://").to_string();
    let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // A 4 MiB batch announced; its first bytes sent, the rest never.
    let head = format!(
        "POST /v1/instances/d0/kv-events HTTP/1.1\r\nhost: {addr}\r\n\
         content-type: application/json\r\nx-connex-credential: guessed\r\n\
         content-length: {}\r\n\r\n{{\"events\": [",
        4 << 20
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut reply = vec![0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut reply))
        .await
        .expect("answered without waiting for the body")
        .unwrap();
    let reply = String::from_utf8_lossy(&reply[..read]);
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
}

/// The ids of the router's static instances (`--prefill`/`--decode`) cannot
/// be taken by a registrant before discovery adds them (it would receive
/// their traffic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrant_cannot_squat_a_static_instance_id() {
    let router = router(&[]);
    let (status, body) = post_internal(
        &router,
        "/v1/instances",
        &json!({"id": "static-decode-127.0.0.1:9", "role": "decode",
            "url": "http://127.0.0.1:9", "model": "mock"}),
        None,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "id");
    assert!(instances(&router).await.is_empty());
}
