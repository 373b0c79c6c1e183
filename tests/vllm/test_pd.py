"""P/D on real vLLM engines with the ConnexConnector, behind connex-router.

One prefill and two decoders (registered by the connector's in-process agent),
compared token for token with a single engine without P/D. The decoder-kill test
is last: it leaves one decoder dead.
"""

from __future__ import annotations

import ctypes
import math
import signal
import time

import harness
import httpx
import pytest
from connex import _transfer

# The kill test's logprobs: alternatives per token, and the float tolerance
# (nats) of a resumed decoder's values against an uninterrupted run's.
LOGPROBS = 2
LOGPROB_TOL = 1e-2

PROMPTS = [
    "def fibonacci(n):\n",
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n" * 3,
    "import os\nimport sys\nfrom pathlib import Path\n" * 12,
]


def fresh(tag: str, lines: int = 6) -> str:
    """A prompt no engine has seen in this session: prefix caches cannot hit it."""
    fresh.count += 1
    return f"# {tag} {fresh.count} {time.time_ns()}\n" + "def handler(event, context):\n" * lines


fresh.count = 0


def stream_completion(url: str, body: dict) -> tuple[list[int], str, dict]:
    ids, text, last = [], "", {}
    for event in harness.stream_events(url, "/v1/completions", body):
        for choice in event.get("choices", []):
            ids += choice.get("token_ids") or []
            text += choice.get("text") or ""
            if choice.get("finish_reason"):
                last = choice
    return ids, text, last


def body(prompt, max_tokens: int, **extra) -> dict:
    return {
        "model": harness.MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def prefill(engine: harness.Engine, prompt) -> dict:
    """The router's first phase, by hand: returns the hold's kv_transfer_params."""
    answer = harness.complete(
        engine.url,
        prompt,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    params = answer["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True
    return params


def stats(ctrl: str) -> dict:
    return _transfer.Reader(backend="tcp").stats(ctrl)


def hold(ctrl: str, transfer_id: str):
    return _transfer.Reader(backend="tcp").stat(ctrl, transfer_id)


def kv_usage(engine: harness.Engine) -> float:
    return engine.metric("vllm:kv_cache_usage_perc")


# ---- equal to a single engine -------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "medium", "long"])
def test_completions_through_pd_equal_a_single_engine(cluster, prompt):
    want = harness.complete(cluster["plain"].url, prompt, 40)["choices"][0]
    got = harness.complete(cluster.router.url, prompt, 40)["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    assert got["text"] == want["text"]
    ids, text, last = stream_completion(cluster.router.url, body(prompt, 40, stream=True))
    assert ids == want["token_ids"]
    assert text == want["text"]
    assert last["finish_reason"] == "length"


def test_chat_through_pd_equals_a_single_engine(cluster):
    chat = {
        "model": harness.MODEL_NAME,
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function that parses a config file."},
        ],
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    want = httpx.post(f"{cluster['plain'].url}/v1/chat/completions", json=chat, timeout=120)
    got = httpx.post(f"{cluster.router.url}/v1/chat/completions", json=chat, timeout=120)
    assert got.status_code == 200, got.text
    content = want.json()["choices"][0]["message"]["content"]
    assert got.json()["choices"][0]["message"]["content"] == content
    pieces = []
    for event in harness.stream_events(
        cluster.router.url, "/v1/chat/completions", chat | {"stream": True}
    ):
        for choice in event.get("choices", []):
            pieces.append(choice.get("delta", {}).get("content") or "")
    assert "".join(pieces) == content


def test_decoder_releases_the_hold_when_its_request_finishes(cluster):
    ctrl = cluster.ctrl("prefill")
    # The earlier tests' holds are released by their decoders after their
    # answers: one landing in this test's window would count as its release.
    harness.wait_for(lambda: stats(ctrl)["holds"] == 0, 30, "no hold left from earlier tests")
    before = stats(ctrl)
    prompt = fresh("release")
    # References first: the holds under test have short leases.
    want = harness.complete(cluster["plain"].url, prompt, 24)["choices"][0]
    params = prefill(cluster["prefill"], prompt)
    assert hold(ctrl, params["transfer_id"]) is not None
    assert params["remote_ctrl"] == ctrl
    got = harness.complete(cluster["d1"].url, prompt, 24, kv_transfer_params=params)
    assert got["choices"][0]["token_ids"] == want["token_ids"]
    harness.wait_for(lambda: hold(ctrl, params["transfer_id"]) is None, 10, "release")
    after = stats(ctrl)
    assert after["pulls"] - before["pulls"] == 1
    assert after["releases"] - before["releases"] == 1
    harness.wait_for(lambda: kv_usage(cluster["prefill"]) == 0, 10, "prefill blocks freed")


def test_kv_transfer_metrics_are_on_the_engines_own_metrics(cluster):
    """The connector's counters reach vLLM's /metrics through KVConnectorStats:
    the prefill's live holds, the decoder's pull, its bytes and its time."""
    ctrl = cluster.ctrl("prefill")
    d2 = cluster["d2"]
    prompt = fresh("metrics")
    pulls = d2.metric("connex_kv_pulls_total", absent=0.0)
    pulled = d2.metric("connex_kv_pulled_bytes_total", absent=0.0)
    timed = d2.metric("connex_kv_pull_seconds_count", absent=0.0)
    failed = d2.metric("connex_kv_pull_failures_total", absent=0.0)
    served = stats(ctrl)["bytes_served"]
    params = prefill(cluster["prefill"], prompt)
    harness.wait_for(
        lambda: cluster["prefill"].metric("connex_kv_holds") >= 1, 20, "the hold on /metrics"
    )
    harness.complete(d2.url, prompt, 8, kv_transfer_params=params)
    harness.wait_for(
        lambda: d2.metric("connex_kv_pulls_total") >= pulls + 1, 20, "the pull on /metrics"
    )
    assert (
        d2.metric("connex_kv_pulled_bytes_total") - pulled == stats(ctrl)["bytes_served"] - served
    )
    assert d2.metric("connex_kv_pull_seconds_count") == timed + 1
    assert d2.metric("connex_kv_pull_failures_total") == failed


def test_full_local_prefix_hit_pulls_nothing_and_releases(cluster):
    """Seed breakage 1: a resume landing on a decoder that has the whole context
    cached must not pull (nor crash), and must still release the hold."""
    ctrl = cluster.ctrl("prefill")
    d1 = cluster["d1"]
    context = harness.complete(cluster["plain"].url, fresh("hit", 20), 1)["choices"][0]
    ids = context["prompt_token_ids"]
    # d1 computes (and caches) the whole context once, without P/D.
    harness.complete(d1.url, ids, 1)
    want = harness.complete(cluster["plain"].url, ids, 30)["choices"][0]
    params = prefill(cluster["prefill"], ids[:70])
    before = stats(ctrl)
    got = harness.complete(d1.url, ids, 30, kv_transfer_params=params | {"resume_epoch": 1})
    assert got["choices"][0]["token_ids"] == want["token_ids"]
    assert stats(ctrl)["pulls"] == before["pulls"]
    harness.wait_for(lambda: hold(ctrl, params["transfer_id"]) is None, 10, "release")
    assert d1.alive()


def test_stale_resume_epoch_is_refused(cluster):
    ctrl = cluster.ctrl("prefill")
    prompt = fresh("stale")
    want = harness.complete(cluster["plain"].url, prompt, 16)["choices"][0]
    params = prefill(cluster["prefill"], prompt)
    # A newer decoder (epoch 1) has read the hold ...
    reader = _transfer.Reader(backend="tcp")
    blocks = params["remote_block_ids"]
    piece = params["page_bytes"]
    count = len(blocks) * params["num_layers"]
    buf = ctypes.create_string_buffer(piece * count)
    rid = reader.register_region(ctypes.addressof(buf), piece * count)
    reader.pull(ctrl, params["transfer_id"], 1, [(rid, i * piece, piece) for i in range(count)])
    assert any(buf.raw), "pulled KV is all zeros"
    # ... so an older one (epoch 0) is refused, and computes the prompt itself.
    d2 = cluster["d2"]
    seen = len(d2.log_text())
    got = harness.complete(d2.url, prompt, 16, kv_transfer_params=params)
    assert got["choices"][0]["token_ids"] == want["token_ids"]
    log = d2.log_text()[seen:]
    assert "kv load failed" in log and "epoch" in log.lower()
    reader.release(ctrl, params["transfer_id"])


def test_bad_kv_transfer_params_are_a_failed_load_not_a_crash(cluster):
    """Issue 13: params that claim a hold they do not describe (a port that is no
    port, an epoch past u32) are a failed load; with the `recompute` policy the
    decoder computes the prompt itself and stays up."""
    ctrl = cluster.ctrl("prefill")
    d2 = cluster["d2"]
    prompt = fresh("bad-params")
    want = harness.complete(cluster["plain"].url, prompt, 16)["choices"][0]
    params = prefill(cluster["prefill"], prompt)
    seen = len(d2.log_text())
    for bad in ({"resume_epoch": 2**32}, {"remote_ctrl": ctrl.replace(":", ":x")}):
        got = harness.complete(d2.url, prompt, 16, kv_transfer_params=params | bad)
        assert got["choices"][0]["token_ids"] == want["token_ids"]
    log = d2.log_text()[seen:]
    assert "bad kv_transfer_params: resume_epoch must be in 0..4294967295" in log
    assert "bad kv_transfer_params: remote_ctrl must be host:port" in log
    assert d2.alive()
    _transfer.Reader(backend="tcp").release(ctrl, params["transfer_id"])


def test_hold_listeners_require_the_transfer_secret(cluster):
    # The tier runs as deployed: with the secret, and a peer without it gets nothing.
    assert stats(cluster.ctrl("prefill"))["holds"] >= 0
    with pytest.raises(_transfer.TransferError):
        _transfer.Reader(backend="tcp", secret="not-the-secret").stats(cluster.ctrl("prefill"))


def test_hold_expires_after_retain_s_and_frees_the_blocks(cluster):
    ctrl = cluster.ctrl("prefill")
    before = stats(ctrl)
    began = time.monotonic()
    params = prefill(cluster["prefill"], fresh("expiry", 20))
    assert kv_usage(cluster["prefill"]) > 0
    time.sleep(cluster.RETAIN_S / 2)
    assert hold(ctrl, params["transfer_id"]) is not None
    harness.wait_for(
        lambda: hold(ctrl, params["transfer_id"]) is None, cluster.RETAIN_S + 10, "expiry"
    )
    assert time.monotonic() - began >= cluster.RETAIN_S * 0.9
    assert stats(ctrl)["expiries"] - before["expiries"] == 1
    harness.wait_for(lambda: kv_usage(cluster["prefill"]) == 0, 10, "prefill blocks freed")


def test_after_pull_frees_the_hold_on_first_read(cluster):
    p_after = cluster["p_after"]
    ctrl = cluster.ctrl("p_after")
    prompt = fresh("after_pull", 20)
    want = harness.complete(cluster["plain"].url, prompt, 200)["choices"][0]
    params = prefill(p_after, prompt)
    assert hold(ctrl, params["transfer_id"]) is not None
    ids = []
    events = harness.stream_events(
        cluster["d1"].url,
        "/v1/completions",
        body(prompt, 200, stream=True, kv_transfer_params=params),
    )
    for event in events:
        ids += event["choices"][0].get("token_ids") or []
        if len(ids) == 1:
            # The decode is under way: the hold is already gone.
            assert hold(ctrl, params["transfer_id"]) is None
            assert stats(ctrl)["pulls"] == 1
    assert ids == want["token_ids"]
    harness.wait_for(lambda: kv_usage(p_after) == 0, 10, "prefill blocks freed")


# ---- resume -------------------------------------------------------------------------


def stream_and_kill_decoder(cluster, prompt: str, total: int, k: int):
    """Streams `prompt` through the router and kills its decoder at token k.

    The decoder is first frozen (SIGSTOP) and the router's journal consulted: on a
    heavily loaded machine the client can lag so far behind that the decoder has
    already finished; then the kill would prove nothing, and the caller tries
    again. Returns (ids, text, logprobs, killed engine) or None for such a late
    kill. The request asks for logprobs: they resume too."""
    request_id = f"kill-{time.time_ns()}"
    ids: list[int] = []
    text = ""
    logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    killed = None
    with httpx.stream(
        "POST",
        f"{cluster.router.url}/v1/completions",
        json=body(prompt, total, stream=True, logprobs=LOGPROBS),
        headers={"X-Request-Id": request_id},
        timeout=300,
    ) as reply:
        assert reply.status_code == 200
        decoder = reply.headers["x-connex-decoder"]
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = httpx.Response(200, content=line[6:]).json()
            assert "error" not in event, event
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
                text += choice.get("text") or ""
                for key, values in logprobs.items():
                    values += (choice.get("logprobs") or {}).get(key) or []
            if killed is None and len(ids) >= k:
                engine = cluster[decoder]
                engine.kill(signal.SIGSTOP)
                entry = next(
                    # The journal names a request by the engines' id: the
                    # client's, with a suffix of its own.
                    (
                        e
                        for e in cluster.router.requests()
                        if e["request_id"].startswith(f"{request_id}-")
                    ),
                    None,
                )
                if entry is None or entry["generated_tokens"] >= total:
                    engine.kill(signal.SIGCONT)
                    return None
                assert entry["decoder"] == decoder, entry
                engine.kill()
                killed = engine
    return ids, text, logprobs, killed


def tokens_agree(ids: list[int], logprobs: dict[str, list], want: dict) -> int:
    """Checks a resumed stream's tokens against an uninterrupted run's (`want`,
    a completion choice with logprobs) and returns how many leading tokens
    were compared: all of them, or those before the first place where the
    reference had a tie and the stream took the other tied token.

    The test model is tiny and random: its top two logprobs are often equal
    to the last bit. On CPUs whose bf16 kernels block by batch shape (AMX),
    recomputing the generated tokens as one prompt (a resume) or running the
    prompt on another engine (P/D) moves logprobs by ~1e-3, which decides
    such a tie the other way; from there the two runs are different, equally
    greedy continuations. Parting anywhere else is a failure."""
    expected = want["token_ids"]
    parted = next((i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b), None)
    if parted is None:
        assert len(ids) == len(expected), (len(ids), len(expected))
        return len(ids)
    top = want["logprobs"]["top_logprobs"][parted]
    best = max(top.values())
    tied = {token for token, value in top.items() if best - value <= LOGPROB_TOL}
    token = logprobs["tokens"][parted]
    assert len(tied) >= 2 and token in tied, (
        f"parted from the uninterrupted run at token {parted} without a tie: "
        f"took {token!r}, the reference's top logprobs were {top}"
    )
    print(f"parted at a tie at token {parted} of {len(expected)}: {top}")
    return parted


def assert_same_top(got: dict[str, float], expected: dict[str, float]) -> None:
    """One position's top logprobs equal the reference's up to float noise. A
    token may stand in for another only at the cut, where the two are tied
    (the last place of the top-k; see tokens_agree)."""
    for token in got.keys() & expected.keys():
        assert math.isclose(got[token], expected[token], abs_tol=LOGPROB_TOL), (got, expected)
    for mine, other in ((got, expected), (expected, got)):
        for token in mine.keys() - other.keys():
            assert mine[token] - min(other.values()) <= LOGPROB_TOL, (got, expected)
    assert len(got) == len(expected), (got, expected)


def test_decoder_killed_mid_stream_resumes_from_the_hold(cluster):
    """SIGKILL the decoder serving a stream at token k: the stream completes on the
    other decoder with the tokens (and logprobs, within float tolerance) of an
    uninterrupted run, without a second prefill; the hold is pulled twice and
    released once at the end."""
    ctrl = cluster.ctrl("prefill")
    total, k = 300, 40
    for _ in range(3):
        prompt = fresh("resume", 30)
        want = harness.complete(cluster["plain"].url, prompt, total, logprobs=LOGPROBS)
        want = want["choices"][0]
        prefill_requests = cluster["prefill"].metric("vllm:request_success_total")
        before = stats(ctrl)
        # Counted from its first resume on: absent until then.
        resumes = cluster.router.metric("connex_resumes_total", absent=0.0)
        outcome = stream_and_kill_decoder(cluster, prompt, total, k)
        if outcome is not None:
            break
    else:
        pytest.fail("the decoder finished before the client saw token k, three times")
    ids, text, logprobs, killed = outcome
    assert killed is not None
    harness.wait_for(lambda: not killed.alive(), 10, "the killed decoder to exit")
    agreed = tokens_agree(ids, logprobs, want)
    if agreed == len(ids):
        assert text == want["text"]
    # The resumed decoder computed the logprobs of the tokens after k with the
    # generated ones as its prompt: the same values, up to float noise.
    assert logprobs["tokens"][:agreed] == want["logprobs"]["tokens"][:agreed]
    for got, expected in zip(
        logprobs["token_logprobs"][:agreed],
        want["logprobs"]["token_logprobs"][:agreed],
        strict=True,
    ):
        assert math.isclose(got, expected, abs_tol=LOGPROB_TOL), (got, expected)
    for got, expected in zip(
        logprobs["top_logprobs"][:agreed], want["logprobs"]["top_logprobs"][:agreed], strict=True
    ):
        assert_same_top(got, expected)
    # The router resumed it, once.
    assert cluster.router.metric("connex_resumes_total") - resumes == 1
    # One prefill only.
    assert cluster["prefill"].metric("vllm:request_success_total") - prefill_requests == 1
    # Pulled by the first decoder and by the one that took over; released once.
    harness.wait_for(lambda: stats(ctrl)["releases"] > before["releases"], 10, "release")
    after = stats(ctrl)
    assert after["pulls"] - before["pulls"] == 2
    assert after["releases"] - before["releases"] == 1
    assert after["holds"] == before["holds"]
