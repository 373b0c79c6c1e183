"""Reading the Prometheus text that routers and engines export."""

from __future__ import annotations


def sum_metric(text: str, name: str, absent: float | None = None) -> float:
    """Sum of the samples of metric `name`. An absent metric is an error (so that
    a misspelt name cannot pass as 0) unless the caller says what it means
    (`absent=0.0` for a counter that appears at its first increment)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name) : len(name) + 1] in (" ", "{")):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        if absent is not None:
            return absent
        raise KeyError(f"metric {name!r} is not exported")
    return total
