"""Responses that survive their router replica (issue 31), across real hosts.

Two router replicas share membership (one etcd) and responses (one Redis with
an append-only file, on the membership network); one prefill and two decoder
mock engines with the tokens API. A client starts a background response on r1,
reads some of its events, r1's container is killed, and the client reattaches
to r2 with `starting_after`: r2 took the generation over from its last
checkpoint, and the client gets every event exactly once, the text equal to an
uninterrupted run. Then the stored response and the next turn through r2, and
Redis restarted while background responses run on both replicas.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from harness import (
    REDIS_IMAGE,
    UNREACHABLE,
    Cluster,
    RouterHandle,
    build_images,
    build_redis_image,
    docker,
    require_docker,
    wait_for,
    wait_sees,
)

TOKENS = 80  # 25 ms a token: about 2 s
LEASE_MS = "1000"


@pytest.fixture(scope="module", autouse=True)
def images():
    require_docker()
    build_images()
    build_redis_image()


@pytest.fixture
def cluster():
    with Cluster() as c:
        c.data = c.network("data")
        c.ctrl = c.network("membership")
        etcd = c.start_etcd(c.ctrl, members=1)
        c.redis = c.run(
            "redis", REDIS_IMAGE, [c.ctrl],
            "--bind", "0.0.0.0", "--protected-mode", "no",
            "--appendonly", "yes", "--appendfsync", "always", "--dir", "/tmp",
        )  # fmt: skip
        store = ("--response-store", "redis://redis:6379", "--response-lease-ms", LEASE_MS)
        c.r1 = c.start_router("r1", c.data, c.ctrl, etcd, *store)
        c.r2 = c.start_router("r2", c.data, c.ctrl, etcd, *store)
        c.start_engine("p1", "prefill", c.data, "--enable-scale-out")
        for name in ("d1", "d2"):
            c.start_engine(name, "decode", c.data, "--enable-scale-out")
        for router in (c.r1, c.r2):
            wait_sees(router, {"p1", "d1", "d2"})
        yield c


def create(router: RouterHandle, body: dict) -> dict:
    reply = httpx.post(f"{router.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def text_of(response: dict) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def events(router: RouterHandle, rid: str, after: int | None, take: int | None = None) -> list:
    """A background response's events after `after` through `router`: `take`
    of them, or all until it ends. A store error event ends the read early."""
    url = f"{router.url}/v1/responses/{rid}?stream=true"
    if after is not None:
        url += f"&starting_after={after}"
    got = []
    with httpx.Client(timeout=60) as client, client.stream("GET", url) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            got.append(json.loads(line[6:]))
            if take is not None and len(got) >= take:
                break
    return got


def read_all(routers: list[RouterHandle], rid: str, have: list) -> list:
    """Reads on after the events `have`, reattaching (to the next router) after
    any store error, as a client does, until the response ends."""
    out = list(have)
    for attempt in range(20):
        after = out[-1]["sequence_number"] if out else None
        got = events(routers[attempt % len(routers)], rid, after)
        out.extend(e for e in got if e.get("type") != "error")
        if out and out[-1]["type"] in ("response.completed", "response.failed"):
            return out
    raise AssertionError(f"{rid} did not end: {out[-3:]}")


def assert_once(all_events: list) -> None:
    numbers = [e["sequence_number"] for e in all_events]
    assert numbers == list(range(len(all_events))), numbers


def test_a_background_response_outlives_its_replica_killed(cluster):
    prompt = "container router killed"
    want = create(cluster.r2, {"model": "mock", "input": prompt, "max_output_tokens": TOKENS})
    body = {"model": "mock", "input": prompt, "background": True, "max_output_tokens": TOKENS}
    rid = create(cluster.r1, body)["id"]
    seen = events(cluster.r1, rid, None, take=12)
    docker("kill", cluster.r1.name)
    everything = read_all([cluster.r2], rid, seen)
    assert_once(everything)
    done = everything[-1]["response"]
    assert everything[-1]["type"] == "response.completed", done
    assert text_of(done) == text_of(want)
    assert done["usage"]["output_tokens"] == TOKENS
    # Stored, and continued, through the replica left.
    stored = httpx.get(f"{cluster.r2.url}/v1/responses/{rid}", timeout=10).json()
    assert stored == done
    nxt = create(cluster.r2, {"model": "mock", "previous_response_id": rid, "input": "more",
                              "max_output_tokens": 4})  # fmt: skip
    assert nxt["previous_response_id"] == rid


def test_redis_restarted_under_load(cluster):
    prompts = [f"container redis restart {n}" for n in range(6)]
    want = {
        p: text_of(create(cluster.r2, {"model": "mock", "input": p, "max_output_tokens": TOKENS}))
        for p in prompts
    }
    routers = [cluster.r1, cluster.r2]
    rids = {}
    for n, prompt in enumerate(prompts):
        body = {"model": "mock", "input": prompt, "background": True, "max_output_tokens": TOKENS}
        rids[prompt] = (create(routers[n % 2], body)["id"], n % 2)
    # Plain requests keep being served while Redis restarts.
    served, failed = [], []

    def plain_load():
        for n in range(10):
            reply = httpx.post(
                f"{routers[n % 2].url}/v1/responses",
                json={"model": "mock", "input": f"plain {n}", "max_output_tokens": 8},
                timeout=60,
            )
            (served if reply.status_code == 200 else failed).append(reply.status_code)

    load = threading.Thread(target=plain_load)
    load.start()
    docker("restart", "--time", "0", cluster.redis)
    load.join()
    assert not failed and len(served) == 10, (served, failed)
    # Each background response, read through the replica that did not make it.
    for prompt, (rid, made_on) in rids.items():
        everything = read_all([routers[1 - made_on], routers[made_on]], rid, [])
        assert_once(everything)
        assert everything[-1]["type"] == "response.completed", everything[-1]
        assert text_of(everything[-1]["response"]) == want[prompt], prompt
    for router in routers:
        wait_for(
            lambda router=router: router.get_json("/ready")[1].get("response_store") == "shared",
            30,
            f"{router.name} to see the store back",
            tolerate=UNREACHABLE,
        )
