"""Session-wide vLLM engines, shared by every test of this tier.

Starting an engine costs 40-120 s on two cores, so each kind of engine is started
once per session, and all engines a test needs are started together.
"""

from __future__ import annotations

import time

import harness
import pytest

# Failed tests' reports carry the log tails of the engines and routers running
# then (tests/connex_harness/reports.py).
pytest_plugins = ("connex_harness.reports",)


class Fleet:
    """Engines by name, started on first need and stopped at session end."""

    def __init__(self) -> None:
        self.engines: dict[str, harness.Engine] = {}
        self.startup_s: dict[str, float] = {}

    def ensure(self, wanted: dict[str, harness.Engine]) -> dict[str, harness.Engine]:
        missing = [e for name, e in wanted.items() if name not in self.engines]
        if missing:
            began = time.monotonic()
            self.startup_s.update(harness.start_all(missing))
            names = ", ".join(e.name for e in missing)
            print(f"\nstarted {names} in {time.monotonic() - began:.1f}s: {self.startup_s}")
            for engine in missing:
                self.engines[engine.name] = engine
        return {name: self.engines[name] for name in wanted}

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture(scope="session")
def fleet():
    harness.model_dir()
    fleet = Fleet()
    try:
        yield fleet
    finally:
        fleet.stop()


# Engines that answer chat with tools: a tool parser must be set for vLLM to
# take `tools` with a named or required `tool_choice` (answered through
# structured output); `pythonic` needs no special tokens in the vocabulary.
TOOL_ARGS = ["--tool-call-parser", "pythonic", "--enable-auto-tool-choice"]


def plain_engine() -> harness.Engine:
    """A single engine without P/D: the reference every P/D answer must equal."""
    return harness.Engine("plain", core=1, extra_args=list(TOOL_ARGS))


# Whether this session runs tests on the P/D cluster: then the first test that
# needs any engine starts them all at once (one parallel start, not two).
_WANTS_CLUSTER = False


def pytest_collection_modifyitems(items):
    global _WANTS_CLUSTER
    _WANTS_CLUSTER = any("cluster" in item.fixturenames for item in items)


@pytest.fixture(scope="session")
def plain(fleet, request) -> harness.Engine:
    if _WANTS_CLUSTER:
        return request.getfixturevalue("cluster")["plain"]
    return fleet.ensure({"plain": plain_engine()})["plain"]


def connex_kv(role: str, engine: harness.Engine, **extra) -> dict:
    """A --kv-transfer-config for ConnexConnector; `policy` sets the load failure
    policy. Holds are in place unless `hold="staged"` is given: the tier's
    tests of holds (leases, expiry, release, resume) watch the prefill's own
    blocks; tests/vllm/test_staged_pd.py covers staged holds."""
    policy = extra.pop("policy", "recompute")
    extra.setdefault("hold", "in_place")
    return {
        "kv_connector": "ConnexConnector",
        "kv_connector_module_path": "connex.adapters.vllm.pd_connector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"ctrl_port": harness.free_port(), **extra},
    }


def registered(
    engine: harness.Engine, role: str, router: harness.Router, **extra
) -> harness.Engine:
    """`engine` with ConnexConnector in `role` (`connex_kv`'s `extra`), its
    in-process agent registering it with `router` under the engine's name."""
    engine.kv_config = connex_kv(
        role, engine, router=router.internal, url=engine.url, instance_id=engine.name, **extra
    )
    return engine


class Cluster:
    """connex-router + one prefill + two decoders (self-registered through the
    connector's in-process agent), a plain engine to compare with, and a second
    prefill in `after_pull` mode that is not registered with the router."""

    RETAIN_S = 8.0

    def __init__(self, fleet: Fleet) -> None:
        self.router = harness.Router("--heartbeat-ttl-s", "3")
        wanted = {"plain": plain_engine()}
        for name, role, core in (
            ("prefill", "kv_producer", 0),
            ("d1", "kv_consumer", 1),
            ("d2", "kv_consumer", 0),
        ):
            engine = harness.Engine(name, core=core, extra_args=list(TOOL_ARGS))
            wanted[name] = registered(engine, role, self.router, retain_s=self.RETAIN_S)
        after = harness.Engine("p_after", core=1)
        after.kv_config = connex_kv("kv_producer", after, retain_s=30, release="after_pull")
        wanted["p_after"] = after
        self.engines = fleet.ensure(wanted)
        self.router.wait_instances({"prefill", "d1", "d2"})

    def __getitem__(self, name: str) -> harness.Engine:
        return self.engines[name]

    def ctrl(self, name: str) -> str:
        return self.engines[name].ctrl


@pytest.fixture(scope="session")
def cluster(fleet):
    cluster = Cluster(fleet)
    try:
        yield cluster
    finally:
        cluster.router.stop()
