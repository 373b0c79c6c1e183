"""kv_transfer_params as a decoder reads them: a valid hold round-trips, and any
other value is a ParamsError with a clear message, never another exception (a
client writes these params; an exception here would crash the engine)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from connex.adapters.vllm.params import (
    MAX_EPOCH,
    Layout,
    ParamsError,
    ctrl_for_rank,
    hold_params,
    remote_hold,
    wants_hold,
)
from hypothesis import given, settings
from hypothesis import strategies as st

LAYOUT = Layout(tp_size=2, block_size=32, num_layers=2, page_bytes=8192)


def valid(**changes) -> dict:
    params = hold_params(
        transfer_id="prefill-1-abcd",
        remote_ctrl="10.0.0.5:14579",
        engine_id="prefill",
        block_ids=[7, 8, 9],
        num_tokens=70,
        backend="tcp",
        lease_s=30.0,
        layout=LAYOUT,
    )
    params.update(changes)
    return params


def test_a_hold_round_trips_through_json():
    hold = remote_hold(json.loads(json.dumps(valid(resume_epoch=3))))
    assert hold is not None
    assert (hold.transfer_id, hold.block_ids, hold.num_tokens) == ("prefill-1-abcd", [7, 8, 9], 70)
    assert (hold.epoch, hold.lease_s, hold.layout) == (3, 30.0, LAYOUT)
    assert hold.all_ctrls() == ["10.0.0.5:14579", "10.0.0.5:14580"]


def test_params_without_a_hold_are_not_a_hold():
    assert remote_hold(None) is None
    assert remote_hold({}) is None
    assert remote_hold({"do_remote_decode": True}) is None
    assert remote_hold({"do_remote_prefill": False, "transfer_id": 5}) is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"remote_ctrl": "10.0.0.5:http"}, "remote_ctrl must be host:port"),
        ({"remote_ctrl": "10.0.0.5:70000"}, "port out of range"),
        ({"remote_ctrl": "10.0.0.5:65535"}, "port out of range"),  # rank 1 would be 65536
        ({"remote_ctrl": "10.0.0.5:0"}, "port out of range"),
        ({"remote_ctrl": ":14579"}, "host:port"),
        ({"remote_ctrl": 14579}, "host:port string"),
        ({"resume_epoch": 2**32}, "resume_epoch must be in 0..4294967295"),
        ({"resume_epoch": -1}, "resume_epoch must be in"),
        ({"resume_epoch": 1.0}, "resume_epoch must be an integer"),
        ({"resume_epoch": "1"}, "resume_epoch must be an integer"),
        ({"resume_epoch": True}, "resume_epoch must be an integer"),
        ({"lease_s": math.inf}, "lease_s must be in"),
        ({"lease_s": math.nan}, "lease_s must be in"),
        ({"lease_s": 10**400}, "lease_s must be in"),
        ({"lease_s": 0}, "lease_s must be in"),
        ({"lease_s": "30"}, "lease_s must be a number"),
        ({"remote_block_ids": [1, "2"]}, "remote_block_ids[] must be an integer"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids[] must be in"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids must be a list"),
        ({"remote_block_ids": list(range(70_000))}, "at most 65536"),
        ({"remote_num_tokens": -1}, "remote_num_tokens must be in 0.."),
        ({"remote_num_tokens": 2**40}, "remote_num_tokens must be in 0.."),
        ({"transfer_id": "has space"}, "transfer_id must be"),
        ({"transfer_id": "x" * 257}, "transfer_id must be"),
        ({"transfer_id": ""}, "transfer_id must be"),
        ({"tp_size": 0}, "tp_size must be in"),
        ({"block_size": None}, "block_size must be an integer"),
        ({"page_bytes": 2**60}, "page_bytes must be in"),
        ({"backend": "rdma"}, "backend must be one of"),
        ({"remote_engine_id": ["x"]}, "remote_engine_id must be a string"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill must be true or false"),
        ({"kv_groups": 0}, "kv_groups must be in 1.."),
        ({"kv_groups": 65}, "kv_groups must be in 1.."),
        ({"kv_groups": "2"}, "kv_groups must be an integer"),
        ({"kv_groups": 2}, "3 block ids for 2 KV cache groups"),
    ],
)
def test_each_bad_field_is_named_in_a_params_error(changes, message):
    with pytest.raises(ParamsError) as err:
        remote_hold(valid(**changes))
    assert message in str(err.value)


def test_missing_keys_and_non_objects_are_params_errors():
    params = valid()
    del params["remote_ctrl"]
    with pytest.raises(ParamsError, match="lack 'remote_ctrl'"):
        remote_hold(params)
    with pytest.raises(ParamsError, match="must be an object"):
        remote_hold([1, 2])


def test_a_huge_integer_does_not_break_the_error_message():
    with pytest.raises(ParamsError, match="too large to show"):
        remote_hold(valid(resume_epoch=10**5000))


def test_only_a_true_do_remote_decode_asks_for_a_hold():
    assert wants_hold({"do_remote_decode": True})
    assert not wants_hold({"do_remote_decode": "false"})
    assert not wants_hold(["do_remote_decode"])
    assert not wants_hold(None)


def test_ctrl_for_rank_checks_every_rank_port():
    assert ctrl_for_rank("[::1]:9000", 3) == "[::1]:9003"
    with pytest.raises(ParamsError):
        ctrl_for_rank("h:65535", 1)


# JSON values, including the non-standard NaN/Infinity Python's json accepts.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)
keys = st.sampled_from(sorted(valid()) + ["other"])


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, json_values) | json_values)
def test_arbitrary_params_give_a_hold_or_a_params_error(params):
    try:
        hold = remote_hold(params)
    except ParamsError:
        return
    if hold is not None:
        assert 0 <= hold.epoch <= MAX_EPOCH
        assert math.isfinite(hold.lease_s) and hold.lease_s > 0
        assert hold.all_ctrls()


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, json_values), st.data())
def test_a_valid_hold_with_one_field_replaced_never_raises_anything_else(replaced, data):
    params = valid(**replaced)
    try:
        hold = remote_hold(params)
    except ParamsError:
        return
    if hold is None:
        assert params["do_remote_prefill"] in (None, False)
        return
    # Whatever was accepted is usable as is: every rank's address, the epoch.
    rank = data.draw(st.integers(min_value=0, max_value=hold.layout.tp_size - 1))
    host, _, port = hold.ctrl_for_rank(rank).rpartition(":")
    assert host and 0 < int(port) < 65536


def test_a_kv_dtype_mismatch_is_named_and_an_unknown_one_is_not_compared():
    """float16 and bfloat16 caches have the same page bytes: only the dtype
    tells them apart (a prefill of an older Connex sends none)."""
    bf16 = dataclasses.replace(LAYOUT, dtype="bfloat16")
    hold = remote_hold(valid(kv_dtype="float16"))
    assert hold is not None and hold.layout.dtype == "float16"
    error = bf16.mismatch(hold.layout)
    assert error is not None and "dtype prefill=float16 decode=bfloat16" in error
    old = remote_hold({k: v for k, v in valid().items() if k != "kv_dtype"})
    assert old is not None and bf16.mismatch(old.layout) is None
    assert bf16.mismatch(dataclasses.replace(LAYOUT, dtype="bfloat16")) is None
    with pytest.raises(ParamsError, match="kv_dtype"):
        remote_hold(valid(kv_dtype=16))


def test_a_compat_mismatch_is_named_and_a_name_one_side_lacks_is_not_compared():
    """Equal page bytes and dtype, other attention layout: the fingerprint
    names what differs; a prefill of an older Connex sends none."""
    mine = dataclasses.replace(
        LAYOUT, compat=(("attn_backend", "auto"), ("kv_cache_layout", "NHD"), ("vllm", "0.32.0"))
    )
    hold = remote_hold(valid(compat={"kv_cache_layout": "HND", "vllm": "0.32.0"}))
    assert hold is not None
    error = mine.mismatch(hold.layout)
    assert error is not None and "kv_cache_layout prefill=HND decode=NHD" in error
    assert "vllm" not in error.split("(")[1].split(")")[0]
    assert mine.mismatch(remote_hold(valid(compat={"vllm": "0.32.0"})).layout) is None
    old = remote_hold({k: v for k, v in valid().items() if k != "compat"})
    assert old is not None and mine.mismatch(old.layout) is None


@pytest.mark.parametrize(
    "compat",
    [[], "NHD", {"kv_cache_layout": 1}, {"color": "red"}, {"model": "m" * 300}],
)
def test_a_compat_that_is_not_a_fingerprint_is_refused(compat):
    with pytest.raises(ParamsError, match="compat"):
        remote_hold(valid(compat=compat))


def test_kv_cache_groups_round_trip_and_a_prefill_without_them_had_one():
    """A hold of a hybrid model carries each group's blocks, one group after
    another; a decoder that groups otherwise names the difference, and a
    prefill of an older Connex (no `kv_groups`) had one group."""
    two = dataclasses.replace(LAYOUT, kv_groups=2)
    hold = remote_hold(valid(kv_groups=2, remote_block_ids=[7, 8, 0, 9]))
    assert hold is not None and hold.layout == two and hold.block_ids == [7, 8, 0, 9]
    assert two.mismatch(hold.layout) is None
    error = LAYOUT.mismatch(hold.layout)
    assert error is not None and "kv_groups prefill=2 decode=1" in error
    old = remote_hold({k: v for k, v in valid().items() if k != "kv_groups"})
    assert old is not None and old.layout.kv_groups == 1


def test_another_tp_size_is_read_when_the_sizes_divide_and_split_the_same_heads():
    """A TP 1 prefill's page holds all the heads, a TP 2 decoder's half: read by
    runs of heads. Sizes that do not divide, or pages that do not split the
    same heads, stay a named mismatch."""
    one = Layout(tp_size=1, block_size=32, num_layers=2, page_bytes=8192)
    one = dataclasses.replace(one, compat=(("kv_heads", "4"),))
    two = dataclasses.replace(one, tp_size=2, page_bytes=4096, compat=(("kv_heads", "2"),))
    assert two.mismatch(one) is None and one.mismatch(two) is None
    three = dataclasses.replace(two, tp_size=3)
    error = three.mismatch(one)
    assert error is not None and "tp_size prefill=1 decode=3" in error
    error = dataclasses.replace(two, page_bytes=8192).mismatch(one)
    assert error is not None and "tp_size prefill=1 decode=2" in error
    wrong_heads = dataclasses.replace(two, compat=(("kv_heads", "4"),))
    assert wrong_heads.mismatch(one) is not None


def test_a_kv_heads_entry_that_is_no_number_is_a_mismatch_not_an_error():
    one = Layout(
        tp_size=1, block_size=32, num_layers=2, page_bytes=8192, compat=(("kv_heads", "4"),)
    )
    hold = remote_hold(valid(tp_size=2, page_bytes=4096, compat={"kv_heads": "two"}))
    assert hold is not None
    error = one.mismatch(hold.layout)
    assert error is not None and "tp_size prefill=2 decode=1" in error
