"""The ConnexConnector's KV transfer metrics through vLLM's own classes: a
worker's counters become KVConnectorStats, vLLM's aggregation across workers
and steps keeps them whole, and ConnexPromMetrics writes the `connex_kv_*`
families vLLM serves on its /metrics. (test_pd.py checks them on real engines.)"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from connex.adapters.vllm.pd_connector import ConnexConnector
from connex.adapters.vllm.stats import ConnexKVStats
from connex.adapters.vllm.worker import ConnexWorker
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


class Holder:
    """The holder's counters as `_transfer.Holder.stats()` gives them."""

    def __init__(self) -> None:
        self.counts = {"holds": 0, "held_bytes": 0, "evictions": 0}

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    def freed(self) -> list[str]:
        return []


class Pull:
    def __init__(self, result: dict[str, Any] | None) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self) -> dict[str, Any]:
        if self._result is None:
            raise RuntimeError("hold not found")
        return self._result


def worker(rank: int) -> ConnexWorker:
    w = ConnexWorker(
        None,  # type: ignore[arg-type]
        rank,
        16,
        [],
        is_producer=True,
        is_consumer=True,
        hold_mode="in_place",
    )
    w.holder = Holder()  # type: ignore[assignment]
    w._holder_sampled = -1e9
    return w


def test_worker_reports_what_changed_since_its_last_report():
    w = worker(0)
    # The first report has the holder's gauges; then nothing happened.
    first = w.take_stats()
    assert first is not None and first["holds"] == {"0": 0} and first["pulls"] == 0
    w._holder_sampled = -1e9
    assert w.take_stats() is None
    w.holder.counts.update(holds=2, held_bytes=4096)  # type: ignore[union-attr]
    load = SimpleNamespace(transfer_id="t", remote_ctrl="127.0.0.1:1", epoch=0)
    w._pulls = {  # type: ignore[dict-item]
        "a": (Pull({"bytes": 1000, "elapsed_s": 0.02}), load, None),
        "b": (Pull(None), load, None),
    }
    w.get_finished(set())
    w._holder_sampled = -1e9
    data = w.take_stats()
    assert data is not None
    assert (data["pulls"], data["pull_failures"], data["pulled_bytes"]) == (1, 1, 1000)
    assert data["pull_seconds"] == [0.02]
    assert data["holds"] == {"0": 2} and data["held_bytes"] == {"0": 4096}
    # Unchanged since: nothing to report (the holder is read again).
    w._holder_sampled = -1e9
    assert w.take_stats() is None
    w.holder.counts.update(holds=0, held_bytes=0, evictions=3)  # type: ignore[union-attr]
    w._holder_sampled = -1e9
    data = w.take_stats()
    assert data is not None and data["evictions"] == 3 and data["holds"] == {"0": 0}


def registry_types(registry: CollectorRegistry) -> dict[type, type]:
    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.pop("multiprocess_mode", None) if cls is not Gauge else None
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def sample(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert lines, f"{name} not exported:\n{text}"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_reports_of_every_worker_and_step_reach_the_engines_metrics():
    # Two TP workers, two steps, as vLLM aggregates them.
    r0, r1 = worker(0), worker(1)
    r0.counters.pulled({"bytes": 500, "elapsed_s": 0.01})
    r1.counters.pulled({"bytes": 700, "elapsed_s": 0.03})
    r0.holder.counts.update(holds=1, held_bytes=100)  # type: ignore[union-attr]
    r1.holder.counts.update(holds=1, held_bytes=300)  # type: ignore[union-attr]
    first: KVConnectorStats = ConnexKVStats(data=r0.take_stats() or {})
    first = first.aggregate(ConnexConnector.build_kv_connector_stats(r1.take_stats()))  # type: ignore[arg-type]
    r0.holder.counts.update(holds=0, held_bytes=0, evictions=1)  # type: ignore[union-attr]
    r0._holder_sampled = -1e9
    second = ConnexKVStats(data=r0.take_stats() or {})
    total = ConnexKVStats(data=copy.deepcopy(first.data)).aggregate(second)
    assert total.reduce() == {
        "pulls": 2,
        "pull_failures": 0,
        "pulled_bytes": 1200,
        "evictions": 1,
        "avg_pull_ms": 20.0,
        "holds": 1,
        "held_bytes": 300,
    }
    registry = CollectorRegistry()
    prom = ConnexConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        registry_types(registry),
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    assert prom is not None
    prom.observe(first.to_dict(), 0)
    prom.observe(second.to_dict(), 0)
    text = generate_latest(registry).decode()
    assert sample(text, "connex_kv_pulls_total") == 2
    assert sample(text, "connex_kv_pulled_bytes_total") == 1200
    assert sample(text, "connex_kv_pull_seconds_count") == 2
    assert sample(text, "connex_kv_hold_evictions_total") == 1
    assert sample(text, "connex_kv_holds") == 1  # rank 1's hold is still alive
    assert sample(text, "connex_kv_held_bytes") == 300
    for family in ("connex_kv_pulls_total", "connex_kv_holds", "connex_kv_pull_seconds"):
        assert f"# HELP {family} " in text
