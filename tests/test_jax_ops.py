"""``cupy_paged_attn.jax`` inside ``jax.jit``: on the CPU (the buffer callback runs the float64 reference) wherever
jax is installed, and on the GPU (marker ``gpu``, the kernels on XLA's stream) against the reference. Errors are
raised at trace time, with the library's messages."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import assert_close, assert_same, convert_bias, make_problem
from prefill_helpers import make_prefill_problem

from cupy_paged_attn.reference import (
    paged_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
    to_numpy,
)

jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")
cpj = pytest.importorskip("cupy_paged_attn.jax")
jnp = jax.numpy

gpu = pytest.mark.gpu
SEQ_LENS = [1, 17, 0, 300]
PREFILL_SEQS = [(40, 7), (17, 17), (5, 1), (0, 0)]


def _devices(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:
        return []


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=gpu)])
def device(request):
    """Where the arrays live: committed arrays make jit run there."""
    found = _devices(request.param)
    if not found:
        pytest.skip(f"jax has no {request.param} device")
    return found[0]


def put(device, arr):
    return None if arr is None else jax.device_put(np.ascontiguousarray(arr), device)


def decode_args(p, device):
    kwargs = p.kwargs()
    return ([put(device, a) for a in p.args()],
            {"scale": kwargs["scale"], "kv_layout": kwargs["kv_layout"], "alibi_slopes": put(device, p.alibi_slopes),
             "attn_bias": convert_bias(kwargs["attn_bias"], functools.partial(put, device))})


def test_missing_buffer_callback_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "jax.experimental.buffer_callback", None)
    with pytest.raises(ImportError, match=r"buffer_callback, added in jax 0\.6\.1; this is jax"):
        cpj._buffer_callback()


@pytest.mark.parametrize("bias", ["none", "dense", "ragged", "t5-causal", "t5-traced"])
def test_decode_under_jit(rng, device, bias):
    dtype = "bf16" if device.platform == "gpu" else "f32"
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype,
                     bias="t5-causal" if bias == "t5-traced" else bias, bias_dtype="f32", alibi=True)
    args, kwargs = decode_args(p, device)

    if bias == "t5-traced":  # the table is an argument of the jitted function: a tracer
        t5 = p.bias_kind

        @jax.jit
        def run(q, kc, vc, bt, sl, table, slopes):
            bias = cpj.relative_position_bias(table, num_buckets=t5.num_buckets, max_distance=t5.max_distance,
                                              bidirectional=t5.bidirectional)
            return cpj.paged_attention(q, kc, vc, bt, sl, attn_bias=bias, alibi_slopes=slopes)

        out = run(*args, put(device, t5.table), kwargs["alibi_slopes"])
    else:
        run = jax.jit(functools.partial(cpj.paged_attention, **kwargs))
        out = run(*args)
        out = run(*args)  # the cached executable
    assert isinstance(out, jax.Array) and out.dtype == args[0].dtype and out.devices() == {device}
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs()), dtype, bias)


@pytest.mark.parametrize("bias", ["none", "dense", "t5-bidir"])
def test_prefill_under_jit(rng, device, bias):
    dtype = "f16" if device.platform == "gpu" else "f32"
    p = make_prefill_problem(rng, PREFILL_SEQS, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype, bias=bias,
                             alibi=True, causal=bias != "t5-bidir")
    kwargs = dict(p.kwargs())
    kwargs["attn_bias"] = convert_bias(kwargs["attn_bias"], functools.partial(put, device))
    kwargs["alibi_slopes"] = put(device, p.alibi_slopes)
    out = jax.jit(functools.partial(cpj.paged_prefill_attention, **kwargs))(*(put(device, a) for a in p.args()))
    assert_close(to_numpy(out), paged_prefill_attention_ref(*p.args(), **p.kwargs()), dtype, bias)


@pytest.mark.parametrize(("bias", "options"), [("t5-bidir", {"logits_soft_cap": 5.0, "window_left": 20}),
                                               ("dense", {"window_left": 0}), ("ragged", {"logits_soft_cap": 2.5})])
def test_score_options_under_jit(rng, device, bias, options):
    """Soft-cap and sliding window are static options of the decode and the prefill."""
    dtype = "bf16" if device.platform == "gpu" else "f32"
    p = make_problem(rng, [300, 1, 77, 1200], num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype, bias=bias,
                     bias_dtype="f32", alibi=True)
    args, kwargs = decode_args(p, device)
    out = jax.jit(functools.partial(cpj.paged_attention, **kwargs, **options))(*args)
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs(), **options), dtype, bias)
    if bias == "ragged":  # (a decode bias)
        return
    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=8, num_kv_heads=2, head_size=128, dtype=dtype,
                              bias=bias, alibi=True)
    kw = dict(pp.kwargs())
    kw["attn_bias"] = convert_bias(kw["attn_bias"], functools.partial(put, device))
    kw["alibi_slopes"] = put(device, pp.alibi_slopes)
    out = jax.jit(functools.partial(cpj.paged_prefill_attention, **kw, **options))(*(put(device, a) for a in pp.args()))
    assert_close(to_numpy(out), paged_prefill_attention_ref(*pp.args(), **pp.kwargs(), **options), dtype, bias)


@pytest.mark.parametrize("donate", [False, True])
def test_cache_write_then_decode_under_jit(rng, device, donate):
    """reshape_and_cache is functional (new caches; the old ones intact unless donated) and feeds the decode."""
    dtype = "bf16" if device.platform == "gpu" else "f32"
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype, bias="dense")
    args, kwargs = decode_args(p, device)
    bs = p.key_cache.shape[1]
    key = rng.standard_normal((len(SEQ_LENS), 2, 64)).astype(p.key_cache.dtype)
    value = rng.standard_normal(key.shape).astype(p.key_cache.dtype)
    slots = np.array([-1 if n == 0 else p.block_tables[s, (n - 1) // bs] * bs + (n - 1) % bs
                      for s, n in enumerate(p.seq_lens.tolist())], np.int32)
    k_ref, v_ref = reshape_and_cache_ref(key, value, p.key_cache.copy(), p.value_cache.copy(), slots)

    def step(q, kc, vc, bt, sl, bias, k, v, slot):
        kc, vc = cpj.reshape_and_cache(k, v, kc, vc, slot)
        return cpj.paged_attention(q, kc, vc, bt, sl, attn_bias=bias), kc, vc

    run = jax.jit(step, donate_argnums=(1, 2) if donate else ())
    out, k_new, v_new = run(*args, kwargs["attn_bias"], *(put(device, a) for a in (key, value, slots)))
    assert_same(to_numpy(k_new), k_ref)
    assert_same(to_numpy(v_new), v_ref)
    expected = paged_attention_ref(p.query, k_ref, v_ref, p.block_tables, p.seq_lens, attn_bias=p.attn_bias)
    assert_close(to_numpy(out), expected, dtype)
    if not donate:
        assert_same(to_numpy(args[1]), p.key_cache)  # the input is left as it was


def test_errors_at_trace_time(rng):
    cpu = _devices("cpu")[0]
    p = make_problem(rng, [5, 3], num_heads=4, num_kv_heads=2, bias="dense")
    args, _ = decode_args(p, cpu)
    with pytest.raises(ValueError, match=r"attn_bias: expected shape \(num_seqs=2, num_heads=4"):
        jax.jit(cpj.paged_attention).lower(*args, attn_bias=jnp.zeros((2, 3, 9)))
    with pytest.raises(ValueError, match="block_tables: expected dtype"):
        jax.jit(cpj.paged_attention).lower(*args[:3], args[3].astype(jnp.float32), args[4])
    with pytest.raises(ValueError, match="slot_mapping"):
        cpj.reshape_and_cache(args[1][0], args[1][0], args[1], args[2], jnp.zeros(3, jnp.int32))


def test_fp8_caches_under_jit(device, rng):
    """float8 caches (bitcast to uint8 on their way to the kernels) with a scale array and a static number: decode,
    prefill and the cache write, which returns float8 caches."""
    from helpers import dense_attention

    from cupy_paged_attn.reference import fp8_quantize

    scale = np.float32([0.05, 0.2])
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense")
    k8, v8 = (fp8_quantize(c.astype(np.float32), scale) for c in (p.key_cache, p.value_cache))
    p.dense_k = [fp8_quantize(k, scale).astype(np.float64) * scale[:, None] for k in p.dense_k]
    p.dense_v = [fp8_quantize(v, scale).astype(np.float64) * scale[:, None] for v in p.dense_v]
    args, kwargs = decode_args(p, device)
    args[1], args[2] = put(device, k8), put(device, v8)
    run = jax.jit(lambda *a, s: cpj.paged_attention(*a, **kwargs, k_scale=s, v_scale=s))
    assert_close(to_numpy(run(*args, s=put(device, scale))), dense_attention(p), "bf16", "decode")

    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=4, num_kv_heads=2, head_size=64, dtype="f16")
    pk8, pv8 = (fp8_quantize(c.astype(np.float32), 0.25, "fp8_e5m2") for c in (pp.key_cache, pp.value_cache))
    pargs = [put(device, a) for a in (pp.query, pk8, pv8, *pp.args()[3:])]
    out = jax.jit(lambda *a: cpj.paged_prefill_attention(*a, k_scale=0.25, v_scale=0.25))(*pargs)
    expected = paged_prefill_attention_ref(pp.query, pk8, pv8, *pp.args()[3:], k_scale=0.25, v_scale=0.25)
    assert_close(to_numpy(out), expected, "f16", "prefill")

    key = rng.standard_normal((5, 2, 64)).astype(np.float32)
    slots = np.int32([3, 17, -1, 40, 63])
    empty = np.zeros((4, 16, 2, 64), np.float32).astype(k8.dtype)
    k_out, v_out = jax.jit(lambda *a: cpj.reshape_and_cache(*a, k_scale=put(device, scale), v_scale=0.5))(
        *(put(device, a) for a in (key, key * 2, empty, empty, slots)))
    want_k, want_v = reshape_and_cache_ref(key, key * 2, empty.copy(), empty.copy(), slots, k_scale=scale,
                                           v_scale=0.5)
    assert k_out.dtype == empty.dtype
    np.testing.assert_array_equal(np.asarray(k_out).view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(v_out).view(np.uint8), want_v.view(np.uint8))
