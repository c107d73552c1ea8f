"""Representative launches of every kernel family, small enough for compute-sanitizer, each checked against the
reference: decode and prefill (tensor-core and float32 kernels), MHA and GQA, single-pass and split-K, both layouts,
dense and broadcast bias, ALiBi, ragged and empty sequences, ragged and T5 biases, and hostile device data (block
ids outside the cache, negative and huge seq_lens, ragged-bias offsets outside their rows, T5 buckets outside the
table, slots past the cache), fp8 caches read and written.

Run through tests/gpu/sanitize.sh (or alone: ``PYTHONPATH=.:tests python3 tests/gpu/sanitize_cases.py``).
"""

from __future__ import annotations

import sys

import cupy
import numpy as np
from helpers import assert_close, hostile_t5_bias, make_problem
from prefill_helpers import make_prefill_problem
from test_decode_gpu import device_args, to_cupy
from test_fp8_gpu import device_options, fp8_problem
from test_prefill_gpu import device_kwargs

import cupy_paged_attn as cpa
from cupy_paged_attn import tuning
from cupy_paged_attn.reference import paged_attention_ref, paged_prefill_attention_ref, to_numpy

CASES = [  # (name, make_problem keywords, split-K: False, True, "reduce" (not in clusters) or the SMs to plan for)
    ("mha-bf16-d64-nhd", dict(seq_lens=[1, 17, 40, 0], num_heads=4, num_kv_heads=4, head_size=64, dtype="bf16",
                              bias="dense", bias_dtype="bf16"), False),
    ("gqa4-f16-d128-vllm-split", dict(seq_lens=[300, 5], num_heads=8, num_kv_heads=2, head_size=128, dtype="f16",
                                      kv_layout="vllm", bias="broadcast-head", alibi=True), True),
    ("gqa3-f32-d80-b8", dict(seq_lens=[33, 8], num_heads=6, num_kv_heads=2, head_size=80, block_size=8,
                             bias="strided"), False),
    ("mqa-bf16-d256-b1-split", dict(seq_lens=[70, 2], num_heads=8, num_kv_heads=1, head_size=256, block_size=1,
                                    dtype="bf16"), True),
    ("f32-d192-vllm", dict(seq_lens=[20], num_heads=2, num_kv_heads=1, head_size=192, kv_layout="vllm"), False),
    ("ragged-strided-bf16-gqa4-split", dict(seq_lens=[300, 0, 7], num_heads=8, num_kv_heads=2, dtype="bf16",
                                            bias="ragged-strided", bias_dtype="bf16"), True),
    ("t5-bidir-f16-d64", dict(seq_lens=[200, 1], num_heads=4, num_kv_heads=4, dtype="f16", bias="t5-bidir",
                              bias_dtype="f32", alibi=True), False),
    ("t5-causal-f32-split", dict(seq_lens=[260], num_heads=4, num_kv_heads=1, bias="t5-causal"), "reduce"),
    # The SIMT kernel's partitions combined in thread block clusters (sm_90): the latency case's shape, 8
    # partitions; a CTA of 4 heads (3 in use) in 3 partitions, an empty and a one-key sequence beside it.
    ("latency-bf16-d64-dense-cluster", dict(seq_lens=[1024], num_heads=16, num_kv_heads=16, dtype="bf16",
                                            bias="dense", bias_dtype="bf16", alibi=True), 132),
    ("gqa3-f32-d128-t5-cluster", dict(seq_lens=[300, 0, 1], num_heads=6, num_kv_heads=2, head_size=128,
                                      bias="t5-bidir"), True),
    ("gqa20-bf16-d96-t5-split", dict(seq_lens=[333, 64, 1], num_heads=40, num_kv_heads=2, head_size=96,
                                     dtype="bf16", bias="t5-bidir", bias_dtype="bf16"), True),
    ("gqa16-bf16-d128-dense", dict(seq_lens=[200, 3], num_heads=32, num_kv_heads=2, head_size=128, dtype="bf16",
                                   bias="dense", bias_dtype="bf16", alibi=True), False),
    ("gqa4-f16-d128-dense-rows-split", dict(seq_lens=[301, 5, 77], num_heads=8, num_kv_heads=2, head_size=128,
                                            dtype="f16", bias="dense", bias_dtype="f16"), True),
    ("gqa4-bf16-d128-ragged-rows-split", dict(seq_lens=[301, 5, 77], num_heads=8, num_kv_heads=2, head_size=128,
                                              dtype="bf16", bias="ragged", bias_dtype="bf16"), True),
    # 8 CTAs where 2 SMs hold 6: a tail split taken longest first, sequence by sequence (decode_mma.cu).
    ("gqa4-bf16-d128-dense-rows-ranked-split", dict(seq_lens=[77, 0, 301, 300], num_heads=8, num_kv_heads=2,
                                                    head_size=128, dtype="bf16", bias="dense", bias_dtype="bf16"), 2),
    # A sliding window and a soft-cap: partitions cut from the window's first tile on, pages before it unread.
    ("window-cap-bf16-gqa4-dense-split", dict(seq_lens=[300, 5, 77], num_heads=8, num_kv_heads=2, head_size=128,
                                              dtype="bf16", bias="dense", bias_dtype="bf16",
                                              options={"window_left": 40, "logits_soft_cap": 5.0}), True),
    ("window-f32-d64-cluster", dict(seq_lens=[1024, 3, 0], num_heads=4, num_kv_heads=4,
                                    options={"window_left": 100, "logits_soft_cap": 2.0}), 132),
]


def switches(split: bool | str | int) -> dict:
    """The tuning switches that plan ``split``: unsplit (False), split as far as the keys allow (True, "reduce": by
    the combine kernel, never in clusters), or planned for that many SMs (an int)."""
    return dict(num_sms=split if type(split) is int else 10**6 if split else 1, cluster_combine=split != "reduce")


def run(name: str, kwargs: dict, split: bool | str | int, rng: np.random.Generator) -> None:
    kwargs = dict(kwargs)
    options = kwargs.pop("options", {})  # soft-cap and window
    p = make_problem(rng, **kwargs)
    args, kw = device_args(p, to_cupy)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)
    with tuning.override(**switches(split)):
        cpa.paged_attention(*args, **kw, **options, out=out)
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs(), **options), kwargs.get("dtype", "f32"),
                 name)
    print(f"ok  {name}")


PREFILL_CASES = [  # (name, make_prefill_problem keywords, force split-K)
    ("prefill-bf16-gqa4-t5-causal", dict(seqs=[(70, 70), (40, 7), (0, 0), (9, 1)], num_heads=8, num_kv_heads=2,
                                         dtype="bf16", bias="t5-causal"), False),
    ("prefill-f16-d128-vllm-dense-bidir-split", dict(seqs=[(300, 33), (20, 20)], num_heads=4, num_kv_heads=4,
                                                     head_size=128, dtype="f16", kv_layout="vllm", bias="dense",
                                                     causal=False, alibi=True), True),
    ("prefill-bf16-d256-t5-bidir", dict(seqs=[(50, 50)], num_heads=2, num_kv_heads=1, head_size=256, dtype="bf16",
                                        bias="t5-bidir", causal=False), False),
    ("prefill-f32-d80-simt", dict(seqs=[(33, 5), (17, 17)], num_heads=6, num_kv_heads=2, head_size=80,
                                  bias="broadcast-rows"), False),
    # The Hopper tiling (on an H100 / H200) with the vLLM value layout (values gathered by ordinary stores), split-K.
    ("prefill-f16-d64-vllm-none-split", dict(seqs=[(300, 130), (20, 20)], num_heads=8, num_kv_heads=2, head_size=64,
                                             dtype="f16", kv_layout="vllm", causal=False), True),
    # Several M tiles of 128 rows and key tiles near and far from them (T5's table), causal tiles skipped per warp.
    ("prefill-bf16-d128-t5-long", dict(seqs=[(450, 450), (700, 260)], num_heads=2, num_kv_heads=2, head_size=128,
                                       dtype="bf16", bias="t5-bidir", causal=True), False),
    ("prefill-bf16-d128-window-cap-split", dict(seqs=[(450, 450), (700, 260)], num_heads=2, num_kv_heads=2,
                                                head_size=128, dtype="bf16", causal=True,
                                                options={"window_left": 70, "logits_soft_cap": 5.0}), True),
    ("prefill-f16-d96-window-dense-bidir", dict(seqs=[(300, 33), (20, 20)], num_heads=4, num_kv_heads=2,
                                                head_size=96, dtype="f16", bias="dense", causal=False,
                                                options={"window_left": 9}), False),
    ("prefill-f32-window-cap", dict(seqs=[(90, 40)], num_heads=2, num_kv_heads=1,
                                    options={"window_left": 20, "logits_soft_cap": 2.0}), True),
]


def run_prefill(name: str, kwargs: dict, split: bool, rng: np.random.Generator) -> None:
    kwargs = dict(kwargs)
    options = kwargs.pop("options", {})
    p = make_prefill_problem(rng, **kwargs)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)
    with tuning.override(**switches(split)):
        cpa.paged_prefill_attention(*[to_cupy(a) for a in p.args()], **device_kwargs(p, to_cupy), **options, out=out)
    assert_close(to_numpy(out), paged_prefill_attention_ref(*p.args(), **p.kwargs(), **options),
                 kwargs.get("dtype", "f32"), name)
    print(f"ok  {name}")


def hostile(rng: np.random.Generator) -> None:
    """Hostile device data on every decode path (SIMT kernel, tensor cores with biases staged or not; single pass and
    split, long enough sequences that the split has partitions; a split taken longest first), prefill and the cache
    write."""
    # (split, dtype, bias dtype): the SIMT kernel, split combined in clusters and by the combine kernel; the tensor
    # cores, a 16-bit bias staged in shared memory or not
    for split, dtype, bias_dtype in ((False, "f32", "f32"), (True, "f32", "f32"), ("reduce", "f32", "f32"),
                                     (False, "bf16", "f32"), (True, "bf16", "bf16"), (False, "f16", "f16"),
                                     (True, "f16", "f32")):
        hostile_decode(rng, split, dtype, bias_dtype)
    # A tail split taken longest first (8 CTAs, 6 slots): lengths clamped before the ranking and each sequence's cut.
    with tuning.override(**switches(2)):
        hostile_ranked_split(rng)
    for split in (False, True):
        with tuning.override(**switches(split)):
            hostile_prefill(rng)
    for kernel in ("tensor-cores", "simt"):  # fp8 caches: block ids and lengths out of range on both decode kernels
        with tuning.override(decode_kernel=kernel, num_sms=10**6):
            hostile_fp8_decode(rng)
    key = cupy.asarray(rng.standard_normal((4, 2, 64)).astype(np.float16))
    k_cache = cupy.asarray(rng.standard_normal((3, 16, 2, 64)).astype(np.float16))
    v_cache = k_cache.copy()
    for slots in ([3, 48, 2**40, -2], [-1, -1, 47, 0]):
        cpa.reshape_and_cache(key, key, k_cache, v_cache, cupy.asarray(np.array(slots, np.int64)))
    cupy.cuda.get_current_stream().synchronize()
    print("ok  hostile indices (no fault)")


def hostile_decode(rng: np.random.Generator, split: bool | str, dtype: str, bias_dtype: str) -> None:
    with tuning.override(**switches(split)):
        p = make_problem(rng, [400, 300, 200, 100], num_heads=4, num_kv_heads=2, bias="dense", dtype=dtype,
                         bias_dtype=bias_dtype)
        tables = p.block_tables.copy()
        tables[0, 1], tables[1, 0], tables[2, 1] = -7, 2**31 - 1, p.key_cache.shape[0]
        args, kw = device_args(p, to_cupy)
        args[3] = cupy.asarray(tables)
        args[4] = cupy.asarray(np.array([400, -5, 10**9, 2**31 - 1], np.int32))
        cpa.paged_attention(*args, **kw)
        r = make_problem(rng, [400, 300, 200, 100], num_heads=8, num_kv_heads=2, bias="ragged", dtype=dtype,
                         bias_dtype=bias_dtype)
        args, kw = device_args(r, to_cupy)
        total = r.bias_kind.values.shape[0]
        for offsets in ([-50, 46, 2**31 - 1, total - 5, total], [3, 10, 800, 1030, 2**31 - 1]):
            offsets = cupy.asarray(np.array(offsets, np.int32))
            kw["attn_bias"] = cpa.RaggedBias(to_cupy(r.bias_kind.values), offsets)
            cpa.paged_attention(*args, **kw)
        for kind in ("t5-causal", "t5-wide", "t5-many"):  # the SIMT kernel's column and table paths, far keys
            t = make_problem(rng, [700, 130, 1], num_heads=4, num_kv_heads=2, bias=kind, dtype=dtype)
            args, kw = device_args(t, to_cupy)
            kw["attn_bias"] = hostile_t5_bias(kw["attn_bias"], to_cupy)
            cpa.paged_attention(*args, **kw)


def hostile_fp8_decode(rng: np.random.Generator) -> None:
    p, scales = fp8_problem(rng, "fp8_e4m3", "per-head", "nhd", num_heads=4, num_kv_heads=4, dtype="bf16",
                            bias="dense", bias_dtype="bf16")
    tables = p.block_tables.copy()
    tables[4, 1], tables[5, 0], tables[6, 1] = -7, 2**31 - 1, p.key_cache.shape[0]
    args, kw = device_args(p, to_cupy)
    args[3] = cupy.asarray(tables)
    args[4] = cupy.asarray(np.array([1, -5, 10**9, 0, 513, 2**31 - 1, 1300], np.int32))
    cpa.paged_attention(*args, **kw, **device_options(scales, to_cupy))


def hostile_ranked_split(rng: np.random.Generator) -> None:
    p = make_problem(rng, [400, 300, 200, 100], num_heads=8, num_kv_heads=2, head_size=128, bias="dense",
                     dtype="bf16", bias_dtype="bf16")
    args, kw = device_args(p, to_cupy)
    launch = cpa.DecodePlan(*args, **kw).launch
    assert launch.longest_first and launch.num_parts > 1, launch
    tables = p.block_tables.copy()
    tables[0, 1], tables[1, 0], tables[2, 1] = -7, 2**31 - 1, p.key_cache.shape[0]
    args[3] = cupy.asarray(tables)
    args[4] = cupy.asarray(np.array([400, -5, 10**9, 2**31 - 1], np.int32))
    cpa.paged_attention(*args, **kw)


def hostile_prefill(rng: np.random.Generator) -> None:
    q = make_prefill_problem(rng, [(40, 10), (30, 30), (20, 5), (10, 10)], num_heads=4, num_kv_heads=2,
                             dtype="bf16", bias="dense")
    args = [to_cupy(a) for a in q.args()]
    tables = q.block_tables.copy()
    tables[0, 1], tables[1, 0] = -7, 2**31 - 1
    args[3] = cupy.asarray(tables)
    args[4] = cupy.asarray(np.array([40, -5, 10**9, 2**31 - 1], np.int32))
    args[5] = cupy.asarray(np.array([0, 60, -3, 2**31 - 1, 55], np.int32))  # query_start_loc out of order
    cpa.paged_prefill_attention(*args, **device_kwargs(q, to_cupy))
    for max_distance in (128, 3000):  # the CTA's table of relative positions; per logit
        t = make_prefill_problem(rng, [(300, 300), (50, 9)], num_heads=4, num_kv_heads=4, dtype="bf16",
                                 causal=False)
        t.attn_bias = cpa.RelativePositionBias(rng.standard_normal((32, 4)).astype(np.float32), num_buckets=32,
                                               max_distance=max_distance, bidirectional=True)
        kw = device_kwargs(t, to_cupy)
        kw["attn_bias"] = hostile_t5_bias(kw["attn_bias"], to_cupy)
        cpa.paged_prefill_attention(*[to_cupy(a) for a in t.args()], **kw)


FP8_CASES = [  # (name, fp8_problem arguments, split-K)
    ("fp8-e4m3-bf16-gqa4-dense-per-head-split", dict(fmt="fp8_e4m3", scales="per-head", layout="nhd", num_heads=8,
                                                    num_kv_heads=2, head_size=128, dtype="bf16", bias="dense",
                                                    bias_dtype="bf16"), True),
    ("fp8-e5m2-f16-d64-vllm-t5-window", dict(fmt="fp8_e5m2", scales="one", layout="vllm", num_heads=4,
                                             num_kv_heads=4, dtype="f16", bias="t5-causal", alibi=True,
                                             options={"window_left": 100}), False),
]


def run_fp8(name: str, kwargs: dict, split: bool, rng: np.random.Generator) -> None:
    """An fp8 decode (test_fp8_gpu's problems), then an fp8 cache write into the vLLM layout's pages."""
    kwargs = dict(kwargs)
    options = kwargs.pop("options", {})
    p, scales = fp8_problem(rng, **kwargs)
    args, kw = device_args(p, to_cupy)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)
    with tuning.override(**switches(split)):
        cpa.paged_attention(*args, **kw, **device_options(scales, to_cupy), **options, out=out)
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs(), **scales, **options), kwargs["dtype"],
                 name)
    key = cupy.asarray(rng.standard_normal((40, 2, 64)).astype(np.float16))
    k_cache = cupy.zeros((4, 2, 4, 16, 16), cupy.uint8)
    v_cache = cupy.zeros((4, 2, 64, 16), cupy.uint8)
    slots = cupy.asarray(np.r_[np.arange(39), 10**6].astype(np.int32))  # the last one past the cache
    cpa.reshape_and_cache(key, key, k_cache, v_cache, slots, kv_layout="vllm", kv_cache_dtype="fp8_e4m3",
                          k_scale=cupy.asarray(np.float32([0.1, 0.2])), v_scale=0.3)
    print(f"ok  {name}")


def main() -> int:
    """``sanitize_cases.py [SEED] [--hostile]``: every case, or (``--hostile``) the hostile device data alone."""
    numbers = [a for a in sys.argv[1:] if not a.startswith("--")]
    rng = np.random.default_rng(int(numbers[0]) if numbers else 0)
    if "--hostile" in sys.argv[1:]:
        hostile(rng)
        return 0
    for name, kwargs, split in CASES:
        run(name, kwargs, split, rng)
    for name, kwargs, split in FP8_CASES:
        run_fp8(name, kwargs, split, rng)
    for name, kwargs, split in PREFILL_CASES:
        run_prefill(name, kwargs, split, rng)
    hostile(rng)
    cupy.cuda.get_current_stream().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
