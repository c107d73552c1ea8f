"""Every error path of ``paged_attention`` and ``reshape_and_cache`` that NumPy inputs reach (the CPU path).

Each case starts from a valid problem (``test_valid_problem_runs`` shows it is one), breaks one thing, and expects the
documented exception with a message that names the argument first: ``"<name>: expected ..."``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from cupy_paged_attn import RaggedBias, RelativePositionBias, paged_attention, reshape_and_cache, t5_bucket_table
from cupy_paged_attn.reference import paged_attention_ref

# The valid decode problem: GQA (2 query heads per KV head), one sequence of one key, one ending mid-page and one at
# the block table's capacity (MAX_BLOCKS * BLOCK_SIZE = 24); the bias is longer than any sequence.
NUM_SEQS = 3
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 32
BLOCK_SIZE = 8
NUM_BLOCKS = 11
MAX_BLOCKS = 3
SEQ_LENS = (1, 13, 24)
BIAS_LEN = 29
# Block-table entries past a sequence's length: never read, so any id goes there.
UNUSED_IDS = (-1, NUM_BLOCKS, 2**31 - 1, -(2**31))

# The valid cache write: 5 tokens into a cache of NUM_BLOCKS * BLOCK_SIZE = 88 slots (0 and 87 are the ends).
SLOTS = (3, 17, 87, 0, 40)
CAPACITY = NUM_BLOCKS * BLOCK_SIZE

LAYOUTS = ("nhd", "vllm")
DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)
UNSUPPORTED_HEAD_SIZES = (16, 48, 72, 512)  # multiples of 8, so a kv_layout="vllm" cache can hold them
UNSUPPORTED_BLOCK_SIZES = (3, 12, 48, 512)
BAD_LAYOUTS = ("NHD", "HND", "vllm ", "", None, 0, ("nhd",))
BAD_SCALE_VALUES = (math.nan, -math.inf, math.inf, np.float32("nan"), 10**400)
BAD_SCALE_KINDS = ("0.125", True, False, 1j, np.array(0.125))

LAYOUT_MSG = r"kv_layout: expected one of 'nhd', 'vllm', 'hnd', got "
SCALE_MSG = r"scale: expected None or a finite real number, got "
NOT_AN_ARRAY_MSG = r"expected a NumPy, CuPy, PyTorch or JAX array, got "


# ---------------------------------------------------------------------------------------------------------------
# Valid problems
# ---------------------------------------------------------------------------------------------------------------
def rand(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """Fresh random values of magnitude in [0.25, 1), either sign: never zero."""
    rng = np.random.default_rng()
    values = rng.uniform(0.25, 1.0, shape) * rng.choice((-1.0, 1.0), shape)
    return values.astype(dtype)


def x_of(dtype: Any) -> int:
    """kv_layout="vllm"'s innermost key dimension: 16 bytes of ``dtype``."""
    return 16 // np.dtype(dtype).itemsize


def cache_shapes(layout: str = "nhd", dtype: Any = np.float32, *, num_blocks: int = NUM_BLOCKS,
                 block_size: int = BLOCK_SIZE, num_kv_heads: int = NUM_KV_HEADS, head_size: int = HEAD_SIZE,
                 x: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key_cache shape, value_cache shape) of ``layout``; ``x`` overrides vLLM's 16 // itemsize."""
    if layout == "nhd":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return shape, shape
    x = x or x_of(dtype)
    return (num_blocks, num_kv_heads, head_size // x, block_size, x), (num_blocks, num_kv_heads, head_size, block_size)


def make_caches(layout: str = "nhd", dtype: Any = np.float32, **geometry: int) -> tuple[np.ndarray, np.ndarray]:
    key_shape, value_shape = cache_shapes(layout, dtype, **geometry)
    return rand(key_shape, dtype), rand(value_shape, dtype)


def used_entries(block_size: int = BLOCK_SIZE) -> np.ndarray:
    """[NUM_SEQS, MAX_BLOCKS] bool: the block-table entries SEQ_LENS read."""
    return np.arange(MAX_BLOCKS)[None, :] < -(-np.array(SEQ_LENS)[:, None] // block_size)


def make_block_tables(block_size: int = BLOCK_SIZE) -> np.ndarray:
    """Distinct random page ids where SEQ_LENS reads, out-of-range ids everywhere else."""
    tables = np.random.default_rng().permutation(NUM_BLOCKS)[: NUM_SEQS * MAX_BLOCKS].reshape(NUM_SEQS, MAX_BLOCKS)
    unused = ~used_entries(block_size)
    tables[unused] = np.resize(UNUSED_IDS, unused.sum())
    return tables.astype(np.int32)


def decode_args(layout: str = "nhd", dtype: Any = np.float32, *, head_size: int = HEAD_SIZE,
                block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """Valid keyword arguments of ``paged_attention`` (bias and ALiBi included)."""
    key_cache, value_cache = make_caches(layout, dtype, head_size=head_size, block_size=block_size)
    return {
        "query": rand((NUM_SEQS, NUM_HEADS, head_size), dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": make_block_tables(block_size),
        "seq_lens": np.array(SEQ_LENS, np.int32),
        "attn_bias": rand((NUM_SEQS, NUM_HEADS, BIAS_LEN), dtype),
        "alibi_slopes": rand(NUM_HEADS, np.float32),
        "kv_layout": layout,
    }


def cache_args(layout: str = "nhd", dtype: Any = np.float32, *, head_size: int = HEAD_SIZE,
               block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """Valid keyword arguments of ``reshape_and_cache``."""
    key_cache, value_cache = make_caches(layout, dtype, head_size=head_size, block_size=block_size)
    return {
        "key": rand((len(SLOTS), NUM_KV_HEADS, head_size), dtype),
        "value": rand((len(SLOTS), NUM_KV_HEADS, head_size), dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": np.array(SLOTS, np.int32),
        "kv_layout": layout,
    }


BUILDERS: dict[Callable[..., Any], Callable[..., dict[str, Any]]] = {
    paged_attention: decode_args,
    reshape_and_cache: cache_args,
}


# ---------------------------------------------------------------------------------------------------------------
# Ways to break them
# ---------------------------------------------------------------------------------------------------------------
def replaced(arr: np.ndarray, index: Any, value: Any) -> np.ndarray:
    """A copy of ``arr`` with ``arr[index] = value``."""
    arr = arr.copy()
    arr[index] = value
    return arr


def aligned_flat(size: int, dtype: Any = np.float32, offset: int = 0) -> np.ndarray:
    """Random 1-D data starting ``offset`` elements past a 64-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty((size + offset) * itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64 + offset * itemsize
    flat = raw[start : start + size * itemsize].view(dtype)
    flat[...] = rand(size, dtype)
    return flat


def paged_view(shape: tuple[int, ...], dtype: Any = np.float32, *, page_stride: int | None = None,
               offset: int = 0) -> np.ndarray:
    """A cache of ``shape`` whose pages are contiguous and ``page_stride`` elements apart (default: packed)."""
    page = math.prod(shape[1:])
    page_stride = page if page_stride is None else page_stride
    flat = aligned_flat((shape[0] - 1) * page_stride + page, dtype, offset)
    inner = np.empty(shape[1:], dtype).strides
    return as_strided(flat, shape, (page_stride * flat.itemsize, *inner))


def both_caches(make: Callable[[tuple[int, ...], Any], np.ndarray]) -> dict[str, Callable[[dict], np.ndarray]]:
    """Changes that rebuild both caches with ``make(shape, dtype)``, shapes of the problem's kv_layout."""

    def cache(which: int) -> Callable[[dict], np.ndarray]:
        return lambda a: make(cache_shapes(a["kv_layout"], a["key_cache"].dtype)[which], a["key_cache"].dtype)

    return {"key_cache": cache(0), "value_cache": cache(1)}


class ForeignArray:
    """An array of no framework the library knows, speaking DLPack (the interop calls that framework "dlpack")."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._arr.__dlpack_device__()


def call(function: Callable[..., Any], base: dict[str, Any], changes: dict[str, Any]) -> Any:
    """``function`` on the valid arguments ``BUILDERS[function](**base)`` with ``changes`` applied.

    A change is a value, or a function of the valid arguments that returns one.
    """
    args = BUILDERS[function](**base)
    args.update({name: change(args) if callable(change) else change for name, change in changes.items()})
    return function(**args)


def case(function: Callable[..., Any], case_id: str, exc: type[Exception], match: str,
         base: dict[str, Any] | None = None, **changes: Any) -> Any:
    """One error case: ``function`` on the valid problem of options ``base``, with ``changes``, raises ``exc``
    whose message matches ``match`` (which starts with the argument's name)."""
    return pytest.param(function, base or {}, changes, exc, match, id=f"{function.__name__}-{case_id}")


decode_case = functools.partial(case, paged_attention)
cache_case = functools.partial(case, reshape_and_cache)
VLLM = {"layout": "vllm"}
F16 = {"dtype": np.float16}

# ---------------------------------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------------------------------
DECODE_RANK_ERRORS = [
    decode_case("query-2d", ValueError, r"query: expected a 3-D array \[num_seqs, num_heads, head_size\], got shape "
                r"\(4, 32\)", query=lambda a: a["query"][0]),
    decode_case("query-4d", ValueError, r"query: expected a 3-D array", query=lambda a: a["query"][None]),
    decode_case("key_cache-3d", ValueError, r"key_cache: expected a 4-D array \[num_blocks, block_size, "
                r"num_kv_heads, head_size\]", key_cache=lambda a: a["key_cache"][0]),
    decode_case("key_cache-5d-for-nhd", ValueError, r"key_cache: expected a 4-D array",
                **both_caches(lambda shape, dtype: rand(cache_shapes("vllm", dtype)[0], dtype))),
    decode_case("key_cache-4d-for-vllm", ValueError, r"key_cache: expected a 5-D array \[num_blocks, num_kv_heads, "
                r"head_size // 4, block_size, 4\]", VLLM,
                **both_caches(lambda shape, dtype: rand(cache_shapes("nhd", dtype)[0], dtype))),
    decode_case("value_cache-3d", ValueError, r"value_cache: expected shape \(11, 8, 2, 32\)",
                value_cache=lambda a: a["value_cache"][0]),
    decode_case("value_cache-5d-vllm", ValueError, r"value_cache: expected shape \(11, 2, 32, 8\) \[num_blocks, "
                r"num_kv_heads, head_size, block_size\]", VLLM, value_cache=lambda a: a["value_cache"][..., None]),
    decode_case("block_tables-1d", ValueError, r"block_tables: expected a 2-D array \[num_seqs, max_blocks_per_seq\]",
                block_tables=lambda a: a["block_tables"][0]),
    decode_case("block_tables-3d", ValueError, r"block_tables: expected a 2-D array",
                block_tables=lambda a: a["block_tables"][None]),
    decode_case("seq_lens-2d", ValueError, r"seq_lens: expected shape \(3,\) \[num_seqs\], got \(1, 3\)",
                seq_lens=lambda a: a["seq_lens"][None]),
    decode_case("seq_lens-0d", ValueError, r"seq_lens: expected shape \(3,\)", seq_lens=np.int32(24)),
    decode_case("attn_bias-2d", ValueError, r"attn_bias: expected a 3-D array \[num_seqs, num_heads, L\]",
                attn_bias=lambda a: a["attn_bias"][0]),
    decode_case("attn_bias-4d", ValueError, r"attn_bias: expected a 3-D array",
                attn_bias=lambda a: a["attn_bias"][None]),
    decode_case("alibi_slopes-2d", ValueError, r"alibi_slopes: expected shape \(4,\) \[num_heads\], got \(1, 4\)",
                alibi_slopes=lambda a: a["alibi_slopes"][None]),
    decode_case("alibi_slopes-0d", ValueError, r"alibi_slopes: expected shape \(4,\)", alibi_slopes=np.float32(0.5)),
]

DECODE_DTYPE_ERRORS = [
    *(decode_case(f"query-{np.dtype(dt)}", ValueError, rf"query: expected dtype float32, float16 or bfloat16, got "
                  rf"{np.dtype(dt)}", query=lambda a, dt=dt: a["query"].astype(dt))
      for dt in (np.float64, np.int32, np.complex64)),
    decode_case("key_cache-float16", ValueError, r"key_cache: expected dtype float32 \(the query's\) or "
                r"float8_e4m3fn / float8_e5m2, got float16", key_cache=lambda a: a["key_cache"].astype(np.float16)),
    decode_case("key_cache-float32-for-float16", ValueError, r"key_cache: expected dtype float16 \(the query's\) "
                r"or float8_e4m3fn / float8_e5m2, got float32", F16,
                key_cache=lambda a: a["key_cache"].astype(np.float32)),
    decode_case("value_cache-bfloat16", ValueError, r"value_cache: expected dtype float32 \(the query's\) or "
                r"float8_e4m3fn / float8_e5m2, got bfloat16",
                value_cache=lambda a: a["value_cache"].astype(ml_dtypes.bfloat16)),
    decode_case("value_cache-float16-vllm", ValueError, r"value_cache: expected dtype float32 \(the query's\)", VLLM,
                value_cache=lambda a: a["value_cache"].astype(np.float16)),
    decode_case("block_tables-int64", ValueError, r"block_tables: expected dtype int32, got int64",
                block_tables=lambda a: a["block_tables"].astype(np.int64)),
    decode_case("block_tables-uint32", ValueError, r"block_tables: expected dtype int32, got uint32",
                block_tables=lambda a: a["block_tables"].clip(0).astype(np.uint32)),
    decode_case("block_tables-float32", ValueError, r"block_tables: expected dtype int32, got float32",
                block_tables=lambda a: a["block_tables"].astype(np.float32)),
    decode_case("seq_lens-int64", ValueError, r"seq_lens: expected dtype int32, got int64",
                seq_lens=lambda a: a["seq_lens"].astype(np.int64)),
    decode_case("seq_lens-float32", ValueError, r"seq_lens: expected dtype int32, got float32",
                seq_lens=lambda a: a["seq_lens"].astype(np.float32)),
    decode_case("attn_bias-int32", ValueError, r"attn_bias: expected dtype float32, float16 or bfloat16, got int32",
                attn_bias=lambda a: (a["attn_bias"] * 8).astype(np.int32)),
    decode_case("attn_bias-float64", ValueError, r"attn_bias: expected dtype float32, float16 or bfloat16, got "
                r"float64", attn_bias=lambda a: a["attn_bias"].astype(np.float64)),
    decode_case("alibi_slopes-float64", ValueError, r"alibi_slopes: expected dtype float32, got float64",
                alibi_slopes=lambda a: a["alibi_slopes"].astype(np.float64)),
    decode_case("alibi_slopes-float16", ValueError, r"alibi_slopes: expected dtype float32, got float16",
                alibi_slopes=lambda a: a["alibi_slopes"].astype(np.float16)),
]

DECODE_SHAPE_ERRORS = [
    # num_seqs: the query's is the one the others must match
    decode_case("query-num_seqs", ValueError, r"block_tables: expected shape \(2, max_blocks_per_seq\) with num_seqs "
                r"from query, got \(3, 3\)", query=lambda a: a["query"][:2]),
    decode_case("block_tables-num_seqs", ValueError, r"block_tables: expected shape \(3, max_blocks_per_seq\)",
                block_tables=lambda a: a["block_tables"][:2]),
    decode_case("seq_lens-num_seqs", ValueError, r"seq_lens: expected shape \(3,\) \[num_seqs\], got \(4,\)",
                seq_lens=lambda a: np.append(a["seq_lens"], np.int32(1))),
    decode_case("attn_bias-num_seqs", ValueError, r"attn_bias: expected shape \(num_seqs=3, num_heads=4, "
                r"L >= max\(seq_lens\)\), got \(2, 4, 29\)", attn_bias=lambda a: a["attn_bias"][:2]),
    # num_heads
    decode_case("attn_bias-num_heads", ValueError, r"attn_bias: expected shape \(num_seqs=3, num_heads=4, "
                r"L >= max\(seq_lens\)\), got \(3, 2, 29\)", attn_bias=lambda a: a["attn_bias"][:, :2]),
    decode_case("alibi_slopes-num_heads", ValueError, r"alibi_slopes: expected shape \(4,\) \[num_heads\], got \(3,\)",
                alibi_slopes=lambda a: a["alibi_slopes"][:3]),
    decode_case("query-zero-heads", ValueError, r"query: expected num_heads >= 1, got shape \(3, 0, 32\)",
                query=lambda a: a["query"][:, :0]),
    decode_case("num_kv_heads-3-of-4", ValueError, r"key_cache: num_kv_heads \(3\) must divide the query's "
                r"num_heads \(4\)", key_cache=rand((NUM_BLOCKS, BLOCK_SIZE, 3, HEAD_SIZE)),
                value_cache=rand((NUM_BLOCKS, BLOCK_SIZE, 3, HEAD_SIZE))),
    decode_case("num_kv_heads-8-of-4-vllm", ValueError, r"key_cache: num_kv_heads \(8\) must divide the query's "
                r"num_heads \(4\)", VLLM, **both_caches(lambda shape, dtype: rand((shape[0], 8, *shape[2:]), dtype))),
    # value_cache unlike key_cache, dimension by dimension
    *(decode_case(f"value_cache-{dim}-{layout}", ValueError, r"value_cache: expected shape \(", {"layout": layout},
                  value_cache=lambda a, change=change: rand(cache_shapes(a["kv_layout"], **change)[1]))
      for layout in LAYOUTS
      for dim, change in (("num_blocks", {"num_blocks": NUM_BLOCKS + 1}), ("block_size", {"block_size": 16}),
                          ("num_kv_heads", {"num_kv_heads": 1}), ("head_size", {"head_size": 64}))),
    # head_size: the query's against the caches'
    decode_case("head_size-64-caches-nhd", ValueError, r"key_cache: expected head_size 32 \(from query\), got 64",
                key_cache=lambda a: rand(cache_shapes(head_size=64)[0]),
                value_cache=lambda a: rand(cache_shapes(head_size=64)[1])),
    decode_case("head_size-64-caches-vllm", ValueError, r"key_cache: expected head_size 32 \(from query\), got 64",
                VLLM, key_cache=lambda a: rand(cache_shapes("vllm", head_size=64)[0]),
                value_cache=lambda a: rand(cache_shapes("vllm", head_size=64)[1])),
    decode_case("head_size-64-query", ValueError, r"key_cache: expected head_size 64 \(from query\), got 32",
                query=lambda a: rand((NUM_SEQS, NUM_HEADS, 64))),
    # An empty cache is valid; a sequence that needs a page of it is not.
    decode_case("no-blocks", ValueError, r"block_tables: sequence 0 uses block id \d+, outside \[0, 0\)",
                key_cache=lambda a: a["key_cache"][:0], value_cache=lambda a: a["value_cache"][:0]),
]

DECODE_CACHE_MEMORY_ERRORS = [
    # kv_layout="vllm": the key's innermost dimension must be 16 bytes
    decode_case("vllm-x-8-for-float32", ValueError, r"key_cache: kv_layout='vllm' with dtype float32 needs last "
                r"dimension x = 16 // itemsize = 4, got shape \(11, 2, 4, 8, 8\)", VLLM,
                key_cache=lambda a: rand(cache_shapes("vllm", x=8)[0])),
    decode_case("vllm-x-4-for-float16", ValueError, r"key_cache: kv_layout='vllm' with dtype float16 needs last "
                r"dimension x = 16 // itemsize = 8", {**VLLM, **F16},
                key_cache=lambda a: rand(cache_shapes("vllm", x=4)[0], np.float16)),
    decode_case("vllm-x-16-for-bfloat16", ValueError, r"key_cache: kv_layout='vllm' with dtype bfloat16 needs last "
                r"dimension x = 16 // itemsize = 8", {"layout": "vllm", "dtype": ml_dtypes.bfloat16},
                key_cache=lambda a: rand(cache_shapes("vllm", x=16)[0], ml_dtypes.bfloat16)),
    decode_case("vllm-float16-caches-for-float32", ValueError, r"key_cache: expected dtype float32 \(the query's\) "
                r"or float8_e4m3fn / float8_e5m2, got float16", VLLM,
                key_cache=lambda a: make_caches("vllm", np.float16)[0],
                value_cache=lambda a: make_caches("vllm", np.float16)[1]),
    # each page contiguous
    decode_case("key_cache-page-strided-rows", ValueError, r"key_cache: each page must be contiguous \(strides "
                r"\(64, 32, 1\) in elements after the first dimension\), got strides \(1024, 128, 32, 1\)",
                **both_caches(lambda shape, dtype: rand((shape[0], 2 * shape[1], *shape[2:]), dtype)[:, ::2])),
    decode_case("key_cache-head-dim-strided", ValueError, r"key_cache: each page must be contiguous",
                key_cache=lambda a: rand((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE))[..., ::2]),
    decode_case("value_cache-page-transposed", ValueError, r"value_cache: each page must be contiguous",
                value_cache=lambda a: rand((NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)).transpose(0, 2, 1, 3)),
    decode_case("key_cache-vllm-x-strided", ValueError, r"key_cache: each page must be contiguous", VLLM,
                key_cache=lambda a: rand((*a["key_cache"].shape[:-1], 8))[..., ::2]),
    decode_case("value_cache-vllm-fortran", ValueError, r"value_cache: each page must be contiguous", VLLM,
                value_cache=lambda a: np.asfortranarray(a["value_cache"])),
    # a page the kernels can address in 32 bits (broadcast: no memory behind it)
    decode_case("key_cache-page-over-2**31-elements", ValueError, r"key_cache: a page \(block_size x num_kv_heads "
                r"x head_size\) must hold fewer than 2\*\*31 elements, got 2147483648",
                **both_caches(lambda shape, dtype: np.broadcast_to(np.zeros((), dtype), (2, 256, 2**18, HEAD_SIZE)))),
    # page stride: at least a page, a multiple of x, the same for both caches
    decode_case("key_cache-page-stride-0", ValueError, r"key_cache: page stride must be >= 512 elements and a "
                r"multiple of 4, got 0", key_cache=lambda a: np.broadcast_to(a["key_cache"][:1], a["key_cache"].shape)),
    decode_case("key_cache-page-stride-half", ValueError, r"key_cache: page stride must be >= 512 elements and a "
                r"multiple of 4, got 256", **both_caches(lambda shape, dtype: paged_view(shape, page_stride=256))),
    decode_case("key_cache-page-stride-reversed", ValueError, r"key_cache: page stride must be >= 512 elements and "
                r"a multiple of 4, got -512", **both_caches(lambda shape, dtype: rand(shape)[::-1])),
    decode_case("key_cache-page-stride-not-multiple-of-x", ValueError, r"key_cache: page stride must be >= 512 "
                r"elements and a multiple of 4, got 513", **both_caches(lambda s, dt: paged_view(s, page_stride=513))),
    decode_case("value_cache-page-stride-not-multiple-of-x-vllm-float16", ValueError, r"value_cache: page stride "
                r"must be >= 512 elements and a multiple of 8, got 516", {**VLLM, **F16},
                value_cache=lambda a: paged_view(a["value_cache"].shape, np.float16, page_stride=516)),
    decode_case("value_cache-page-stride-unlike-key", ValueError, r"value_cache: expected the page stride of "
                r"key_cache \(1024\), got 512", key_cache=lambda a: paged_view(a["key_cache"].shape, page_stride=1024)),
    decode_case("key_cache-misaligned", ValueError, r"key_cache: data must be 16-byte aligned",
                **both_caches(lambda shape, dtype: paged_view(shape, dtype, offset=1))),
    decode_case("value_cache-misaligned-vllm-bfloat16", ValueError, r"value_cache: data must be 16-byte aligned",
                {"layout": "vllm", "dtype": ml_dtypes.bfloat16},
                value_cache=lambda a: paged_view(a["value_cache"].shape, ml_dtypes.bfloat16, offset=3)),
]

DECODE_OPTION_ERRORS = [
    *(decode_case(f"kv_layout-{i}", ValueError, LAYOUT_MSG, kv_layout=layout) for i, layout in enumerate(BAD_LAYOUTS)),
    *(decode_case(f"scale-{i}", ValueError, SCALE_MSG, scale=scale) for i, scale in enumerate(BAD_SCALE_VALUES)),
    *(decode_case(f"scale-kind-{i}", TypeError, SCALE_MSG, scale=scale) for i, scale in enumerate(BAD_SCALE_KINDS)),
]

DECODE_KIND_ERRORS = [
    decode_case("query-list", TypeError, rf"query: {NOT_AN_ARRAY_MSG}builtins\.list",
                query=lambda a: a["query"].tolist()),
    decode_case("key_cache-list", TypeError, rf"key_cache: {NOT_AN_ARRAY_MSG}builtins\.list",
                key_cache=lambda a: a["key_cache"].tolist()),
    decode_case("block_tables-tuple", TypeError, rf"block_tables: {NOT_AN_ARRAY_MSG}builtins\.tuple",
                block_tables=lambda a: tuple(map(tuple, a["block_tables"].tolist()))),
    decode_case("seq_lens-list", TypeError, rf"seq_lens: {NOT_AN_ARRAY_MSG}builtins\.list", seq_lens=list(SEQ_LENS)),
    decode_case("attn_bias-float", TypeError, rf"attn_bias: {NOT_AN_ARRAY_MSG}builtins\.float", attn_bias=0.5),
    decode_case("alibi_slopes-list", TypeError, rf"alibi_slopes: {NOT_AN_ARRAY_MSG}builtins\.list",
                alibi_slopes=[0.5] * NUM_HEADS),
    decode_case("out-list", TypeError, rf"out: {NOT_AN_ARRAY_MSG}builtins\.list",
                out=lambda a: np.empty_like(a["query"]).tolist()),
    decode_case("query-foreign", TypeError, r"key_cache: all arrays must come from one framework; query is dlpack, "
                r"key_cache is numpy", query=lambda a: ForeignArray(a["query"])),
    decode_case("attn_bias-foreign", TypeError, r"attn_bias: all arrays must come from one framework; query is "
                r"numpy, attn_bias is dlpack", attn_bias=lambda a: ForeignArray(a["attn_bias"])),
    decode_case("out-foreign", TypeError, r"out: all arrays must come from one framework; query is numpy, out is "
                r"dlpack", out=lambda a: ForeignArray(np.empty_like(a["query"]))),
    *(decode_case(f"stream-{name}", TypeError, r"stream: NumPy arrays run on the CPU; expected stream=None",
                  stream=stream) for name, stream in (("0", 0), ("int", 7), ("object", object()), ("str", "default"))),
]

DECODE_UNSUPPORTED = [
    *(decode_case(f"head_size-{d}-{layout}", NotImplementedError, rf"query: head_size {d} is not supported; "
                  r"supported: 32, 64, 80, 96, 112, 120, 128, 192, 256", {"layout": layout, "head_size": d})
      for d in UNSUPPORTED_HEAD_SIZES for layout in LAYOUTS),
    *(decode_case(f"block_size-{b}-{layout}", NotImplementedError, rf"key_cache: block_size {b} is not supported; "
                  r"supported: powers of two up to 256", {"layout": layout, "block_size": b})
      for b in UNSUPPORTED_BLOCK_SIZES for layout in LAYOUTS),
]

# What the NumPy path checks in the data (the GPU clamps and skips instead, with no sync).
DECODE_DATA_ERRORS = [
    decode_case("seq_lens-negative", ValueError, r"seq_lens: sequence 1 has length -1, outside \[0, 24\]",
                seq_lens=lambda a: replaced(a["seq_lens"], 1, -1)),
    decode_case("seq_lens-int32-min", ValueError, r"seq_lens: sequence 0 has length -2147483648, outside \[0, 24\]",
                seq_lens=lambda a: replaced(a["seq_lens"], 0, -(2**31))),
    decode_case("seq_lens-past-capacity", ValueError, r"seq_lens: sequence 2 has length 25, outside \[0, 24\] "
                r"\(max_blocks_per_seq \* block_size\)$", attn_bias=None,
                seq_lens=lambda a: replaced(a["seq_lens"], 2, 25)),
    decode_case("seq_lens-past-capacity-with-bias", ValueError, r"seq_lens: sequence 2 has length 25, outside "
                r"\[0, 24\] \(max_blocks_per_seq \* block_size\)$", seq_lens=lambda a: replaced(a["seq_lens"], 2, 25)),
    decode_case("seq_lens-past-bias-length", ValueError, r"attn_bias: sequence 1 has 13 keys \(seq_lens\[1\]\) but "
                r"the bias covers L = 12 \(its last dimension\)$",
                attn_bias=lambda a: a["attn_bias"][:, :, :12], seq_lens=lambda a: replaced(a["seq_lens"], 2, 12)),
    decode_case("block_tables-negative-id", ValueError, r"block_tables: sequence 2 uses block id -1, outside "
                r"\[0, 11\)", block_tables=lambda a: replaced(a["block_tables"], (2, 0), -1)),
    decode_case("block_tables-id-num_blocks", ValueError, r"block_tables: sequence 1 uses block id 11, outside "
                r"\[0, 11\)", block_tables=lambda a: replaced(a["block_tables"], (1, 1), NUM_BLOCKS)),
    decode_case("block_tables-id-int32-max-vllm", ValueError, r"block_tables: sequence 2 uses block id 2147483647, "
                r"outside \[0, 11\)", VLLM, block_tables=lambda a: replaced(a["block_tables"], (2, 2), 2**31 - 1)),
    decode_case("block_tables-id-once-used", ValueError, r"block_tables: sequence 0 uses block id -1, outside "
                r"\[0, 11\)", seq_lens=lambda a: replaced(a["seq_lens"], 0, 9)),  # entry (0, 1) now read
]

# ---------------------------------------------------------------------------------------------------------------
# reshape_and_cache
# ---------------------------------------------------------------------------------------------------------------
CACHE_ERRORS = [
    # key and value
    cache_case("key-2d", ValueError, r"key: expected a 3-D array \[num_tokens, num_kv_heads, head_size\], got "
               r"shape \(2, 32\)", key=lambda a: a["key"][0]),
    cache_case("key-4d", ValueError, r"key: expected a 3-D array", key=lambda a: a["key"][None]),
    *(cache_case(f"key-{np.dtype(dt)}", ValueError, rf"key: expected dtype float32, float16 or bfloat16, got "
                 rf"{np.dtype(dt)}", key=lambda a, dt=dt: a["key"].astype(dt),
                 value=lambda a, dt=dt: a["value"].astype(dt))
      for dt in (np.float64, np.int32)),
    cache_case("value-2d", ValueError, r"value: expected shape \(5, 2, 32\) \[num_tokens, num_kv_heads, head_size\] "
               r"\(the key's shape\), got \(2, 32\)", value=lambda a: a["value"][0]),
    cache_case("value-num_tokens", ValueError, r"value: expected shape \(5, 2, 32\)", value=lambda a: a["value"][:4]),
    cache_case("value-num_kv_heads", ValueError, r"value: expected shape \(5, 2, 32\)",
               value=lambda a: a["value"][:, :1]),
    cache_case("value-head_size", ValueError, r"value: expected shape \(5, 2, 32\)",
               value=lambda a: rand((len(SLOTS), NUM_KV_HEADS, 64))),
    cache_case("value-float16", ValueError, r"value: expected dtype float32 \(the key's\), got float16",
               value=lambda a: a["value"].astype(np.float16)),
    cache_case("head_size-48", NotImplementedError, r"key: head_size 48 is not supported", {"head_size": 48}),
    cache_case("head_size-16-vllm", NotImplementedError, r"key: head_size 16 is not supported",
               {"layout": "vllm", "head_size": 16}),
    # the caches
    cache_case("key_cache-3d", ValueError, r"key_cache: expected a 4-D array", key_cache=lambda a: a["key_cache"][0]),
    cache_case("key_cache-4d-vllm", ValueError, r"key_cache: expected a 5-D array", VLLM,
               key_cache=lambda a: a["value_cache"]),
    cache_case("value_cache-num_blocks", ValueError, r"value_cache: expected shape \(11, 8, 2, 32\)",
               value_cache=lambda a: a["value_cache"][:-1]),
    cache_case("value_cache-block_size-vllm", ValueError, r"value_cache: expected shape \(11, 2, 32, 8\)", VLLM,
               value_cache=lambda a: rand(cache_shapes("vllm", block_size=16)[1])),
    cache_case("key_cache-float16", ValueError, r"key_cache: expected dtype float32",
               **both_caches(lambda shape, dtype: rand(shape, np.float16))),
    cache_case("value_cache-bfloat16", ValueError, r"value_cache: expected dtype float16", F16,
               value_cache=lambda a: a["value_cache"].astype(ml_dtypes.bfloat16)),
    cache_case("key_cache-head_size", ValueError, r"key_cache: expected head_size 32 \(from key\), got 64",
               key_cache=lambda a: rand(cache_shapes(head_size=64)[0]),
               value_cache=lambda a: rand(cache_shapes(head_size=64)[1])),
    cache_case("key_cache-num_kv_heads", ValueError, r"key_cache: expected num_kv_heads 2 \(from key\), got 4",
               **both_caches(lambda shape, dtype: rand(cache_shapes(num_kv_heads=4)[0]))),
    cache_case("key_cache-num_kv_heads-vllm", ValueError, r"key_cache: expected num_kv_heads 2 \(from key\), got 1",
               VLLM, key_cache=lambda a: a["key_cache"][:, :1], value_cache=lambda a: a["value_cache"][:, :1]),
    cache_case("key_cache-block_size-12", NotImplementedError, r"key_cache: block_size 12 is not supported",
               {"block_size": 12}),
    cache_case("vllm-x-8-for-float32", ValueError, r"key_cache: kv_layout='vllm' with dtype float32 needs last "
               r"dimension x = 16 // itemsize = 4", VLLM, key_cache=lambda a: rand(cache_shapes("vllm", x=8)[0])),
    cache_case("key_cache-page-strided-rows", ValueError, r"key_cache: each page must be contiguous",
               **both_caches(lambda shape, dtype: rand((shape[0], 2 * shape[1], *shape[2:]), dtype)[:, ::2])),
    cache_case("value_cache-misaligned", ValueError, r"value_cache: data must be 16-byte aligned",
               value_cache=lambda a: paged_view(a["value_cache"].shape, offset=2)),
    cache_case("no-blocks", ValueError, r"slot_mapping: token 0 has slot \d+, outside the cache's 0 slots",
               key_cache=lambda a: a["key_cache"][:0], value_cache=lambda a: a["value_cache"][:0]),
    # slot_mapping
    *(cache_case(f"slot_mapping-{np.dtype(dt)}", ValueError, rf"slot_mapping: expected dtype int32 or int64, got "
                 rf"{np.dtype(dt)}", slot_mapping=lambda a, dt=dt: a["slot_mapping"].astype(dt))
      for dt in (np.float32, np.float64, np.int16, np.uint32)),
    cache_case("slot_mapping-short", ValueError, r"slot_mapping: expected shape \(5,\) \[num_tokens\], got \(4,\)",
               slot_mapping=lambda a: a["slot_mapping"][:4]),
    cache_case("slot_mapping-2d", ValueError, r"slot_mapping: expected shape \(5,\) \[num_tokens\], got \(1, 5\)",
               slot_mapping=lambda a: a["slot_mapping"][None]),
    cache_case("slot_mapping-0d", ValueError, r"slot_mapping: expected shape \(5,\)", slot_mapping=np.int32(3)),
    cache_case("slot_mapping-capacity", ValueError, r"slot_mapping: token 2 has slot 88, outside the cache's 88 "
               r"slots", slot_mapping=lambda a: replaced(a["slot_mapping"], 2, CAPACITY)),
    cache_case("slot_mapping-int64-far-vllm", ValueError, r"slot_mapping: token 4 has slot 1099511627776, outside "
               r"the cache's 88 slots", VLLM,
               slot_mapping=lambda a: replaced(a["slot_mapping"].astype(np.int64), 4, 2**40)),
    # options and kinds
    *(cache_case(f"kv_layout-{i}", ValueError, LAYOUT_MSG, kv_layout=layout) for i, layout in enumerate(BAD_LAYOUTS)),
    cache_case("key-list", TypeError, rf"key: {NOT_AN_ARRAY_MSG}builtins\.list", key=lambda a: a["key"].tolist()),
    cache_case("slot_mapping-list", TypeError, rf"slot_mapping: {NOT_AN_ARRAY_MSG}builtins\.list",
               slot_mapping=list(SLOTS)),
    cache_case("value_cache-foreign", TypeError, r"value_cache: all arrays must come from one framework; key is "
               r"numpy, value_cache is dlpack", value_cache=lambda a: ForeignArray(a["value_cache"])),
]

# Bias kinds: a RaggedBias over rows [0, 1), [1, 14), [14, 38) of 38, a RelativePositionBias with T5's geometry.
OFFSETS = (0, 1, 14, 38)


def ragged(values: Any = None, offsets: Any = None) -> Callable[[dict], RaggedBias]:
    """A change of attn_bias to a RaggedBias: valid parts, or the given (functions of the valid values/offsets)."""
    def build(args: dict) -> RaggedBias:
        dtype = args["query"].dtype
        good_values, good_offsets = rand((OFFSETS[-1], NUM_HEADS), dtype), np.array(OFFSETS, np.int32)
        return RaggedBias(good_values if values is None else values(good_values),
                          good_offsets if offsets is None else offsets(good_offsets))
    return build


def t5(table: Callable[[np.ndarray], Any] = lambda t: t) -> Callable[[dict], RelativePositionBias]:
    return lambda args: RelativePositionBias(table(rand((32, NUM_HEADS))), num_buckets=32, max_distance=128)


def t5_buckets(buckets: Callable[[np.ndarray], np.ndarray], bidirectional: bool = False
               ) -> Callable[[dict], RelativePositionBias]:
    """A change of attn_bias to a RelativePositionBias (32 buckets, max_distance 128) built by ``from_buckets``
    around ``buckets`` (a function of the valid bucket array)."""
    valid = t5_bucket_table(num_buckets=32, max_distance=128, bidirectional=bidirectional)
    return lambda args: RelativePositionBias.from_buckets(rand((32, NUM_HEADS)), buckets(valid), num_buckets=32,
                                                          max_distance=128, bidirectional=bidirectional)


DECODE_BIAS_KIND_ERRORS = [
    decode_case("ragged-values-1d", ValueError, r"attn_bias.values: expected a 2-D array \[total, num_heads\]",
                attn_bias=ragged(values=lambda v: v[:, 0])),
    decode_case("ragged-values-heads", ValueError, r"attn_bias.values: expected shape \(total, num_heads=4\), "
                r"got \(38, 2\)", attn_bias=ragged(values=lambda v: v[:, :2])),
    decode_case("ragged-values-int", ValueError, r"attn_bias.values: expected dtype float32, float16 or bfloat16, "
                r"got int32", attn_bias=ragged(values=lambda v: v.astype(np.int32))),
    decode_case("ragged-values-list", TypeError, rf"attn_bias.values: {NOT_AN_ARRAY_MSG}builtins\.list",
                attn_bias=ragged(values=lambda v: v.tolist())),
    decode_case("ragged-values-foreign", TypeError, r"attn_bias.values: all arrays must come from one framework; "
                r"query is numpy, attn_bias.values is dlpack", attn_bias=ragged(values=ForeignArray)),
    decode_case("ragged-offsets-short", ValueError, r"attn_bias.offsets: expected shape \(4,\) \[num_seqs \+ 1\], "
                r"got \(3,\)", attn_bias=ragged(offsets=lambda o: o[:3])),
    decode_case("ragged-offsets-int64", ValueError, r"attn_bias.offsets: expected dtype int32, got int64",
                attn_bias=ragged(offsets=lambda o: o.astype(np.int64))),
    decode_case("ragged-offsets-none", TypeError, rf"attn_bias.offsets: {NOT_AN_ARRAY_MSG}None",
                attn_bias=ragged(offsets=lambda o: None)),
    decode_case("ragged-rows-too-few", ValueError, r"attn_bias.offsets: sequence 2 has 24 keys but rows \[14, 37\) "
                r"of values \(total 38\)", attn_bias=ragged(offsets=lambda o: replaced(o, 3, 37))),
    decode_case("ragged-rows-negative", ValueError, r"attn_bias.offsets: sequence 0 has 1 keys but rows \[-1, 1\)",
                attn_bias=ragged(offsets=lambda o: replaced(o, 0, -1))),
    decode_case("ragged-rows-past-values", ValueError, r"attn_bias.offsets: sequence 2 has 24 keys but rows "
                r"\[20, 50\) of values \(total 38\)", attn_bias=ragged(offsets=lambda o: np.array([0, 1, 20, 50],
                                                                                              np.int32))),
    # the kernels step from key to key by a 32-bit byte count
    decode_case("dense-key-stride-2**31-bytes", NotImplementedError, r"attn_bias: the step from one key to the next "
                r"must be under 2\*\*31 bytes, got 536870912 elements \(2147483648 bytes\)",
                attn_bias=lambda a: huge_key_stride(a["attn_bias"].shape)),
    decode_case("ragged-key-stride-2**31-bytes", NotImplementedError, r"attn_bias.values: the step from one key to "
                r"the next must be under 2\*\*31 bytes",
                attn_bias=ragged(values=lambda v: huge_key_stride(v.shape, 0))),
    decode_case("t5-table-heads", ValueError, r"attn_bias.table: expected shape \(32, 4\) \[num_buckets, "
                r"num_heads\], got \(32, 2\)", attn_bias=t5(lambda t: t[:, :2])),
    decode_case("t5-table-int", ValueError, r"attn_bias.table: expected dtype float32, float16 or bfloat16, got "
                r"int32", attn_bias=t5(lambda t: (t * 8).astype(np.int32))),
    decode_case("t5-table-foreign", TypeError, r"attn_bias.table: all arrays must come from one framework",
                attn_bias=lambda a: _foreign_t5()),
    decode_case("t5-bucket-past-side", ValueError, r"attn_bias.buckets: distance 5 has bucket 32, outside \[0, 32\)",
                attn_bias=t5_buckets(lambda b: replaced(b, 5, 32))),
    decode_case("t5-bucket-negative", ValueError, r"attn_bias.buckets: distance 0 has bucket -1, outside \[0, 16\)",
                attn_bias=t5_buckets(lambda b: replaced(b, 0, -1), bidirectional=True)),
]


def huge_key_stride(shape: tuple[int, ...], axis: int = -1) -> np.ndarray:
    """A float32 array of ``shape`` whose keys (``axis``) lie 2**31 bytes apart (a view of one element: the checks
    must refuse it before anything reads it)."""
    strides = [0] * len(shape)
    strides[axis] = 2**31
    return as_strided(np.zeros(1, np.float32), shape, strides)


def _foreign_t5() -> RelativePositionBias:
    """A T5 bias whose table is of a framework the rest of the call is not."""
    bias = RelativePositionBias(rand((32, NUM_HEADS)))
    bias.table = ForeignArray(bias.table)
    return bias


ALL_ERRORS = [
    *DECODE_RANK_ERRORS, *DECODE_DTYPE_ERRORS, *DECODE_SHAPE_ERRORS, *DECODE_CACHE_MEMORY_ERRORS,
    *DECODE_OPTION_ERRORS, *DECODE_KIND_ERRORS, *DECODE_UNSUPPORTED, *DECODE_DATA_ERRORS, *CACHE_ERRORS,
    *DECODE_BIAS_KIND_ERRORS,
]


EDGE_CASES = [  # each was once a crash or an unnamed error
    decode_case("out-head_size", ValueError, r"out: expected shape \(3, 4, 32\)",
                out=lambda a: np.empty((NUM_SEQS, NUM_HEADS, 16), np.float32)),
    decode_case("out-2d", ValueError, r"out: expected shape \(3, 4, 32\)",
                out=lambda a: np.empty((NUM_SEQS, NUM_HEADS * HEAD_SIZE), np.float32)),
    decode_case("out-float16", ValueError, r"out: expected dtype float32 \(the query's\), got float16",
                out=lambda a: np.empty(a["query"].shape, np.float16)),
    decode_case("out-last-dim-strided", ValueError, r"out: the last dimension must be contiguous",
                out=lambda a: np.empty((NUM_SEQS, NUM_HEADS, 2 * HEAD_SIZE), np.float32)[..., ::2]),
    *(decode_case(f"{name}-None", TypeError, rf"{name}: {NOT_AN_ARRAY_MSG}None", **{name: None})
      for name in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")),
    *(cache_case(f"{name}-None", TypeError, rf"{name}: {NOT_AN_ARRAY_MSG}None", **{name: None})
      for name in ("key", "value", "key_cache", "value_cache", "slot_mapping")),
    decode_case("num_kv_heads-0", ValueError, r"key_cache: .*num_kv_heads",
                **both_caches(lambda shape, dtype: as_strided(np.empty(1, np.float32), (shape[0], BLOCK_SIZE, 0,
                                                              HEAD_SIZE), (0, 0, 4 * HEAD_SIZE, 4)))),
    decode_case("num_kv_heads-0-packed", ValueError, r"key_cache: .*num_kv_heads",
                **both_caches(lambda shape, dtype: np.empty((shape[0], BLOCK_SIZE, 0, HEAD_SIZE), np.float32))),
    cache_case("key_cache-read-only", ValueError, r"key_cache: expected a writeable array",
               key_cache=lambda a: np.broadcast_to(a["key_cache"], a["key_cache"].shape)),
]


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------
CASE_FIELDS = ("function", "base", "changes", "exc", "match")


@pytest.mark.parametrize(CASE_FIELDS, ALL_ERRORS + EDGE_CASES)
def test_rejects(function, base, changes, exc, match):
    with pytest.raises(exc, match=match):
        call(function, base, changes)


@pytest.mark.parametrize(CASE_FIELDS, ALL_ERRORS)
def test_message_starts_with_argument_name(function, base, changes, exc, match):
    """Every message (each ValueError, and the TypeErrors and NotImplementedErrors too) starts with the name of one
    of the function's parameters, or a part of one (``attn_bias.offsets``): ``"<argument>: "``."""
    name = match.partition(":")[0]
    assert name.partition(".")[0] in inspect.signature(function).parameters
    with pytest.raises(exc) as info:
        call(function, base, changes)
    assert str(info.value).startswith(f"{name}: ")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: np.dtype(dt).name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_valid_problem_runs(layout, dtype):
    """The problems every case breaks are valid, with and without ``out``, bias and ALiBi."""
    args = decode_args(layout, dtype)
    want = paged_attention_ref(**args).astype(dtype)
    got = paged_attention(**args)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)
    out = np.full(args["query"].shape, np.nan, dtype)
    assert paged_attention(**args, out=out, scale=None) is out
    np.testing.assert_array_equal(out, want)
    bare = {**args, "attn_bias": None, "alibi_slopes": None}
    np.testing.assert_array_equal(paged_attention(**bare), paged_attention_ref(**bare).astype(dtype))
    written = cache_args(layout, dtype)
    key_cache, value_cache = reshape_and_cache(**written)
    assert key_cache is written["key_cache"] and value_cache is written["value_cache"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_may_lie_further_apart_than_a_page(layout):
    """A page stride above the page size (e.g. caches cut from one [num_blocks, 2, ...] array) is not an error."""
    args = decode_args(layout)
    x = x_of(np.float32)
    for name in ("key_cache", "value_cache"):
        shape = args[name].shape
        args[name] = paged_view(shape, page_stride=math.prod(shape[1:]) + x)
    packed = {**args, "key_cache": args["key_cache"].copy(), "value_cache": args["value_cache"].copy()}
    np.testing.assert_array_equal(paged_attention(**args), paged_attention_ref(**packed).astype(np.float32))


@pytest.mark.parametrize("unused_id", UNUSED_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_range_ids_in_unused_entries_are_fine(layout, unused_id):
    """Block-table entries past a sequence's length are never checked nor read."""
    args = decode_args(layout)
    unused = ~used_entries()
    tables = replaced(args["block_tables"], unused, unused_id)
    valid = replaced(args["block_tables"], unused, 0)
    # Pages no sequence reads hold NaN: the result must not depend on them.
    idle = np.setdiff1d(np.arange(NUM_BLOCKS), args["block_tables"][~unused])
    args["key_cache"][idle] = np.nan
    args["value_cache"][idle] = np.nan
    got = paged_attention(**{**args, "block_tables": tables})
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, paged_attention_ref(**{**args, "block_tables": valid}).astype(np.float32))


def slots_view(cache: np.ndarray, layout: str) -> np.ndarray:
    """The cache as [num_blocks * block_size, num_kv_heads, head_size] (a copy)."""
    if layout == "vllm":
        cache = cache.transpose(0, 3, 1, 2, 4) if cache.ndim == 5 else cache.transpose(0, 3, 1, 2)
    return cache.reshape(CAPACITY, NUM_KV_HEADS, HEAD_SIZE).copy()


@pytest.mark.parametrize("slot_dtype", (np.int32, np.int64), ids=("int32", "int64"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_slots_are_skipped(layout, slot_dtype):
    args = cache_args(layout)
    args["slot_mapping"] = np.array((3, -1, 87, -(2**31), 40), slot_dtype)
    want = {name: slots_view(args[name], layout) for name in ("key_cache", "value_cache")}
    for t, slot in enumerate(args["slot_mapping"].tolist()):
        if slot >= 0:
            want["key_cache"][slot] = args["key"][t]
            want["value_cache"][slot] = args["value"][t]
    key_cache, value_cache = reshape_and_cache(**args)
    assert key_cache is args["key_cache"] and value_cache is args["value_cache"]
    np.testing.assert_array_equal(slots_view(key_cache, layout), want["key_cache"])
    np.testing.assert_array_equal(slots_view(value_cache, layout), want["value_cache"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slot_past_the_cache_writes_nothing(layout):
    """The slot check runs before any write: a rejected call leaves the caches as they were."""
    args = cache_args(layout)
    args["slot_mapping"] = replaced(args["slot_mapping"], 4, CAPACITY)
    before = args["key_cache"].copy(), args["value_cache"].copy()
    with pytest.raises(ValueError, match=r"slot_mapping: token 4 has slot 88, outside the cache's 88 slots"):
        reshape_and_cache(**args)
    np.testing.assert_array_equal(args["key_cache"], before[0])
    np.testing.assert_array_equal(args["value_cache"], before[1])


# ---------------------------------------------------------------------------------------------------------------
# paged_prefill_attention (the NumPy path runs every check, device data included)
# ---------------------------------------------------------------------------------------------------------------
from cupy_paged_attn.prefill import paged_prefill_attention  # noqa: E402

Q_LENS = (1, 5, 10)  # query rows per sequence, each <= its SEQ_LENS entry
TOTAL_Q = sum(Q_LENS)
MAX_Q = 12  # rows of the dense prefill bias


def prefill_args(layout: str = "nhd", dtype: Any = np.float32) -> dict[str, Any]:
    """Valid keyword arguments of ``paged_prefill_attention`` (dense bias and ALiBi included)."""
    key_cache, value_cache = make_caches(layout, dtype)
    return {
        "query": rand((TOTAL_Q, NUM_HEADS, HEAD_SIZE), dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": make_block_tables(),
        "seq_lens": np.array(SEQ_LENS, np.int32),
        "query_start_loc": np.array((0, *np.cumsum(Q_LENS)), np.int32),
        "attn_bias": rand((NUM_SEQS, NUM_HEADS, MAX_Q, BIAS_LEN), dtype),
        "alibi_slopes": rand(NUM_HEADS, np.float32),
        "kv_layout": layout,
    }


BUILDERS[paged_prefill_attention] = prefill_args
prefill_case = functools.partial(case, paged_prefill_attention)

PREFILL_ERRORS = [
    prefill_case("causal-int", TypeError, r"causal: expected a bool, got int 1", causal=1),
    prefill_case("query-2d", ValueError, r"query: expected a 3-D array \[total_query_tokens, num_heads, head_size\]",
                 query=lambda a: a["query"][0]),
    prefill_case("query-head-size", NotImplementedError, r"query: head_size 48 is not supported",
                 query=lambda a: rand((TOTAL_Q, NUM_HEADS, 48))),
    prefill_case("query-dtype", ValueError, r"query: expected dtype float32, float16 or bfloat16, got float64",
                 query=lambda a: a["query"].astype(np.float64)),
    prefill_case("key_cache-dtype", ValueError, r"key_cache: expected dtype float32 \(the query's\) or float8_e4m3fn / "
                 r"float8_e5m2, got float16", key_cache=lambda a: a["key_cache"].astype(np.float16)),
    prefill_case("kv-heads", ValueError, r"key_cache: num_kv_heads \(2\) must divide the query's num_heads \(3\)",
                 query=lambda a: a["query"][:, :3], alibi_slopes=None, attn_bias=None),
    prefill_case("query_start_loc-shape", ValueError, r"query_start_loc: expected shape \(4,\) \[num_seqs \+ 1\]",
                 query_start_loc=lambda a: a["query_start_loc"][:3]),
    prefill_case("query_start_loc-dtype", ValueError, r"query_start_loc: expected dtype int32, got int64",
                 query_start_loc=lambda a: a["query_start_loc"].astype(np.int64)),
    prefill_case("query_start_loc-not-zero", ValueError, r"query_start_loc: expected to start at 0 and end at "
                 r"total_query_tokens=16, got 1 \.\.\. 16",
                 query_start_loc=lambda a: replaced(a["query_start_loc"], 0, 1)),
    prefill_case("query_start_loc-short", ValueError, r"query_start_loc: expected to start at 0 and end at "
                 r"total_query_tokens=16, got 0 \.\.\. 15",
                 query_start_loc=lambda a: replaced(a["query_start_loc"], 3, 15)),
    prefill_case("query_start_loc-decreasing", ValueError, r"query_start_loc: sequence 1 has -1 query rows",
                 query_start_loc=lambda a: replaced(a["query_start_loc"], 2, 0)),
    prefill_case("q_len-past-seq_len", ValueError, r"query_start_loc: sequence 0 has 2 query rows but "
                 r"seq_lens\[0\] = 1 keys", query_start_loc=lambda a: replaced(a["query_start_loc"], 1, 2)),
    prefill_case("seq_lens-shape", ValueError, r"seq_lens: expected shape \(3,\) \[num_seqs\]",
                 seq_lens=np.array((1, 13), np.int32)),
    prefill_case("seq_lens-range", ValueError, r"seq_lens: sequence 2 has length 25, outside \[0, 24\]",
                 seq_lens=np.array((1, 13, 25), np.int32)),
    prefill_case("block-id", ValueError, r"block_tables: sequence 1 uses block id 11, outside \[0, 11\)",
                 block_tables=lambda a: replaced(a["block_tables"], (1, 0), NUM_BLOCKS)),
    prefill_case("bias-3d", ValueError, r"attn_bias: expected a 4-D array \[num_seqs, num_heads, max_q_len, L\]",
                 attn_bias=lambda a: a["attn_bias"][:, :, 0]),
    prefill_case("bias-heads", ValueError, r"attn_bias: expected shape \(num_seqs=3, num_heads=4, max_q_len",
                 attn_bias=lambda a: a["attn_bias"][:, :2]),
    prefill_case("t5-bucket-past-side", ValueError, r"attn_bias.buckets: distance 127 has bucket 40, outside "
                 r"\[0, 32\)", attn_bias=t5_buckets(lambda b: replaced(b, 127, 40))),
    prefill_case("bias-key-stride-2**31-bytes", NotImplementedError, r"attn_bias: the step from one key to the next "
                 r"must be under 2\*\*31 bytes", attn_bias=lambda a: huge_key_stride(a["attn_bias"].shape)),
    prefill_case("bias-rows", ValueError, r"attn_bias: sequence 2 has 10 query rows, more than the bias's "
                 r"max_q_len = 9", attn_bias=lambda a: a["attn_bias"][:, :, :9]),
    prefill_case("bias-short", ValueError, r"attn_bias: sequence 2 has 24 keys \(seq_lens\[2\]\) but the bias "
                 r"covers L = 20",
                 attn_bias=lambda a: a["attn_bias"][..., :20]),
    prefill_case("bias-ragged", NotImplementedError, r"attn_bias: RaggedBias is a decode bias",
                 attn_bias=lambda a: RaggedBias(rand((40, NUM_HEADS)), np.array((0, 1, 14, 38), np.int32))),
    prefill_case("t5-heads", ValueError, r"attn_bias.table: expected shape \(32, 4\)",
                 attn_bias=lambda a: RelativePositionBias(rand((32, 3)))),
    prefill_case("alibi-shape", ValueError, r"alibi_slopes: expected shape \(4,\)",
                 alibi_slopes=lambda a: a["alibi_slopes"][:3]),
    prefill_case("out-shape", ValueError, r"out: expected shape \(16, 4, 32\)",
                 out=lambda a: np.empty((15, NUM_HEADS, HEAD_SIZE), np.float32)),
    prefill_case("layout", ValueError, r"kv_layout: expected one of 'nhd', 'vllm', 'hnd', got 'HND'", kv_layout="HND"),
    prefill_case("scale-inf", ValueError, r"scale: expected None or a finite real number", scale=math.inf),
    prefill_case("stream-numpy", TypeError, r"stream: NumPy arrays run on the CPU", stream=0),
    prefill_case("mixed-types", TypeError, r"query_start_loc: expected a NumPy, CuPy, PyTorch or JAX array, got "
                 r"builtins.list", query_start_loc=[0, 1, 6, 16]),
]


@pytest.mark.parametrize(CASE_FIELDS, PREFILL_ERRORS)
def test_prefill_rejects(function, base, changes, exc, match):
    with pytest.raises(exc, match=match):
        call(function, base, changes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_valid_problem_runs(layout):
    args = prefill_args(layout)
    got = paged_prefill_attention(**args)
    assert got.shape == (TOTAL_Q, NUM_HEADS, HEAD_SIZE) and np.isfinite(got).all()
    assert paged_prefill_attention(**{**args, "causal": False, "attn_bias": RelativePositionBias(
        rand((32, NUM_HEADS)), bidirectional=True)}).shape == got.shape
