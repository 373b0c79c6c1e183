"""The test harness every Python tier shares (tests/python, tests/vllm,
tests/container) and bench/ through tests/vllm/harness.py: the workspace's
binaries, free ports, connex-router's start arguments and processes, mock
engines, clusters of them, waiting, metrics, and the log tails a failed test's
report shows. What only one tier needs stays in its own folder (vLLM engines
in tests/vllm/harness.py, containers in tests/container/harness.py).

# Layout
- paths.py: the workspace root and CONNEX_BIN_DIR.
- ports.py: free loopback ports, each handed out once.
- processes.py: a binary as a process (its announced URLs, its output kept),
  the mock engine, and the registry of what is running.
- router.py: the router's start arguments (one function), what a test asks a
  router (admin, metrics, registrations), the router as a process.
- clusters.py: a router with mock engines, registered and ready.
- waiting.py: polling for a condition, with a bound.
- metrics.py: summing a Prometheus metric.
- reports.py: the pytest plugin that adds log tails to a failed test's report.

The tiers put tests/ on sys.path (their conftest.py or harness.py) and import
`connex_harness`; pytest runs each tier with its own folder as the root.
"""

from .clusters import mock_cluster
from .metrics import sum_metric
from .paths import BIN_DIR, ROOT, binary
from .ports import free_port
from .processes import RUNNING, MockEngine, Process
from .router import ADMIN_TOKEN, Router, RouterApi, router_args
from .waiting import UNREACHABLE, wait_for

__all__ = [
    "ADMIN_TOKEN",
    "BIN_DIR",
    "ROOT",
    "RUNNING",
    "UNREACHABLE",
    "MockEngine",
    "Process",
    "Router",
    "RouterApi",
    "binary",
    "free_port",
    "mock_cluster",
    "router_args",
    "sum_metric",
    "wait_for",
]
