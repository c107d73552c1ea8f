"""CPU: the prefill reference against an independent dense attention, its agreement with the decode reference at
q_len = 1, and the NumPy path of ``paged_prefill_attention``."""

from __future__ import annotations

import numpy as np
import pytest
from prefill_helpers import DENSE_KINDS, T5_KINDS, dense_prefill_attention, make_prefill_problem

import cupy_paged_attn as cpa
from cupy_paged_attn.prefill import paged_prefill_attention
from cupy_paged_attn.reference import paged_attention_ref, paged_prefill_attention_ref

SEQS = [(30, 30), (45, 7), (1, 1), (0, 0), (20, 0), (70, 64)]  # full, chunked, single, empty, no queries


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("bias", ["none", *DENSE_KINDS, *T5_KINDS])
def test_reference_matches_dense_attention(rng, bias, causal):
    p = make_prefill_problem(rng, SEQS, num_heads=8, num_kv_heads=2, head_size=32, block_size=8, bias=bias,
                             alibi=bias == "dense", causal=causal)
    np.testing.assert_allclose(paged_prefill_attention_ref(*p.args(), **p.kwargs()), dense_prefill_attention(p),
                               atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_vllm_layout_and_dtypes(rng, layout):
    for dtype in ("bf16", "f16"):
        p = make_prefill_problem(rng, SEQS, dtype=dtype, kv_layout=layout, bias="t5-bidir", causal=False)
        np.testing.assert_allclose(paged_prefill_attention_ref(*p.args(), **p.kwargs()),
                                   dense_prefill_attention(p), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("bias", ["dense", "t5-causal", "none"])
def test_single_query_rows_equal_decode(rng, bias):
    p = make_prefill_problem(rng, [(17, 1), (1, 1), (40, 1)], num_heads=4, num_kv_heads=1, bias=bias, alibi=True)
    decode_bias = p.attn_bias
    if bias == "dense":
        decode_bias = p.attn_bias[:, :, 0, :]
    got = paged_prefill_attention_ref(*p.args(), **p.kwargs())
    want = paged_attention_ref(*p.args()[:5], scale=p.scale, attn_bias=decode_bias, alibi_slopes=p.alibi_slopes)
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=1e-10)


def test_causal_first_row_sees_its_prefix_only(rng):
    """Chunked prefill: row 0 of a 3-row chunk of a 10-key sequence sees keys 0..7."""
    p = make_prefill_problem(rng, [(10, 3)], num_heads=2, num_kv_heads=2)
    full = paged_prefill_attention_ref(*p.args(), **p.kwargs())
    short = make_prefill_problem(rng, [(8, 1)], num_heads=2, num_kv_heads=2)
    short.key_cache, short.value_cache, short.block_tables = p.key_cache, p.value_cache, p.block_tables
    short.query = p.query[:1]
    short.seq_lens = np.array([8], np.int32)
    np.testing.assert_allclose(full[:1], paged_prefill_attention_ref(*short.args(), **short.kwargs()), atol=1e-12)


def test_all_masked_rows_are_zeros(rng):
    p = make_prefill_problem(rng, [(12, 4)], num_heads=2, num_kv_heads=1, bias="dense")
    p.attn_bias[0, 1, 2, :] = -np.inf
    out = paged_prefill_attention_ref(*p.args(), **p.kwargs())
    assert (out[2, 1] == 0).all() and np.isfinite(out).all()


def test_numpy_path_returns_query_dtype_and_writes_out(rng):
    p = make_prefill_problem(rng, SEQS, dtype="bf16", bias="t5-causal")
    got = paged_prefill_attention(*p.args(), **p.kwargs())
    assert got.dtype == p.query.dtype and got.shape == p.query.shape
    out = np.full(p.query.shape, np.nan, np.float32)
    p32 = make_prefill_problem(rng, SEQS)
    assert paged_prefill_attention(*p32.args(), **p32.kwargs(), out=out) is out
    assert np.isfinite(out).all()


def test_t5_encoder_bias_is_bidirectional(rng):
    """Non-causal with a bidirectional table: keys after the query use the upper buckets."""
    p = make_prefill_problem(rng, [(9, 9)], num_heads=2, num_kv_heads=2, bias="t5-bidir", causal=False)
    assert isinstance(p.attn_bias, cpa.RelativePositionBias) and p.attn_bias.bidirectional
    np.testing.assert_allclose(paged_prefill_attention_ref(*p.args(), **p.kwargs()), dense_prefill_attention(p),
                               atol=1e-12)
