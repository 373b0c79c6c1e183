"""Where the workspace and its binaries are: CONNEX_BIN_DIR names the folder
of the built binaries (tests/run: target/debug), else target/debug."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("CONNEX_BIN_DIR", ROOT / "target" / "debug"))


def binary(name: str) -> Path:
    """The path of the workspace's binary `name` (connex-router, connex-mock-engine)."""
    return BIN_DIR / name
