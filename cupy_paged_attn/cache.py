"""The paged caches' own kernels: ``reshape_and_cache`` writes new tokens' keys and values into their slots;
:func:`dequantize_pages` gives prefill the pages of fp8 caches that it reads, in the query's dtype."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _checks, _compile, _interop, _launch, _specs, reference

__all__ = ["reshape_and_cache"]

def _vector_ready(arr: Any) -> Any:
    """``arr`` if the kernel can read it in 16-byte vectors (unit last stride, aligned rows), else a copy."""
    vec = 16 // arr.dtype.itemsize
    strides = _checks.element_strides(arr)
    if strides[-1] == 1 and strides[0] % vec == 0 and strides[1] % vec == 0 and _interop.data_ptr(arr) % 16 == 0:
        return arr
    return _interop.contiguous(arr)


def reshape_and_cache(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    *,
    kv_layout: str = "nhd",
    kv_cache_dtype: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
    validate: bool = False,
) -> tuple[Any, Any]:
    """Write ``key[t]`` and ``value[t]`` into cache slot ``slot_mapping[t]`` (vLLM's ``reshape_and_cache``).

    ``slot = block * block_size + offset``: the token lands in row ``offset`` of page ``block``. Negative slots
    (padding) are skipped.

    Parameters
    ----------
    key, value : arrays ``[num_tokens, num_kv_heads, head_size]``, float16 / bfloat16 / float32, one dtype
    key_cache, value_cache : arrays of the key's dtype, or fp8, in ``kv_layout`` (see :func:`paged_attention`)
        torch, CuPy and NumPy caches are written in place. JAX arrays are immutable: new caches are returned and
        the arguments are left as they were.
    slot_mapping : array ``[num_tokens]``, int32 or int64
    kv_layout : {"nhd", "vllm", "hnd"}
    kv_cache_dtype, k_scale, v_scale
        As in :func:`paged_attention`. An fp8 cache stores ``value / scale`` computed in float32, saturated to the
        format's largest finite value (finite input never becomes NaN or inf), rounded to nearest even
        (:func:`cupy_paged_attn.reference.fp8_quantize`), on the GPU as on the NumPy path.
    validate : bool
        Also check that no slot lies past the cache (``ValueError`` naming the first such token). Copies
        ``slot_mapping`` to the host: a synchronisation, off by default. The NumPy path always does it.

    Returns
    -------
    (key_cache, value_cache)
        The caches written: the arguments themselves for torch, CuPy and NumPy; new arrays for JAX.

    Raises
    ------
    TypeError
        Not arrays, or arrays of different frameworks.
    ValueError
        Shapes (key and value alike, caches of the key's num_kv_heads and head_size, slot_mapping ``[num_tokens]``),
        dtypes (caches of the key's dtype, slot_mapping int32/int64), cache contiguity within a page and alignment,
        ``kv_layout``, devices. On the NumPy path also a slot past the cache.
    NotImplementedError
        An unsupported head_size or block_size.

    Notes
    -----
    On the GPU, unless ``validate=True``, a slot past the cache (``>= num_blocks * block_size``) is skipped rather
    than written, since checking it on the host would need a sync.
    """
    options, scale_arrays = _checks.serving_options(None, None, kv_cache_dtype, k_scale, v_scale)
    named = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
             "slot_mapping": slot_mapping, **scale_arrays}
    framework = _interop.common_framework(named, optional=())
    if framework == "numpy":
        return reference.reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping, kv_layout=kv_layout,
                                               **options)

    device = _interop.device_of("key", key, framework)
    with _interop.launch_context(framework, device, None) as stream:
        arr = _interop.wrap_all(named, framework)
        problem = _checks.check_cache_write(
            arr["key"], arr["value"], arr["key_cache"], arr["value_cache"], arr["slot_mapping"], kv_layout,
            kv_cache_dtype, *(arr.get(name, options.get(name)) for name in ("k_scale", "v_scale")),
        )
        _checks.check_kernel_support(problem.cache, problem.dtype, "cache write")
        if validate:
            _checks.check_slots_host(dataclasses.replace(problem, slot_mapping=reference.to_numpy(slot_mapping)))
        k_cache, v_cache = problem.key_cache, problem.value_cache
        if framework == "jax":  # never write into memory JAX owns
            k_cache, v_cache = k_cache.copy(), v_cache.copy()
        if problem.num_tokens:
            slot_dtype = "i64" if np.dtype(problem.slot_mapping.dtype) == np.int64 else "i32"
            spec = _specs.CacheWriteSpec(problem.dtype, problem.kv_layout, slot_dtype, problem.cache.fp8)
            (kernel,) = _compile.kernels(spec, device)
            k, v = _vector_ready(problem.key), _vector_ready(problem.value)
            slots = _interop.unit_last_stride(problem.slot_mapping)
            ks, vs = _checks.element_strides(k), _checks.element_strides(v)
            ptr, i64, i32 = _interop.kernel_arg, np.int64, np.int32
            scale_arrays = _scale_arrays(problem)  # (kept here until the launch is queued)
            args = _launch.PackedArgs([
                ("key", ptr(k)), ("key.stride_t", i64(ks[0])), ("key.stride_h", i64(ks[1])), ("value", ptr(v)),
                ("value.stride_t", i64(vs[0])), ("value.stride_h", i64(vs[1])), ("key_cache", ptr(k_cache)),
                ("value_cache", ptr(v_cache)), ("block_stride", i64(problem.cache.block_stride)),
                ("slot_mapping", ptr(slots)), ("num_kv_heads", i32(problem.cache.num_kv_heads)),
                ("head_size", i32(problem.cache.head_size)), ("block_size", i32(problem.cache.block_size)),
                ("num_blocks", i32(problem.cache.num_blocks)),
                *_scale_args(problem, scale_arrays),
            ])
            _launch.Launch(_launch.function_of(kernel), (problem.num_tokens, 1, 1), spec.threads, args).launch(
                stream.ptr)
    if framework == "jax":
        return _interop.finish("jax", k_cache), _interop.finish("jax", v_cache)
    return key_cache, value_cache


def _scale_arrays(problem: Any) -> dict[str, Any]:
    """A checked problem's fp8 scales given as arrays, by operand name, each with a unit last stride (a copy where it
    had none: the caller keeps them until its launch is queued)."""
    return {name: _interop.unit_last_stride(scale.array)
            for name, scale in (("k_scale", problem.k_scale), ("v_scale", problem.v_scale))
            if scale is not None and scale.array is not None}


def _scale_args(problem: Any, scale_arrays: dict[str, Any]) -> list[tuple[str, np.generic]]:
    """The kernel's fp8 scale parameters (_launch.kv_scale_args), pointing at ``scale_arrays``."""
    return _launch.kv_scale_args(problem.k_scale, problem.v_scale,
                                 {name: _interop.data_ptr(x) for name, x in scale_arrays.items()})


def dequantize_pages(problem: _checks.PrefillProblem, framework: str, like: Any, stream: Any,
                     device: int) -> _checks.PrefillProblem:
    """``problem`` (checked, fp8 caches) over new caches in the query's dtype and the NHD layout that hold the pages
    its sequences read, dequantized on ``stream``: page ``s * max_blocks_per_seq + i`` for entry ``i`` of sequence
    ``s``'s block table, and a block table of those pages (-1 for entries past the sequence's length or outside the
    cache, which the attention kernels skip). No device data is read on the host. The new caches hold
    ``num_seqs * max_blocks_per_seq`` pages of ``block_size * num_kv_heads * head_size`` elements each, allocated
    in the caller's framework for ``stream`` (the returned problem owns them until the launches that read them are
    queued).
    """
    c = problem.cache
    pages = problem.num_seqs * problem.max_blocks_per_seq
    shape = (pages, c.block_size, c.num_kv_heads, c.head_size)
    key_out = _interop.empty(framework, shape, problem.query.dtype, like, stream)[1]
    value_out = _interop.empty(framework, shape, problem.query.dtype, like, stream)[1]
    table = _interop.empty(framework, (problem.num_seqs, problem.max_blocks_per_seq), np.int32, like, stream)[1]
    spec = _specs.CacheDequantizeSpec(problem.dtype, c.fp8, c.head_size, problem.kv_layout)
    (kernel,) = _compile.kernels(spec, device)
    tables, lens = _interop.unit_last_stride(problem.block_tables), _interop.unit_last_stride(problem.seq_lens)
    scale_arrays = _scale_arrays(problem)
    ptr, i64, i32 = _interop.kernel_arg, np.int64, np.int32
    args = _launch.PackedArgs([
        ("key_out", ptr(key_out)), ("value_out", ptr(value_out)), ("table_out", ptr(table)),
        ("key_cache", ptr(problem.key_cache)), ("value_cache", ptr(problem.value_cache)),
        ("block_stride", i64(c.block_stride)), ("num_blocks", i32(c.num_blocks)),
        ("block_shift", i32(c.block_size.bit_length() - 1)), ("num_kv_heads", i32(c.num_kv_heads)),
        ("block_tables", ptr(tables)), ("block_tables.stride", i64(_checks.element_strides(tables)[0])),
        ("seq_lens", ptr(lens)), ("max_blocks", i32(problem.max_blocks_per_seq)),
        *_scale_args(problem, scale_arrays),
    ])
    _launch.Launch(_launch.function_of(kernel), (pages, 1, 1), spec.threads, args).launch(stream.ptr)
    geometry = _checks.CacheGeometry(pages, c.block_size, c.num_kv_heads, c.head_size,
                                     c.block_size * c.num_kv_heads * c.head_size)
    return dataclasses.replace(problem, key_cache=key_out, value_cache=value_out, block_tables=table,
                               kv_layout="nhd", cache=geometry, k_scale=None, v_scale=None)
