"""Session-wide vLLM engines, shared by every test of this tier.

Starting an engine costs 40-120 s on two cores, so each kind of engine is started
once per session, and all engines a test needs are started together.
"""

from __future__ import annotations

import sys
import time

import harness
import pytest

# The connex package from source (maturin develop builds its module in place).
sys.path.insert(0, str(harness.ROOT / "shim-py" / "python"))


class Fleet:
    """Engines by name, started on first need and stopped at session end."""

    def __init__(self) -> None:
        self.engines: dict[str, harness.Engine] = {}
        self.startup_s: dict[str, float] = {}

    def ensure(self, wanted: dict[str, harness.Engine]) -> dict[str, harness.Engine]:
        missing = [e for name, e in wanted.items() if name not in self.engines]
        if missing:
            began = time.monotonic()
            self.startup_s.update(harness.start_all(missing))
            names = ", ".join(e.name for e in missing)
            print(f"\nstarted {names} in {time.monotonic() - began:.1f}s: {self.startup_s}")
            for engine in missing:
                self.engines[engine.name] = engine
        return {name: self.engines[name] for name in wanted}

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture(scope="session")
def fleet():
    harness.model_dir()
    fleet = Fleet()
    try:
        yield fleet
    finally:
        fleet.stop()


def plain_engine() -> harness.Engine:
    """A single engine without P/D: the reference every P/D answer must equal."""
    return harness.Engine("plain", core=1)


@pytest.fixture(scope="session")
def plain(fleet) -> harness.Engine:
    return fleet.ensure({"plain": plain_engine()})["plain"]
