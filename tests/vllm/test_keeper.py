"""The decoder's hold keeper: renewals while a request runs, releases that are
retried until the holder answers (seed breakages 2 and 6)."""

from __future__ import annotations

import socket
import threading
import time

from connex.adapters.vllm import keeper as keeper_module
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
    assert keeper.stats.gone == 1 and list(keeper.stats.recent_gone) == ["t1"]
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


def listener() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    host, port = sock.getsockname()
    return sock, f"{host}:{port}"


def answering_holder() -> str:
    """A holder that answers every call at once."""
    sock, addr = listener()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.recv(4096)
            conn.sendall(b"k")

    def accept() -> None:
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return addr


def black_hole() -> tuple[str, list[socket.socket]]:
    """A holder whose packets are black-holed after the connect: it accepts
    connections and never answers. Returns the connections it accepted."""
    sock, addr = listener()
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            conn, _ = sock.accept()
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return addr, accepted


class SocketCtrl:
    """A control client that, like `connex._transfer.Reader`, makes each call
    over TCP and waits for the holder's answer up to its time limit."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.answered: list[tuple[str, str, str, float]] = []

    def _call(self, op: str, ctrl: str, transfer_id: str) -> None:
        host, port = ctrl.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=self.timeout_s) as conn:
            conn.sendall(f"{op} {transfer_id}\n".encode())
            if not conn.recv(1):
                raise ConnectionError("holder closed the connection")
        with self.lock:
            self.answered.append((op, ctrl, transfer_id, time.monotonic()))

    def renew(self, ctrl: str, transfer_id: str, epoch: int) -> dict:
        self._call("renew", ctrl, transfer_id)
        return {}

    def release(self, ctrl: str, transfer_id: str) -> bool:
        self._call("release", ctrl, transfer_id)
        return True

    def renewals_of(self, transfer_id: str) -> list[float]:
        with self.lock:
            return [at for op, _, tid, at in self.answered if op == "renew" and tid == transfer_id]


def test_a_holder_that_never_answers_cannot_make_holds_on_others_lapse():
    # N4 (issue 27): a prefill whose control port accepts and never answers
    # holds renewals and releases of its own requests; each call runs to the
    # client's 1 s limit. The hold on a healthy prefill must still be renewed
    # within every lease. Before, the keeper made every call on one thread, so
    # the black hole's calls kept it for seconds and the healthy hold lapsed.
    healthy = answering_holder()
    hole, accepted = black_hole()
    ctrl = SocketCtrl(timeout_s=1.0)
    keeper = HoldKeeper(ctrl, tick_s=0.01)
    began = time.monotonic()
    keeper.keep("healthy", [healthy], "kept", epoch=0, lease_s=0.6)
    for i in range(4):
        keeper.keep(f"stuck{i}", [hole], f"stuck{i}", epoch=0, lease_s=0.6)
    for i in range(20):
        keeper.keep(f"ended{i}", [hole], f"ended{i}", epoch=0, lease_s=60)
        keeper.finish(f"ended{i}", release=True)
    time.sleep(2.5)
    ended = time.monotonic()
    renewals = ctrl.renewals_of("kept")
    gaps = [b - a for a, b in zip([began, *renewals], [*renewals, ended], strict=True)]
    assert max(gaps) < 0.6, f"the healthy hold went {max(gaps):.2f} s without a renewal"
    # The black hole's calls ran one at a time, on its own lane.
    assert 1 <= len(accepted) <= 4, len(accepted)
    keeper.close(flush_s=0.1)


def test_renewals_to_a_silent_holder_stop_when_the_hold_lapses():
    hole, accepted = black_hole()
    keeper = HoldKeeper(SocketCtrl(timeout_s=0.1), tick_s=0.01)
    keeper.keep("r1", [hole], "t1", epoch=0, lease_s=0.6)
    # Due at 0.2 s, retried with backoff until the hold lapses at 0.6 s.
    wait_until(lambda: keeper.stats.expired == 1, timeout_s=3)
    tried = len(accepted)
    assert tried >= 2, tried
    time.sleep(0.5)
    assert len(accepted) == tried, "renewed after the hold lapsed"
    keeper.close(flush_s=0.1)


def test_a_failing_pass_does_not_end_the_keeper():
    class Buggy(HoldKeeper):
        failed = False

        def _queue_due(self) -> None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("a bug")
            super()._queue_due()

    ctrl = FlakyCtrl()
    keeper = Buggy(ctrl, gone_errors=(Gone,), tick_s=0.01)
    keeper.keep("r1", ["h:1"], "t1", epoch=0, lease_s=0.3)
    wait_until(lambda: keeper.stats.renewals >= 2)
    assert keeper.stats.errors == 1
    keeper.close(flush_s=0.1)


def test_what_the_keeper_remembers_is_bounded():
    ctrl = FlakyCtrl(gone={f"t{i}" for i in range(200)})
    keeper = HoldKeeper(ctrl, gone_errors=(Gone,), tick_s=0.01)
    for i in range(200):
        keeper.keep(f"r{i}", ["h:1"], f"t{i}", epoch=0, lease_s=0.3)
    wait_until(lambda: keeper.stats.gone == 200)
    assert len(keeper.stats.recent_gone) == keeper_module.RECENT_GONE
    keeper.close(flush_s=0.1)
