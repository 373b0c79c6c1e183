"""The workspace's binaries as processes on loopback, and what a failed test's
report shows of everything still running.

A binary announces its addresses on stdout ("listening on URL", and before it
any other: a router's "internal API on URL", a mock engine's "publishes KV
events on ENDPOINT"); `Process` reads up to that line, then keeps every line
the process prints (stdout and stderr), so that it never blocks on a full pipe
and a failed test can show what it said.
"""

from __future__ import annotations

import atexit
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import Protocol

from .paths import binary

LISTENING = "listening on "


class Running(Protocol):
    """Anything a test started that outlives one call: a process, an engine,
    a cluster of containers."""

    def log_tail(self, lines: int = 40) -> str: ...

    def kill(self) -> None: ...


# What is running now, by the title of its log in a failed test's report
# (reports.py). Each part registers when it starts and leaves when it stops.
RUNNING: dict[str, Running] = {}


@atexit.register
def _kill_the_running() -> None:
    """Parts still running when the interpreter exits (a session that ended
    without its teardown: its output pipe closed, an interrupt) are killed: a
    vLLM engine holds about 2.8 GB, and a few left behind starve the next
    session."""
    for part in list(RUNNING.values()):
        part.kill()


class Process:
    """One binary of the workspace (`binary` under CONNEX_BIN_DIR), started with
    `args`; `url` is the one of its "listening on" line. With `log_dir`, its
    output is also written to `log_dir`/`name`-PID.log."""

    KEPT_LINES = 2000

    def __init__(self, name: str, *args: str, log_dir: Path | None = None) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [str(binary(name)), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._lines: deque[str] = deque(maxlen=self.KEPT_LINES)
        self._announced: list[str] = []
        self._log = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(log_dir / f"{name}-{self.proc.pid}.log", "a")  # noqa: SIM115
        self.url = self._read_announcements()
        self.title = f"{name} {self.proc.pid}"
        RUNNING[self.title] = self
        threading.Thread(target=self._keep_output, daemon=True).start()

    def _read_announcements(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._keep(line)
            self._announced.append(line)
            if LISTENING in line:
                return line.split(LISTENING, 1)[1].strip()
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"{self.name} exited before listening:\n" + "".join(self._lines))

    def _keep(self, line: str) -> None:
        self._lines.append(line)
        if self._log is not None:
            self._log.write(line)
            self._log.flush()

    def _keep_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._keep(line)

    def announced(self, what: str) -> str:
        """The address after `what` in the lines up to "listening on"."""
        for line in self._announced:
            if what in line:
                return line.split(what, 1)[1].strip()
        raise KeyError(f"{self.name} did not announce {what!r}: {self._announced}")

    def log_tail(self, lines: int = 40) -> str:
        return "".join(list(self._lines)[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()

    def wait(self) -> int:
        """Waits for the process to end (after `kill`); it no longer counts as running."""
        code = self.proc.wait()
        RUNNING.pop(self.title, None)
        return code

    def stop(self) -> None:
        self.kill()
        self.wait()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


class MockEngine(Process):
    """connex-mock-engine with `flags` (see its --help)."""

    def __init__(self, *flags: str, log_dir: Path | None = None) -> None:
        super().__init__("connex-mock-engine", *flags, log_dir=log_dir)

    @property
    def kv_events(self) -> str:
        """The ZMQ endpoint it publishes KV events on (`--kv-events-publish`)."""
        return self.announced("publishes KV events on ")
