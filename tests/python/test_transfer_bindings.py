"""connex._transfer from Python: a holder in one process, a reader in another,
pulling into caller-owned memory (bytearray / ctypes buffers). Every test runs
with CONNEX_TRANSFER_SECRET set, as a cluster does: each connection starts with
the challenge-response handshake."""

import ctypes
import hashlib
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from connex import _transfer as t

BLOCK = 64 * 1024
BLOCKS = 24
SECRET = "py-cluster-secret"
# Holders refuse transfer ids without 128 random bits' worth of hex at their end.
HOLD = "py-hold-5f3c9a1e7b2d4086a9c1e3f5b7d90246"


def tid(name: str) -> str:
    return f"{name}-5f3c9a1e7b2d4086a9c1e3f5b7d90246"


@pytest.fixture(autouse=True)
def cluster_secret(monkeypatch):
    """The secret every holder and reader takes from the environment (holder
    processes inherit it)."""
    monkeypatch.setenv("CONNEX_TRANSFER_SECRET", SECRET)


# A holder process: holds BLOCKS blocks of deterministic bytes, scattered in a
# ctypes buffer, under HOLD; prints its address and the bytes' sha256;
# serves until its stdin closes.
HOLDER = textwrap.dedent(
    f"""
    import ctypes, hashlib, sys
    from connex import _transfer as t
    retain_s = float(sys.argv[1])
    logical = bytes((i * 7 + i // 251) % 256 for i in range({BLOCKS} * {BLOCK}))
    buf = ctypes.create_string_buffer({BLOCKS} * {BLOCK})
    h = t.Holder(backend="tcp", listen="127.0.0.1:0", retain_s=retain_s)
    rid = h.register_region(ctypes.addressof(buf), len(buf))
    blocks = []
    for b in range({BLOCKS}):
        at = ({BLOCKS} - 1 - b) * {BLOCK}
        buf[at:at + {BLOCK}] = logical[b * {BLOCK}:(b + 1) * {BLOCK}]
        blocks.append((rid, at, {BLOCK}))
    h.create_hold("{HOLD}", blocks)
    print(h.ctrl_addr, hashlib.sha256(logical).hexdigest(), flush=True)
    sys.stdin.read()
    h.close()
    """
)


@pytest.fixture
def holder_process(request):
    """(ctrl address, sha256 of the held bytes) of a holder in its own process."""
    retain_s = getattr(request, "param", 60.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(retain_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        addr, digest = proc.stdout.readline().split()
        yield addr, digest, proc
    finally:
        proc.kill()
        proc.wait()


def dest_blocks(rid: int, base: int = 0) -> list[tuple[int, int, int]]:
    return [(rid, base + b * BLOCK, BLOCK) for b in range(BLOCKS)]


def test_pull_into_a_bytearray_matches_the_holders_bytes(holder_process):
    addr, digest, _ = holder_process
    reader = t.Reader(backend="tcp")
    dest = bytearray(BLOCKS * BLOCK)
    rid = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest))
    stats = reader.pull(addr, HOLD, 0, dest_blocks(rid))
    assert stats["bytes"] == BLOCKS * BLOCK
    assert stats["blocks"] == BLOCKS
    assert hashlib.sha256(dest).hexdigest() == digest
    info = reader.stat(addr, HOLD)
    assert info is not None and info["pulls"] == 1 and info["bytes"] == BLOCKS * BLOCK
    assert reader.release(addr, HOLD) is True
    assert reader.release(addr, HOLD) is False
    assert reader.stat(addr, HOLD) is None
    with pytest.raises(t.HoldNotFound):
        reader.pull(addr, HOLD, 0, dest_blocks(rid))


def test_pull_async_into_a_ctypes_buffer(holder_process):
    addr, digest, _ = holder_process
    reader = t.Reader()
    dest = ctypes.create_string_buffer(BLOCKS * BLOCK + 100)
    rid = reader.register_region(ctypes.addressof(dest), len(dest))
    pull = reader.pull_async(addr, HOLD, 2, dest_blocks(rid, base=100))
    stats = pull.result()
    assert pull.done()
    assert stats["bytes"] == BLOCKS * BLOCK
    assert hashlib.sha256(dest.raw[100:]).hexdigest() == digest
    # Epoch 2 was served: an older replay is refused, a newer one renews.
    with pytest.raises(t.StaleEpoch):
        reader.renew(addr, HOLD, 1)
    with pytest.raises(t.StaleEpoch):
        reader.pull_async(addr, HOLD, 0, dest_blocks(rid)).result()
    assert reader.renew(addr, HOLD, 3)["epoch"] == 3


@pytest.mark.parametrize("holder_process", [0.5], indirect=True)
def test_a_hold_expires_without_pulls(holder_process):
    addr, _, _ = holder_process
    reader = t.Reader()
    assert reader.stat(addr, HOLD)["expires_in_s"] <= 0.5
    time.sleep(1.0)
    assert reader.stat(addr, HOLD) is None
    dest = bytearray(BLOCKS * BLOCK)
    rid = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest))
    with pytest.raises(t.HoldNotFound):
        reader.pull(addr, HOLD, 0, dest_blocks(rid))


def test_errors_are_exceptions(holder_process):
    addr, _, proc = holder_process
    reader = t.Reader()
    dest = bytearray(BLOCKS * BLOCK)
    rid = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest))
    # Wrong geometry: refused before any byte moves.
    with pytest.raises(t.TransferError, match="size mismatch"):
        reader.pull(addr, HOLD, 0, dest_blocks(rid)[:-1])
    with pytest.raises(t.TransferError, match="outside the region"):
        reader.pull(addr, HOLD, 0, [(rid, 1, BLOCKS * BLOCK)])
    with pytest.raises(ValueError):
        t.Reader(backend="carrier-pigeon")
    # The wheel tests/run builds has the mooncake feature but not the ucx one.
    with pytest.raises(t.TransferError, match="not built in"):
        t.Reader(backend="ucx")
    # The holder dies: the next call says so, it does not hang.
    proc.kill()
    proc.wait()
    started = time.monotonic()
    with pytest.raises(t.Unreachable):
        reader.pull(addr, HOLD, 0, dest_blocks(rid), timeout_s=5.0)
    assert time.monotonic() - started < 5.0


def test_in_process_holder_counts_and_frees():
    holder = t.Holder(retain_s=60.0, release="after_pull", budget_bytes=3 * BLOCK)
    src = ctypes.create_string_buffer(b"\x5a" * (4 * BLOCK), 4 * BLOCK)
    rid = holder.register_region(ctypes.addressof(src), len(src))
    holder.create_hold(tid("a"), [(rid, 0, BLOCK), (rid, BLOCK, BLOCK)])
    holder.create_hold(tid("b"), [(rid, 2 * BLOCK, 2 * BLOCK)])  # evicts "a"
    assert holder.freed() == [tid("a")]
    reader = t.Reader()
    dest = bytearray(2 * BLOCK)
    did = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest))
    reader.pull(holder.ctrl_addr, tid("b"), 0, [(did, 0, 2 * BLOCK)])
    assert dest == b"\x5a" * (2 * BLOCK)
    stats = holder.stats()
    assert (stats["evictions"], stats["pulls"], stats["releases"], stats["holds"]) == (1, 1, 1, 0)
    assert holder.freed() == [tid("b")]
    holder.create_hold(tid("c"), [(rid, 0, 1)])
    with pytest.raises(t.TransferError, match="exists already"):
        holder.create_hold(tid("c"), [(rid, 0, 1)])
    holder.close()
    holder.close()
    with pytest.raises(t.TransferError, match="closed"):
        holder.stats()


def test_a_secret_guards_the_holder(monkeypatch):
    holder = t.Holder(secret="s3cret")
    src = ctypes.create_string_buffer(b"\x33" * BLOCK, BLOCK)
    rid = holder.register_region(ctypes.addressof(src), len(src))
    holder.create_hold(tid("s"), [(rid, 0, BLOCK)])
    # No secret ("" overrides the environment), or a wrong one: refused, clearly.
    for secret in ("", "guess"):
        reader = t.Reader(secret=secret)
        with pytest.raises(t.Unauthorized, match="CONNEX_TRANSFER_SECRET"):
            reader.stats(holder.ctrl_addr)
        dest = bytearray(BLOCK)
        did = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), BLOCK)
        with pytest.raises(t.Unauthorized, match="handshake failed"):
            reader.pull(holder.ctrl_addr, tid("s"), 0, [(did, 0, BLOCK)], timeout_s=5.0)
    # The secret given, or taken from the environment when not given.
    monkeypatch.setenv("CONNEX_TRANSFER_SECRET", "s3cret")
    for reader in (t.Reader(secret="s3cret"), t.Reader()):
        dest = bytearray(BLOCK)
        did = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), BLOCK)
        reader.pull(holder.ctrl_addr, tid("s"), 0, [(did, 0, BLOCK)])
        assert dest == b"\x33" * BLOCK
    assert holder.stats()["pulls"] == 2
    holder.close()


def test_transfer_ids_are_random_and_guessable_ones_are_refused():
    ids = {t.new_transfer_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"cx-[0-9a-f]{32}", i) for i in ids)
    holder = t.Holder()
    src = ctypes.create_string_buffer(BLOCK)
    rid = holder.register_region(ctypes.addressof(src), len(src))
    # What the vLLM connector made before: 32 random bits.
    for weak in ("engine-0-7-1a2b3c4d", "req-42", "0" * 32):
        with pytest.raises(t.TransferError, match="128 bits|random"):
            holder.create_hold(weak, [(rid, 0, BLOCK)])
    hold = t.new_transfer_id()
    holder.create_hold(hold, [(rid, 0, BLOCK)])
    holder.close()


def test_an_epoch_past_the_bound_is_refused():
    holder = t.Holder(max_epoch=4)
    src = ctypes.create_string_buffer(BLOCK)
    rid = holder.register_region(ctypes.addressof(src), len(src))
    hold = t.new_transfer_id()
    holder.create_hold(hold, [(rid, 0, BLOCK)])
    reader = t.Reader()
    # A subclass of StaleEpoch: the connector treats the hold as gone.
    with pytest.raises(t.EpochOutOfRange):
        reader.renew(holder.ctrl_addr, hold, 2**32 - 1)
    assert issubclass(t.EpochOutOfRange, t.StaleEpoch)
    assert reader.renew(holder.ctrl_addr, hold, 4)["epoch"] == 4
    holder.close()


def test_a_fake_holder_never_learns_the_secret():
    """A listener posing as a holder records what a reader with the secret
    sends it: a nonce, never the secret nor the transfer id."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()

    def fake() -> None:
        conn, _ = listener.accept()
        conn.settimeout(1.5)
        try:
            while chunk := conn.recv(4096):
                seen.extend(chunk)
        except OSError:
            pass
        conn.close()

    thread = threading.Thread(target=fake)
    thread.start()
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    reader = t.Reader()
    dest = bytearray(BLOCK)
    did = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), BLOCK)
    hold = t.new_transfer_id()
    with pytest.raises(t.TransferError):
        reader.pull(addr, hold, 0, [(did, 0, BLOCK)], timeout_s=1.0)
    thread.join()
    listener.close()
    assert seen, "the reader did connect"
    assert SECRET.encode() not in seen
    assert hold.encode() not in seen


def test_bad_epochs_and_timeouts_are_value_errors():
    """What a decoder may be handed in kv_transfer_params: a ValueError the
    connector can turn into a failed load, never an OverflowError."""
    holder = t.Holder()
    src = ctypes.create_string_buffer(BLOCK)
    rid = holder.register_region(ctypes.addressof(src), len(src))
    hold = t.new_transfer_id()
    holder.create_hold(hold, [(rid, 0, BLOCK)])
    reader = t.Reader()
    dest = bytearray(BLOCK)
    did = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), BLOCK)
    blocks = [(did, 0, BLOCK)]
    for epoch in (2**32, -1, 2**64, "1", 1.5):
        with pytest.raises(ValueError, match="resume epoch"):
            reader.pull(holder.ctrl_addr, hold, epoch, blocks)
        with pytest.raises(ValueError, match="resume epoch"):
            reader.pull_async(holder.ctrl_addr, hold, epoch, blocks)
        with pytest.raises(ValueError, match="resume epoch"):
            reader.renew(holder.ctrl_addr, hold, epoch)
    for timeout_s in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="timeout_s"):
            reader.pull(holder.ctrl_addr, hold, 0, blocks, timeout_s=timeout_s)
    reader.pull(holder.ctrl_addr, hold, 0, blocks)
    assert bytes(dest) == bytes(BLOCK)
    holder.close()


def test_the_tcp_backend_reports_it_cannot_move_device_memory():
    """The connector stages a GPU KV cache through host memory for a backend
    that says so; tcp must always say so (it reads raw host addresses)."""
    holder = t.Holder(backend="tcp", listen="127.0.0.1:0")
    try:
        assert holder.moves_device_memory is False
    finally:
        holder.close()
    assert t.Reader(backend="tcp").moves_device_memory is False


STALLED_MOONCAKE_HOLDER = textwrap.dedent(
    f"""
    import ctypes, sys
    from connex import _transfer as t
    buf = ctypes.create_string_buffer({BLOCKS} * {BLOCK})
    h = t.Holder(backend="mooncake", listen="127.0.0.1:0", stall_after_bytes=0)
    rid = h.register_region(ctypes.addressof(buf), len(buf))
    h.create_hold("{HOLD}", [(rid, b * {BLOCK}, {BLOCK}) for b in range({BLOCKS})])
    print(h.ctrl_addr, flush=True)
    sys.stdin.read()
    """
)


def test_a_failed_mooncake_pull_says_its_reads_may_still_write_until_they_end():
    # Mooncake cannot cancel a read: a pull that gave up on a stalled holder
    # returns with reads queued, and the blocks must not go back to vLLM
    # (the connector asks this before it reports the load failed).
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_MOONCAKE_HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().strip()
        reader = t.Reader(backend="mooncake")
        dest = bytearray(BLOCKS * BLOCK)
        rid = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest))
        with pytest.raises(t.TransferError):
            reader.pull(addr, HOLD, 0, dest_blocks(rid), timeout_s=1.0)
        assert reader.writing_into(dest_blocks(rid))
        assert not reader.writing_into([(rid, 0, 0)])  # an empty range overlaps nothing
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 45
        while reader.writing_into(dest_blocks(rid)):
            assert time.monotonic() < deadline, "the dead holder's reads never ended"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_tcp_pull_writes_nothing_once_it_returns(holder_process):
    addr, _, proc = holder_process
    reader = t.Reader(backend="tcp")
    dest = bytearray(BLOCKS * BLOCK)
    rid = reader.register_region(ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest))
    proc.kill()
    proc.wait()
    with pytest.raises(t.TransferError):
        reader.pull(addr, HOLD, 0, dest_blocks(rid), timeout_s=2.0)
    assert not reader.writing_into(dest_blocks(rid))
