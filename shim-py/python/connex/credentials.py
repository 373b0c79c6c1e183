"""Where the agent and the connector find their secrets: the environment or a
file, so that none has to sit on a command line (`ps` shows those) or in
`--kv-transfer-config` (vLLM logs it at startup)."""

from __future__ import annotations

import os
from pathlib import Path

# The bearer token the router requires of registrations.
REGISTER_TOKEN_ENV = "CONNEX_REGISTER_TOKEN"
# The secret the hold control listeners require of every peer.
TRANSFER_SECRET_ENV = "CONNEX_TRANSFER_SECRET"


def read_secret(
    value: str | None = None,
    file: str | os.PathLike[str] | None = None,
    env: str | None = None,
) -> str | None:
    """A token or secret: `value` when given, else the contents of `file` (without
    surrounding whitespace), else the environment variable `env`; None when there
    is none. A named file that is missing or empty is an error, not "no secret"."""
    if value is not None and not isinstance(value, str):
        raise ValueError("a token or secret must be a string")
    if value:
        return value
    if file:
        text = Path(file).read_text(encoding="utf-8").strip()
        if not text:
            raise ValueError(f"{file} is empty")
        return text
    if env:
        return os.environ.get(env) or None
    return None
