"""Cache-aware routing on real vLLM engines, fed by vLLM's own KV events.

Two prefills publish their KV cache events over ZMQ (`--kv-events-config`,
prefix caching on, as by default); the ConnexConnector's in-process agent
subscribes to them and forwards them to a connex-router started with
`--prefill-policy cache_aware` and the model's own tokenizer.json
(`--tokenizer`: completions text prompts are tokenized in the router, chat
prompts by an engine's /tokenize for the chat template). A long prompt sent
again is routed back to the prefill that computed it, both ways: that
engine's own prefix cache hit counter (`vllm:prefix_cache_hits`) rises by the
prompt's cached blocks, and the other prefill never sees the prompt (its
prompt token counter stays put). Round robin
would send the second request to the other prefill.

One small cluster of its own (two prefills, one decoder), started in parallel.
"""

from __future__ import annotations

import json
import time

import harness
import httpx
import pytest
import tiny_model
from conftest import registered

# Long enough for many full blocks (harness.BLOCK_SIZE tokens each), short
# enough to prefill in a second or two on a busy core.
PROMPT = "".join(f"Rule {i}: answer in the voice of a patient librarian.\n" for i in range(40))


class AwareCluster:
    """connex-router (cache_aware prefills) + prefills p1, p2 publishing KV
    events + decoder d (all registered by the connector's agent)."""

    def __init__(self, fleet) -> None:
        tokenizer = f"{harness.MODEL_NAME}={tiny_model.ensure() / 'tokenizer.json'}"
        self.router = harness.Router(
            "--heartbeat-ttl-s", "3", "--prefill-policy", "cache_aware", "--tokenizer", tokenizer
        )
        wanted = {}
        for name, role, core in (
            ("aware_p1", "kv_producer", 0),
            ("aware_p2", "kv_producer", 1),
            ("aware_d", "kv_consumer", 0),
        ):
            engine = registered(harness.Engine(name, core=core), role, self.router)
            if role == "kv_producer":
                events = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{harness.free_port()}",
                }
                engine.extra_args = [
                    "--enable-prefix-caching",
                    "--kv-events-config",
                    json.dumps(events),
                ]
            wanted[name] = engine
        try:
            self.engines = fleet.ensure(wanted)
            self.router.wait_instances(set(wanted))
        except BaseException:
            self.router.stop()
            raise


@pytest.fixture(scope="module")
def aware(fleet):
    cluster = AwareCluster(fleet)
    try:
        yield cluster
    finally:
        cluster.router.stop()
        # Nothing else in the tier uses these engines: free the cores now.
        for name in ("aware_p1", "aware_p2", "aware_d"):
            fleet.engines.pop(name).stop()


def routed(url: str, prompt: str, chat: bool) -> str:
    """Sends a completion (or a chat with `prompt` as its system message)
    through the router; returns the prefill that served it."""
    body = {"model": harness.MODEL_NAME, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [
            {"role": "system", "content": prompt},
            {"role": "user", "content": "Which rule comes first?"},
        ]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    reply = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.headers["x-connex-prefill"]


def index_of(router: harness.Router, instance: str) -> tuple[str, int]:
    """The router's prefix index of `instance`: its source and size in blocks."""
    for i in router.instances():
        if i["id"] == instance:
            return i["prefix_index_source"], int(i["prefix_index_blocks"])
    raise AssertionError(f"{instance} is not registered")


def reported_blocks(router: harness.Router, instance: str) -> int:
    """Blocks indexed from the engine's own KV events (0 until they arrived:
    until then the router indexes the prompts it sent)."""
    source, blocks = index_of(router, instance)
    return blocks if source == "kv_events" else 0


def tokenized(text: str, by: str) -> float:
    """Prompts the router tokenized `by` itself ("router") or through an
    engine's /tokenize ("engine"), from its metrics text."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("connex_tokenize_duration_seconds_count{")
        and f'by="{by}"' in line
        and 'outcome="ok"' in line
    )


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_repeated_long_prompt_goes_back_to_the_prefill_that_computed_it(aware, route):
    router = aware.router
    p1, p2 = aware.engines["aware_p1"], aware.engines["aware_p2"]
    counters = ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")
    before = {e.name: {c: e.metric(c, absent=0.0) for c in counters} for e in (p1, p2)}
    prompt = f"{PROMPT}# session {time.time_ns()}\n"
    chat = route == "chat"
    # Each case's prompt is its own; the prefills may hold an earlier case's.
    blocks_before = {e: index_of(router, e)[1] for e in ("aware_p1", "aware_p2")}
    tokenized_before = {by: tokenized(router_metrics(router), by) for by in ("router", "engine")}

    first = routed(router.url, prompt, chat)
    other = "aware_p2" if first == "aware_p1" else "aware_p1"
    # The engine's BlockStored events reach the router through the agent.
    blocks = harness.wait_for(
        lambda: max(0, reported_blocks(router, first) - blocks_before[first]),
        30,
        f"{first}'s KV events in the router's index",
    )
    assert index_of(router, other)[1] == blocks_before[other]

    second = routed(router.url, prompt, chat)
    assert second == first, "the repeated prompt went to the prefill without its KV"
    engines = {"aware_p1": p1, "aware_p2": p2}
    after = {name: {c: engines[name].metric(c, absent=0.0) for c in counters} for name in engines}
    hit = "vllm:prefix_cache_hits_total"
    hits = after[first][hit] - before[first][hit]
    # vLLM's own counter: the second prefill reused the first one's blocks
    # (every full block but the last, which vLLM always recomputes).
    assert hits >= (blocks - 1) * harness.BLOCK_SIZE, (hits, blocks)
    # The other prefill never computed the prompt.
    assert after[other] == before[other]
    # The router says why it chose: the second prefill decision was for the cache.
    text = router_metrics(router)
    # Completions text was tokenized by the router's own tokenizer (the
    # model's tokenizer.json gives vLLM's ids, or the repeat would have missed
    # the index); chat by an engine (the chat template is the engine's).
    by = "engine" if chat else "router"
    assert tokenized(text, by) - tokenized_before[by] == 2, text
    other_by = "router" if chat else "engine"
    assert tokenized(text, other_by) == tokenized_before[other_by], text
    cache = [
        line
        for line in text.splitlines()
        if line.startswith("connex_routing_decisions_total{")
        and 'phase="prefill"' in line
        and 'reason="cache"' in line
    ]
    assert cache and float(cache[0].rsplit(" ", 1)[1]) >= 1, text


def router_metrics(router: harness.Router) -> str:
    return httpx.get(f"{router.internal}/metrics", timeout=10).text
