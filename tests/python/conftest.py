"""Fixtures: a real connex-router and mock engines as processes on loopback."""

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("CONNEX_BIN_DIR", ROOT / "target" / "debug"))


def start(
    binary: str, *args: str, second: str = "internal API on "
) -> tuple[subprocess.Popen, str, str]:
    """Starts a binary; returns it with the URL of its "listening on" line and
    the address of the `second` line printed before it: for a router, its
    internal listener (registration, admin, metrics); for a mock engine with
    `--kv-events-publish`, its KV event endpoint ("publishes KV events on ").
    Without that line, the second address is the URL again."""
    proc = subprocess.Popen([str(BIN_DIR / binary), *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    other = ""
    for line in proc.stdout:
        if second in line:
            other = line.split(second, 1)[1].strip()
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].strip()
            return proc, url, other or url
    proc.kill()
    raise RuntimeError(f"{binary} exited before listening")


def ready_instances(router: str) -> int:
    request = urllib.request.Request(
        f"{router}/admin/instances", headers={"Authorization": "Bearer t"}
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        return sum(1 for i in json.load(reply)["data"] if i["state"] == "ready")


@pytest.fixture
def cluster(cluster_urls):
    """A router with one prefill and one decode mock engine, all registered
    through the router's internal listener; yields the client URL."""
    yield cluster_urls[0]


@pytest.fixture
def cluster_urls():
    """The `cluster`, as (client URL, internal URL: admin, metrics)."""
    with mock_cluster([], [("prefill", []), ("decode", [])]) as urls:
        yield urls


@contextlib.contextmanager
def mock_cluster(router_flags: list[str], engines: list[tuple[str, list[str]]]):
    """A router (admin token `t`, `router_flags`) and mock engines of model
    `mock`, each `(role, extra flags)`, all registered and ready; yields (client
    URL, internal URL) and stops them all."""
    procs = []
    try:
        router_proc, router, internal = start(
            "connex-router",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--internal-listen",
            "127.0.0.1:0",
            "--admin-token",
            "t",
            *router_flags,
        )
        procs.append(router_proc)
        for role, extra in engines:
            proc, _, _ = start(
                "connex-mock-engine",
                "--role",
                role,
                "--model",
                "mock",
                "--router",
                internal,
                *extra,
            )
            procs.append(proc)
        deadline = time.monotonic() + 10
        while ready_instances(internal) < len(engines):
            assert time.monotonic() < deadline, "mock engines did not register"
            time.sleep(0.05)
        yield router, internal
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
