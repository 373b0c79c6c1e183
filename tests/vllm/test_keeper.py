"""The decoder's hold keeper: renewals while a request runs, releases that are
retried until the holder answers (seed breakages 2 and 6)."""

from __future__ import annotations

import time

from connex.adapters.vllm.keeper import HoldKeeper


class Gone(Exception):
    pass


class FlakyCtrl:
    """A control client whose holder is unreachable for the first `down` calls."""

    def __init__(self, down: int = 0, gone: set[str] | None = None) -> None:
        self.down = down
        self.gone = gone or set()
        self.calls: list[tuple[str, str, str]] = []

    def _call(self, op: str, ctrl: str, transfer_id: str):
        self.calls.append((op, ctrl, transfer_id))
        if self.down > 0:
            self.down -= 1
            raise ConnectionError("holder unreachable")
        if transfer_id in self.gone:
            raise Gone(transfer_id)

    def renew(self, ctrl: str, transfer_id: str, epoch: int) -> dict:
        self._call("renew", ctrl, transfer_id)
        return {}

    def release(self, ctrl: str, transfer_id: str) -> bool:
        self._call("release", ctrl, transfer_id)
        return True


def wait_until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_release_is_retried_until_the_holder_answers():
    ctrl = FlakyCtrl(down=3)
    keeper = HoldKeeper(ctrl, gone_errors=(Gone,), tick_s=0.01)
    keeper.keep("r1", ["h:1", "h:2"], "t1", epoch=0, lease_s=60)
    keeper.finish("r1", release=True)
    wait_until(lambda: keeper.pending_releases() == 0)
    releases = [c for c in ctrl.calls if c[0] == "release"]
    assert len(releases) == 5  # 3 refused, then one per TP rank
    assert {c[1] for c in releases} == {"h:1", "h:2"}
    assert keeper.stats.releases == 2 and keeper.stats.release_failures == 0
    keeper.close()


def test_release_gives_up_at_its_deadline_and_says_so():
    ctrl = FlakyCtrl(down=10**6)
    keeper = HoldKeeper(ctrl, gone_errors=(Gone,), release_deadline_s=0.3, tick_s=0.01)
    keeper.keep("r1", ["h:1"], "t1", epoch=0, lease_s=60)
    keeper.finish("r1", release=True)
    wait_until(lambda: keeper.pending_releases() == 0)
    assert keeper.stats.release_failures == 1
    keeper.close()


def test_holds_are_renewed_every_third_of_the_lease_until_finish():
    ctrl = FlakyCtrl()
    keeper = HoldKeeper(ctrl, gone_errors=(Gone,), tick_s=0.01)
    began = time.monotonic()
    keeper.keep("r1", ["h:1"], "t1", epoch=2, lease_s=0.3)
    wait_until(lambda: len([c for c in ctrl.calls if c[0] == "renew"]) >= 3)
    # Every 0.1 s: three renewals cannot come sooner than 0.3 s.
    assert time.monotonic() - began >= 0.3
    keeper.finish("r1", release=False)
    seen = len(ctrl.calls)
    # Long enough for three more renewals had it kept renewing.
    passes = keeper.stats.passes
    wait_until(lambda: keeper.stats.passes >= passes + 40)
    assert len(ctrl.calls) == seen, "renewed after finish, or released without being asked"
    keeper.close()


def test_a_hold_that_is_gone_is_no_longer_renewed():
    ctrl = FlakyCtrl(gone={"t1"})
    keeper = HoldKeeper(ctrl, gone_errors=(Gone,), tick_s=0.01)
    keeper.keep("r1", ["h:1"], "t1", epoch=0, lease_s=0.15)
    wait_until(lambda: not keeper.keeps("r1"))
    assert keeper.stats.gone == ["t1"]
    keeper.close()


def test_a_failed_renewal_is_retried_well_inside_the_lease():
    # A 6 s lease is renewed every 2 s; the first renewal fails. It must be
    # retried at once (backoff from 50 ms), not a third of the lease later, when
    # one more failure would let the hold lapse.
    ctrl = FlakyCtrl(down=1)
    keeper = HoldKeeper(ctrl, gone_errors=(Gone,), tick_s=0.01)
    keeper.keep("r1", ["h:1"], "t1", epoch=0, lease_s=6)
    wait_until(lambda: keeper.stats.renew_failures == 1, timeout_s=5)
    failed_at = time.monotonic()
    wait_until(lambda: keeper.stats.renewals == 1, timeout_s=5)
    assert time.monotonic() - failed_at < 1.0, "a failed renewal waited for the next period"
    keeper.close()
