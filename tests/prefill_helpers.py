"""Random paged prefill problems for the tests, and an independent dense attention to check them against.

Built on :func:`helpers.make_problem` (scattered pages, NaN in every unused cache slot, poisoned block-table
entries); the queries are packed rows ``[total_query_tokens, num_heads, head_size]`` with ``query_start_loc``.
A dense bias holds NaN wherever no query row or key of a sequence reaches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from helpers import DTYPES, make_problem

import cupy_paged_attn as cpa

#: Dense bias layouts, then the in-kernel T5 kinds.
DENSE_KINDS = ("dense", "broadcast-seq", "broadcast-head", "broadcast-rows", "strided")
T5_KINDS = ("t5-causal", "t5-bidir", "t5-short")  # t5-short: bidirectional, max_distance 12 (many far key tiles)
T5_GEOMETRY = {"t5-causal": (32, 128, False), "t5-bidir": (32, 128, True), "t5-short": (10, 12, True)}


@dataclass
class PrefillProblem:
    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    attn_bias: Any  # a dense array, a RelativePositionBias or None
    alibi_slopes: np.ndarray | None
    scale: float | None
    kv_layout: str
    causal: bool
    dense_k: list[np.ndarray] = field(default_factory=list)
    dense_v: list[np.ndarray] = field(default_factory=list)

    def args(self) -> tuple[np.ndarray, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)

    def kwargs(self) -> dict[str, Any]:
        return {"causal": self.causal, "scale": self.scale, "attn_bias": self.attn_bias,
                "alibi_slopes": self.alibi_slopes, "kv_layout": self.kv_layout}


def make_prefill_problem(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],  # (seq_len, q_len) per sequence, q_len <= seq_len
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: str = "f32",
    kv_layout: str = "nhd",
    bias: str = "none",  # "none" | DENSE_KINDS | T5_KINDS
    bias_dtype: str = "f32",
    alibi: bool = False,
    scale: float | None = None,
    causal: bool = True,
    extra_table_cols: int = 1,
) -> PrefillProblem:
    seq_lens = [n for n, _ in seqs]
    q_lens = [q for _, q in seqs]
    base = make_problem(rng, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                        block_size=block_size, dtype=dtype, kv_layout=kv_layout, alibi=alibi, scale=scale,
                        extra_table_cols=extra_table_cols)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(starts[-1]), num_heads, head_size)).astype(DTYPES[dtype])
    num_seqs = len(seqs)
    max_q, length = max(q_lens, default=0) + 2, max(seq_lens, default=0) + 5
    b_dtype = DTYPES[bias_dtype]
    attn_bias: Any = None
    if bias == "dense":
        attn_bias = rng.standard_normal((num_seqs, num_heads, max_q, length)).astype(b_dtype)
        for s, (n, q) in enumerate(seqs):  # never read: rows past q_len, keys past seq_len
            attn_bias[s, :, q:] = np.nan
            attn_bias[s, :, :, n:] = np.nan
    elif bias == "broadcast-seq":
        attn_bias = np.broadcast_to(rng.standard_normal((1, num_heads, max_q, length)).astype(b_dtype),
                                    (num_seqs, num_heads, max_q, length))
    elif bias == "broadcast-head":
        attn_bias = np.broadcast_to(rng.standard_normal((num_seqs, 1, max_q, length)).astype(b_dtype),
                                    (num_seqs, num_heads, max_q, length))
    elif bias == "broadcast-rows":  # one bias row for every query row (a key-padding mask, say)
        attn_bias = np.broadcast_to(rng.standard_normal((num_seqs, num_heads, 1, length)).astype(b_dtype),
                                    (num_seqs, num_heads, max_q, length))
    elif bias == "strided":  # keys outermost in memory, every other key
        wide = rng.standard_normal((2 * length, num_seqs, max_q, num_heads)).astype(b_dtype)
        attn_bias = wide[::2].transpose(1, 3, 2, 0)
    elif bias in T5_KINDS:
        num_buckets, max_distance, bidirectional = T5_GEOMETRY[bias]
        table = rng.standard_normal((num_buckets, num_heads)).astype(b_dtype)
        attn_bias = cpa.RelativePositionBias(table, num_buckets=num_buckets, max_distance=max_distance,
                                             bidirectional=bidirectional)
    elif bias != "none":
        raise ValueError(bias)
    return PrefillProblem(query, base.key_cache, base.value_cache, base.block_tables, base.seq_lens, starts,
                          attn_bias, base.alibi_slopes, scale, kv_layout, causal, base.dense_k, base.dense_v)


def dense_prefill_attention(p: PrefillProblem, soft_cap: float | None = None,
                            window_left: int | None = None) -> np.ndarray:
    """Attention of every query row from the dense per-sequence K/V, loop by loop, independent of the library's
    reference (T5 through the public bucket function; Gemma 2's soft-cap and a sliding window when asked)."""
    q = p.query.astype(np.float64)
    total, num_heads, head_size = q.shape
    scale = p.scale if p.scale is not None else head_size**-0.5
    out = np.zeros((total, num_heads, head_size))
    for s in range(len(p.seq_lens)):
        k = p.dense_k[s].astype(np.float64)
        v = p.dense_v[s].astype(np.float64)
        n = k.shape[0]
        q0, q1 = int(p.query_start_loc[s]), int(p.query_start_loc[s + 1])
        group = num_heads // k.shape[1]
        for i in range(q1 - q0):
            pos = n - (q1 - q0) + i
            keys = np.arange(pos + 1 if p.causal else n)
            if window_left is not None:
                keys = keys[keys >= pos - window_left]
            if keys.size == 0:
                continue
            for h in range(num_heads):
                logits = scale * (k[keys, h // group, :] @ q[q0 + i, h])
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                if p.alibi_slopes is not None:
                    logits += float(p.alibi_slopes[h]) * (keys - pos)
                if isinstance(p.attn_bias, cpa.RelativePositionBias):
                    t5 = p.attn_bias
                    buckets = cpa.t5_relative_position_bucket(keys - pos, bidirectional=t5.bidirectional,
                                                              num_buckets=t5.num_buckets, max_distance=t5.max_distance)
                    logits += np.asarray(p.attn_bias.table, dtype=np.float64)[buckets, h]
                elif p.attn_bias is not None:
                    logits += np.asarray(p.attn_bias[s, h, i, keys], dtype=np.float64)
                w = np.exp(logits - logits.max())
                out[q0 + i, h] = (w / w.sum()) @ v[keys, h // group, :]
    return out
