"""JAX operations callable inside ``jax.jit``, through ``jax.experimental.buffer_callback`` (jax >= 0.6.1).

:func:`cupy_paged_attn.paged_attention` takes concrete JAX arrays (eager) but not tracers. The functions here put
the same computations into a jitted program: at trace time the arguments are checked from their shapes and dtypes
(the library's own checks and messages) and a ``buffer_callback`` is staged; at run time XLA hands the callback its
device buffers and its CUDA stream, and the kernels launch on that stream, writing straight into XLA's output
buffer (no copy, no host round trip). Arrays on the CPU run the float64 NumPy reference the same way.

``reshape_and_cache`` is functional: it returns the new caches. The caches are aliased to the outputs
(``input_output_aliases``), so under ``jax.jit(..., donate_argnums=...)`` of the caches the write happens in place;
without donation XLA copies them first.

There are no autodiff or vmap rules (inference kernels). Use int32 block tables, seq_lens and offsets (JAX's
default integers).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _checks, _interop
from . import cache as _cache
from . import decode as _decode
from . import prefill as _prefill
from .bias import RaggedBias, RelativePositionBias, t5_bucket_table

__all__ = ["paged_attention", "paged_prefill_attention", "relative_position_bias", "reshape_and_cache"]

_MIN_JAX = (0, 6, 1)
_KDL_CPU = 1


def _buffer_callback() -> Callable[..., Any]:
    """``jax.experimental.buffer_callback.buffer_callback``, or a clear error naming the jax version it needs."""
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as exc:
        raise ImportError(
            f"cupy_paged_attn.jax needs jax.experimental.buffer_callback, added in jax "
            f"{'.'.join(map(str, _MIN_JAX))}; this is jax {jax.__version__} (pip install -U 'jax>=0.6.1')"
        ) from exc
    return buffer_callback


# ---------------------------------------------------------------------------------------------------------------
# Bias kinds as operands (traced arrays) and static facts (hashable, part of the staged callback)
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _BiasSpec:
    """What the callback needs to rebuild ``attn_bias`` from its buffers."""

    kind: str  # "none" | "dense" | "ragged" | "t5"
    num_buckets: int = 0
    max_distance: int = 0
    bidirectional: bool = False

    @property
    def num_arrays(self) -> int:
        return {"none": 0, "dense": 1, "ragged": 2, "t5": 2}[self.kind]

    def rebuild(self, arrays: list[Any]) -> Any:
        if self.kind == "none":
            return None
        if self.kind == "dense":
            return arrays[0]
        if self.kind == "ragged":
            return RaggedBias(*arrays)
        return RelativePositionBias.from_buckets(arrays[0], arrays[1], num_buckets=self.num_buckets,
                                                 max_distance=self.max_distance, bidirectional=self.bidirectional)


def _split_bias(attn_bias: Any) -> tuple[_BiasSpec, list[Any]]:
    if attn_bias is None:
        return _BiasSpec("none"), []
    if isinstance(attn_bias, RaggedBias):
        return _BiasSpec("ragged"), [attn_bias.values, attn_bias.offsets]
    if isinstance(attn_bias, RelativePositionBias):
        spec = _BiasSpec("t5", attn_bias.num_buckets, attn_bias.max_distance, attn_bias.bidirectional)
        return spec, [attn_bias.table, attn_bias.buckets]
    return _BiasSpec("dense"), [attn_bias]


# ---------------------------------------------------------------------------------------------------------------
# fp8 caches: float8 arrays travel as uint8 (a bitcast, free under jit: CuPy has no float8 dtype) with their format
# static; a scale is a static number or an operand
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Fp8Spec:
    """The static part of a call's fp8 options: the format (``"auto"``: no fp8 cache), each scale's number (None:
    none given, or its array is an operand, after the bias's and ALiBi's: ``k_array`` / ``v_array``)."""

    kv_cache_dtype: str = "auto"
    k_scale: float | None = None
    v_scale: float | None = None
    k_array: bool = False
    v_array: bool = False

    def options(self, arrays: list[Any]) -> dict[str, Any]:
        """The library's keyword arguments, with the scale arrays (``arrays``: the trailing operands) put back."""
        if self.kv_cache_dtype == "auto":
            return {}
        rest = iter(arrays)
        return {"kv_cache_dtype": self.kv_cache_dtype,
                "k_scale": next(rest) if self.k_array else self.k_scale,
                "v_scale": next(rest) if self.v_array else self.v_scale}


def _split_fp8(key_cache: Any, value_cache: Any, kv_cache_dtype: str, k_scale: Any, v_scale: Any
               ) -> tuple[_Fp8Spec, Any, Any, list[Any]]:
    """``(spec, key_cache, value_cache, scale operands)``: float8 caches bitcast to uint8 with their format named
    (``kv_cache_dtype`` "auto" takes it from the dtype), number scales static."""
    fmt = kv_cache_dtype
    if isinstance(fmt, str) and fmt == "auto" and np.dtype(value_cache.dtype) == np.dtype(key_cache.dtype):
        fmt = {v: k for k, v in _checks.FP8_FORMATS.items()}.get(np.dtype(key_cache.dtype), "auto")
    if not isinstance(fmt, str) or fmt not in _checks.FP8_FORMATS:  # none (the checks name what is wrong)
        return _Fp8Spec(), key_cache, value_cache, []
    caches = [jax.lax.bitcast_convert_type(c, np.uint8) if np.dtype(c.dtype).itemsize == 1 and
              np.dtype(c.dtype) != np.uint8 else c for c in (key_cache, value_cache)]
    arrays = [x for x in (k_scale, v_scale) if x is not None and hasattr(x, "shape")]
    spec = _Fp8Spec(fmt, *(None if x is None or hasattr(x, "shape") else float(x) for x in (k_scale, v_scale)),
                    hasattr(k_scale, "shape"), hasattr(v_scale, "shape"))
    return spec, caches[0], caches[1], arrays


def relative_position_bias(table: jax.Array, *, num_buckets: int = 32, max_distance: int = 128,
                           bidirectional: bool = False) -> RelativePositionBias:
    """T5's bias for the functions of this module, usable on a traced ``table`` (inside ``jax.jit``).

    :class:`~cupy_paged_attn.RelativePositionBias` reads its table when constructed, which a tracer does not
    allow; this builds the same object with the bucket array as a constant of the program.

    Parameters
    ----------
    table : jax.Array ``[num_buckets, num_heads]``, float32 / float16 / bfloat16
        T5's ``relative_attention_bias`` weight.
    num_buckets, max_distance, bidirectional
        As in :class:`~cupy_paged_attn.RelativePositionBias`.

    Returns
    -------
    RelativePositionBias
        Its ``buckets`` an int32 ``jax.Array`` ``[max_distance + 1]``.
    """
    host = t5_bucket_table(num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)
    return RelativePositionBias.from_buckets(table, jax.numpy.asarray(host), num_buckets=num_buckets,
                                             max_distance=max_distance, bidirectional=bidirectional)


# ---------------------------------------------------------------------------------------------------------------
# Trace-time checks: the library's checks on shape-only stand-ins (JAX arrays are always compact)
# ---------------------------------------------------------------------------------------------------------------
def _stand_in(x: Any) -> np.ndarray | None:
    """A NumPy array with ``x``'s shape, dtype and C-contiguous strides, over one element (never read)."""
    if x is None:
        return None
    dtype = np.dtype(x.dtype)
    shape = tuple(int(n) for n in x.shape)
    strides = tuple(n * dtype.itemsize for n in _checks.contiguous_strides(shape))
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, strides, writeable=False)


def _stand_in_bias(spec: _BiasSpec, arrays: list[Any]) -> tuple[Any, dict[str, Any]]:
    bias = spec.rebuild([_stand_in(a) for a in arrays])
    return bias, _checks.bias_operands(bias)


# ---------------------------------------------------------------------------------------------------------------
# Run time: XLA's buffers as CuPy (GPU) or NumPy (CPU) arrays
# ---------------------------------------------------------------------------------------------------------------
def _on_cpu(buffer: Any) -> bool:
    return int(buffer.__dlpack_device__()[0]) == _KDL_CPU


def _array(buffer: Any) -> Any:
    """A zero-copy view of an XLA buffer: NumPy on the CPU, CuPy on a GPU."""
    if _on_cpu(buffer):
        return np.asarray(buffer)
    import cupy

    return cupy.from_dlpack(buffer)


def _stream(ctx: Any, buffer: Any) -> int | None:
    """XLA's stream for a GPU launch (a ``cudaStream_t`` int); None on the CPU."""
    return None if _on_cpu(buffer) else int(ctx.stream)


@functools.cache
def _decode_callback(bias: _BiasSpec, has_alibi: bool, scale: float | None, kv_layout: str,
                     scores: _checks.ScoreOptions, fp8: _Fp8Spec) -> Callable[..., None]:
    """One callback per static configuration, so that equal calls stage equal primitives (jit cache hits). Operands:
    the five arrays, the bias's, ALiBi's slopes, the fp8 scale arrays."""

    def callback(ctx: Any, out: Any, *buffers: Any) -> None:
        arrays = [_array(b) for b in buffers]
        q, k_cache, v_cache, tables, lens = arrays[:5]
        extra = arrays[5:]
        n = bias.num_arrays + has_alibi
        _decode.paged_attention(
            q, k_cache, v_cache, tables, lens, scale=scale, attn_bias=bias.rebuild(extra[: bias.num_arrays]),
            alibi_slopes=extra[n - 1] if has_alibi else None, kv_layout=kv_layout, out=_array(out),
            stream=_stream(ctx, out), logits_soft_cap=scores.soft_cap, window_left=scores.window_left,
            **fp8.options(extra[n:]),
        )

    return callback


@functools.cache
def _prefill_callback(bias: _BiasSpec, has_alibi: bool, causal: bool, scale: float | None, kv_layout: str,
                      scores: _checks.ScoreOptions, fp8: _Fp8Spec) -> Callable[..., None]:
    def callback(ctx: Any, out: Any, *buffers: Any) -> None:
        arrays = [_array(b) for b in buffers]
        q, k_cache, v_cache, tables, lens, starts = arrays[:6]
        extra = arrays[6:]
        n = bias.num_arrays + has_alibi
        _prefill.paged_prefill_attention(
            q, k_cache, v_cache, tables, lens, starts, causal=causal, scale=scale,
            attn_bias=bias.rebuild(extra[: bias.num_arrays]), alibi_slopes=extra[n - 1] if has_alibi else None,
            kv_layout=kv_layout, out=_array(out), stream=_stream(ctx, out), logits_soft_cap=scores.soft_cap,
            window_left=scores.window_left, **fp8.options(extra[n:]),
        )

    return callback


@functools.cache
def _cache_callback(kv_layout: str, fp8: _Fp8Spec) -> Callable[..., None]:
    def callback(ctx: Any, out: tuple[Any, Any], key: Any, value: Any, key_cache: Any, value_cache: Any,
                 slot_mapping: Any, *scales: Any) -> None:
        del key_cache, value_cache  # aliased to the outputs: ``out`` holds them, written in place
        k_out = out[0]
        args = [_array(b) for b in (key, value, *out, slot_mapping)]
        options = fp8.options([_array(b) for b in scales])
        if _on_cpu(k_out):
            _cache.reshape_and_cache(*args, kv_layout=kv_layout, **options)
            return
        import cupy

        device = int(k_out.__dlpack_device__()[1])
        with cupy.cuda.Device(device), _interop.resolve_stream(int(ctx.stream), "cupy", device):
            _cache.reshape_and_cache(*args, kv_layout=kv_layout, **options)  # on CuPy's current stream: XLA's

    return callback


def _scale(scale: float | None) -> float | None:
    return None if scale is None else float(scale)


def _stand_in_fp8(fp8: _Fp8Spec, kv_cache_dtype: Any, k_scale: Any, v_scale: Any) -> dict[str, Any]:
    """The fp8 keyword arguments of the trace-time checks: the format (as given, where it names none), the scales as
    numbers or shape-only stand-ins."""
    return {"kv_cache_dtype": fp8.kv_cache_dtype if fp8.kv_cache_dtype != "auto" else kv_cache_dtype,
            "k_scale": _stand_in(k_scale) if hasattr(k_scale, "shape") else k_scale,
            "v_scale": _stand_in(v_scale) if hasattr(v_scale, "shape") else v_scale}


# ---------------------------------------------------------------------------------------------------------------
# The operations
# ---------------------------------------------------------------------------------------------------------------
def paged_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float | None = None,
    attn_bias: jax.Array | RaggedBias | RelativePositionBias | None = None,
    alibi_slopes: jax.Array | None = None,
    kv_layout: str = "nhd",
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> jax.Array:
    """:func:`cupy_paged_attn.paged_attention` for ``jax.jit``: arrays or tracers in, a ``jax.Array`` out.

    Parameters
    ----------
    query : jax.Array ``[num_seqs, num_heads, head_size]``, float16 / bfloat16 / float32
    key_cache, value_cache : jax.Array of the query's dtype
        ``"nhd"``: ``[num_blocks, block_size, num_kv_heads, head_size]``; ``"vllm"``: vLLM's layouts.
    block_tables : jax.Array ``[num_seqs, max_blocks_per_seq]``, int32
    seq_lens : jax.Array ``[num_seqs]``, int32
    scale : float, optional
        A Python number (static); default ``1 / sqrt(head_size)``.
    attn_bias : optional
        A dense array ``[num_seqs, num_heads, L >= max(seq_lens)]``; a :class:`~cupy_paged_attn.RaggedBias` of
        arrays (``values [total, num_heads]``, ``offsets [num_seqs + 1]`` int32); or a
        :class:`~cupy_paged_attn.RelativePositionBias` (built outside ``jit``, or with
        :func:`relative_position_bias` inside).
    alibi_slopes : jax.Array ``[num_heads]``, float32, optional
    kv_layout : {"nhd", "vllm", "hnd"}
    logits_soft_cap : float, optional
        Static. Gemma 2's soft-cap: a logit is ``c * tanh(scale * <q, k> / c)`` before the bias and ALiBi.
    window_left : int, optional
        Static. A sliding window: the query at position ``p`` attends keys ``p - window_left ... p``.
    kv_cache_dtype, k_scale, v_scale
        fp8 caches, as in :func:`cupy_paged_attn.paged_attention`: caches of ``jnp.float8_e4m3fn`` /
        ``float8_e5m2`` (or uint8 with ``kv_cache_dtype``, static); a scale is a number (static) or a float32 array
        ``[1]`` or ``[num_kv_heads]`` (an operand).

    Returns
    -------
    jax.Array ``[num_seqs, num_heads, head_size]`` of the query's dtype, on its device.

    Raises
    ------
    ImportError
        jax older than 0.6.1 (no ``buffer_callback``).
    TypeError, ValueError, NotImplementedError
        At trace time, as :func:`cupy_paged_attn.paged_attention` checks shapes and dtypes. Device data (seq_lens,
        block ids) is not read: out-of-contract values give NaN rows (see :func:`cupy_paged_attn.paged_attention`).
    """
    spec, bias_arrays = _split_bias(attn_bias)
    fp8, key_cache, value_cache, scale_arrays = _split_fp8(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    operands = [query, key_cache, value_cache, block_tables, seq_lens, *bias_arrays]
    if alibi_slopes is not None:
        operands.append(alibi_slopes)
    stand = [_stand_in(x) for x in (query, key_cache, value_cache, block_tables, seq_lens)]
    bias, named = _stand_in_bias(spec, bias_arrays)
    problem = _checks.check_decode(*stand, scale=scale, attn_bias=bias, alibi_slopes=_stand_in(alibi_slopes),
                                   kv_layout=kv_layout, out=None, bias_arrays=named, logits_soft_cap=logits_soft_cap,
                                   window_left=window_left, **_stand_in_fp8(fp8, kv_cache_dtype, k_scale, v_scale))
    callback = _decode_callback(spec, alibi_slopes is not None, _scale(scale), kv_layout, problem.scores, fp8)
    operands += scale_arrays
    result = jax.ShapeDtypeStruct(query.shape, query.dtype)
    return _buffer_callback()(callback, result)(*operands)


def paged_prefill_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    attn_bias: jax.Array | RelativePositionBias | None = None,
    alibi_slopes: jax.Array | None = None,
    kv_layout: str = "nhd",
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> jax.Array:
    """:func:`cupy_paged_attn.prefill.paged_prefill_attention` for ``jax.jit``.

    Parameters
    ----------
    query : jax.Array ``[total_query_tokens, num_heads, head_size]``, float16 / bfloat16 / float32
        The query rows of all sequences, packed; sequence ``s``'s rows are the last ``q_len`` of its
        ``seq_lens[s]`` keys.
    key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, kv_layout, logits_soft_cap
    kv_cache_dtype, k_scale, v_scale
        As in :func:`paged_attention`.
    window_left : int, optional
        Static. A sliding window: a query row at position ``p`` attends keys ``p - window_left`` on (through ``p``
        when ``causal``; without ``causal`` only the keys before ``p - window_left`` are masked).
    query_start_loc : jax.Array ``[num_seqs + 1]``, int32
        Sequence ``s`` owns query rows ``query_start_loc[s] : query_start_loc[s + 1]``.
    causal : bool
        Static. Mask keys after each query row's position.
    attn_bias : optional
        A dense array ``[num_seqs, num_heads, max_q_len, L]`` or a RelativePositionBias.

    Returns
    -------
    jax.Array ``[total_query_tokens, num_heads, head_size]`` of the query's dtype. Rows that belong to no sequence
    are unspecified.

    Raises
    ------
    ImportError, TypeError, ValueError, NotImplementedError
        As :func:`paged_attention` (a RaggedBias is NotImplementedError).
    """
    spec, bias_arrays = _split_bias(attn_bias)
    fp8, key_cache, value_cache, scale_arrays = _split_fp8(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    operands = [query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *bias_arrays]
    if alibi_slopes is not None:
        operands.append(alibi_slopes)
    stand = [_stand_in(x) for x in (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)]
    bias, named = _stand_in_bias(spec, bias_arrays)
    problem = _checks.check_prefill(*stand, causal=causal, scale=scale, attn_bias=bias,
                                    alibi_slopes=_stand_in(alibi_slopes), kv_layout=kv_layout, out=None,
                                    bias_arrays=named, logits_soft_cap=logits_soft_cap, window_left=window_left,
                                    **_stand_in_fp8(fp8, kv_cache_dtype, k_scale, v_scale))
    callback = _prefill_callback(spec, alibi_slopes is not None, bool(causal), _scale(scale), kv_layout,
                                 problem.scores, fp8)
    operands += scale_arrays
    result = jax.ShapeDtypeStruct(query.shape, query.dtype)
    return _buffer_callback()(callback, result)(*operands)


def reshape_and_cache(
    key: jax.Array,
    value: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    slot_mapping: jax.Array,
    *,
    kv_layout: str = "nhd",
    kv_cache_dtype: str = "auto",
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`cupy_paged_attn.reshape_and_cache` for ``jax.jit``, functional: returns the written caches.

    Parameters
    ----------
    key, value : jax.Array ``[num_tokens, num_kv_heads, head_size]``, float16 / bfloat16 / float32
    key_cache, value_cache : jax.Array of the key's dtype, in ``kv_layout``
        Not modified (unless donated to the jitted function, which lets XLA write them in place).
    slot_mapping : jax.Array ``[num_tokens]``, int32
        ``slot = block * block_size + offset``; negative slots are skipped, slots past the cache are skipped.
    kv_layout : {"nhd", "vllm", "hnd"}
    kv_cache_dtype, k_scale, v_scale
        fp8 caches, as in :func:`paged_attention` (stored: ``value / scale``, rounded to the nearest, saturated).

    Returns
    -------
    (key_cache, value_cache) : new jax.Arrays, the caches with the tokens written (of the caches' dtype).
    """
    dtypes = (key_cache.dtype, value_cache.dtype)
    fp8, key_cache, value_cache, scale_arrays = _split_fp8(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    stand = [_stand_in(x) for x in (key, value, key_cache, value_cache, slot_mapping)]
    _checks.check_cache_write(*stand, kv_layout, **_stand_in_fp8(fp8, kv_cache_dtype, k_scale, v_scale))
    results = (jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
               jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype))
    staged = _buffer_callback()(_cache_callback(kv_layout, fp8), results, input_output_aliases={2: 0, 3: 1})
    k_out, v_out = staged(key, value, key_cache, value_cache, slot_mapping, *scale_arrays)
    if k_out.dtype != dtypes[0]:  # float8 caches travelled as uint8
        k_out, v_out = (jax.lax.bitcast_convert_type(x, d) for x, d in zip((k_out, v_out), dtypes, strict=True))
    return k_out, v_out
