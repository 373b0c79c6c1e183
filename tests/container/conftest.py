"""The container tier's pytest set-up: the harness the Python tiers share lies
beside this folder, and a failed test's report carries the log tails of the
containers running then (tests/connex_harness/reports.py)."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

pytest_plugins = ("connex_harness.reports",)
