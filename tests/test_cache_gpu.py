"""GPU: reshape_and_cache against the NumPy reference, for CuPy, PyTorch and JAX, both layouts, both slot dtypes; a
split decode run right after it reads what it wrote."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DTYPES, assert_close, make_problem
from test_decode_gpu import device_args, to_cupy, to_torch

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import paged_attention_ref, reshape_and_cache_ref, to_numpy

pytestmark = pytest.mark.gpu

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS = 7, 16, 3


def make_inputs(rng, dtype, layout, head_size, num_tokens=40):
    np_dtype = DTYPES[dtype]
    key = rng.standard_normal((num_tokens, NUM_KV_HEADS, head_size)).astype(np_dtype)
    value = rng.standard_normal((num_tokens, NUM_KV_HEADS, head_size)).astype(np_dtype)
    if layout == "nhd":
        shape_k = shape_v = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    elif layout == "hnd":
        shape_k = shape_v = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, head_size)
    else:
        x = 16 // np.dtype(np_dtype).itemsize
        shape_k = (NUM_BLOCKS, NUM_KV_HEADS, head_size // x, BLOCK_SIZE, x)
        shape_v = (NUM_BLOCKS, NUM_KV_HEADS, head_size, BLOCK_SIZE)
    k_cache = rng.standard_normal(shape_k).astype(np_dtype)
    v_cache = rng.standard_normal(shape_v).astype(np_dtype)
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens].astype(np.int64)
    slots[::7] = -1  # padding tokens
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", ["nhd", "vllm", "hnd"])
@pytest.mark.parametrize(("dtype", "head_size"), [("bf16", 128), ("f16", 80), ("f32", 256), ("f32", 32)])
def test_cupy_matches_reference(rng, dtype, head_size, layout, slot_dtype):
    key, value, k_cache, v_cache, slots = make_inputs(rng, dtype, layout, head_size)
    slots = slots.astype(slot_dtype)
    dk, dv = to_cupy(k_cache), to_cupy(v_cache)
    result = cpa.reshape_and_cache(to_cupy(key), to_cupy(value), dk, dv, to_cupy(slots), kv_layout=layout)
    assert result[0] is dk and result[1] is dv
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots, kv_layout=layout)
    np.testing.assert_array_equal(to_numpy(dk).view(np.uint8), k_cache.view(np.uint8))
    np.testing.assert_array_equal(to_numpy(dv).view(np.uint8), v_cache.view(np.uint8))


@pytest.mark.parametrize("layout", ["nhd", "vllm", "hnd"])
def test_torch_in_place_with_strided_key(rng, layout):
    torch = pytest.importorskip("torch")
    key, value, k_cache, v_cache, slots = make_inputs(rng, "bf16", layout, 64)
    tk, tv = to_torch(k_cache), to_torch(v_cache)
    wide = torch.zeros((key.shape[0], NUM_KV_HEADS, 2 * 64), dtype=torch.bfloat16, device="cuda")
    wide[:, :, 64:] = to_torch(key)
    cpa.reshape_and_cache(wide[:, :, 64:], to_torch(value), tk, tv, to_torch(slots), kv_layout=layout)
    torch.cuda.synchronize()
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots, kv_layout=layout)
    np.testing.assert_array_equal(to_numpy(tk).view(np.uint16), k_cache.view(np.uint16))
    np.testing.assert_array_equal(to_numpy(tv).view(np.uint16), v_cache.view(np.uint16))


def test_jax_returns_new_caches(rng):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU")
    jnp = jax.numpy
    key, value, k_cache, v_cache, slots = make_inputs(rng, "f16", "nhd", 64)
    jk, jv = jnp.asarray(k_cache), jnp.asarray(v_cache)
    new_k, new_v = cpa.reshape_and_cache(jnp.asarray(key), jnp.asarray(value), jk, jv,
                                         jnp.asarray(slots.astype(np.int32)))
    assert isinstance(new_k, jax.Array)
    np.testing.assert_array_equal(np.asarray(jk), k_cache)  # the arguments are untouched
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots)
    np.testing.assert_array_equal(np.asarray(new_k), k_cache)
    np.testing.assert_array_equal(np.asarray(new_v), v_cache)


def test_out_of_range_slot_is_skipped_on_gpu(rng):
    import cupy

    key, value, k_cache, v_cache, slots = make_inputs(rng, "f32", "nhd", 64, num_tokens=4)
    slots = np.array([3, NUM_BLOCKS * BLOCK_SIZE, 2**40, -2], np.int64)
    dk, dv = to_cupy(k_cache), to_cupy(v_cache)
    cpa.reshape_and_cache(to_cupy(key), to_cupy(value), dk, dv, to_cupy(slots))
    cupy.cuda.get_current_stream().synchronize()
    expected = k_cache.copy()
    expected[0, 3] = key[0]
    np.testing.assert_array_equal(to_numpy(dk), expected)
    with pytest.raises(ValueError, match=r"slot_mapping: token 1 has slot 112, outside the cache's 112 slots"):
        cpa.reshape_and_cache(to_cupy(key), to_cupy(value), dk, dv, to_cupy(slots), validate=True)


@pytest.mark.parametrize("kernel", ["simt", "tensor-cores"])
def test_split_decode_reads_the_token_written_just_before(rng, tune, kernel):
    """A decode step: each sequence's newest key and value written by reshape_and_cache, then a split attention run
    at once. The attention kernel is launched as a dependent of the cache write (which lets it launch early, on
    devices that have programmatic dependent launch) and must still read the new token."""
    import cupy

    tune(num_sms=10**6, decode_kernel=kernel)
    p = make_problem(rng, [700, 3, 300], num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense",
                     bias_dtype="bf16")
    args, kwargs = device_args(p, to_cupy)
    plan = cpa.DecodePlan(*args, **kwargs)
    assert plan.launch.num_parts > 1
    block = p.key_cache.shape[1]
    lens = p.seq_lens.astype(np.int64)
    blocks = p.block_tables[np.arange(len(lens)), (lens - 1) // block]
    slots = blocks * block + (lens - 1) % block  # each sequence's last position
    for step in range(3):
        new_k = rng.standard_normal((len(lens), 2, 64)).astype(p.key_cache.dtype)
        new_v = rng.standard_normal((len(lens), 2, 64)).astype(p.key_cache.dtype)
        p.key_cache[blocks, (lens - 1) % block] = new_k
        p.value_cache[blocks, (lens - 1) % block] = new_v
        cpa.reshape_and_cache(to_cupy(new_k), to_cupy(new_v), args[1], args[2], cupy.asarray(slots))
        out = to_numpy(plan.run(*args, **{k: kwargs[k] for k in ("attn_bias", "alibi_slopes")}))
        assert_close(out, paged_attention_ref(*p.args(), **p.kwargs()), "bf16", f"step {step}")
