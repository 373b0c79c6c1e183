"""The Grafana dashboard (helm/connex/dashboards/) queries only metrics that
Connex exports: every name in every PromQL expression is a family of a live
router's /metrics after traffic, or (for the few that need a fault to appear)
a family the router declares, or one of the ConnexConnector's `connex_kv_*`
families that vLLM serves on the engines' /metrics (declared in stats.py;
tests/vllm/test_pd.py reads them from real engines)."""

from __future__ import annotations

import json
import re
import urllib.request

from connex_harness import ROOT

DASHBOARDS = sorted((ROOT / "helm" / "connex" / "dashboards").glob("*.json"))
NAME = re.compile(r"\b(connex_[a-z0-9_]+)\b")
# Families that appear only after a fault the `cluster` has none of (a failed
# engine call, a probe failure, a refused ejection, a hold released or renewed
# by the router, a broken etcd watch, a resume).
FAULT_ONLY = {
    "connex_resume_latency_seconds",
    "connex_upstream_errors_total",
    "connex_health_check_failures_total",
    "connex_ejections_refused_total",
    "connex_holds_released_total",
    "connex_holds_renewed_total",
    "connex_registry_reconnects_total",
}


def queries() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            assert panel.get("targets"), f"{path.name}: panel {panel['title']!r} has no query"
            out += [(panel["title"], t["expr"]) for t in panel["targets"]]
    return out


def scraped_families(internal: str) -> dict[str, str]:
    """family -> type, from the `# TYPE` lines of a live scrape; each family
    with a `# HELP`."""
    with urllib.request.urlopen(f"{internal}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = set(re.findall(r"^# HELP (\S+) \S", text, re.M))
    assert set(types) <= helps, f"families without # HELP: {set(types) - helps}"
    return types


def declared_families() -> set[str]:
    """The names the router's sources declare as metric names."""
    names: set[str] = set()
    for source in ("router/src/observe/metrics.rs", "router/src/membership/status.rs"):
        names |= set(
            re.findall(r'pub const \w+: &str = "(connex_[a-z0-9_]+)";', (ROOT / source).read_text())
        )
    return names


def connector_families() -> dict[str, str]:
    """family -> type of the ConnexConnector's metrics (prometheus_client adds
    `_total` to a counter's name)."""
    source = (ROOT / "shim-py" / "python" / "connex" / "adapters" / "vllm" / "stats.py").read_text()
    out = {}
    for kind, name in re.findall(
        r'(counter|gauge|histogram)\(\s*name="(connex_kv_[a-z_]+)"', source
    ):
        out[name + "_total" if kind == "counter" else name] = kind
    return out


def family(name: str, types: dict[str, str], declared: set[str]) -> str:
    """A histogram's `_bucket`/`_sum`/`_count` series named by their family."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and (types.get(base) == "histogram" or base in declared - set(types)):
            return base
    return name


def test_every_dashboard_query_names_a_metric_the_router_exports(cluster_urls):
    router, internal = cluster_urls
    # Traffic, so that the request, latency and per-instance families exist.
    for stream in (False, True):
        body = json.dumps({"model": "mock", "prompt": "dash", "max_tokens": 4, "stream": stream})
        request = urllib.request.Request(
            f"{router}/v1/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()
    types = scraped_families(internal)
    connector = connector_families()
    assert len(connector) == 7, connector
    declared = declared_families() | set(connector)
    types |= {name: kind for name, kind in connector.items() if kind == "histogram"}
    assert DASHBOARDS, "no dashboard"
    used = set()
    for title, expr in queries():
        names = NAME.findall(expr)
        assert names, f"{title!r}: no connex metric in {expr}"
        for name in names:
            base = family(name, types, declared)
            used.add(base)
            if base in types or base in connector:
                continue
            assert base in FAULT_ONLY and base in declared, (
                f"{title!r}: {name} is not exported by the router ({sorted(types)})"
            )
    # The dashboard shows what the issue asks for.
    for needed in (
        "connex_requests_total",
        "connex_ttft_seconds",
        "connex_prefill_duration_seconds",
        "connex_instance_request_duration_seconds",
        "connex_instances",
        "connex_resumes_total",
        "connex_registry_connected",
        "connex_kv_pulled_bytes_total",
        "connex_kv_holds",
    ):
        assert needed in used, f"the dashboard does not show {needed}"
