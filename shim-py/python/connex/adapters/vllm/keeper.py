"""A decoder's side of the holds it reads: renewals while a request runs, and a
reliable release when it finishes.

Lives in the scheduler process (it knows when requests start and finish) and owns
one daemon thread that decides what is due, plus one thread per holder (a
prefill rank's control address) that makes that holder's calls. Renewal keeps a
hold alive through a decode longer than the prefill's `retain_s`, so that a
resume can still pull it; a release is retried until the holder answers (or for
`release_deadline_s`), never fired and forgotten. A hold that answers "not
found" or "stale epoch" is dropped from renewal: it is gone or another decoder
has taken the request over.

Bounds (docs/security.md, "Hold calls"): a holder that accepts connections and
never answers holds up only its own lane, never another holder's renewals; a
lane queues at most `MAX_QUEUED_PER_HOLDER` calls; a failing renewal is retried
only until its hold lapses; at most `MAX_PENDING_RELEASES` releases wait; a
failing pass or call is logged and never ends the keeper's thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("connex.vllm.keeper")


class Ctrl(Protocol):
    """The control operations of `connex._transfer.Reader`."""

    def renew(self, remote_ctrl: str, transfer_id: str, epoch: int) -> dict[str, Any]: ...

    def release(self, remote_ctrl: str, transfer_id: str) -> bool: ...


# The first retry of a failed renewal; it doubles up to a third of the lease.
RETRY_FIRST_S = 0.05
# Renewals come every third of the lease and no more often than every 0.1 s: a
# prefill announcing `lease_s: 1e-300` must not make the keeper spin.
MIN_RENEW_EVERY_S = 0.1
# Calls waiting for one holder's lane at most. Each renewal or release is queued
# once at a time, so this only bites with more holds than this on one holder:
# the rest wait for the next pass.
MAX_QUEUED_PER_HOLDER = 256
# A lane's thread ends after this long without calls (a new call starts another).
LANE_IDLE_S = 30.0
# Releases waiting at most; past it the oldest is given up (its lease frees it).
MAX_PENDING_RELEASES = 65_536
# Transfer ids of the last holds found gone, kept for diagnostics.
RECENT_GONE = 64


# Compared by identity: two holds alike are still two entries.
@dataclass(eq=False)
class _Renewal:
    """One hold on one rank's holder."""

    req_id: str
    ctrl: str
    transfer_id: str
    epoch: int
    lease_s: float
    renew_every_s: float
    next_renew: float
    # When the hold lapses unless renewed: its lease from when it was kept or
    # from the start of its last successful renewal.
    expires: float
    retry_s: float = RETRY_FIRST_S
    # Queued on its holder's lane or in flight: not queued again meanwhile.
    busy: bool = False


@dataclass(eq=False)
class _Release:
    ctrl: str
    transfer_id: str
    deadline: float
    next_try: float
    backoff_s: float = 0.05
    busy: bool = False


@dataclass
class KeeperStats:
    renewals: int = 0
    renew_failures: int = 0
    # Renewals stopped because the hold lapsed before one went through.
    expired: int = 0
    releases: int = 0
    release_failures: int = 0
    # Releases given up unsent: more than MAX_PENDING_RELEASES waiting.
    releases_dropped: int = 0
    # Holds found gone (not found, stale epoch), and the last few of their ids.
    gone: int = 0
    recent_gone: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_GONE))
    # Passes of the keeper's thread (each queues whatever is due).
    passes: int = 0
    # Unexpected errors in a pass or a call (logged; the keeper goes on).
    errors: int = 0


class _Lane:
    """One holder's calls, run in order on a thread of their own: a holder that
    never answers delays only the calls queued behind it on its lane."""

    def __init__(self, holder: str, on_error: Callable[[], None]) -> None:
        self._holder = holder
        self._on_error = on_error
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._thread: threading.Thread | None = None
        self._running = 0
        self._stopped = False

    def submit(self, job: Callable[[], None]) -> bool:
        """Queues `job`; False when the lane is full or stopped."""
        with self._cond:
            if self._stopped or len(self._jobs) >= MAX_QUEUED_PER_HOLDER:
                return False
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name=f"connex-hold-lane-{self._holder}", daemon=True
                )
                self._thread.start()
            self._cond.notify()
            return True

    def busy(self) -> int:
        """Calls queued or running."""
        with self._cond:
            return len(self._jobs) + self._running

    def idle(self) -> bool:
        with self._cond:
            return self._thread is None and not self._jobs

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._jobs.clear()
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._jobs and not self._stopped:
                    self._cond.wait(LANE_IDLE_S)
                if not self._jobs or self._stopped:
                    self._thread = None
                    return
                job = self._jobs.popleft()
                self._running = 1
            try:
                job()
            except Exception:  # a bug in one call must not end the lane
                self._on_error()
                logger.exception("hold call to %s failed unexpectedly", self._holder)
            finally:
                with self._cond:
                    self._running = 0


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
        self._kept: dict[str, list[_Renewal]] = {}
        self._releases: deque[_Release] = deque()
        self._lanes: dict[str, _Lane] = {}
        self.stats = KeeperStats()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connex-hold-keeper", daemon=True)
        self._thread.start()

    def keep(
        self, req_id: str, ctrls: list[str], transfer_id: str, epoch: int, lease_s: float
    ) -> None:
        """Renews the hold every third of its lease until `finish(req_id)`."""
        every = max(lease_s / 3.0, MIN_RENEW_EVERY_S)
        lease_s = max(lease_s, 3 * MIN_RENEW_EVERY_S)
        now = time.monotonic()
        units = [
            _Renewal(req_id, c, transfer_id, epoch, lease_s, every, now + every, now + lease_s)
            for c in dict.fromkeys(ctrls)
        ]
        with self._lock:
            self._kept[req_id] = units

    def keeps(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._kept

    def finish(self, req_id: str, release: bool) -> None:
        """Stops renewing; with `release`, releases the hold on every rank."""
        with self._lock:
            units = self._kept.pop(req_id, None)
            if units is None or not release:
                return
            now = time.monotonic()
            for unit in units:
                self._releases.append(
                    _Release(unit.ctrl, unit.transfer_id, now + self._release_deadline_s, now)
                )
            while len(self._releases) > MAX_PENDING_RELEASES:
                given_up = self._releases.popleft()
                self.stats.releases_dropped += 1
                logger.warning(
                    "too many hold releases waiting: %s at %s given up (its lease frees it)",
                    given_up.transfer_id,
                    given_up.ctrl,
                )
        self._wake.set()

    def pending_releases(self) -> int:
        with self._lock:
            return len(self._releases)

    def in_flight(self) -> int:
        """Calls queued on a holder's lane or running."""
        with self._lock:
            lanes = list(self._lanes.values())
        return sum(lane.busy() for lane in lanes)

    def close(self, flush_s: float = 5.0) -> None:
        """Gives pending releases up to `flush_s`, then stops the threads."""
        deadline = time.monotonic() + flush_s
        while self.pending_releases() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=flush_s)
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.stop()

    # ---- the keeper's thread: what is due goes to its holder's lane ------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._queue_due()
            except Exception:  # a bug in one pass must not end renewals for good
                self._count_error()
                logger.exception("hold keeper pass failed; the next one follows")
            self.stats.passes += 1
            self._wake.wait(self._tick_s)
            self._wake.clear()

    def _count_error(self) -> None:
        with self._lock:
            self.stats.errors += 1

    def _queue_due(self) -> None:
        now = time.monotonic()
        jobs: list[tuple[str, Callable[[], None], _Renewal | _Release]] = []
        with self._lock:
            for rel in list(self._releases):
                if rel.busy or rel.next_try > now:
                    continue
                if now >= rel.deadline:  # its lane never had room in time
                    self._releases.remove(rel)
                    self.stats.release_failures += 1
                    logger.error("could not release hold %s at %s", rel.transfer_id, rel.ctrl)
                    continue
                rel.busy = True
                jobs.append((rel.ctrl, functools.partial(self._release, rel), rel))
            for req_id, units in list(self._kept.items()):
                for unit in list(units):
                    if unit.busy or unit.next_renew > now:
                        continue
                    if now >= unit.expires:
                        # Retrying a hold that has lapsed renews nothing and
                        # keeps its holder's lane busy.
                        units.remove(unit)
                        self.stats.expired += 1
                        logger.warning(
                            "hold %s of %s at %s lapsed before a renewal went through",
                            unit.transfer_id,
                            req_id,
                            unit.ctrl,
                        )
                        continue
                    unit.busy = True
                    jobs.append((unit.ctrl, functools.partial(self._renew, unit), unit))
            for holder in [h for h, lane in self._lanes.items() if lane.idle()]:
                del self._lanes[holder]
            lanes = {holder: self._lane(holder) for holder, _, _ in jobs}
        for holder, job, item in jobs:
            if not lanes[holder].submit(job):
                with self._lock:  # full: due again at the next pass
                    item.busy = False

    def _lane(self, holder: str) -> _Lane:
        lane = self._lanes.get(holder)
        if lane is None:
            lane = self._lanes[holder] = _Lane(holder, self._count_error)
        return lane

    # ---- the lanes' calls --------------------------------------------------------

    def _release(self, rel: _Release) -> None:
        try:
            self._ctrl.release(rel.ctrl, rel.transfer_id)
        except self._gone_errors:
            pass  # released already, by its lease or the router
        except Exception as err:  # unreachable, timeout: try again until the deadline
            now = time.monotonic()
            with self._lock:
                rel.busy = False
                if now < rel.deadline:
                    rel.next_try = now + rel.backoff_s
                    rel.backoff_s = min(rel.backoff_s * 2, 2.0)
                    return
                self.stats.release_failures += 1
                self._releases.remove(rel)
            logger.error("could not release hold %s at %s: %s", rel.transfer_id, rel.ctrl, err)
            return
        with self._lock:
            self.stats.releases += 1
            if rel in self._releases:
                self._releases.remove(rel)

    def _renew(self, unit: _Renewal) -> None:
        started = time.monotonic()
        try:
            self._ctrl.renew(unit.ctrl, unit.transfer_id, unit.epoch)
        except self._gone_errors as err:
            logger.warning(
                "hold %s of %s no longer renewable: %s", unit.transfer_id, unit.req_id, err
            )
            with self._lock:
                self.stats.gone += 1
                self.stats.recent_gone.append(unit.transfer_id)
                # Unless the request was finished (or kept anew) meanwhile.
                if any(u is unit for u in self._kept.get(unit.req_id, ())):
                    self._kept.pop(unit.req_id, None)
            return
        except Exception as err:  # transient: tried again soon, not a lease later
            logger.debug("renewing hold %s failed: %s", unit.transfer_id, err)
            # A failed renewal is retried with backoff, well inside the lease, so
            # one lost call never lets a hold lapse.
            with self._lock:
                self.stats.renew_failures += 1
                unit.next_renew = time.monotonic() + min(unit.retry_s, unit.renew_every_s)
                unit.retry_s = min(unit.retry_s * 2, unit.renew_every_s)
                unit.busy = False
            return
        # Only a renewal that went through moves the next one a third of the lease away.
        with self._lock:
            self.stats.renewals += 1
            unit.retry_s = RETRY_FIRST_S
            unit.expires = started + unit.lease_s
            unit.next_renew = time.monotonic() + unit.renew_every_s
            unit.busy = False
