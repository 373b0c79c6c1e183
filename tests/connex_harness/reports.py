"""A pytest plugin (each tier's conftest.py names it in `pytest_plugins`): a
failed test's report carries the log tail of every part running then (routers,
engines, containers). What they said is most often why (a refused pull, a load
that failed, a registration refused), and CI keeps nothing else of them."""

from __future__ import annotations

import pytest

from .processes import RUNNING

TAIL_LINES = 60


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for title, part in list(RUNNING.items()):
            report.sections.append((f"{title} log (tail)", part.log_tail(TAIL_LINES)))
    return report
