"""Fixtures: a real connex-router and mock engines as processes on loopback
(tests/connex_harness starts them)."""

import sys
from pathlib import Path

import pytest

# The harness the Python tiers share lies beside this folder.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from connex_harness import mock_cluster  # noqa: E402

pytest_plugins = ("connex_harness.reports",)


@pytest.fixture
def cluster(cluster_urls):
    """A router with one prefill and one decode mock engine, all registered
    through the router's internal listener; yields the client URL."""
    yield cluster_urls[0]


@pytest.fixture
def cluster_urls():
    """The `cluster`, as (client URL, internal URL: admin, metrics)."""
    with mock_cluster([], [("prefill", []), ("decode", [])]) as router:
        yield router.url, router.internal
