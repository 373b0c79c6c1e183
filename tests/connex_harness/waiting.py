"""Waiting for a condition a test cannot be told about (a registration, a
restart, a drop): polling, with a bound and a message that says what failed."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")

# What a check may raise while the part it asks is not up yet (a container
# restarting, a port not published yet): `wait_for(..., tolerate=UNREACHABLE)`
# asks again. Where a check should always be answered, nothing is tolerated.
UNREACHABLE: tuple[type[Exception], ...] = (
    OSError,
    httpx.HTTPError,
    urllib.error.URLError,
    ValueError,
)


def wait_for(
    check: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.1,
    tolerate: tuple[type[Exception], ...] = (),
) -> T:
    """Polls `check` until it returns something truthy (returned) or time runs
    out (an AssertionError naming `what`). An exception of a `tolerate` type
    counts as "not yet" (the last one is named on timeout); any other fails at
    once."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except tolerate as err:
            last_error = err
        time.sleep(interval_s)
    why = f" (last error: {last_error})" if last_error is not None else ""
    raise AssertionError(f"timed out waiting for {what}{why}")
