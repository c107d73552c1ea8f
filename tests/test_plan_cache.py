"""CPU: ``paged_attention``'s cache of plans, keyed on stand-ins for CuPy arrays, which need no GPU: what the key
holds, that a cached plan is found under it, and that a call it cannot key (an unhashable scale, arrays of no
framework it reads) goes to the full checks instead of raising from the lookup."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cupy_paged_attn import decode, tuning


class FakeCupyArray:
    """What a signature reads of a CuPy array: dtype, shape, byte strides, itemsize and device."""

    __module__ = "cupy._core.core"  # the key takes the framework from the query's type's top-level module

    def __init__(self, shape: tuple[int, ...], dtype: str, device: int = 0) -> None:
        self.dtype = np.dtype(dtype)
        self.shape = shape
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(s) for s in np.empty(shape, self.dtype).strides)
        self.device = types.SimpleNamespace(id=device)


@pytest.fixture
def operands(monkeypatch):
    monkeypatch.setattr(decode, "_PLANS", decode.threading.local())  # this test's own cache
    cache = FakeCupyArray((8, 16, 2, 64), "float16")
    return decode._operands(FakeCupyArray((3, 4, 64), "float16"), cache, cache, FakeCupyArray((3, 4), "int32"),
                            FakeCupyArray((3,), "int32"), FakeCupyArray((3, 4, 64), "float32"), None)


def test_key_holds_each_operands_signature_and_finds_its_plan(operands):
    key, signatures, plan = decode._plan_key(operands, None, "nhd", operands["attn_bias"])
    assert plan is None and list(signatures) == ["query", "key_cache", "value_cache", "block_tables", "seq_lens",
                                                 "attn_bias"]
    assert signatures["key_cache"] == (np.dtype("float16"), (8, 16, 2, 64), (2048, 128, 64, 1), 0)
    assert tuple(signatures.values()) in key and tuning.current() in key
    cached = object()
    decode._PLANS.plans = {key: cached}
    assert decode._plan_key(operands, None, "nhd", operands["attn_bias"])[2] is cached
    assert decode._plan_key(operands, 0.5, "nhd", operands["attn_bias"])[2] is None  # another scale, another key
    wider = {**operands, "seq_lens": FakeCupyArray((4,), "int32")}
    assert decode._plan_key(wider, None, "nhd", operands["attn_bias"])[2] is None
    with tuning.override(longest_first=False):  # other switches, another key
        assert decode._plan_key(operands, None, "nhd", operands["attn_bias"])[2] is None


@pytest.mark.parametrize("options", [{"logits_soft_cap": 30.0}, {"window_left": 128}, {"window_left": True},
                                     {"logits_soft_cap": 30, "window_left": 128}])
def test_score_options_are_part_of_the_key(operands, options):
    """A soft-cap or a window is in the key, with its type (``window_left=True`` is refused by the checks, so it
    must not find the plan of ``window_left=1``)."""
    key = decode._plan_key(operands, None, "nhd", operands["attn_bias"], options)[0]
    cached = object()
    decode._PLANS.plans = {key: cached}
    assert decode._plan_key(operands, None, "nhd", operands["attn_bias"], dict(options))[2] is cached
    assert decode._plan_key(operands, None, "nhd", operands["attn_bias"])[2] is None
    other = {name: (value + 1 if not isinstance(value, bool) else 1) for name, value in options.items()}
    assert decode._plan_key(operands, None, "nhd", operands["attn_bias"], other)[2] is None


@pytest.mark.parametrize("scale", [np.array(0.125), [0.125]], ids=["ndarray", "list"])
def test_unhashable_scale_is_left_to_the_checks(operands, scale):
    assert decode._plan_key(operands, scale, "nhd", operands["attn_bias"]) is None
    assert decode._plan_key(operands, None, ["nhd"], operands["attn_bias"]) is None


def test_other_frameworks_and_unreadable_operands_are_not_keyed(operands):
    numpy_query = {**operands, "query": np.zeros((3, 4, 64), np.float16)}
    assert decode._plan_key(numpy_query, None, "nhd", None) is None
    not_an_array = {**operands, "block_tables": [[0, 1], [2, 3], [4, 5]]}  # no dtype: the checks name it
    assert decode._plan_key(not_an_array, None, "nhd", operands["attn_bias"]) is None
