"""Free loopback ports for what a test starts, each handed out once a session."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ports handed out this session: never twice (a port an engine released may
# still be in TIME_WAIT, or taken again by the next engine of a test).
_HANDED_OUT: set[int] = set()
# Where ports are chosen from: below the kernel's ephemeral range.
FIRST_PORT = 10_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port p such that p .. p + count - 1 are free on loopback (one hold
    listener per TP rank), chosen below the kernel's ephemeral range and never
    handed out twice. An engine's own sockets (vLLM's ZMQ and torch ports, every
    connect) take ephemeral ports: a port picked with bind(0) could be taken by
    one of them between now and when its engine binds it, which is how a
    prefill once failed to start ("Address already in use" on its hold
    listener) while other engines started beside it."""
    top = _ephemeral_low() - count
    if top <= FIRST_PORT:  # an unusual range: the kernel's choice, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(FIRST_PORT, top)
        ports = range(base, base + count)
        if any(p in _HANDED_OUT for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _HANDED_OUT.update(ports)
        return base
    raise RuntimeError(f"no {count} consecutive free ports below {top + count}")
