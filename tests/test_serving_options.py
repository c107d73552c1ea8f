"""CPU: the serving options on the NumPy path (the float64 reference) against independent dense attention —
Gemma 2's logit soft-cap, the sliding window, the ``"hnd"`` cache layout and fp8 caches with their scales — and their
argument errors. The GPU kernels' soft-cap and window are tested in test_serving_options_gpu.py; ``"hnd"`` in the
decode, prefill and cache-write grids."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from helpers import BIAS_KINDS, assert_close, dense_attention, make_problem
from prefill_helpers import dense_prefill_attention, make_prefill_problem

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import fp8_quantize, paged_attention_ref, paged_prefill_attention_ref

SEQ_LENS = [1, 15, 17, 0, 33, 64]
PREFILL_SEQS = [(1, 1), (17, 17), (40, 9), (0, 0), (33, 1), (64, 30)]  # (seq_len, q_len)
SOFT_CAPS = [0.5, 3.0, 50.0]
WINDOWS = [0, 1, 5, 16, 63, 1000]
FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


# ---------------------------------------------------------------------------------------------------------------
# Soft-cap and sliding window
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cap", "bias"), list(itertools.product(SOFT_CAPS, ["none", "dense"])))
def test_decode_soft_cap_matches_definition(rng, cap, bias):
    """c * tanh(scale * <q, k> / c), then the bias and ALiBi (Gemma 2's order); scale 1 makes the cap bite."""
    p = make_problem(rng, SEQ_LENS, bias=bias, alibi=True, scale=1.0)
    got = paged_attention_ref(*p.args(), **p.kwargs(), logits_soft_cap=cap)
    np.testing.assert_allclose(got, dense_attention(p, soft_cap=cap), atol=1e-12)
    assert not np.allclose(got, dense_attention(p), atol=1e-3), "the cap changed nothing"


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", ["nhd", "vllm", "hnd"])
def test_decode_window_matches_definition(rng, window, layout):
    p = make_problem(rng, SEQ_LENS, bias="dense", alibi=True, kv_layout=layout)
    got = paged_attention_ref(*p.args(), **p.kwargs(), window_left=window)
    np.testing.assert_allclose(got, dense_attention(p, window_left=window), atol=1e-12)


def test_decode_window_edges(rng):
    """window 0 attends the last key alone (out = its value); a window reaching the first key changes nothing."""
    p = make_problem(rng, [9, 40], num_heads=4, num_kv_heads=2, bias="dense")
    last = paged_attention_ref(*p.args(), **p.kwargs(), window_left=0)
    for s, n in enumerate((9, 40)):
        np.testing.assert_allclose(last[s], np.repeat(p.dense_v[s][n - 1], 2, axis=0), atol=1e-12)
    full = paged_attention_ref(*p.args(), **p.kwargs())
    np.testing.assert_allclose(paged_attention_ref(*p.args(), **p.kwargs(), window_left=39), full, atol=1e-12)


def test_decode_soft_cap_window_and_bias_kinds(rng):
    """Every bias kind combines with both options (the NumPy path, in the query's dtype)."""
    for kind in BIAS_KINDS:
        p = make_problem(rng, SEQ_LENS, bias=kind, alibi=True, dtype="bf16", bias_dtype="bf16")
        expected = dense_attention(p, soft_cap=2.0, window_left=7)
        assert_close(cpa.paged_attention(*p.args(), **p.kwargs(), logits_soft_cap=2.0, window_left=7), expected,
                     "bf16", kind)


@pytest.mark.parametrize(("causal", "window"), list(itertools.product([True, False], [0, 3, 20, None])))
def test_prefill_window_and_soft_cap_match_definition(rng, causal, window):
    """Causal: keys in [p - w, p]; not causal: keys from p - w to the sequence's end."""
    p = make_prefill_problem(rng, PREFILL_SEQS, bias="dense", alibi=True, causal=causal, scale=0.9)
    got = paged_prefill_attention_ref(*p.args(), **p.kwargs(), window_left=window, logits_soft_cap=4.0)
    np.testing.assert_allclose(got, dense_prefill_attention(p, soft_cap=4.0, window_left=window), atol=1e-12)


def test_prefill_single_rows_equal_decode_with_options(rng):
    """One query row per sequence is decode, soft-cap and window included."""
    p = make_prefill_problem(rng, [(n, 1) for n in (1, 15, 33)], bias="none", alibi=True)
    decode = paged_attention_ref(p.query, *p.args()[1:5], scale=p.scale, alibi_slopes=p.alibi_slopes,
                                 logits_soft_cap=1.5, window_left=6)
    prefill = paged_prefill_attention_ref(*p.args(), **p.kwargs(), logits_soft_cap=1.5, window_left=6)
    np.testing.assert_allclose(prefill, decode, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# The "hnd" layout
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_hnd_layout_decode_and_prefill(rng, dtype):
    p = make_problem(rng, SEQ_LENS, kv_layout="hnd", bias="dense", dtype=dtype, bias_dtype=dtype)
    assert p.key_cache.shape[1:3] == (2, 16)  # [num_blocks, num_kv_heads, block_size, head_size]
    assert_close(cpa.paged_attention(*p.args(), **p.kwargs()), dense_attention(p), dtype)
    q = make_prefill_problem(rng, PREFILL_SEQS, kv_layout="hnd", bias="dense", dtype=dtype, bias_dtype=dtype)
    assert_close(cpa.paged_prefill_attention(*q.args(), **q.kwargs()), dense_prefill_attention(q), dtype)


def test_hnd_cache_write_positions(rng):
    """Element (token t, head h, dim d) of slot b * block_size + o lands at [b, h, o, d]."""
    key, value = (rng.standard_normal((2, 3, 32)).astype(np.float16) for _ in range(2))
    k_cache, v_cache = (np.zeros((4, 3, 8, 32), np.float16) for _ in range(2))
    cpa.reshape_and_cache(key, value, k_cache, v_cache, np.array([2 * 8 + 5, 7], np.int32), kv_layout="hnd")
    np.testing.assert_array_equal(k_cache[2, :, 5], key[0])
    np.testing.assert_array_equal(v_cache[0, :, 7], value[1])
    assert np.count_nonzero(k_cache) == key.size


# ---------------------------------------------------------------------------------------------------------------
# fp8 caches
# ---------------------------------------------------------------------------------------------------------------
def _quantized(p, fmt: str, k_scale: np.ndarray, v_scale: np.ndarray, storage: str):
    """``p`` with fp8 caches (``value / scale`` rounded by ml_dtypes; NaN slots stay NaN) stored as the float8
    dtype or as uint8, and its dense K/V replaced by what the caches hold, dequantized."""
    dtype = FP8[fmt]
    heads_axis = 2 if p.kv_layout == "nhd" else 1
    shape = [1] * p.key_cache.ndim
    shape[heads_axis] = -1
    k8 = (p.key_cache.astype(np.float32) / k_scale.reshape(shape)).astype(dtype)
    v8 = (p.value_cache.astype(np.float32) / v_scale.reshape(shape)).astype(dtype)
    p.key_cache, p.value_cache = (c.view(np.uint8) if storage == "uint8" else c for c in (k8, v8))
    p.dense_k = [(k.astype(np.float32) / k_scale[:, None]).astype(dtype).astype(np.float64) * k_scale[:, None]
                 for k in p.dense_k]
    p.dense_v = [(v.astype(np.float32) / v_scale[:, None]).astype(dtype).astype(np.float64) * v_scale[:, None]
                 for v in p.dense_v]
    return p


@pytest.mark.parametrize(("fmt", "storage", "layout", "scales"), [
    ("fp8_e4m3", "float8", "nhd", "number"), ("fp8_e4m3", "uint8", "hnd", "per-head"),
    ("fp8_e5m2", "float8", "hnd", "one"), ("fp8_e5m2", "uint8", "nhd", "per-head"),
])
def test_fp8_decode_and_prefill_match_dequantized(rng, fmt, storage, layout, scales):
    """Read = fp8 value x its KV head's scale: the reference equals dense attention over the dequantized K/V."""
    p = make_problem(rng, SEQ_LENS, kv_layout=layout, bias="dense", dtype="bf16", bias_dtype="bf16", alibi=True)
    per_head = {"number": np.full(2, 0.37), "one": np.full(2, 0.05), "per-head": np.array([0.02, 0.3])}[scales]
    p = _quantized(p, fmt, per_head.astype(np.float32), (per_head * 1.7).astype(np.float32), storage)
    k_scale, v_scale = {"number": (0.37, 0.37 * 1.7), "one": (np.float32([0.05]), np.float32([0.05 * 1.7])),
                        "per-head": (np.float32([0.02, 0.3]), np.float32([0.02, 0.3]) * np.float32(1.7))}[scales]
    options = {"kv_cache_dtype": fmt if storage == "uint8" else "auto", "k_scale": k_scale, "v_scale": v_scale}
    got = paged_attention_ref(*p.args(), **p.kwargs(), **options)
    np.testing.assert_allclose(got, dense_attention(p), atol=1e-6)  # the scales' float32 products
    assert_close(cpa.paged_attention(*p.args(), **p.kwargs(), **options), dense_attention(p), "bf16")


def test_fp8_quantize_saturates_and_rounds_like_torch(rng):
    """Finite values beyond the format saturate to its largest value (never NaN or inf); rounding equals torch's
    own conversion (round to nearest even) of the float32 quotient; NaN stays NaN."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((64, 2, 32)).astype(np.float32) * 300
    x[0, 0, :4] = (1e30, -1e30, np.inf, -np.inf)
    scale = np.float32([0.5, 3.0])
    for fmt, torch_dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        q = fp8_quantize(x, scale, fmt)
        largest = float(ml_dtypes.finfo(FP8[fmt]).max)
        assert np.isfinite(q.astype(np.float32)).all() and abs(q.astype(np.float32)).max() == largest
        quotient = torch.from_numpy(x) / torch.from_numpy(scale)[:, None]
        ours = torch.from_numpy(q.view(np.uint8))
        theirs = quotient.clamp(-largest, largest).to(torch_dtype).view(torch.uint8)
        assert torch.equal(ours, theirs), fmt
    nan = fp8_quantize(np.float32([[[np.nan]]]), 1.0)
    assert np.isnan(nan.astype(np.float32)).all()


@pytest.mark.parametrize("layout", ["nhd", "hnd", "vllm"])
def test_fp8_cache_write_round_trip(rng, layout):
    """reshape_and_cache into an fp8 cache stores fp8_quantize(value, scale); decoding it equals dense attention
    over the dequantized values; a huge value saturates instead of becoming NaN."""
    p = make_problem(rng, [5, 17, 16], kv_layout=layout, num_heads=4, num_kv_heads=2)
    dtype = FP8["fp8_e4m3"]
    k_cache = np.full(p.key_cache.shape, np.nan, np.float32).astype(dtype)
    v_cache = np.full(p.value_cache.shape, np.nan, np.float32).astype(dtype)
    if layout == "vllm":  # x = 16 // itemsize: 16 for fp8
        n, h, _, b, _ = p.key_cache.shape
        k_cache = np.full((n, h, 64 // 16, b, 16), np.nan, np.float32).astype(dtype)
    k_scale, v_scale = np.float32([0.01, 0.02]), 0.05
    p.dense_k[0][0, 0, 0] = 1e9  # saturates to 448 * 0.01
    keys = np.concatenate(p.dense_k)
    values = np.concatenate(p.dense_v)
    slots = np.asarray([int(p.block_tables[s, j // 16]) * 16 + j % 16 for s, n in enumerate(p.seq_lens)
                        for j in range(n)], np.int32)
    cpa.reshape_and_cache(keys, values, k_cache, v_cache, slots, kv_layout=layout, k_scale=k_scale, v_scale=v_scale)
    p.key_cache, p.value_cache = k_cache, v_cache
    p.dense_k = [fp8_quantize(k, k_scale).astype(np.float64) * k_scale[:, None] for k in p.dense_k]
    p.dense_v = [fp8_quantize(v, v_scale).astype(np.float64) * v_scale for v in p.dense_v]
    assert p.dense_k[0][0, 0, 0] == pytest.approx(448 * 0.01, rel=1e-6)
    got = paged_attention_ref(*p.args(), **p.kwargs(), k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_allclose(got, dense_attention(p), atol=1e-6)


def test_fp8_torch_cpu_tensors_through_the_reference(rng):
    """torch's float8 dtypes reach the reference through to_numpy (the bits, viewed as ml_dtypes')."""
    torch = pytest.importorskip("torch")
    p = _quantized(make_problem(rng, [7, 20]), "fp8_e4m3", np.float32([0.1, 0.2]), np.float32([0.3, 0.4]), "float8")
    args = [torch.from_numpy(p.query), *(torch.from_numpy(c.view(np.uint8)).view(torch.float8_e4m3fn)
                                         for c in (p.key_cache, p.value_cache)),
            torch.from_numpy(p.block_tables), torch.from_numpy(p.seq_lens)]
    got = paged_attention_ref(*args, k_scale=torch.tensor([0.1, 0.2]), v_scale=torch.tensor([0.3, 0.4]))
    np.testing.assert_allclose(got, dense_attention(p), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Argument errors
# ---------------------------------------------------------------------------------------------------------------
def _fp8_problem(rng):
    return _quantized(make_problem(rng, [5, 9]), "fp8_e4m3", np.float32([1.0, 1.0]), np.float32([1.0, 1.0]),
                      "uint8")


OPTION_ERRORS = [
    *((TypeError, r"logits_soft_cap: expected None or a finite number > 0, got (bool|str)", {"logits_soft_cap": c})
      for c in (True, "30")),
    *((ValueError, r"logits_soft_cap: expected None \(no cap\) or a finite number > 0, got", {"logits_soft_cap": c})
      for c in (0, 0.0, -1.0, float("inf"), float("nan"))),
    *((TypeError, r"window_left: expected None or an int >= 0, got (bool|float)", {"window_left": w})
      for w in (True, 1.5)),
    (ValueError, r"window_left: expected None \(no window\) or an int >= 0, got -1", {"window_left": -1}),
    *((ValueError, r"kv_cache_dtype: expected one of 'auto', 'fp8_e4m3', 'fp8_e5m2', got", {"kv_cache_dtype": d})
      for d in ("fp8", "FP8_E4M3", None, "float8_e4m3fn")),
    (ValueError, r"key_cache: expected dtype float8_e4m3fn or uint8 \(kv_cache_dtype='fp8_e4m3'\), got float32",
     {"kv_cache_dtype": "fp8_e4m3"}),
    (ValueError, r"k_scale: only fp8 caches are scaled", {"k_scale": 1.0}),
    (ValueError, r"v_scale: only fp8 caches are scaled", {"v_scale": np.float32([1.0])}),
]


@pytest.mark.parametrize(("error", "match", "options"), OPTION_ERRORS)
@pytest.mark.parametrize("entry", ["decode", "prefill"])
def test_option_errors(rng, entry, error, match, options):
    if entry == "decode":
        p = make_problem(rng, [5, 9])
        call = lambda: cpa.paged_attention(*p.args(), **p.kwargs(), **options)  # noqa: E731
    else:
        q = make_prefill_problem(rng, [(5, 2), (9, 9)])
        call = lambda: cpa.paged_prefill_attention(*q.args(), **q.kwargs(), **options)  # noqa: E731
    with pytest.raises(error, match=match):
        call()


FP8_ERRORS = [
    (ValueError, r"key_cache: expected dtype float32 \(the query's\) or float8_e4m3fn / float8_e5m2, got uint8",
     {}),
    (ValueError, r"key_cache: expected dtype float8_e5m2 or uint8 \(kv_cache_dtype='fp8_e5m2'\), got float8_e4m3fn",
     {"kv_cache_dtype": "fp8_e5m2", "view": True}),
    *((ValueError, r"k_scale: expected a finite number > 0, got", {"k_scale": s}) for s in (0.0, -2.0, float("inf"))),
    (ValueError, r"v_scale: expected shape \(1,\) or \(num_kv_heads=2,\), got \(3,\)",
     {"v_scale": np.float32([1, 2, 3])}),
    (ValueError, r"k_scale: expected dtype float32, got float64", {"k_scale": np.float64([1.0])}),
    (TypeError, r"k_scale: expected a NumPy, CuPy, PyTorch or JAX array, got builtins\.str", {"k_scale": "1"}),
    (ValueError, r"v_scale: expected finite values > 0, got 0.0 at index 1", {"v_scale": np.float32([1.0, 0.0])}),
]


@pytest.mark.parametrize(("error", "match", "options"), FP8_ERRORS)
def test_fp8_errors(rng, error, match, options):
    p = _fp8_problem(rng)
    options = {"kv_cache_dtype": "fp8_e4m3", **options}
    if options.pop("view", False):
        p.key_cache, p.value_cache = (c.view(ml_dtypes.float8_e4m3fn) for c in (p.key_cache, p.value_cache))
    if "expected dtype float32 (the query's)" in match.replace("\\", ""):
        options["kv_cache_dtype"] = "auto"
    with pytest.raises(error, match=match):
        cpa.paged_attention(*p.args(), **p.kwargs(), **options)


def test_fp8_cache_write_errors(rng):
    key = rng.standard_normal((2, 2, 32)).astype(np.float32)
    caches = [np.zeros((4, 8, 2, 32), ml_dtypes.float8_e5m2) for _ in range(2)]
    slots = np.int32([1, 2])
    with pytest.raises(ValueError, match=r"k_scale: expected finite values > 0, got nan at index 0"):
        cpa.reshape_and_cache(key, key, *caches, slots, k_scale=np.float32([np.nan]))
    with pytest.raises(ValueError, match=r"value_cache: expected dtype float8_e5m2"):
        cpa.reshape_and_cache(key, key, caches[0], caches[1].view(np.uint8), slots)
    with pytest.raises(ValueError, match=r"v_scale: only fp8 caches are scaled"):
        cpa.reshape_and_cache(key, key, *(np.zeros((4, 8, 2, 32), np.float32) for _ in range(2)), slots,
                              v_scale=2.0)
