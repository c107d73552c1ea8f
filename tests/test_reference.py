"""CPU: the float64 reference (and the NumPy path of the public API) against an independent dense attention."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import BIAS_KINDS as BIAS_OBJECTS
from helpers import DTYPES, assert_close, dense_attention, make_problem

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import paged_attention_ref, reshape_and_cache_ref

SEQ_LENS = [1, 15, 17, 0, 33, 64]
GQA = [(4, 4), (4, 1), (8, 2)]  # (num_heads, num_kv_heads): ratios 1, 4, 4 and MQA
BIAS_KINDS = ["none", "dense", "broadcast-seq", "broadcast-head", "strided"]
LAYOUTS = ["nhd", "vllm"]


@pytest.mark.parametrize(("heads", "bias", "layout"), list(itertools.product(GQA, BIAS_KINDS, LAYOUTS)))
def test_reference_matches_dense(rng, heads, bias, layout):
    p = make_problem(rng, SEQ_LENS, num_heads=heads[0], num_kv_heads=heads[1], bias=bias, kv_layout=layout,
                     alibi=bias == "dense")
    np.testing.assert_allclose(paged_attention_ref(*p.args(), **p.kwargs()), dense_attention(p), atol=1e-12)


@pytest.mark.parametrize("kind", BIAS_OBJECTS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_bias_kinds_match_dense(rng, kind, dtype):
    """RaggedBias (NaN in the gaps between sequences) and RelativePositionBias, through the public NumPy path, vs
    the independent dense attention with the bias materialised by the test helpers."""
    p = make_problem(rng, SEQ_LENS, num_heads=4, num_kv_heads=2, dtype=dtype, bias=kind, bias_dtype=dtype,
                     alibi=True)
    expected = dense_attention(p)
    np.testing.assert_allclose(paged_attention_ref(*p.args(), **p.kwargs()), expected, atol=1e-12)
    assert_close(cpa.paged_attention(*p.args(), **p.kwargs()), expected, dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_reference_dtypes_and_blocks(rng, dtype, block_size):
    p = make_problem(rng, [1, block_size, block_size + 1, 3 * block_size], block_size=block_size, dtype=dtype,
                     bias="dense", bias_dtype=dtype, scale=0.7)
    np.testing.assert_allclose(paged_attention_ref(*p.args(), **p.kwargs()), dense_attention(p), atol=1e-12)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_numpy_path_returns_query_dtype(rng, dtype):
    p = make_problem(rng, [5, 20], dtype=dtype, bias="dense")
    out = cpa.paged_attention(*p.args(), **p.kwargs())
    assert out.dtype == np.dtype(DTYPES[dtype]) and out.shape == p.query.shape
    assert_close(out, dense_attention(p), dtype)


def test_numpy_path_writes_out(rng):
    p = make_problem(rng, [5, 20, 0], bias="dense")
    out = np.full(p.query.shape, np.nan, dtype=p.query.dtype)
    result = cpa.paged_attention(*p.args(), **p.kwargs(), out=out)
    assert result is out
    assert_close(out, dense_attention(p), "f32")
    assert (out[2] == 0).all(), "an empty sequence gives zeros"


def test_masked_keys_and_fully_masked_row(rng):
    """A -inf bias removes a key; a head whose keys are all masked gets zeros, not NaN."""
    p = make_problem(rng, [6, 6], bias="dense")
    p.attn_bias[0, :, :3] = -np.inf  # sequence 0: keys 0..2 masked for every head
    p.attn_bias[1, 1, :6] = -np.inf  # sequence 1, head 1: every key masked
    out = paged_attention_ref(*p.args(), **p.kwargs())
    # Sequence 0 equals attention over its keys 3..5 alone (alibi-free, so positions do not matter).
    tail = make_problem(rng, [3])
    tail.query, tail.attn_bias = p.query[:1], p.attn_bias[:1, :, 3:6]
    tail.dense_k, tail.dense_v = [p.dense_k[0][3:]], [p.dense_v[0][3:]]
    np.testing.assert_allclose(out[0], dense_attention(tail)[0], atol=1e-12)
    assert (out[1, 1] == 0).all() and np.isfinite(out).all()


def test_default_scale_is_inverse_sqrt_head_size(rng):
    p = make_problem(rng, [9], head_size=128)
    explicit = paged_attention_ref(*p.args(), **{**p.kwargs(), "scale": 128**-0.5})
    np.testing.assert_allclose(paged_attention_ref(*p.args(), **p.kwargs()), explicit, atol=1e-12)


def test_alibi_matches_definition(rng):
    """alibi_slopes[h] * (j - len + 1) equals the same values passed as a dense bias."""
    p = make_problem(rng, [7, 30], alibi=True)
    n = 30
    as_bias = p.alibi_slopes[None, :, None] * (np.arange(n)[None, None, :] - p.seq_lens[:, None, None] + 1)
    with_alibi = paged_attention_ref(*p.args(), **p.kwargs())
    with_bias = paged_attention_ref(*p.args(), **{**p.kwargs(), "alibi_slopes": None,
                                                  "attn_bias": as_bias.astype(np.float32)})
    np.testing.assert_allclose(with_alibi, with_bias, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_reshape_and_cache_round_trip(rng, layout, slot_dtype):
    """Tokens written with reshape_and_cache into a NaN cache decode to the dense attention."""
    p = make_problem(rng, [5, 17, 16], kv_layout=layout, num_heads=4, num_kv_heads=2)
    k_cache = np.full_like(p.key_cache, np.nan)
    v_cache = np.full_like(p.value_cache, np.nan)
    bs = 16
    keys, values, slots = [], [], []
    for s, n in enumerate(p.seq_lens):
        keys.append(p.dense_k[s])
        values.append(p.dense_v[s])
        slots.extend(int(p.block_tables[s, j // bs]) * bs + j % bs for j in range(n))
    slots_arr = np.asarray([*slots, -1], dtype=slot_dtype)  # a padding token with slot -1 is skipped
    key = np.concatenate([*keys, keys[0][:1]])
    value = np.concatenate([*values, values[0][:1]])
    result = cpa.reshape_and_cache(key, value, k_cache, v_cache, slots_arr, kv_layout=layout)
    assert result[0] is k_cache and result[1] is v_cache
    p.key_cache, p.value_cache = k_cache, v_cache
    np.testing.assert_allclose(paged_attention_ref(*p.args(), **p.kwargs()), dense_attention(p), atol=1e-12)


def test_reshape_and_cache_vllm_layout_positions(rng):
    """Element (token t, head h, dim d) lands where vLLM's layout puts it."""
    key = rng.standard_normal((1, 2, 32)).astype(np.float16)
    value = rng.standard_normal((1, 2, 32)).astype(np.float16)
    k_cache = np.zeros((3, 2, 4, 8, 8), np.float16)  # [N, Hkv, D/x, B, x], x = 8
    v_cache = np.zeros((3, 2, 32, 8), np.float16)  # [N, Hkv, D, B]
    reshape_and_cache_ref(key, value, k_cache, v_cache, np.array([2 * 8 + 5]), kv_layout="vllm")
    for h, d in itertools.product(range(2), range(32)):
        assert k_cache[2, h, d // 8, 5, d % 8] == key[0, h, d]
        assert v_cache[2, h, d, 5] == value[0, h, d]
