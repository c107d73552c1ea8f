"""Property tests (hypothesis): the NumPy path and the GPU kernel against an independent dense attention, on random
shapes, page sizes, ragged lengths (0, 1, page boundaries), GQA ratios, bias kinds and strides, ALiBi and scales.
On failure hypothesis prints the falsifying example and a reproduction blob.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BIAS_KINDS as BIAS_OBJECTS
from helpers import assert_close, dense_attention, make_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import paged_attention_ref, to_numpy

#: Every way a bias arrives: none, dense arrays laid out four ways, ragged, T5 in-kernel.
BIAS_KINDS = ["none", "dense", "broadcast-seq", "broadcast-head", "strided", *BIAS_OBJECTS]


@st.composite
def problems(draw, dtypes=("f32", "f16", "bf16"), head_sizes=(32, 64, 80), long: bool = False):
    block_size = draw(st.sampled_from([1, 2, 8, 16, 32]))
    # Lengths cluster around page boundaries, with empty and one-token sequences; ``long``: also hundreds to
    # thousands of keys (split-K's partitions).
    length = st.one_of(
        st.sampled_from([0, 1, block_size - 1, block_size, block_size + 1, 2 * block_size]),
        st.integers(0, 90), *((st.integers(300, 3000),) if long else ()),
    )
    seq_lens = [max(n, 0) for n in draw(st.lists(length, min_size=1, max_size=4))]
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8, 9]))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_problem(
        np.random.default_rng(seed), seq_lens,
        num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from(head_sizes)), block_size=block_size, dtype=dtype,
        kv_layout=draw(st.sampled_from(["nhd", "vllm", "hnd"])), bias=draw(st.sampled_from(BIAS_KINDS)),
        bias_dtype=draw(st.sampled_from(["f32", dtype])), alibi=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        extra_table_cols=draw(st.integers(0, 2)), spare_blocks=draw(st.integers(0, 3)),
    ), dtype


@settings(max_examples=300, deadline=None, print_blob=True)
@given(problems())
def test_reference_against_dense(case):
    problem, _ = case
    np.testing.assert_allclose(paged_attention_ref(*problem.args(), **problem.kwargs()), dense_attention(problem),
                               atol=1e-10)


@settings(max_examples=100, deadline=None, print_blob=True)
@given(problems())
def test_numpy_path_against_dense(case):
    problem, dtype = case
    out = cpa.paged_attention(*problem.args(), **problem.kwargs())
    assert out.dtype == problem.query.dtype
    assert_close(out, dense_attention(problem), dtype)


#: Tolerance of the GPU property test, per (sequence, head) row: R times the row's largest |value| + A. Relative to the
#: output's magnitude, which an attention over thousands of keys makes small: a key dropped from 700 moves the output
#: by about |v| / 700, which a fixed absolute tolerance of 16-bit size lets pass.
ROW_TOLERANCES = {"f32": (1e-5, 1e-6), "f16": (2e-3, 1e-4), "bf16": (8e-3, 5e-4)}


def assert_close_to_scale(actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    actual = np.asarray(actual, dtype=np.float64)
    assert np.isfinite(actual).all(), "non-finite values in the result"
    r, a = ROW_TOLERANCES[dtype]
    bound = r * np.abs(expected).max(axis=-1, keepdims=True) + a
    bad = np.abs(actual - expected) > bound
    assert not bad.any(), (f"{int(bad.sum())} elements past the row tolerance; worst "
                           f"{float(np.max(np.abs(actual - expected) - bound)):.3g} past it")


@pytest.mark.gpu
@settings(max_examples=150, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems(dtypes=("f32", "f16", "bf16"), head_sizes=(64, 128), long=True), st.integers(0, 2**32 - 1))
def test_gpu_kernel_against_reference(case, seed):
    """Both decode kernels and split-K (thousands of keys), every bias kind, -inf in a dense bias, against the
    reference, each row to a tolerance of its own magnitude."""
    import cupy
    from test_decode_gpu import device_args, to_cupy

    problem, dtype = case
    bias = problem.attn_bias
    if isinstance(bias, np.ndarray) and bias.flags.writeable:  # -inf masks some keys (a whole row: zeros)
        masked = np.random.default_rng(seed).random(bias.shape) < 0.1
        bias[masked] = -np.inf
    args, kwargs = device_args(problem, to_cupy)
    out = cupy.full(problem.query.shape, np.nan, dtype=problem.query.dtype)
    cpa.paged_attention(*args, **kwargs, out=out)
    assert_close_to_scale(to_numpy(out), paged_attention_ref(*problem.args(), **problem.kwargs()), dtype)


def test_row_tolerance_catches_one_dropped_key():
    """The GPU property test's tolerance fails an answer that leaves out one key of 700 (bfloat16), where the fixed
    16-bit tolerance passes it. On one fixed problem: how far the last key moves the output depends on its weight
    (over random draws the row tolerance catches it in about 97 % of them; this one: 4.4 times the tolerance, and
    half the fixed one)."""
    problem = make_problem(np.random.default_rng(1), [700], num_heads=4, num_kv_heads=4, head_size=64, dtype="bf16")
    expected = paged_attention_ref(*problem.args(), **problem.kwargs())
    short = problem.seq_lens.copy()
    short[0] = 699
    dropped = paged_attention_ref(problem.query, problem.key_cache, problem.value_cache, problem.block_tables, short,
                                  **problem.kwargs())
    assert_close(dropped.astype(np.float64), expected, "bf16")  # passes the fixed tolerance
    with pytest.raises(AssertionError, match="past the row tolerance"):
        assert_close_to_scale(dropped, expected, "bf16")
