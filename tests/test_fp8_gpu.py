"""GPU: fp8 KV caches (float8 e4m3fn and e5m2) — the decode reading them, and prefill over them, against the float64
reference with every bias kind, ALiBi, GQA, the three layouts, split-K, the score options, scales as numbers,
one-element and per-head arrays; ``reshape_and_cache`` writing them bit for bit as the reference quantizes; the
conversions of common.cuh over every fp8 value; ``DecodePlan`` and a CUDA graph that follows a scale array; and the
refusals, by name, of what the GPU does not run."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import DTYPES, assert_close, make_problem, to_vllm_layout
from test_decode_gpu import captured, device_args, to_cupy, to_torch

import cupy_paged_attn as cpa
from cupy_paged_attn import _compile
from cupy_paged_attn.reference import (
    fp8_quantize,
    paged_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
    to_numpy,
)

pytestmark = pytest.mark.gpu

FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
# Lengths past a few partitions (split-K), page boundaries, one key, none.
SEQ_LENS = [1, 15, 17, 0, 513, 700, 1300]


def fp8_problem(rng, fmt: str, scales: str, layout: str, **kwargs):
    """A decode problem whose caches hold fp8 (:func:`quantize`), with its fp8 options."""
    return quantize(rng, make_problem(rng, SEQ_LENS, kv_layout="nhd", **kwargs), fmt, scales, layout)


def quantize(rng, p, fmt: str, scales: str, layout: str):
    """``p`` (NHD caches) with caches of fp8 in ``layout`` (``value / scale`` rounded by ml_dtypes, uint8 storage;
    unused slots NaN), and dense K/V that are what the caches hold, dequantized; and its options: ``kv_cache_dtype``
    and ``k_scale`` / ``v_scale`` as ``scales`` says ("number", "one": an array of one, "per-head")."""
    hkv = p.key_cache.shape[2]
    k_heads = {"number": np.full(hkv, 0.37), "one": np.full(hkv, 0.05),
               "per-head": rng.uniform(0.02, 0.4, hkv)}[scales].astype(np.float32)
    v_heads = (k_heads * np.float32(1.7)).astype(np.float32)
    dtype = FP8[fmt]
    k8 = (p.key_cache.astype(np.float32) / k_heads[:, None]).astype(dtype).view(np.uint8).copy()
    v8 = (p.value_cache.astype(np.float32) / v_heads[:, None]).astype(dtype).view(np.uint8).copy()
    if layout == "vllm":  # x = 16 for one-byte elements
        k8, v8 = to_vllm_layout(k8, v8)
    elif layout == "hnd":
        k8, v8 = (np.ascontiguousarray(c.transpose(0, 2, 1, 3)) for c in (k8, v8))
    p.key_cache, p.value_cache, p.kv_layout = k8, v8, layout
    p.dense_k = [(k.astype(np.float32) / k_heads[:, None]).astype(dtype).astype(np.float64) * k_heads[:, None]
                 for k in p.dense_k]
    p.dense_v = [(v.astype(np.float32) / v_heads[:, None]).astype(dtype).astype(np.float64) * v_heads[:, None]
                 for v in p.dense_v]
    if scales == "number":
        k_scale, v_scale = float(k_heads[0]), float(v_heads[0])
    else:
        k_scale, v_scale = (k_heads, v_heads) if scales == "per-head" else (k_heads[:1].copy(), v_heads[:1].copy())
    return p, {"kv_cache_dtype": fmt, "k_scale": k_scale, "v_scale": v_scale}


def device_options(options: dict, convert) -> dict:
    return {k: convert(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}


# (kernel, fmt, dtype, head_size, block_size, (num_heads, num_kv_heads), layout, bias, alibi, scales, cap, window):
# the tensor-core decode (grouped queries, multi-head forced), the SIMT one (multi-head, head sizes past 128)
DECODE_GRID = [
    ("tensor-cores", "fp8_e4m3", "bf16", 128, 16, (32, 8), "nhd", "dense", False, "per-head", None, None),
    ("tensor-cores", "fp8_e4m3", "f16", 64, 16, (16, 16), "hnd", "none", True, "number", None, None),
    ("tensor-cores", "fp8_e5m2", "bf16", 128, 32, (8, 2), "vllm", "t5-causal", False, "one", None, None),
    ("tensor-cores", "fp8_e4m3", "f16", 96, 8, (6, 2), "nhd", "ragged", True, "per-head", None, None),
    ("tensor-cores", "fp8_e5m2", "bf16", 64, 16, (8, 1), "nhd", "t5-wide", False, "number", None, None),
    ("tensor-cores", "fp8_e4m3", "bf16", 32, 64, (16, 2), "hnd", "ragged-strided", False, "number", None, None),
    ("tensor-cores", "fp8_e5m2", "f16", 80, 16, (40, 8), "nhd", "t5-bidir", True, "per-head", None, None),
    ("tensor-cores", "fp8_e4m3", "bf16", 128, 16, (32, 8), "hnd", "dense", True, "per-head", 2.0, 64),
    ("tensor-cores", "fp8_e4m3", "f16", 112, 16, (40, 2), "vllm", "dense", False, "one", 5.0, None),
    ("simt", "fp8_e4m3", "bf16", 256, 16, (4, 4), "vllm", "dense", True, "one", None, None),
    ("simt", "fp8_e5m2", "f16", 112, 16, (4, 4), "nhd", "none", False, "one", 5.0, None),
    ("simt", "fp8_e4m3", "f16", 192, 8, (8, 2), "vllm", "t5-causal", False, "number", None, 300),
    ("simt", "fp8_e5m2", "bf16", 64, 16, (8, 8), "hnd", "ragged", True, "per-head", None, None),
]


@pytest.mark.parametrize(("kernel", "fmt", "dtype", "head_size", "block_size", "heads", "layout", "bias", "alibi",
                          "scales", "cap", "window"), DECODE_GRID,
                         ids=[f"{k}-{f}-{d}-d{h}-b{b}-{q}of{kv}-{lay}-{bias}-{sc}-cap{c}-w{w}"
                              for k, f, d, h, b, (q, kv), lay, bias, _, sc, c, w in DECODE_GRID])
def test_fp8_decode_matches_the_reference(rng, split, tune, kernel, fmt, dtype, head_size, block_size, heads, layout,
                                          bias, alibi, scales, cap, window):
    import cupy

    tune(decode_kernel=kernel)
    p, options = fp8_problem(rng, fmt, scales, layout, num_heads=heads[0], num_kv_heads=heads[1],
                             head_size=head_size, block_size=block_size, dtype=dtype, bias=bias, bias_dtype=dtype,
                             alibi=alibi, scale=1.0 if cap is not None and cap < 3 else None)
    options.update(logits_soft_cap=cap, window_left=window)
    expected = paged_attention_ref(*p.args(), **p.kwargs(), **options)
    args, kwargs = device_args(p, to_cupy)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)  # poisoned: every row must be written
    result = cpa.paged_attention(*args, **kwargs, **device_options(options, to_cupy), out=out)
    assert result is out
    assert_close(to_numpy(result), expected, dtype, f"{kernel} {fmt} {split} {scales}")


# Query magnitudes of a bfloat16 query (factors of its rows) that a float16 cannot hold, or holds only as
# subnormals, with the softmax scale that keeps the largest rows' logits of order one.
QUERY_RANGES = {
    "huge": ([2.0**40], 2.0**-40),
    "tiny": ([2.0**-30], 2.0**30),
    "huge-and-small": ([2.0**20, 2.0**-6], 2.0**-20),
}


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)], ids=["gqa", "mha"])
@pytest.mark.parametrize("magnitude", list(QUERY_RANGES))
def test_fp8_decode_of_a_bfloat16_query_past_float16s_range(rng, split, tune, fmt, heads, magnitude):
    """The tensor-core decode over fp8 caches runs its mmas in float16 and takes a bfloat16 query there scaled by a
    power of two: queries of 2^40, of 2^-30, and rows 2^26 apart in one CTA still match the reference."""
    import cupy

    tune(decode_kernel="tensor-cores")
    factors, scale = QUERY_RANGES[magnitude]
    p, options = fp8_problem(rng, fmt, "per-head", "nhd", num_heads=heads[0], num_kv_heads=heads[1], head_size=128,
                             dtype="bf16", bias="dense", bias_dtype="bf16", scale=scale)
    row_factor = np.resize(np.asarray(factors, np.float32), heads[0])[None, :, None]
    p.query = (p.query.astype(np.float32) * row_factor).astype(ml_dtypes.bfloat16)
    expected = paged_attention_ref(*p.args(), **p.kwargs(), **options)
    args, kwargs = device_args(p, to_cupy)
    options = device_options(options, to_cupy)
    assert cpa.DecodePlan(*args, **kwargs, **options).launch.tensor_cores
    got = cpa.paged_attention(*args, **kwargs, **options)
    assert isinstance(got, cupy.ndarray)
    assert_close(to_numpy(got), expected, "bf16", f"{fmt} {magnitude} {split}")


def test_fp8_planning_takes_the_kernels_that_exist(rng):
    """Grouped queries over fp8 caches up to head size 128 run on the tensor cores even where the SIMT kernel is
    asked for (it serves one query head per CTA there); the plan names an fp8 specialisation."""
    p, options = fp8_problem(rng, "fp8_e4m3", "number", "nhd", num_heads=8, num_kv_heads=2, head_size=128,
                             dtype="bf16")
    args, kwargs = device_args(p, to_cupy)
    with cpa.tuning.override(decode_kernel="simt"):
        plan = cpa.DecodePlan(*args, **kwargs, **options)
    assert plan.launch.tensor_cores and plan.launch.spec.kv_cache == "fp8_e4m3"


def test_fp8_decode_torch_float8_dtypes_and_the_plan_cache(rng):
    """torch's float8 caches (kv_cache_dtype "auto"); repeated calls with other number scales each get their own
    answer (the plan cache keys the scales)."""
    torch = pytest.importorskip("torch")
    p, options = fp8_problem(rng, "fp8_e4m3", "number", "nhd", num_heads=8, num_kv_heads=2, head_size=128,
                             dtype="bf16")
    dev = [to_torch(a) for a in p.args()]
    dev[1:3] = [c.view(torch.float8_e4m3fn) for c in dev[1:3]]
    k_scale, v_scale = options["k_scale"], options["v_scale"]
    for factor in (1.0, 2.0, 1.0, 0.5):
        got = cpa.paged_attention(*dev, k_scale=k_scale * factor, v_scale=v_scale * factor)
        expected = paged_attention_ref(*p.args(), kv_cache_dtype="fp8_e4m3", k_scale=k_scale * factor,
                                       v_scale=v_scale * factor)
        assert_close(got.float().cpu().numpy(), expected, "bf16", f"factor {factor}")


def test_fp8_decode_plan_follows_a_scale_array_under_a_cuda_graph(rng):
    """A DecodePlan built with scale arrays reads them at each run: a replayed CUDA graph follows new values."""
    torch = pytest.importorskip("torch")
    p, options = fp8_problem(rng, "fp8_e5m2", "per-head", "hnd", num_heads=16, num_kv_heads=4, head_size=64,
                             dtype="f16")
    dev = [to_torch(a) for a in p.args()]
    k_scale, v_scale = to_torch(options["k_scale"]), to_torch(options["v_scale"])
    plan = cpa.DecodePlan(*dev, kv_layout="hnd", kv_cache_dtype="fp8_e5m2", k_scale=k_scale, v_scale=v_scale)
    assert plan.launch.spec.kv_cache == "fp8_e5m2"
    out = torch.empty_like(dev[0])
    graph = captured(lambda: plan.run(*dev, k_scale=k_scale, v_scale=v_scale, out=out))
    for factor in (1.0, 3.0):
        k_scale.copy_(torch.from_numpy(options["k_scale"] * np.float32(factor)))
        v_scale.copy_(torch.from_numpy(options["v_scale"] / np.float32(factor)))
        graph.replay()
        torch.cuda.synchronize()
        expected = paged_attention_ref(*p.args(), kv_layout="hnd", kv_cache_dtype="fp8_e5m2",
                                       k_scale=to_numpy(k_scale), v_scale=to_numpy(v_scale))
        assert_close(out.float().cpu().numpy(), expected, "f16", f"factor {factor}")
    with pytest.raises(ValueError, match=r"k_scale: expected an array like the plan's"):
        plan.run(*dev, v_scale=v_scale)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize(("dtype", "layout", "scales"), [("bf16", "nhd", "per-head"), ("f16", "vllm", "number"),
                                                         ("f32", "hnd", "one"), ("bf16", "vllm", "one")])
def test_fp8_cache_write_matches_the_reference_bit_for_bit(rng, fmt, dtype, layout, scales):
    """reshape_and_cache on the GPU stores the reference's bytes: rounding, subnormals, saturation of huge values
    and infinities, NaN; the slots it does not write keep their bytes."""
    import cupy

    num_blocks, block_size, hkv, d = 6, 16, 3, 64
    key = rng.standard_normal((50, hkv, d)).astype(np.float32)
    key[0, 0, :8] = [1e9, -1e9, np.inf, -np.inf, 1e-7, -3e-3, 0.0, 464.0]
    key[1, 0, :3] = [np.nan, 2.0**-9 * 1.5, 2.0**-16 * 2.5]
    key = key.astype(DTYPES[dtype])
    value = (rng.standard_normal((50, hkv, d)) * 30).astype(DTYPES[dtype])
    shape = {"nhd": (num_blocks, block_size, hkv, d), "hnd": (num_blocks, hkv, block_size, d),
             "vllm": (num_blocks, hkv, d // 16, block_size, 16)}[layout]
    v_shape = (num_blocks, hkv, d, block_size) if layout == "vllm" else shape
    k_cache = rng.integers(0, 256, shape, dtype=np.uint8)
    v_cache = rng.integers(0, 256, v_shape, dtype=np.uint8)
    slots = rng.permutation(num_blocks * block_size)[:50].astype(np.int64)
    slots[::9] = -1
    per_head = rng.uniform(0.01, 0.5, hkv).astype(np.float32)
    k_scale, v_scale = {"number": (0.25, 0.125), "one": (per_head[:1], per_head[:1] * 2),
                        "per-head": (per_head, per_head * 2)}[scales]
    options = {"kv_layout": layout, "kv_cache_dtype": fmt, "k_scale": k_scale, "v_scale": v_scale}
    want_k, want_v = reshape_and_cache_ref(key, value, k_cache.copy(), v_cache.copy(), slots, **options)
    dk, dv = to_cupy(k_cache), to_cupy(v_cache)
    cpa.reshape_and_cache(to_cupy(key), to_cupy(value), dk, dv, to_cupy(slots), **device_options(options, to_cupy))
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(dk.get(), want_k)
    np.testing.assert_array_equal(dv.get(), want_v)


_CONVERSIONS = r'''
#include "common.cuh"
// Every fp8 byte through the decode's conversions, and floats through the cache write's.
extern "C" __global__ void unpack_all(float* portable_e4m3, float* e4m3, float* e5m2) {
  const int i = threadIdx.x;  // bytes 4i .. 4i + 3
  const unsigned w = (4u * i) | ((4u * i + 1) << 8) | ((4u * i + 2) << 16) | ((4u * i + 3) << 24);
  unsigned lo, hi;
  cpa::e4m3x4_to_scaled_half2x2(w, lo, hi);
  cpa::half2x2_to_float4(lo, hi, portable_e4m3 + 4 * i);
  const uint4 raw = make_uint4(w, w, w, w);
  float f[16];
  cpa::unpack<cpa::Fp8E4M3>(raw, f);
  for (int k = 0; k < 4; ++k) e4m3[4 * i + k] = f[k] * cpa::kv_unit<cpa::Fp8E4M3>();
  cpa::unpack<cpa::Fp8E5M2>(raw, f);
  for (int k = 0; k < 4; ++k) e5m2[4 * i + k] = f[k];
}
// The tensor-core decode's tile conversion: 16 fp8 values -> 16 float16 / bfloat16, every byte of both formats.
template <typename T, typename KV>
__device__ void tile_all(T* out) {
  const int i = threadIdx.x;  // bytes 16i .. 16i + 15
  unsigned w[4];
  for (int k = 0; k < 4; ++k) {
    w[k] = (16u * i + 4 * k) | ((16u * i + 4 * k + 1) << 8) | ((16u * i + 4 * k + 2) << 16) |
           ((16u * i + 4 * k + 3) << 24);
  }
  uint4 lo, hi;
  cpa::fp8x16_to_16bit<T, KV>(make_uint4(w[0], w[1], w[2], w[3]), lo, hi);
  reinterpret_cast<uint4*>(out)[2 * i] = lo;
  reinterpret_cast<uint4*>(out)[2 * i + 1] = hi;
}
extern "C" __global__ void tile_f16_e4m3(__half* out) { tile_all<__half, cpa::Fp8E4M3>(out); }
extern "C" __global__ void tile_f16_e5m2(__half* out) { tile_all<__half, cpa::Fp8E5M2>(out); }
extern "C" __global__ void tile_bf16_e4m3(__nv_bfloat16* out) { tile_all<__nv_bfloat16, cpa::Fp8E4M3>(out); }
extern "C" __global__ void tile_bf16_e5m2(__nv_bfloat16* out) { tile_all<__nv_bfloat16, cpa::Fp8E5M2>(out); }
extern "C" __global__ void quantize(const float* x, unsigned char* e4m3, unsigned char* e5m2, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    e4m3[i] = cpa::fp8_from_float<cpa::Fp8E4M3>(x[i]);
    e5m2[i] = cpa::fp8_from_float<cpa::Fp8E5M2>(x[i]);
  }
}
'''


def test_fp8_conversions_over_every_value(rng):
    """The decode's fp8 -> float conversions (the portable e4m3 one that GPUs before sm_89 run, the one this GPU
    runs, e5m2's) give every byte's value (e4m3fn's NaN: NaN, or ±480 on the portable path), and so does the
    tensor-core decode's tile conversion to float16 and bfloat16 (up to kv_unit); the cache write's float -> fp8
    rounds as ml_dtypes does after saturating, ties, subnormals and specials included."""
    import cupy

    module = cupy.RawModule(code=_compile.inline_headers(_CONVERSIONS), options=("-std=c++17",))
    portable, e4m3, e5m2 = (cupy.zeros(256, np.float32) for _ in range(3))
    module.get_function("unpack_all")((1,), (64,), (portable, e4m3, e5m2))
    every = np.arange(256, dtype=np.uint8)
    for got, fmt in ((e4m3, ml_dtypes.float8_e4m3fn), (e5m2, ml_dtypes.float8_e5m2)):
        np.testing.assert_array_equal(got.get(), every.view(fmt).astype(np.float32))
    want = every.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(portable.get()[~nan] * 256, want[~nan])
    np.testing.assert_array_equal(np.abs(portable.get()[nan] * 256), 480)
    for name, fmt, out_dtype in (("tile_f16_e4m3", ml_dtypes.float8_e4m3fn, np.float16),
                                 ("tile_f16_e5m2", ml_dtypes.float8_e5m2, np.float16),
                                 ("tile_bf16_e4m3", ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16),
                                 ("tile_bf16_e5m2", ml_dtypes.float8_e5m2, ml_dtypes.bfloat16)):
        got = cupy.zeros(256, np.uint16)
        module.get_function(name)((1,), (16,), (got,))
        have = got.get().view(out_dtype).astype(np.float32)
        want = every.view(fmt).astype(np.float32)
        ok = np.isfinite(want)
        ratio = have[ok][want[ok] != 0] / want[ok][want[ok] != 0]  # kv_unit: 1, or 1/256 for portable e4m3
        assert np.all(ratio == ratio[0]) and ratio[0] in (1.0, 1.0 / 256), name
        np.testing.assert_array_equal(have[ok][want[ok] == 0], 0, err_msg=name)
        np.testing.assert_array_equal(have[np.isinf(want)], want[np.isinf(want)], err_msg=name)  # e5m2's

    steps = np.concatenate([every.view(f).astype(np.float32) for f in FP8.values()])
    steps = steps[np.isfinite(steps)]
    x = np.concatenate([
        rng.standard_normal(20000) * 10.0 ** rng.uniform(-8, 6, 20000),  # every exponent, both formats
        (steps[:-1] + steps[1:]) / 2, np.nextafter(steps, np.inf), np.nextafter(steps, -np.inf),  # ties, neighbours
        [0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, 465.0, 57344.0, 61440.0, 1e-45, -1e-40],
    ]).astype(np.float32)
    dx = cupy.asarray(x)
    got4, got5 = cupy.zeros(x.size, np.uint8), cupy.zeros(x.size, np.uint8)
    module.get_function("quantize")(((x.size + 255) // 256,), (256,), (dx, got4, got5, np.int32(x.size)))
    tiny = np.abs(x) < np.finfo(np.float32).tiny  # float32 subnormals: the kernels flush them to zero
    for got, fmt in ((got4, "fp8_e4m3"), (got5, "fp8_e5m2")):
        want = fp8_quantize(np.where(tiny, np.float32(0), x)[None, None, :], 1.0, fmt)[0, 0]
        have = got.get().view(FP8[fmt])
        np.testing.assert_array_equal(np.isnan(have.astype(np.float32)), np.isnan(want.astype(np.float32)))
        ok = ~np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(have[ok].astype(np.float32), want[ok].astype(np.float32), err_msg=fmt)


PREFILL_SEQS = [(300, 300), (77, 7), (64, 64), (1, 1), (0, 0), (513, 0), (40, 1), (900, 64)]
# (fmt, dtype, head_size, (num_heads, num_kv_heads), layout, bias, alibi, causal, scales, cap, window)
PREFILL_GRID = [
    ("fp8_e4m3", "bf16", 128, (8, 2), "nhd", "none", False, True, "per-head", None, None),
    ("fp8_e5m2", "f16", 64, (4, 4), "hnd", "t5-causal", True, True, "number", None, None),
    ("fp8_e4m3", "bf16", 96, (6, 2), "vllm", "dense", False, False, "one", 5.0, 40),
    ("fp8_e4m3", "f32", 64, (8, 2), "nhd", "dense", True, True, "per-head", None, None),
    ("fp8_e5m2", "bf16", 256, (4, 1), "vllm", "t5-bidir", False, True, "one", None, 100),
]


@pytest.mark.parametrize(("fmt", "dtype", "head_size", "heads", "layout", "bias", "alibi", "causal", "scales", "cap",
                          "window"), PREFILL_GRID,
                         ids=[f"{f}-{d}-d{h}-{q}of{kv}-{lay}-{bias}-{'causal' if c else 'full'}-{sc}"
                              for f, d, h, (q, kv), lay, bias, _, c, sc, _, _ in PREFILL_GRID])
def test_fp8_prefill_matches_the_reference(rng, split, fmt, dtype, head_size, heads, layout, bias, alibi, causal,
                                           scales, cap, window):
    """Prefill over fp8 caches (the pages it reads dequantized into the query's dtype, then the usual tilings),
    chunked and ragged, split-K or not; unused page slots hold NaN."""
    import cupy
    from prefill_helpers import make_prefill_problem
    from test_prefill_gpu import device_kwargs

    base = make_prefill_problem(rng, PREFILL_SEQS, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                                dtype=dtype, kv_layout="nhd", bias=bias, bias_dtype=dtype, alibi=alibi,
                                causal=causal, scale=1.0 if cap is not None and cap < 3 else None)
    p, options = quantize(rng, base, fmt, scales, layout)
    options.update(logits_soft_cap=cap, window_left=window)
    expected = paged_prefill_attention_ref(*p.args(), **p.kwargs(), **options)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)
    cpa.paged_prefill_attention(*(to_cupy(a) for a in p.args()), **device_kwargs(p, to_cupy),
                                **device_options(options, to_cupy), out=out)
    assert_close(to_numpy(out), expected, dtype, f"{fmt} {split} {scales}")


def test_gpu_refuses_what_it_does_not_run_on_fp8_caches(rng):
    """By name: a float32 query with an fp8 cache in decode, a head size that is not a multiple of 16."""
    p, options = fp8_problem(rng, "fp8_e4m3", "number", "nhd", dtype="f32")
    args, kwargs = device_args(p, to_cupy)
    with pytest.raises(NotImplementedError, match=r"query: an fp8 cache \(fp8_e4m3\) with a float32 query"):
        cpa.paged_attention(*args, **kwargs, **options)
    p, options = fp8_problem(rng, "fp8_e5m2", "number", "nhd", dtype="bf16", head_size=120)
    args, kwargs = device_args(p, to_cupy)
    with pytest.raises(NotImplementedError, match=r"head_size: an fp8 cache on the GPU takes head sizes"):
        cpa.paged_attention(*args, **kwargs, **options)
