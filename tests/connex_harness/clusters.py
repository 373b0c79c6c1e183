"""A router and mock engines together on loopback: the cluster most tests of
the router's behaviour start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .processes import MockEngine
from .router import Router


@contextlib.contextmanager
def mock_cluster(router_flags: list[str], engines: list[tuple[str, list[str]]]) -> Iterator[Router]:
    """A router (admin token `t`, `router_flags`) and mock engines of model
    `mock`, each `(role, extra flags)`, registered through the router's
    internal listener and ready; yields the router and stops them all."""
    with contextlib.ExitStack() as parts:
        router = parts.enter_context(Router(*router_flags))
        for role, extra in engines:
            parts.enter_context(
                MockEngine("--role", role, "--model", "mock", "--router", router.internal, *extra)
            )
        router.wait_ready_count(len(engines))
        yield router
