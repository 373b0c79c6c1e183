"""A decoder's side of the holds it reads: renewals while a request runs, and a
reliable release when it finishes.

Lives in the scheduler process (it knows when requests start and finish) and owns
one daemon thread. Renewal keeps a hold alive through a decode longer than the
prefill's `retain_s`, so that a resume can still pull it; a release is retried
until the holder answers (or for `release_deadline_s`), never fired and forgotten.
A hold that answers "not found" or "stale epoch" is dropped from renewal: it is
gone or another decoder has taken the request over.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("connex.vllm.keeper")


class Ctrl(Protocol):
    """The control operations of `connex._transfer.Reader`."""

    def renew(self, remote_ctrl: str, transfer_id: str, epoch: int) -> dict[str, Any]: ...

    def release(self, remote_ctrl: str, transfer_id: str) -> bool: ...


# The first retry of a failed renewal; it doubles up to a third of the lease.
RETRY_FIRST_S = 0.05


@dataclass
class _Kept:
    ctrls: list[str]
    transfer_id: str
    epoch: int
    renew_every_s: float
    next_renew: float
    retry_s: float = RETRY_FIRST_S


@dataclass
class _Release:
    ctrl: str
    transfer_id: str
    deadline: float
    next_try: float
    backoff_s: float = 0.05


@dataclass
class KeeperStats:
    renewals: int = 0
    renew_failures: int = 0
    releases: int = 0
    release_failures: int = 0
    gone: list[str] = field(default_factory=list)
    # Passes of the keeper's thread (each renews and releases whatever is due).
    passes: int = 0


class HoldKeeper:
    def __init__(
        self,
        ctrl: Ctrl,
        gone_errors: tuple[type[BaseException], ...] = (),
        release_deadline_s: float = 60.0,
        tick_s: float = 0.2,
    ) -> None:
        self._ctrl = ctrl
        self._gone_errors = gone_errors
        self._release_deadline_s = release_deadline_s
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._kept: dict[str, _Kept] = {}
        self._releases: list[_Release] = []
        self.stats = KeeperStats()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connex-hold-keeper", daemon=True)
        self._thread.start()

    def keep(
        self, req_id: str, ctrls: list[str], transfer_id: str, epoch: int, lease_s: float
    ) -> None:
        """Renews the hold every third of its lease until `finish(req_id)`."""
        every = max(lease_s / 3.0, 0.1)
        with self._lock:
            self._kept[req_id] = _Kept(ctrls, transfer_id, epoch, every, time.monotonic() + every)

    def keeps(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._kept

    def finish(self, req_id: str, release: bool) -> None:
        """Stops renewing; with `release`, releases the hold on every rank."""
        with self._lock:
            kept = self._kept.pop(req_id, None)
            if kept is None or not release:
                return
            now = time.monotonic()
            for ctrl in kept.ctrls:
                self._releases.append(
                    _Release(ctrl, kept.transfer_id, now + self._release_deadline_s, now)
                )
        self._wake.set()

    def pending_releases(self) -> int:
        with self._lock:
            return len(self._releases)

    def close(self, flush_s: float = 5.0) -> None:
        """Gives pending releases up to `flush_s`, then stops the thread."""
        deadline = time.monotonic() + flush_s
        while self.pending_releases() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=flush_s)

    # ---- the thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._release_due()
            self._renew_due()
            self.stats.passes += 1
            self._wake.wait(self._tick_s)
            self._wake.clear()

    def _release_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [r for r in self._releases if r.next_try <= now]
        for rel in due:
            try:
                self._ctrl.release(rel.ctrl, rel.transfer_id)
                done = True
                self.stats.releases += 1
            except self._gone_errors:
                done = True
                self.stats.releases += 1
            except Exception as err:  # unreachable, timeout: try again until the deadline
                done = time.monotonic() >= rel.deadline
                if done:
                    self.stats.release_failures += 1
                    logger.error(
                        "could not release hold %s at %s: %s", rel.transfer_id, rel.ctrl, err
                    )
                else:
                    rel.next_try = time.monotonic() + rel.backoff_s
                    rel.backoff_s = min(rel.backoff_s * 2, 2.0)
            if done:
                with self._lock:
                    self._releases.remove(rel)

    def _renew_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [(rid, k) for rid, k in self._kept.items() if k.next_renew <= now]
        for req_id, kept in due:
            renewed = True
            for ctrl in kept.ctrls:
                try:
                    self._ctrl.renew(ctrl, kept.transfer_id, kept.epoch)
                    self.stats.renewals += 1
                except self._gone_errors as err:
                    logger.warning(
                        "hold %s of %s no longer renewable: %s", kept.transfer_id, req_id, err
                    )
                    self.stats.gone.append(kept.transfer_id)
                    with self._lock:
                        self._kept.pop(req_id, None)
                    break
                except Exception as err:  # transient: tried again soon, not a lease later
                    renewed = False
                    self.stats.renew_failures += 1
                    logger.debug("renewing hold %s failed: %s", kept.transfer_id, err)
            # Only a renewal that went through moves the next one a third of the
            # lease away; a failed one is retried with backoff, well inside the
            # lease, so one lost call never lets a hold lapse.
            if renewed:
                kept.retry_s = RETRY_FIRST_S
                kept.next_renew = time.monotonic() + kept.renew_every_s
            else:
                kept.next_renew = time.monotonic() + min(kept.retry_s, kept.renew_every_s)
                kept.retry_s = min(kept.retry_s * 2, kept.renew_every_s)
