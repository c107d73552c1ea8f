"""Argument checks: every argument validated once, in Python, before anything is launched.

Each check raises an error that names the argument, what was expected and what came. The checks run on wrapped
arrays (NumPy or CuPy: both have ``shape``, ``dtype``, ``strides``), so the CPU and GPU paths share them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any

import ml_dtypes
import numpy as np

from . import _interop, _specs, planning
from .bias import RaggedBias, RelativePositionBias

#: Query / cache dtypes by short name.
DTYPES = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(ml_dtypes.bfloat16): "bf16",
}
KV_LAYOUTS = _specs.KV_LAYOUTS
#: fp8 cache formats by the name ``kv_cache_dtype`` takes: the NumPy dtype of a stored value (ml_dtypes').
FP8_FORMATS = {
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
KV_CACHE_DTYPES = ("auto", *FP8_FORMATS)


def dtype_name(name: str, arr: Any) -> str:
    """Short name of a float32 / float16 / bfloat16 array's dtype; ValueError otherwise."""
    try:
        return DTYPES[np.dtype(arr.dtype)]
    except KeyError:
        raise ValueError(f"{name}: expected dtype float32, float16 or bfloat16, got {arr.dtype}") from None


def element_strides(arr: Any) -> tuple[int, ...]:
    """Strides in elements (NumPy and CuPy give bytes)."""
    size = arr.dtype.itemsize
    return tuple(s // size for s in arr.strides)


def check_ndim(name: str, arr: Any, ndim: int, dims: str) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array {dims}, got shape {tuple(arr.shape)}")


def check_shape(name: str, arr: Any, expected: tuple[Any, ...], dims: str) -> None:
    """``expected`` holds ints, or None for a dimension that may be anything."""
    shape = tuple(arr.shape)
    if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape, strict=False)):
        want = ", ".join("*" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "")
        raise ValueError(f"{name}: expected shape ({want}) {dims}, got {shape}")


def check_dtype(name: str, arr: Any, allowed: tuple[Any, ...]) -> None:
    if np.dtype(arr.dtype) not in [np.dtype(a) for a in allowed]:
        want = " or ".join(str(np.dtype(a)) for a in allowed)
        raise ValueError(f"{name}: expected dtype {want}, got {arr.dtype}")


def check_layout_option(kv_layout: Any) -> str:
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {', '.join(map(repr, KV_LAYOUTS))}, got {kv_layout!r}")
    return kv_layout


def check_head_size(name: str, head_size: int) -> None:
    if head_size not in _specs.HEAD_SIZES:
        raise NotImplementedError(
            f"{name}: head_size {head_size} is not supported; supported: {', '.join(map(str, _specs.HEAD_SIZES))}"
        )


@dataclass
class CacheGeometry:
    """The paged caches, whatever their layout."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    block_stride: int  # elements between pages
    fp8: str | None = None  # the fp8 format of the stored values (a key of FP8_FORMATS), None when unquantized


def check_kv_cache_dtype(kv_cache_dtype: Any, key_cache: Any, value_cache: Any, dtype: Any, source: str
                         ) -> str | None:
    """The storage of the caches: None when they hold the ``source``'s dtype, else their fp8 format.

    ``"auto"`` takes the caches' own dtype (the source's, or an ml_dtypes / torch float8 dtype); ``"fp8_e4m3"`` and
    ``"fp8_e5m2"`` name the format of caches stored as uint8 (vLLM's convention) or of that float8 dtype.
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got "
                         f"{kv_cache_dtype!r}")
    by_dtype = {v: k for k, v in FP8_FORMATS.items()}
    have = np.dtype(key_cache.dtype)
    if kv_cache_dtype == "auto":
        fmt = by_dtype.get(have)
        want = (np.dtype(dtype),) if fmt is None else (have,)
    else:
        fmt = kv_cache_dtype
        want = (FP8_FORMATS[fmt], np.dtype(np.uint8))
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if np.dtype(cache.dtype) not in want:
            if kv_cache_dtype == "auto" and fmt is None:
                wanted = f"{np.dtype(dtype)} (the {source}'s) or float8_e4m3fn / float8_e5m2"
            else:
                wanted = " or ".join(map(str, want)) + f" (kv_cache_dtype={fmt!r})"
            raise ValueError(f"{name}: expected dtype {wanted}, got {cache.dtype}")
    return fmt


def check_caches(key_cache: Any, value_cache: Any, kv_layout: str, dtype: Any, head_size: int, source: str,
                 kv_cache_dtype: Any = "auto") -> CacheGeometry:
    """Shapes, dtypes and contiguity of ``key_cache`` / ``value_cache`` for ``kv_layout``.

    The page dimension may have any stride (a cache may be a view of a larger [num_blocks, 2, ...] array); the
    dimensions inside a page must be contiguous. ``source`` names the argument ``dtype`` and ``head_size`` came from;
    the caches hold that dtype or an fp8 format (:func:`check_kv_cache_dtype`).
    """
    fp8 = check_kv_cache_dtype(kv_cache_dtype, key_cache, value_cache, dtype, source)
    itemsize = np.dtype(key_cache.dtype).itemsize
    x = 16 // itemsize
    if kv_layout in ("nhd", "hnd"):
        dims = ("[num_blocks, block_size, num_kv_heads, head_size]" if kv_layout == "nhd" else
                "[num_blocks, num_kv_heads, block_size, head_size]")
        check_ndim("key_cache", key_cache, 4, dims)
        check_shape("value_cache", value_cache, tuple(key_cache.shape), dims + " (the key_cache's shape)")
        if kv_layout == "nhd":
            num_blocks, block_size, num_kv_heads, d = key_cache.shape
        else:
            num_blocks, num_kv_heads, block_size, d = key_cache.shape
    else:
        dims = f"[num_blocks, num_kv_heads, head_size // {x}, block_size, {x}]"
        check_ndim("key_cache", key_cache, 5, dims)
        num_blocks, num_kv_heads, d_x, block_size, xx = key_cache.shape
        if xx != x:
            raise ValueError(
                f"key_cache: kv_layout='vllm' with dtype {key_cache.dtype} needs last dimension x = 16 // itemsize "
                f"= {x}, got shape {tuple(key_cache.shape)}"
            )
        d = d_x * x
        check_shape(
            "value_cache", value_cache, (num_blocks, num_kv_heads, d, block_size),
            "[num_blocks, num_kv_heads, head_size, block_size]",
        )
    if d != head_size:
        raise ValueError(f"key_cache: expected head_size {head_size} (from {source}), got {d}")
    if 0 in key_cache.shape[1:]:
        raise ValueError(f"key_cache: expected block_size, num_kv_heads and head_size >= 1, got shape "
                         f"{tuple(key_cache.shape)}")
    if block_size not in _specs.BLOCK_SIZES:
        raise NotImplementedError(
            f"key_cache: block_size {block_size} is not supported; supported: powers of two up to "
            f"{_specs.BLOCK_SIZES[-1]}"
        )
    page = math.prod(key_cache.shape[1:])
    if page >= 2**31:  # the kernels address within a page in 32 bits
        raise ValueError(f"key_cache: a page (block_size x num_kv_heads x head_size) must hold fewer than 2**31 "
                         f"elements, got {page}")
    if num_blocks == 0:  # an empty cache holds no memory to check (NumPy gives it zero strides)
        return CacheGeometry(0, block_size, num_kv_heads, d, page, fp8)
    k_strides, v_strides = element_strides(key_cache), element_strides(value_cache)
    for name, cache, strides in (("key_cache", key_cache, k_strides), ("value_cache", value_cache, v_strides)):
        inner = contiguous_strides(cache.shape[1:])
        # A dimension of size 1 may carry any stride.
        if any(n > 1 and have != want for n, have, want in zip(cache.shape[1:], strides[1:], inner, strict=True)):
            raise ValueError(
                f"{name}: each page must be contiguous (strides {inner} in elements after the first dimension), "
                f"got strides {strides}"
            )
        if num_blocks > 1 and (strides[0] < page or strides[0] % x):
            raise ValueError(
                f"{name}: page stride must be >= {page} elements and a multiple of {x}, got {strides[0]}"
            )
        check_aligned(name, _interop.data_ptr(cache))
    if num_blocks > 1 and k_strides[0] != v_strides[0]:
        raise ValueError(f"value_cache: expected the page stride of key_cache ({k_strides[0]}), got {v_strides[0]}")
    return CacheGeometry(num_blocks, block_size, num_kv_heads, d, k_strides[0] if num_blocks > 1 else page, fp8)


def check_aligned(name: str, ptr: int) -> None:
    """A cache's address: the kernels copy it in 16-byte vectors."""
    if ptr % 16:
        raise ValueError(f"{name}: data must be 16-byte aligned")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


#: Bias element dtypes as the kernels' BiasDtype codes (common.cuh).
BIAS_DTYPE_CODES = {"f32": 0, "f16": 1, "bf16": 2}


def bias_operands(attn_bias: Any) -> dict[str, Any]:
    """The arrays inside ``attn_bias`` (any kind), named for errors: ``{"attn_bias": dense}`` or the kind's members."""
    if isinstance(attn_bias, RaggedBias):
        return {"attn_bias.values": attn_bias.values, "attn_bias.offsets": attn_bias.offsets}
    if isinstance(attn_bias, RelativePositionBias):
        return {"attn_bias.table": attn_bias.table, "attn_bias.buckets": attn_bias.buckets}
    return {"attn_bias": attn_bias}


def bias_geometry(attn_bias: Any) -> tuple[Any, ...]:
    """What of ``attn_bias`` (any kind) a plan fixes besides its arrays' signatures: the kind and, for a
    RelativePositionBias, ``(num_buckets, max_distance, bidirectional)``."""
    if isinstance(attn_bias, RelativePositionBias):
        return (RelativePositionBias, attn_bias.num_buckets, attn_bias.max_distance, attn_bias.bidirectional)
    return (type(attn_bias),)


def describe_bias_geometry(geometry: tuple[Any, ...]) -> str:
    kind = geometry[0].__name__
    if len(geometry) == 1:
        return kind
    num_buckets, max_distance, bidirectional = geometry[1:]
    return f"{kind}(num_buckets={num_buckets}, max_distance={max_distance}, bidirectional={bidirectional})"


@dataclass
class CheckedBias:
    """A validated ``attn_bias`` of any kind, as the kernels' BiasArgs describe it (common.cuh)."""

    mode: str  # "none" | "dense" | "ragged" | "t5" (the specialisation's bias mode)
    array: Any = None  # dense: the bias; ragged: values; t5: the table (wrapped)
    index: Any = None  # ragged: offsets; t5: buckets (wrapped, unit stride)
    strides: tuple[int, int, int, int] = (0, 0, 0, 0)  # elements: dense (s, h, i, j), ragged (row, h, 0, 0),
    # t5 (bucket, h, buckets per side, 0)
    dtype: str | None = None  # "f32" | "f16" | "bf16"
    n: int = 0  # ragged: rows of values; t5: max_distance
    m: int = 0  # t5: buckets per side when bidirectional, else 0
    length: int | None = None  # dense: L, the most keys it covers
    source: Any = None  # the RelativePositionBias (geometry for the reference), else None

    @property
    def dtype_code(self) -> int:
        """The kernels' BiasDtype of the elements (bias.cuh)."""
        return BIAS_DTYPE_CODES[self.dtype] if self.dtype is not None else 0


def host_bias(bias: CheckedBias, attn_bias: Any) -> CheckedBias:
    """``bias`` with its index array (a RaggedBias's offsets, a RelativePositionBias's buckets) copied to the host
    from the caller's ``attn_bias``, for the checks of device data (``validate=True``)."""
    index = {"ragged": "offsets", "t5": "buckets"}.get(bias.mode)
    return bias if index is None else replace(bias, index=_interop.to_numpy(getattr(attn_bias, index)))


def check_key_stride(name: str, arr: Any, stride: int) -> None:
    """The kernels step from one key's bias to the next by a 32-bit byte count (common.cuh, StridedRow)."""
    step = abs(stride) * np.dtype(arr.dtype).itemsize
    if step >= 2**31:
        raise NotImplementedError(f"{name}: the step from one key to the next must be under 2**31 bytes, got "
                                  f"{abs(stride)} elements ({step} bytes); pass a copy with the keys closer together")


def check_bias(attn_bias: Any, arrays: dict[str, Any], num_seqs: int, num_heads: int,
               rows: int | None = None) -> CheckedBias:
    """Validate ``attn_bias`` (None, a dense array, RaggedBias or RelativePositionBias) whose arrays, wrapped, are
    ``arrays`` (from :func:`bias_operands`). ``rows`` is None for decode (dense ``[num_seqs, num_heads, L]``) or
    the most query rows of a sequence for prefill (dense ``[num_seqs, num_heads, rows, L]``)."""
    if attn_bias is None:
        return CheckedBias("none")
    if isinstance(attn_bias, RaggedBias):
        if rows is not None:
            raise NotImplementedError("attn_bias: RaggedBias is a decode bias; pass a dense array or a "
                                      "RelativePositionBias to prefill")
        values, offsets = arrays["attn_bias.values"], arrays["attn_bias.offsets"]
        check_ndim("attn_bias.values", values, 2, "[total, num_heads]")
        dtype = dtype_name("attn_bias.values", values)
        if values.shape[1] != num_heads:
            raise ValueError(f"attn_bias.values: expected shape (total, num_heads={num_heads}), got "
                             f"{tuple(values.shape)}")
        if values.shape[0] >= 2**31:
            raise ValueError(f"attn_bias.values: at most 2**31 - 1 rows, got {values.shape[0]}")
        check_shape("attn_bias.offsets", offsets, (num_seqs + 1,), "[num_seqs + 1]")
        check_dtype("attn_bias.offsets", offsets, (np.int32,))
        st = element_strides(values)
        check_key_stride("attn_bias.values", values, st[0])
        return CheckedBias("ragged", values, offsets, (st[0], st[1], 0, 0), dtype, n=int(values.shape[0]))
    if isinstance(attn_bias, RelativePositionBias):
        table = arrays["attn_bias.table"]
        check_shape("attn_bias.table", table, (attn_bias.num_buckets, num_heads), "[num_buckets, num_heads]")
        dtype = dtype_name("attn_bias.table", table)
        check_shape("attn_bias.buckets", arrays["attn_bias.buckets"], (attn_bias.max_distance + 1,),
                    "[max_distance + 1] (as RelativePositionBias built it)")
        check_dtype("attn_bias.buckets", arrays["attn_bias.buckets"], (np.int32,))
        st = element_strides(table)
        # The third slot is no stride: the buckets of one side, which the FP32 decode kernel's near table needs.
        return CheckedBias("t5", table, arrays["attn_bias.buckets"], (st[0], st[1], attn_bias.per_side, 0), dtype,
                           n=attn_bias.max_distance, m=attn_bias.per_side if attn_bias.bidirectional else 0,
                           source=attn_bias)
    bias = arrays["attn_bias"]
    if rows is None:
        check_ndim("attn_bias", bias, 3, "[num_seqs, num_heads, L]")
        want = (num_seqs, num_heads)
        expected = f"(num_seqs={num_seqs}, num_heads={num_heads}, L >= max(seq_lens))"
    else:
        check_ndim("attn_bias", bias, 4, "[num_seqs, num_heads, max_q_len, L]")
        want = (num_seqs, num_heads)
        expected = f"(num_seqs={num_seqs}, num_heads={num_heads}, max_q_len >= {rows}, L >= max(seq_lens))"
    dtype = dtype_name("attn_bias", bias)
    if tuple(bias.shape[:2]) != want or (rows is not None and bias.shape[2] < rows):
        raise ValueError(f"attn_bias: expected shape {expected}, got {tuple(bias.shape)}")
    st = element_strides(bias)
    check_key_stride("attn_bias", bias, st[-1])
    strides = (st[0], st[1], 0, st[2]) if rows is None else (st[0], st[1], st[2], st[3])
    return CheckedBias("dense", bias, None, strides, dtype, length=int(bias.shape[-1]))


@dataclass(frozen=True)
class ScoreOptions:
    """What turns ``scale * <q, k>`` into a logit besides the bias: Gemma 2's soft-cap and the sliding window."""

    soft_cap: float | None = None  # logit = soft_cap * tanh(scale * <q, k> / soft_cap), before the bias and ALiBi
    window_left: int | None = None  # a query at position p attends keys at p - window_left and after

    @property
    def default(self) -> bool:
        return self.soft_cap is None and self.window_left is None


def check_score_options(logits_soft_cap: Any, window_left: Any) -> ScoreOptions:
    """``logits_soft_cap``: None or a finite number > 0; ``window_left``: None or an int >= 0."""
    cap = None
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real):
            raise TypeError(f"logits_soft_cap: expected None or a finite number > 0, got "
                            f"{type(logits_soft_cap).__name__} {logits_soft_cap!r}")
        cap = float(logits_soft_cap)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"logits_soft_cap: expected None (no cap) or a finite number > 0, got {logits_soft_cap!r}")
    window = None
    if window_left is not None:
        if isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral):
            raise TypeError(f"window_left: expected None or an int >= 0, got {type(window_left).__name__} "
                            f"{window_left!r}")
        window = int(window_left)
        if window < 0:
            raise ValueError(f"window_left: expected None (no window) or an int >= 0, got {window_left!r}")
    return ScoreOptions(cap, window)


@dataclass
class KvScale:
    """A checked ``k_scale`` / ``v_scale`` of an fp8 cache: a value is read as ``stored * scale`` (and written as
    ``value / scale``, saturated to the format's range)."""

    value: float | None = None  # a Python number's value
    array: Any = None  # or a float32 array of one element or one per KV head (wrapped)

    def per_head(self, num_kv_heads: int) -> np.ndarray:
        """float64 ``[num_kv_heads]`` (host arrays only: the NumPy path and the reference)."""
        if self.array is None:
            return np.full(num_kv_heads, self.value)
        return np.broadcast_to(np.asarray(self.array, dtype=np.float64), (num_kv_heads,))


def check_kv_scale(name: str, scale: Any, cache: CacheGeometry) -> KvScale | None:
    """``k_scale`` / ``v_scale``: None (1.0) or, for an fp8 cache only, a finite number > 0 or a float32 array
    ``[1]`` or ``[num_kv_heads]`` (an array keeps the scale on the device, so a CUDA graph can change it)."""
    if scale is None:
        return KvScale(1.0) if cache.fp8 is not None else None
    if cache.fp8 is None:
        raise ValueError(f"{name}: only fp8 caches are scaled (kv_cache_dtype 'fp8_e4m3' / 'fp8_e5m2' or float8 "
                         f"caches); pass None")
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        value = float(scale)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a finite number > 0, got {scale!r}")
        return KvScale(value)
    if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
        raise TypeError(f"{name}: expected None, a number or an array, got {type(scale).__name__}")
    if tuple(scale.shape) not in ((1,), (cache.num_kv_heads,)):
        raise ValueError(f"{name}: expected shape (1,) or (num_kv_heads={cache.num_kv_heads},), got "
                         f"{tuple(scale.shape)}")
    check_dtype(name, scale, (np.float32,))
    return KvScale(array=scale)


@dataclass
class DecodeProblem:
    """Validated decode arguments; arrays are the wrapped (NumPy or CuPy) ones."""

    query: Any
    key_cache: Any
    value_cache: Any
    block_tables: Any
    seq_lens: Any
    bias: CheckedBias
    alibi_slopes: Any | None
    out: Any | None
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    cache: CacheGeometry
    max_blocks_per_seq: int
    max_len: int  # most keys a sequence can have: the block table's capacity, and a dense bias's length
    scale: float
    kv_layout: str
    dtype: str  # "f32" | "f16" | "bf16"
    scores: ScoreOptions = field(default_factory=ScoreOptions, kw_only=True)
    k_scale: KvScale | None = field(default=None, kw_only=True)  # fp8 caches only
    v_scale: KvScale | None = field(default=None, kw_only=True)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def shape(self) -> planning.DecodeShape:
        """What planning reads of the problem."""
        return planning.DecodeShape(**self._shape_fields())

    def _shape_fields(self) -> dict[str, Any]:
        b = self.bias
        return dict(num_seqs=self.num_seqs, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size, max_len=self.max_len, dtype=self.dtype, kv_layout=self.kv_layout,
                    bias=b.mode, bias_dtype=b.dtype or "f32", bias_strides=b.strides, t5_max_distance=b.n,
                    window_left=self.scores.window_left, soft_cap=self.scores.soft_cap is not None,
                    kv_cache=self.cache.fp8)


def check_scale(scale: Any, head_size: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_size)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected None or a finite real number, got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"scale: expected None or a finite real number, got {scale!r}")
    return value


def _check_query_and_caches(query: Any, key_cache: Any, value_cache: Any, kv_layout: Any, kv_cache_dtype: Any,
                            q_dims: str) -> tuple[str, str, CacheGeometry]:
    """The checks decode and prefill share: kv_layout, the query's rank, dtype, head size and heads, and the caches
    against it. Returns ``(layout, dtype name, cache geometry)``."""
    layout = check_layout_option(kv_layout)
    check_ndim("query", query, 3, q_dims)
    dtype = dtype_name("query", query)
    _, num_heads, head_size = query.shape
    check_head_size("query", head_size)
    if num_heads == 0:
        raise ValueError(f"query: expected num_heads >= 1, got shape {tuple(query.shape)}")
    cache = check_caches(key_cache, value_cache, layout, query.dtype, head_size, "query", kv_cache_dtype)
    if num_heads % cache.num_kv_heads:
        raise ValueError(
            f"key_cache: num_kv_heads ({cache.num_kv_heads}) must divide the query's num_heads ({num_heads})"
        )
    return layout, dtype, cache


def _check_alibi_and_out(alibi_slopes: Any, out: Any, query: Any) -> None:
    """The optional operands decode and prefill share: ``alibi_slopes`` float32 ``[num_heads]``, ``out`` like query."""
    if alibi_slopes is not None:
        check_shape("alibi_slopes", alibi_slopes, (query.shape[1],), "[num_heads]")
        check_dtype("alibi_slopes", alibi_slopes, (np.float32,))
    if out is not None:
        check_out(out, query)


def check_decode(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: Any,
    attn_bias: Any,
    alibi_slopes: Any,
    kv_layout: Any,
    out: Any,
    bias_arrays: dict[str, Any] | None = None,
    logits_soft_cap: Any = None,
    window_left: Any = None,
    kv_cache_dtype: Any = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
) -> DecodeProblem:
    """Validate the arguments of :func:`cupy_paged_attn.paged_attention` (see its docstring for the list).

    ``attn_bias`` is the caller's object (None, a dense array or a bias kind); ``bias_arrays`` its arrays as
    :func:`bias_operands` names them, wrapped (default: ``bias_operands(attn_bias)`` as they are). ``k_scale`` and
    ``v_scale`` are numbers or wrapped arrays.
    """
    if bias_arrays is None:
        bias_arrays = bias_operands(attn_bias)
    scores = check_score_options(logits_soft_cap, window_left)
    layout, dtype, cache = _check_query_and_caches(query, key_cache, value_cache, kv_layout, kv_cache_dtype,
                                                   "[num_seqs, num_heads, head_size]")
    num_seqs, num_heads, head_size = query.shape

    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    check_dtype("block_tables", block_tables, (np.int32,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables: expected shape ({num_seqs}, max_blocks_per_seq) with num_seqs from query, "
            f"got {tuple(block_tables.shape)}"
        )
    max_blocks = block_tables.shape[1]
    check_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    check_dtype("seq_lens", seq_lens, (np.int32,))
    max_len = max_blocks * cache.block_size

    bias = check_bias(attn_bias, bias_arrays, num_seqs, num_heads)
    if bias.length is not None:
        max_len = min(max_len, bias.length)
    _check_alibi_and_out(alibi_slopes, out, query)

    return DecodeProblem(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens,
        bias=bias, alibi_slopes=alibi_slopes, out=out,
        num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=cache.num_kv_heads, head_size=head_size,
        cache=cache, max_blocks_per_seq=max_blocks, max_len=max_len, scale=check_scale(scale, head_size),
        kv_layout=layout, dtype=dtype, scores=scores, k_scale=check_kv_scale("k_scale", k_scale, cache),
        v_scale=check_kv_scale("v_scale", v_scale, cache),
    )


_NO_OPTIONS: tuple[dict[str, Any], dict[str, Any]] = ({}, {})


def serving_options(logits_soft_cap: Any, window_left: Any, kv_cache_dtype: Any, k_scale: Any,
                    v_scale: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options, scale operands)`` of an entry point: its serving options that are not their defaults (keyword
    arguments of the checks and the references), and the fp8 scales given as arrays (operands, to be wrapped with
    the others). Both are empty for a call that uses none."""
    if logits_soft_cap is None and window_left is None and k_scale is None and v_scale is None and (
            kv_cache_dtype == "auto" and isinstance(kv_cache_dtype, str)):
        return _NO_OPTIONS  # the common call, on the repeated-call path: no dictionaries built
    options = {name: value for name, value in (("logits_soft_cap", logits_soft_cap), ("window_left", window_left),
                                                ("k_scale", k_scale), ("v_scale", v_scale)) if value is not None}
    if not (isinstance(kv_cache_dtype, str) and kv_cache_dtype == "auto"):
        options["kv_cache_dtype"] = kv_cache_dtype
    arrays = {name: options[name] for name in ("k_scale", "v_scale")
              if name in options and not isinstance(options[name], numbers.Real)}
    return options, arrays


#: What the NumPy path computes and the GPU kernels do not yet, with the argument that asks for it.
_NOT_ON_GPU = "the NumPy path computes it; the GPU kernels do not have it yet"


def check_kernel_support(cache: CacheGeometry, dtype: str, kernel: str) -> None:
    """NotImplementedError, naming the argument, for what the GPU ``kernel`` (``"decode"``, ``"prefill"`` or
    ``"cache write"``) lacks of fp8 caches: a head size that is not a multiple of 16 (decode and prefill), a float32
    query (decode)."""
    if cache.fp8 is None or kernel == "cache write":
        return
    if kernel == "decode" and dtype not in _specs.FP8_QUERY_DTYPES:
        raise NotImplementedError(f"query: an fp8 cache ({cache.fp8}) with a float32 query on the GPU; "
                                  f"{_NOT_ON_GPU} (float16 and bfloat16 queries run on the GPU)")
    if cache.head_size not in _specs.FP8_HEAD_SIZES:
        raise NotImplementedError(f"head_size: an fp8 cache on the GPU takes head sizes {_specs.FP8_HEAD_SIZES} "
                                  f"(whole 16-byte vectors), got {cache.head_size}")


def check_out(out: Any, query: Any) -> None:
    """``out`` (wrapped) can take the result: the query's shape and dtype, last dimension contiguous."""
    check_shape("out", out, tuple(query.shape), "[num_seqs, num_heads, head_size] (the query's shape)")
    if np.dtype(out.dtype) != np.dtype(query.dtype):
        raise ValueError(f"out: expected dtype {query.dtype} (the query's), got {out.dtype}")
    if out.strides[-1] != out.dtype.itemsize and 0 not in out.shape:  # an empty array's strides are anything
        raise ValueError(f"out: the last dimension must be contiguous, got strides {element_strides(out)}")


def check_host_data(problem: DecodeProblem) -> None:
    """Checks that read device data (host copies in ``problem``): the CPU path runs them always (no sync there),
    the GPU path with ``validate=True``. Each ValueError names the first offending sequence."""
    seq_lens = np.asarray(problem.seq_lens)
    tables = np.asarray(problem.block_tables)
    capacity = problem.max_blocks_per_seq * problem.cache.block_size
    for s, n in enumerate(seq_lens.tolist()):
        if n < 0 or n > capacity:
            raise ValueError(f"seq_lens: sequence {s} has length {n}, outside [0, {capacity}] "
                             "(max_blocks_per_seq * block_size)")
        if problem.bias.length is not None and n > problem.bias.length:
            raise ValueError(f"attn_bias: sequence {s} has {n} keys (seq_lens[{s}]) but the bias covers "
                             f"L = {problem.bias.length} (its last dimension)")
        used = tables[s, : -(-n // problem.cache.block_size)]
        bad = (used < 0) | (used >= problem.cache.num_blocks)
        if bad.any():
            raise ValueError(
                f"block_tables: sequence {s} uses block id {int(used[bad][0])}, outside [0, {problem.cache.num_blocks})"
            )
    check_scale_values(problem.k_scale, problem.v_scale)
    if problem.bias.mode == "ragged":
        check_ragged_offsets(np.asarray(problem.bias.index), seq_lens, problem.bias.n)
    if problem.bias.mode == "t5":
        check_t5_buckets(np.asarray(problem.bias.index), problem.bias.source.per_side)


def check_scale_values(k_scale: KvScale | None, v_scale: KvScale | None) -> None:
    """fp8 scales given as (host copies of) arrays hold finite values > 0."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and scale.array is not None:
            values = np.asarray(scale.array, dtype=np.float64)
            bad = ~(np.isfinite(values) & (values > 0))
            if bad.any():
                raise ValueError(f"{name}: expected finite values > 0, got {values[bad][0]} at index "
                                 f"{int(np.argmax(bad))}")


def check_t5_buckets(buckets: np.ndarray, per_side: int) -> None:
    """A RelativePositionBias's bucket array (its own, or one given to ``from_buckets``) holds buckets of one side:
    every entry in ``[0, per_side)``, as :func:`cupy_paged_attn.t5_bucket_table` builds it. The kernels hold a value
    outside to the last bucket (a wrong weight, no read outside the table); this check reports it."""
    bad = (buckets < 0) | (buckets >= per_side)
    if bad.any():
        d = int(np.argmax(bad))
        raise ValueError(f"attn_bias.buckets: distance {d} has bucket {int(buckets[d])}, outside [0, {per_side}) "
                         f"(the buckets of one side, as t5_bucket_table builds them)")


def check_ragged_offsets(offsets: np.ndarray, seq_lens: np.ndarray, total: int) -> None:
    """Every sequence's rows of a RaggedBias exist: ``0 <= offsets[s]``, ``offsets[s + 1] - offsets[s] >=
    seq_lens[s]`` and ``offsets[s] + seq_lens[s] <= total``."""
    for s, n in enumerate(seq_lens.tolist()):
        first, nxt = int(offsets[s]), int(offsets[s + 1])
        if first < 0 or nxt - first < n or first + n > total:
            raise ValueError(
                f"attn_bias.offsets: sequence {s} has {n} keys but rows [{first}, {nxt}) of values (total {total}); "
                f"expected 0 <= offsets[s], offsets[s + 1] - offsets[s] >= seq_lens[s] and "
                f"offsets[s] + seq_lens[s] <= total"
            )


@dataclass
class CacheWriteProblem:
    key: Any
    value: Any
    key_cache: Any
    value_cache: Any
    slot_mapping: Any
    num_tokens: int
    cache: CacheGeometry
    kv_layout: str
    dtype: str
    k_scale: KvScale | None = None  # fp8 caches only
    v_scale: KvScale | None = None


def check_cache_write(key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any,
                      kv_layout: Any, kv_cache_dtype: Any = "auto", k_scale: Any = None,
                      v_scale: Any = None) -> CacheWriteProblem:
    """Validate the arguments of :func:`cupy_paged_attn.reshape_and_cache`."""
    layout = check_layout_option(kv_layout)
    dims = "[num_tokens, num_kv_heads, head_size]"
    check_ndim("key", key, 3, dims)
    dtype = dtype_name("key", key)
    check_shape("value", value, tuple(key.shape), dims + " (the key's shape)")
    if np.dtype(value.dtype) != np.dtype(key.dtype):
        raise ValueError(f"value: expected dtype {key.dtype} (the key's), got {value.dtype}")
    num_tokens, num_kv_heads, head_size = key.shape
    check_head_size("key", head_size)
    cache = check_caches(key_cache, value_cache, layout, key.dtype, head_size, "key", kv_cache_dtype)
    if cache.num_kv_heads != num_kv_heads:
        raise ValueError(f"key_cache: expected num_kv_heads {num_kv_heads} (from key), got {cache.num_kv_heads}")
    check_shape("slot_mapping", slot_mapping, (num_tokens,), "[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, (np.int32, np.int64))
    return CacheWriteProblem(key, value, key_cache, value_cache, slot_mapping, num_tokens, cache, layout, dtype,
                             check_kv_scale("k_scale", k_scale, cache), check_kv_scale("v_scale", v_scale, cache))


def check_slots_host(problem: CacheWriteProblem) -> None:
    """The CPU path's check of slot values (negative = skipped) and of fp8 scale arrays."""
    check_scale_values(problem.k_scale, problem.v_scale)
    slots = np.asarray(problem.slot_mapping)
    capacity = problem.cache.num_blocks * problem.cache.block_size
    bad = np.nonzero(slots >= capacity)[0]
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"slot_mapping: token {t} has slot {int(slots[t])}, outside the cache's {capacity} slots")


# ---------------------------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------------------------
#: A dense bias's row count when there is none: no query row is cut off by it (int32 in the kernels).
NO_ROW_LIMIT = 2**31 - 1


@dataclass
class PrefillProblem(DecodeProblem):
    """Validated prefill arguments: a decode problem's fields (so the decode checks of device data apply as they
    are) plus the query rows; arrays are the wrapped (NumPy, CuPy or torch) ones."""

    query_start_loc: Any
    total_q: int  # query rows of all sequences together
    q_limit: int  # most query rows a sequence can have in a dense bias (its max_q_len), else NO_ROW_LIMIT
    causal: bool

    @property
    def shape(self) -> planning.PrefillShape:
        """What planning reads of the problem."""
        return planning.PrefillShape(**self._shape_fields(), total_q=self.total_q, causal=self.causal)


def check_prefill(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    *,
    causal: Any,
    scale: Any,
    attn_bias: Any,
    alibi_slopes: Any,
    kv_layout: Any,
    out: Any,
    bias_arrays: dict[str, Any] | None = None,
    logits_soft_cap: Any = None,
    window_left: Any = None,
    kv_cache_dtype: Any = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
) -> PrefillProblem:
    """Validate the arguments of :func:`cupy_paged_attn.paged_prefill_attention` (see its docstring for the list).

    Reads no device data: query lengths are checked by :func:`check_prefill_host_data`.
    """
    if bias_arrays is None:
        bias_arrays = bias_operands(attn_bias)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    scores = check_score_options(logits_soft_cap, window_left)
    layout, dtype, cache = _check_query_and_caches(query, key_cache, value_cache, kv_layout, kv_cache_dtype,
                                                   "[total_query_tokens, num_heads, head_size]")
    total_q, num_heads, head_size = query.shape
    if total_q >= 2**31:
        raise ValueError(f"query: at most 2**31 - 1 tokens, got {total_q}")
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    check_dtype("block_tables", block_tables, (np.int32,))
    num_seqs, max_blocks = block_tables.shape
    check_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs] (num_seqs from block_tables)")
    check_dtype("seq_lens", seq_lens, (np.int32,))
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,), "[num_seqs + 1] (num_seqs from block_tables)")
    check_dtype("query_start_loc", query_start_loc, (np.int32,))
    max_len = max_blocks * cache.block_size

    bias = check_bias(attn_bias, bias_arrays, num_seqs, num_heads, rows=0)
    q_limit = NO_ROW_LIMIT
    if bias.length is not None:
        max_len = min(max_len, bias.length)
        q_limit = int(bias.array.shape[2])
    _check_alibi_and_out(alibi_slopes, out, query)

    return PrefillProblem(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=query_start_loc, bias=bias, alibi_slopes=alibi_slopes, out=out, num_seqs=num_seqs,
        total_q=total_q, num_heads=num_heads, num_kv_heads=cache.num_kv_heads, head_size=head_size, cache=cache,
        max_blocks_per_seq=max_blocks, max_len=max_len, q_limit=q_limit, scale=check_scale(scale, head_size),
        causal=bool(causal), kv_layout=layout, dtype=dtype, scores=scores,
        k_scale=check_kv_scale("k_scale", k_scale, cache), v_scale=check_kv_scale("v_scale", v_scale, cache),
    )


def check_prefill_host_data(problem: PrefillProblem) -> None:
    """The prefill checks that read device data (host copies in ``problem``): those of decode (seq_lens, block
    ids) plus ``query_start_loc``: starts at 0, never decreases, ends at total_query_tokens, and each sequence's
    query rows are at most its keys (and at most a dense bias's max_q_len)."""
    check_host_data(problem)
    starts = np.asarray(problem.query_start_loc).astype(np.int64)
    seq_lens = np.asarray(problem.seq_lens)
    if starts[0] != 0 or starts[-1] != problem.total_q:
        raise ValueError(
            f"query_start_loc: expected to start at 0 and end at total_query_tokens={problem.total_q}, got "
            f"{int(starts[0])} ... {int(starts[-1])}"
        )
    for s in range(problem.num_seqs):
        q_len = int(starts[s + 1] - starts[s])
        if q_len < 0:
            raise ValueError(f"query_start_loc: sequence {s} has {q_len} query rows (the array must not decrease)")
        if q_len > int(seq_lens[s]):
            raise ValueError(
                f"query_start_loc: sequence {s} has {q_len} query rows but seq_lens[{s}] = {int(seq_lens[s])} keys "
                "(the queries are the last keys of their sequence)"
            )
        if q_len > problem.q_limit:
            raise ValueError(
                f"attn_bias: sequence {s} has {q_len} query rows, more than the bias's max_q_len = {problem.q_limit}"
            )
