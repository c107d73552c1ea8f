"""GPU: Gemma 2's logit soft-cap and the sliding window in every kernel (the SIMT and tensor-core decode, the
mma.sync, Hopper and float32 prefill) against the float64 reference, with every bias kind, ALiBi, GQA, the three
layouts, split-K (also combined in clusters), chunked prefill, ``DecodePlan``, the repeated-call plan cache and CUDA
graphs. (fp8 caches: test_fp8_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, dense_attention, make_problem
from prefill_helpers import make_prefill_problem
from test_decode_gpu import device_args, to_cupy, to_torch
from test_prefill_gpu import device_kwargs

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import paged_attention_ref, paged_prefill_attention_ref, to_numpy

pytestmark = pytest.mark.gpu

# Lengths past a few partitions (split-K), page boundaries, one key, none; windows from 0 to past every length.
SEQ_LENS = [1, 15, 17, 0, 513, 700, 1300]
PREFILL_SEQS = [(300, 300), (77, 7), (64, 64), (1, 1), (0, 0), (513, 0), (40, 1), (900, 64)]

DECODE_GRID = [  # (kernel, dtype, head_size, block_size, (num_heads, num_kv_heads), layout, bias, alibi, cap, window)
    ("tensor-cores", "bf16", 128, 16, (32, 8), "nhd", "dense", False, 2.0, None),
    ("tensor-cores", "f16", 64, 16, (16, 16), "hnd", "none", True, None, 100),
    ("tensor-cores", "bf16", 128, 32, (8, 2), "vllm", "t5-causal", False, 30.0, 600),
    ("tensor-cores", "f16", 96, 8, (6, 2), "nhd", "ragged", True, 2.0, 5),
    ("tensor-cores", "bf16", 64, 16, (8, 1), "nhd", "t5-wide", False, None, 0),
    ("tensor-cores", "f16", 128, 16, (40, 2), "hnd", "dense", True, 50.0, 1000),
    ("simt", "bf16", 128, 16, (32, 8), "nhd", "dense", True, 2.0, 64),
    ("simt", "f16", 64, 16, (16, 16), "hnd", "t5-bidir", False, 5.0, 129),
    ("simt", "bf16", 80, 8, (8, 2), "vllm", "ragged-strided", True, None, 300),
    ("simt", "bf16", 256, 16, (4, 4), "nhd", "dense", False, 2.0, 37),
    ("simt", "f32", 64, 32, (8, 2), "nhd", "dense", True, 2.0, 17),
    ("simt", "f32", 128, 16, (4, 1), "hnd", "t5-causal", False, 0.5, 0),
]


@pytest.fixture(params=["single-pass", "split-k", "split-k-cluster"])
def decode_path(request: pytest.FixtureRequest, tune) -> str:
    """The decode paths: one partition (a 1-SM GPU), split-K combined by the combine kernel, and split-K combined in
    thread block clusters (where the device launches them)."""
    tune(num_sms=1 if request.param == "single-pass" else 10**6, cluster_combine=request.param == "split-k-cluster")
    return request.param


def run_decode(p, **options):
    import cupy

    args, kwargs = device_args(p, to_cupy)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)  # poisoned: every row must be written
    result = cpa.paged_attention(*args, **kwargs, **options, out=out)
    assert result is out
    cupy.cuda.get_current_stream().synchronize()
    return to_numpy(result)


@pytest.mark.parametrize(("kernel", "dtype", "head_size", "block_size", "heads", "layout", "bias", "alibi", "cap",
                          "window"), DECODE_GRID,
                         ids=[f"{k}-{d}-d{h}-b{b}-{q}of{kv}-{lay}-{bias}-cap{c}-w{w}"
                              for k, d, h, b, (q, kv), lay, bias, _, c, w in DECODE_GRID])
def test_decode_soft_cap_and_window(rng, decode_path, tune, kernel, dtype, head_size, block_size, heads, layout, bias,
                                    alibi, cap, window):
    tune(decode_kernel=kernel)
    p = make_problem(rng, SEQ_LENS, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                     block_size=block_size, dtype=dtype, kv_layout=layout, bias=bias, bias_dtype=dtype, alibi=alibi,
                     scale=1.0 if cap is not None and cap < 3 else None)
    options = {"logits_soft_cap": cap, "window_left": window}
    expected = paged_attention_ref(*p.args(), **p.kwargs(), **options)
    assert_close(run_decode(p, **options), expected, dtype, f"{kernel} {decode_path} cap={cap} window={window}")


def test_decode_window_reads_no_page_before_it(rng, decode_path):
    """The pages wholly before a sequence's window are never read: NaN there changes nothing."""
    p = make_problem(rng, [700, 1300, 40], num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16")
    window = 100
    for s, n in enumerate(p.seq_lens):
        first_page = max(0, int(n) - 1 - window) // 16
        # Every page before the one holding the window's first key, less one (a kernel's first tile may start on
        # an earlier multiple of its tile), is poisoned.
        for blk in p.block_tables[s, : max(0, first_page - 8)]:
            p.key_cache[blk] = np.nan
            p.value_cache[blk] = np.nan
    expected = dense_attention(p, window_left=window)  # from the dense K/V: the poisoned pages are not there
    assert_close(run_decode(p, window_left=window), expected, "bf16", decode_path)


PREFILL_GRID = [  # (tiling, dtype, head_size, (num_heads, num_kv_heads), layout, bias, alibi, causal, cap, window)
    ("wgmma", "bf16", 128, (8, 2), "nhd", "none", False, True, 2.0, 50),
    ("wgmma", "f16", 64, (4, 4), "hnd", "t5-causal", True, True, None, 200),
    ("wgmma", "bf16", 64, (16, 2), "vllm", "t5-bidir", False, False, 30.0, 3),
    ("mma-sync", "bf16", 128, (8, 2), "nhd", "dense", True, True, 2.0, 0),
    ("mma-sync", "f16", 64, (4, 4), "hnd", "broadcast-rows", False, False, 5.0, 77),
    ("mma-sync", "bf16", 96, (6, 2), "nhd", "t5-short", False, True, None, 129),
    ("mma-sync", "f16", 256, (4, 1), "vllm", "strided", True, True, 2.0, 300),
    ("mma-sync", "bf16", 128, (16, 16), "nhd", "none", False, False, None, 1000),
    ("simt", "f32", 64, (8, 2), "nhd", "dense", True, True, 2.0, 40),
    ("simt", "f32", 128, (4, 4), "hnd", "t5-bidir", False, False, 0.5, 9),
]


def run_prefill(p, **options):
    import cupy

    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)
    result = cpa.paged_prefill_attention(*(to_cupy(a) for a in p.args()), **device_kwargs(p, to_cupy), **options,
                                         out=out)
    cupy.cuda.get_current_stream().synchronize()
    return to_numpy(result)


@pytest.mark.parametrize(("tiling", "dtype", "head_size", "heads", "layout", "bias", "alibi", "causal", "cap",
                          "window"), PREFILL_GRID,
                         ids=[f"{t}-{d}-d{h}-{q}of{kv}-{lay}-{bias}-{'causal' if c else 'full'}-cap{cap}-w{w}"
                              for t, d, h, (q, kv), lay, bias, _, c, cap, w in PREFILL_GRID])
def test_prefill_soft_cap_and_window(rng, split, tune, tiling, dtype, head_size, heads, layout, bias, alibi, causal,
                                     cap, window):
    tune(wgmma=tiling == "wgmma")
    p = make_prefill_problem(rng, PREFILL_SEQS, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                             dtype=dtype, kv_layout=layout, bias=bias, bias_dtype=dtype, alibi=alibi, causal=causal,
                             scale=1.0 if cap is not None and cap < 3 else None)
    options = {"logits_soft_cap": cap, "window_left": window}
    expected = paged_prefill_attention_ref(*p.args(), **p.kwargs(), **options)
    assert_close(run_prefill(p, **options), expected, dtype, f"{tiling} {split} cap={cap} window={window}")


def test_plan_cache_tells_options_apart(rng):
    """The repeated-call plan cache keys a call by its options: the same operands with and without a cap or a
    window give each its own answer, in any order."""
    pytest.importorskip("torch")
    p = make_problem(rng, [700, 40, 1300], num_heads=8, num_kv_heads=2, head_size=128, dtype="bf16", scale=1.0)
    dev = [to_torch(a) for a in p.args()]
    for options in ({}, {"window_left": 50}, {"logits_soft_cap": 2.0}, {}, {"logits_soft_cap": 2.0, "window_left": 7},
                    {"window_left": 50}):
        expected = paged_attention_ref(*p.args(), **p.kwargs(), **options)
        got = cpa.paged_attention(*dev, scale=1.0, **options).float().cpu().numpy()
        assert_close(got, expected, "bf16", str(options))


def test_decode_plan_with_options_under_a_cuda_graph(rng):
    """A DecodePlan fixes the options; replaying its CUDA graph over new lengths follows the window."""
    torch = pytest.importorskip("torch")
    from test_decode_gpu import captured

    p = make_problem(rng, [700, 40, 1300], num_heads=32, num_kv_heads=8, head_size=128, dtype="bf16", scale=1.0)
    dev = [to_torch(a) for a in p.args()]
    options = {"logits_soft_cap": 2.0, "window_left": 200}
    plan = cpa.DecodePlan(*dev, scale=1.0, **options)
    out = torch.empty_like(dev[0])
    graph = captured(lambda: plan.run(*dev, out=out))
    for lens in ([700, 40, 1300], [300, 1, 1000]):
        dev[4].copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        p.seq_lens[:] = lens
        expected = paged_attention_ref(*p.args(), **p.kwargs(), **options)
        assert_close(out.float().cpu().numpy(), expected, "bf16", f"lengths {lens}")
