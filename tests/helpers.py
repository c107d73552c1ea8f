"""Random paged-attention problems for the tests, and an independent dense attention to check them against.

Data is drawn fresh (never zeros); pages are scattered through a shuffled free list; every cache slot that no
sequence uses, and every block-table entry past a sequence's length, holds poison (NaN, out-of-range ids) so
that a kernel reading beyond a sequence shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
#: (atol, rtol) of a kernel's output against the float64 reference, by storage dtype.
TOLERANCES = {"f32": (2e-5, 2e-5), "f16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}
POISON_BLOCK_ID = 2**30  # in block-table entries past a sequence's length


@dataclass
class Problem:
    """NumPy arrays of one decode problem, plus the dense per-sequence K/V it was built from."""

    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    attn_bias: np.ndarray | None
    alibi_slopes: np.ndarray | None
    scale: float | None
    kv_layout: str
    dense_k: list[np.ndarray] = field(default_factory=list)  # per sequence [len, Hkv, D]
    dense_v: list[np.ndarray] = field(default_factory=list)
    bias_kind: Any = None  # a RaggedBias / RelativePositionBias to pass instead of attn_bias (its dense form)

    def kwargs(self) -> dict[str, Any]:
        bias = self.bias_kind if self.bias_kind is not None else self.attn_bias
        return {"scale": self.scale, "attn_bias": bias, "alibi_slopes": self.alibi_slopes,
                "kv_layout": self.kv_layout}

    def args(self) -> tuple[np.ndarray, ...]:
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens


def to_vllm_layout(k_nhd: np.ndarray, v_nhd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, B, Hkv, D] caches -> vLLM's key [N, Hkv, D/x, B, x] and value [N, Hkv, D, B] (copies)."""
    n, b, h, d = k_nhd.shape
    x = 16 // k_nhd.dtype.itemsize
    k = np.ascontiguousarray(k_nhd.reshape(n, b, h, d // x, x).transpose(0, 2, 3, 1, 4))
    v = np.ascontiguousarray(v_nhd.transpose(0, 2, 3, 1))
    return k, v


def make_problem(
    rng: np.random.Generator,
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: str = "f32",
    kv_layout: str = "nhd",
    bias: str = "none",  # "none" | "dense" | "broadcast-seq" | "broadcast-head" | "strided" | BIAS_KINDS
    bias_dtype: str = "f32",
    alibi: bool = False,
    scale: float | None = None,
    spare_blocks: int = 3,
    extra_table_cols: int = 1,
) -> Problem:
    np_dtype = DTYPES[dtype]
    num_seqs = len(seq_lens)
    pages_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages_per_seq) + spare_blocks
    max_pages = max(pages_per_seq, default=0) + extra_table_cols
    k_cache = np.full((num_blocks, block_size, num_kv_heads, head_size), np.nan, dtype=np.float32)
    v_cache = np.full_like(k_cache, np.nan)
    tables = np.full((num_seqs, max_pages), POISON_BLOCK_ID, dtype=np.int32)
    free = list(rng.permutation(num_blocks))
    dense_k, dense_v = [], []
    for s, n in enumerate(seq_lens):
        k = rng.standard_normal((n, num_kv_heads, head_size)).astype(np_dtype)
        v = rng.standard_normal((n, num_kv_heads, head_size)).astype(np_dtype)
        dense_k.append(k)
        dense_v.append(v)
        for p in range(pages_per_seq[s]):
            blk = free.pop()
            tables[s, p] = blk
            rows = slice(p * block_size, min(n, (p + 1) * block_size))
            k_cache[blk, : rows.stop - rows.start] = k[rows]
            v_cache[blk, : rows.stop - rows.start] = v[rows]
    k_cache, v_cache = k_cache.astype(np_dtype), v_cache.astype(np_dtype)
    if kv_layout == "vllm":
        k_cache, v_cache = to_vllm_layout(k_cache, v_cache)
    elif kv_layout == "hnd":
        k_cache, v_cache = (np.ascontiguousarray(c.transpose(0, 2, 1, 3)) for c in (k_cache, v_cache))
    query = rng.standard_normal((num_seqs, num_heads, head_size)).astype(np_dtype)
    length = max(seq_lens, default=0) + 5
    kind = None
    if bias in BIAS_KINDS or bias in T5_KIND_GEOMETRY:  # (tests may add geometries)
        kind, bias_arr = make_bias_kind(rng, bias, seq_lens, num_heads, DTYPES[bias_dtype])
    else:
        bias_arr = make_bias(rng, bias, num_seqs, num_heads, length, DTYPES[bias_dtype])
    if bias == "dense":  # the bias past each sequence's length must never be read
        for s, n in enumerate(seq_lens):
            bias_arr[s, :, n:] = np.nan
    slopes = (rng.uniform(0.01, 0.5, num_heads).astype(np.float32)) if alibi else None
    return Problem(query, k_cache, v_cache, tables, np.asarray(seq_lens, dtype=np.int32), bias_arr, slopes, scale,
                   kv_layout, dense_k, dense_v, kind)


#: Bias kinds other than a dense array: ragged rows (contiguous, or stored head-major), T5 in-kernel (causal as in
#: a decoder, bidirectional as in an encoder; T5's geometry, an odd one, a wide one whose max_distance passes the
#: decode kernel's near-weight table of 128 distances, and one with more buckets on a side, 150, than that kernel's
#: column of 128 table entries per head holds).
BIAS_KINDS = ("ragged", "ragged-strided", "t5-causal", "t5-bidir", "t5-odd", "t5-wide", "t5-many")
#: (num_buckets, max_distance, bidirectional) of the T5 kinds.
T5_KIND_GEOMETRY = {"t5-causal": (32, 128, False), "t5-bidir": (32, 128, True), "t5-odd": (10, 40, True),
                    "t5-wide": (48, 500, False), "t5-many": (300, 1000, True)}
RAGGED_GAP = 3  # rows of NaN before each sequence's rows of a ragged bias: never read


def make_bias_kind(rng: np.random.Generator, kind: str, seq_lens: list[int], num_heads: int, dtype: Any
                   ) -> tuple[Any, np.ndarray]:
    """``(bias object, its dense form [num_seqs, num_heads, max(seq_lens)])``; the dense form, NaN-free, is what
    the independent :func:`dense_attention` adds."""
    import cupy_paged_attn as cpa

    keys = max(seq_lens, default=0)
    dense = np.zeros((len(seq_lens), num_heads, keys), dtype=np.float32)
    if kind.startswith("ragged"):
        offsets = np.zeros(len(seq_lens) + 1, np.int32)
        for s, n in enumerate(seq_lens):
            offsets[s + 1] = offsets[s] + RAGGED_GAP + n
        offsets[:-1] += RAGGED_GAP  # each sequence starts after its gap; the last offset is the end
        total = int(offsets[-1]) + 2
        values = np.full((total, num_heads), np.nan, np.float32)
        for s, n in enumerate(seq_lens):
            rows = rng.standard_normal((n, num_heads)).astype(dtype)
            values[offsets[s]:offsets[s] + n] = rows
            dense[s, :, :n] = rows.T
        values = values.astype(dtype)
        if kind == "ragged-strided":  # stored [num_heads, total]: values' rows are strided
            values = np.ascontiguousarray(values.T).T
        return cpa.RaggedBias(values, offsets), dense
    num_buckets, max_distance, bidirectional = T5_KIND_GEOMETRY[kind]
    table = rng.standard_normal((num_buckets, num_heads)).astype(dtype)
    for s, n in enumerate(seq_lens):
        buckets = cpa.t5_relative_position_bucket(np.arange(n) - (n - 1), bidirectional=bidirectional,
                                                  num_buckets=num_buckets, max_distance=max_distance)
        dense[s, :, :n] = table[buckets].T
    kind_obj = cpa.RelativePositionBias(table, num_buckets=num_buckets, max_distance=max_distance,
                                        bidirectional=bidirectional)
    return kind_obj, dense


def hostile_t5_bias(bias: Any, convert: Any) -> Any:
    """The same RelativePositionBias through ``from_buckets``, its bucket array (``convert``ed, e.g. to CuPy) with
    the last buckets of one side (per_side - 1) replaced by values outside [0, per_side), negative and past the end.
    The kernels hold a bucket as unsigned to at most per_side - 1 (a negative one is past it), which gives back the
    valid array: their result equals the reference. Read as given, the array would index outside the bias table and
    the kernels' shared-memory copy of it."""
    import cupy_paged_attn as cpa
    from cupy_paged_attn.reference import to_numpy

    good = to_numpy(bias.buckets)
    bad = good.copy()
    last = np.flatnonzero(good == bias.per_side - 1)
    assert last.size, "no bucket to replace"
    outside = np.array([-1, bias.per_side, -(2**31), 2**31 - 1, bias.per_side + 1000], np.int32)
    bad[last] = np.resize(outside, last.size)
    return cpa.RelativePositionBias.from_buckets(bias.table, convert(bad), num_buckets=bias.num_buckets,
                                                 max_distance=bias.max_distance, bidirectional=bias.bidirectional)


def convert_bias(bias: Any, convert: Any) -> Any:
    """A bias of any kind with its arrays converted by ``convert`` (e.g. to CuPy or torch)."""
    import cupy_paged_attn as cpa

    if isinstance(bias, cpa.RaggedBias):
        return cpa.RaggedBias(convert(bias.values), convert(bias.offsets))
    if isinstance(bias, cpa.RelativePositionBias):
        return cpa.RelativePositionBias(convert(bias.table), num_buckets=bias.num_buckets,
                                        max_distance=bias.max_distance, bidirectional=bias.bidirectional)
    return convert(bias)


def make_bias(rng: np.random.Generator, kind: str, num_seqs: int, num_heads: int, length: int,
              dtype: Any) -> np.ndarray | None:
    """A bias [num_seqs, num_heads, length] whose positions past each sequence would poison the result."""
    if kind == "none":
        return None
    if kind == "dense":
        return rng.standard_normal((num_seqs, num_heads, length)).astype(dtype)
    if kind == "broadcast-seq":  # stride 0 over sequences
        row = rng.standard_normal((1, num_heads, length)).astype(dtype)
        return np.broadcast_to(row, (num_seqs, num_heads, length))
    if kind == "broadcast-head":  # stride 0 over heads
        row = rng.standard_normal((num_seqs, 1, length)).astype(dtype)
        return np.broadcast_to(row, (num_seqs, num_heads, length))
    if kind == "strided":  # every other key of a wider array, heads and keys swapped in memory
        wide = rng.standard_normal((num_seqs, 2 * length, num_heads)).astype(dtype)
        return wide[:, ::2, :].transpose(0, 2, 1)
    raise ValueError(kind)


def dense_attention(problem: Problem, soft_cap: float | None = None, window_left: int | None = None) -> np.ndarray:
    """Attention computed from the dense per-sequence K/V, written independently of the library's reference (with
    Gemma 2's soft-cap and a sliding window when asked)."""
    q = problem.query.astype(np.float64)
    num_seqs, num_heads, head_size = q.shape
    scale = problem.scale if problem.scale is not None else head_size**-0.5
    out = np.zeros((num_seqs, num_heads, head_size))
    for s in range(num_seqs):
        k = problem.dense_k[s].astype(np.float64)
        v = problem.dense_v[s].astype(np.float64)
        n = k.shape[0]
        if n == 0:
            continue
        group = num_heads // k.shape[1]
        first = 0 if window_left is None else max(0, n - 1 - window_left)  # the window's first key
        for h in range(num_heads):
            logits = scale * (k[first:, h // group, :] @ q[s, h])
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            if problem.alibi_slopes is not None:
                logits = logits + float(problem.alibi_slopes[h]) * (np.arange(first, n) - (n - 1))
            if problem.attn_bias is not None:
                logits = logits + problem.attn_bias[s, h, first:n].astype(np.float64)
            w = np.exp(logits - logits.max())
            out[s, h] = (w / w.sum()) @ v[first:, h // group, :]
    return out


def assert_close(actual: Any, expected: np.ndarray, dtype: str, what: str = "") -> None:
    """Compare with the per-dtype tolerance; NaN never passes."""
    actual = np.asarray(actual, dtype=np.float64)
    assert np.isfinite(actual).all(), f"{what}: non-finite values in the result"
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol, err_msg=what)


def assert_same(actual: Any, expected: np.ndarray) -> None:
    """Bit for bit equal (NaN poison included: NumPy cannot compare bfloat16 NaN as equal)."""
    actual, expected = np.ascontiguousarray(actual), np.ascontiguousarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape)
    bits = np.dtype(f"u{actual.dtype.itemsize}")
    np.testing.assert_array_equal(actual.view(bits), expected.view(bits))


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softcap: float | None,
                     window: int | None) -> np.ndarray:
    """The float64 reference of transformers' attention calls (tests of cupy_paged_attn.transformers). One sequence:
    ``q [q_len, H, d]`` as its last ``q_len`` of ``k, v [k_len, Hkv, d]``, causal; a query attends the last
    ``window`` keys itself included (transformers' convention)."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    out = np.zeros(q.shape)
    for i in range(q_len):
        p = k_len - q_len + i
        first = 0 if window is None else max(0, p - window + 1)
        for h in range(num_heads):
            g = h // (num_heads // num_kv_heads)
            logits = scale * (k[first:p + 1, g] @ q[i, h])
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            weights = np.exp(logits - logits.max())
            out[i, h] = weights @ v[first:p + 1, g] / weights.sum()
    return out
