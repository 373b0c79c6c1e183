"""The ConnexConnector's KV transfer metrics, through vLLM's KVConnectorStats.

Each worker counts what it pulled (decoder) and holds (prefill) in a
`TransferCounters` (worker.py, free of vLLM); `get_kv_connector_stats` hands
what changed since its last report to vLLM as a `ConnexKVStats`, vLLM carries
the reports of every worker to its frontend, and `ConnexPromMetrics` records
them on the engine's own `/metrics`:

- `connex_kv_pulls_total`, `connex_kv_pull_failures_total`,
  `connex_kv_pulled_bytes_total`, `connex_kv_pull_seconds` (decoder);
- `connex_kv_holds`, `connex_kv_held_bytes` (gauges),
  `connex_kv_hold_evictions_total` (prefill: holds evicted for the budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# Pull latencies one report carries at most (the counts stay exact).
MAX_LATENCIES = 1024
PULL_SECONDS_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
]
COUNTERS = ("pulls", "pull_failures", "pulled_bytes", "evictions")
# Gauges, per worker (TP rank): the engine's value is their sum.
GAUGES = ("holds", "held_bytes")


def empty() -> dict[str, Any]:
    data: dict[str, Any] = {name: 0 for name in COUNTERS}
    data["pull_seconds"] = []
    for name in GAUGES:
        data[name] = {}
    return data


@dataclass
class ConnexKVStats(KVConnectorStats):
    """Transfer counts since the last report, and the latest holds per worker."""

    data: dict[str, Any] = field(default_factory=empty)

    def __post_init__(self) -> None:
        merged = empty()
        merged.update(self.data or {})
        self.data = merged

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = ConnexKVStats(data=dict(other.data))
        for name in COUNTERS:
            self.data[name] = int(self.data[name]) + int(theirs.data[name])
        room = MAX_LATENCIES - len(self.data["pull_seconds"])
        self.data["pull_seconds"] = self.data["pull_seconds"] + theirs.data["pull_seconds"][:room]
        for name in GAUGES:
            # The later report of a worker replaces its earlier one.
            self.data[name] = {**self.data[name], **theirs.data[name]}
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["pull_seconds"]
        out: dict[str, int | float] = {name: int(self.data[name]) for name in COUNTERS}
        out["avg_pull_ms"] = round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0
        for name in GAUGES:
            out[name] = sum(int(v) for v in self.data[name].values())
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS) and not any(
            self.data[name] for name in GAUGES
        )


class ConnexPromMetrics(KVConnectorPromMetrics):
    """The `connex_kv_*` families on the engine's `/metrics`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: PromMetric) -> dict[int, Any]:
            return create_metric_per_engine(metric, per_engine_labelvalues)

        # vLLM hands the metric classes to use (its own wrappers under Ray);
        # their common type knows no constructor arguments.
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls

        self.counters = {
            "pulls": per_engine(
                counter(
                    name="connex_kv_pulls",
                    documentation="KV pulls from prefill holds that completed.",
                    labelnames=labelnames,
                )
            ),
            "pull_failures": per_engine(
                counter(
                    name="connex_kv_pull_failures",
                    documentation="KV pulls that failed (the request's load failed).",
                    labelnames=labelnames,
                )
            ),
            "pulled_bytes": per_engine(
                counter(
                    name="connex_kv_pulled_bytes",
                    documentation="Bytes of KV pulled from prefill holds.",
                    labelnames=labelnames,
                )
            ),
            "evictions": per_engine(
                counter(
                    name="connex_kv_hold_evictions",
                    documentation="Holds evicted to keep within the hold budget.",
                    labelnames=labelnames,
                )
            ),
        }
        self.pull_seconds = per_engine(
            histogram(
                name="connex_kv_pull_seconds",
                documentation="Time of one KV pull, start to the last byte.",
                buckets=PULL_SECONDS_BUCKETS,
                labelnames=labelnames,
            )
        )
        # engine -> gauge -> worker -> its latest value.
        self.latest: dict[int, dict[str, dict[str, int]]] = {}
        self.gauges = {
            "holds": per_engine(
                gauge(
                    name="connex_kv_holds",
                    documentation="KV holds alive on this engine (prefill).",
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            ),
            "held_bytes": per_engine(
                gauge(
                    name="connex_kv_held_bytes",
                    documentation="Bytes of KV cache the holds alive keep.",
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = ConnexKVStats(data=dict(transfer_stats_data))
        for name, counter in self.counters.items():
            value = int(stats.data[name])
            if value:
                counter[engine_idx].inc(value)
        for seconds in stats.data["pull_seconds"]:
            self.pull_seconds[engine_idx].observe(float(seconds))
        # A report carries the gauges of the workers whose value changed: the
        # others keep their last one.
        latest = self.latest.setdefault(engine_idx, {})
        for name, gauge in self.gauges.items():
            per_worker = stats.data[name]
            if per_worker:
                known = latest.setdefault(name, {})
                known.update({str(k): int(v) for k, v in per_worker.items()})
                gauge[engine_idx].set(sum(known.values()))
