"""P/D and resume on real vLLM engines with the ConnexConnector's `mooncake` backend.

KV moves through Mooncake Transfer Engine (the real library; tests/run builds the
connex-ai wheel with the `mooncake` feature and puts the library on
LD_LIBRARY_PATH). A router, one prefill and two decoders of their own, all with
`backend: mooncake`; answers are compared token for token with the session's
plain engine (no P/D). The decoder-kill test is last: it leaves a decoder dead.
"""

from __future__ import annotations

import os

import harness
import pytest
import test_pd
from conftest import Fleet, plain_engine, registered
from connex import _transfer

# One machine: engines publish loopback as the address peers reach them at
# (see docs/transfer.md).
os.environ.setdefault("CONNEX_MOONCAKE_HOST", "127.0.0.1")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


class MooncakeCluster:
    """connex-router + prefill + two decoders, every connector on `mooncake`."""

    # No test here waits for an expiry: a lease long enough that a 2-core
    # machine running five engines never lets a hold lapse between the
    # prefill's end and the decoder's pull (8 s did once: the pull came 9 s
    # after, the decoder recomputed, and the resume had to re-prefill).
    RETAIN_S = 30.0
    ENGINES = ("mc_prefill", "mc_d1", "mc_d2")

    def __init__(self, fleet: Fleet, router: harness.Router) -> None:
        self.router = router
        wanted = {"plain": plain_engine()}
        for name, role, core in (
            ("mc_prefill", "kv_producer", 0),
            ("mc_d1", "kv_consumer", 1),
            ("mc_d2", "kv_consumer", 0),
        ):
            engine = harness.Engine(name, core=core)
            wanted[name] = registered(
                engine, role, self.router, backend="mooncake", retain_s=self.RETAIN_S
            )
        self.engines = fleet.ensure(wanted)
        self.router.wait_instances(set(self.ENGINES))

    def __getitem__(self, name: str) -> harness.Engine:
        return self.engines[name]

    def ctrl(self, name: str) -> str:
        return self.engines[name].ctrl


@pytest.fixture(scope="module")
def mooncake(fleet):
    try:
        _transfer.Reader(backend="mooncake")
    except Exception as err:  # the wheel was built without the feature
        pytest.fail(
            "connex._transfer has no mooncake backend: build the wheel with "
            f"`maturin build --features mooncake` and MOONCAKE_LIB_DIR set ({err})"
        )
    router = harness.Router("--heartbeat-ttl-s", "3")
    try:
        yield MooncakeCluster(fleet, router)
    finally:
        router.stop()
        # These engines serve this module only: free their memory for the rest
        # of the session (the plain engine stays, it is shared), also when the
        # cluster failed to come up.
        for name in MooncakeCluster.ENGINES:
            engine = fleet.engines.pop(name, None)
            if engine is not None:
                engine.stop()


@pytest.mark.parametrize("prompt", test_pd.PROMPTS[:2], ids=["short", "medium"])
def test_pd_over_mooncake_equals_a_single_engine(mooncake, prompt):
    ctrl = mooncake.ctrl("mc_prefill")
    before = test_pd.stats(ctrl)
    want = harness.complete(mooncake["plain"].url, prompt, 40)["choices"][0]
    got = harness.complete(mooncake.router.url, prompt, 40)["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    assert got["text"] == want["text"]
    ids, text, last = test_pd.stream_completion(
        mooncake.router.url, test_pd.body(prompt, 40, stream=True)
    )
    assert (ids, text, last["finish_reason"]) == (want["token_ids"], want["text"], "length")
    # The KV really crossed: the prefill's holder served the decoders' pulls.
    assert test_pd.stats(ctrl)["pulls"] - before["pulls"] >= 1


def test_decoder_killed_mid_stream_resumes_over_mooncake(mooncake):
    """SIGKILL the decoder at token k: the other decoder pulls the still-held prompt
    KV through Mooncake and the stream ends as an uninterrupted run would."""
    ctrl = mooncake.ctrl("mc_prefill")
    total, k = 300, 40
    for _ in range(3):
        prompt = test_pd.fresh("mooncake-resume", 30)
        want = harness.complete(mooncake["plain"].url, prompt, total, logprobs=test_pd.LOGPROBS)[
            "choices"
        ][0]
        prefills = mooncake["mc_prefill"].metric("vllm:request_success_total")
        before = test_pd.stats(ctrl)
        resumes = mooncake.router.metric("connex_resumes_total")
        outcome = test_pd.stream_and_kill_decoder(mooncake, prompt, total, k)
        if outcome is not None:
            break
    else:
        pytest.fail("the decoder finished before the client saw token k, three times")
    ids, text, logprobs, killed = outcome
    assert killed is not None
    harness.wait_for(lambda: not killed.alive(), 10, "the killed decoder to exit")
    if test_pd.tokens_agree(ids, logprobs, want) == len(ids):
        assert text == want["text"]
    assert mooncake.router.metric("connex_resumes_total") - resumes == 1
    assert mooncake["mc_prefill"].metric("vllm:request_success_total") - prefills == 1
    harness.wait_for(lambda: test_pd.stats(ctrl)["releases"] > before["releases"], 10, "release")
    after = test_pd.stats(ctrl)
    assert after["pulls"] - before["pulls"] == 2
    assert after["releases"] - before["releases"] == 1
