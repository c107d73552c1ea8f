"""NumPy references, float64 math: the definition the kernels are tested against, and the library's CPU path.

They gather each sequence's keys and values page by page through ``block_tables`` and apply the formula of
:func:`cupy_paged_attn.paged_attention` directly, with no tiling, no online softmax and no split.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _checks
from ._interop import to_numpy
from .bias import t5_position_bias

__all__ = ["dense_bias", "paged_attention_ref", "paged_prefill_attention_ref", "reshape_and_cache_ref", "to_numpy"]


def _nhd_caches(key_cache: np.ndarray, value_cache: np.ndarray, kv_layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Views of the caches as [num_blocks, block_size, num_kv_heads, head_size]."""
    if kv_layout == "nhd":
        return key_cache, value_cache
    n, h, dx, b, x = key_cache.shape
    k = key_cache.transpose(0, 3, 1, 2, 4).reshape(n, b, h, dx * x)
    v = value_cache.transpose(0, 3, 1, 2)
    return k, v


def _sequence_kv(p: Any, k_cache: np.ndarray, v_cache: np.ndarray, s: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence ``s``'s first ``n`` keys and values, float64 ``[n, num_heads, head_size]`` (each KV head repeated for
    the query heads of its group), gathered token by token through the block table: token j lives in page
    ``block_tables[s, j // block_size]`` at offset ``j % block_size``."""
    pages = p.block_tables[s, : -(-n // p.cache.block_size)]
    k = k_cache[pages].reshape(-1, p.num_kv_heads, p.head_size)[:n].astype(np.float64)
    v = v_cache[pages].reshape(-1, p.num_kv_heads, p.head_size)[:n].astype(np.float64)
    g = p.num_heads // p.num_kv_heads
    return np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)


def dense_bias(bias: _checks.CheckedBias, seq_lens: np.ndarray, num_seqs: int, num_heads: int) -> np.ndarray | None:
    """Any checked decode bias (NumPy arrays) as a dense float64 ``[num_seqs, num_heads, max(seq_lens)]``."""
    if bias.mode == "none":
        return None
    keys = int(seq_lens.max(initial=0))
    if bias.mode == "dense":
        return np.asarray(bias.array[:, :, :keys], dtype=np.float64)
    if bias.mode == "ragged":
        values = np.asarray(bias.array, dtype=np.float64)
        dense = np.zeros((num_seqs, num_heads, keys))
        for s, n in enumerate(seq_lens.tolist()):
            first = int(bias.index[s])
            dense[s, :, :n] = values[first:first + n].T
        return dense
    t5 = bias.source
    dense = t5_position_bias(np.asarray(bias.array, dtype=np.float64), seq_lens.astype(np.int64) - 1, keys,
                             bidirectional=t5.bidirectional, num_buckets=t5.num_buckets, max_distance=t5.max_distance)
    return np.asarray(dense)


def decode_math(problem: _checks.DecodeProblem) -> np.ndarray:
    """out[s, h] in float64 for a checked problem whose arrays are NumPy arrays."""
    p = problem
    q = np.asarray(p.query, dtype=np.float64)
    k_cache, v_cache = _nhd_caches(p.key_cache, p.value_cache, p.kv_layout)
    bias = dense_bias(p.bias, np.asarray(p.seq_lens), p.num_seqs, p.num_heads)
    alibi = None if p.alibi_slopes is None else np.asarray(p.alibi_slopes, dtype=np.float64)
    out = np.zeros((p.num_seqs, p.num_heads, p.head_size), dtype=np.float64)
    for s in range(p.num_seqs):
        n = int(p.seq_lens[s])
        if n == 0:
            continue
        k, v = _sequence_kv(p, k_cache, v_cache, s, n)
        logits = p.scale * np.einsum("hd,jhd->hj", q[s], k)
        if alibi is not None:
            logits += alibi[:, None] * (np.arange(n) - n + 1)[None, :]
        if bias is not None:
            logits += bias[s, :, :n]
        m = logits.max(axis=1, keepdims=True)
        masked = np.isneginf(m)  # every key masked by a -inf bias: the row is zeros
        with np.errstate(invalid="ignore"):
            e = np.exp(logits - np.where(masked, 0.0, m))
        total = e.sum(axis=1, keepdims=True)
        probs = np.where(masked, 0.0, e / np.where(masked, 1.0, total))
        out[s] = np.einsum("hj,jhd->hd", probs, v)
    return out


def _check_numpy_out(out: Any) -> None:
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"out: the reference writes NumPy arrays only, got {type(out).__name__}")


def _into(out: np.ndarray | None, result: np.ndarray) -> np.ndarray:
    """The float64 ``result``, or ``out`` with the result cast into it."""
    if out is None:
        return result
    out[...] = result.astype(out.dtype)
    return out


def paged_attention_ref(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: float | None = None,
    attn_bias: Any = None,
    alibi_slopes: Any = None,
    kv_layout: str = "nhd",
    out: Any = None,
    stream: Any = None,
    validate: bool = True,
) -> Any:
    """Reference of :func:`cupy_paged_attn.paged_attention`, same signature, float64 math on the host.

    Arrays of any supported framework are copied to NumPy first. Every bias kind is materialised densely
    (:func:`dense_bias`). Runs the same argument checks plus the checks of device data (``seq_lens`` within
    ``[0, max_len]``, used block ids within ``[0, num_blocks)``, a RaggedBias's offsets), which raise
    ``ValueError``; ``validate`` cannot turn them off (the math needs valid indices). ``stream`` is ignored.

    Returns
    -------
    numpy.ndarray
        ``[num_seqs, num_heads, head_size]`` float64, unless ``out`` (a NumPy array) is given: then the result is
        cast into ``out``, which is returned.
    """
    arrays = [to_numpy(a) for a in (query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes)]
    bias_arrays = {name: to_numpy(a) for name, a in _checks.bias_operands(attn_bias).items()}
    _check_numpy_out(out)
    problem = _checks.check_decode(
        *arrays[:5], scale=scale, attn_bias=attn_bias, alibi_slopes=arrays[5], kv_layout=kv_layout, out=out,
        bias_arrays=bias_arrays,
    )
    _checks.check_host_data(problem)
    result = decode_math(problem)
    return _into(out, result)


def reshape_and_cache_ref(
    key: Any, value: Any, key_cache: np.ndarray, value_cache: np.ndarray, slot_mapping: Any, *, kv_layout: str = "nhd",
    validate: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Reference of :func:`cupy_paged_attn.reshape_and_cache`: writes the NumPy caches in place and returns them.

    Slots past the cache always raise ``ValueError`` (``validate`` cannot turn that off)."""
    key, value, slot_mapping = to_numpy(key), to_numpy(value), to_numpy(slot_mapping)
    problem = _checks.check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_layout)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not cache.flags.writeable:
            raise ValueError(f"{name}: expected a writeable array (the cache is written in place), got a read-only one")
    _checks.check_slots_host(problem)
    bs = problem.cache.block_size
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, bs)
        if problem.kv_layout == "nhd":
            key_cache[blk, off] = key[t]
            value_cache[blk, off] = value[t]
        else:
            x = key_cache.shape[-1]
            key_cache[blk, :, :, off, :] = key[t].reshape(key.shape[1], -1, x)
            value_cache[blk, :, :, off] = value[t]
    return key_cache, value_cache


def prefill_math(problem: _checks.PrefillProblem) -> np.ndarray:
    """out[t, h] in float64 for a checked prefill problem whose arrays are NumPy arrays."""
    p = problem
    q = np.asarray(p.query, dtype=np.float64)
    k_cache, v_cache = _nhd_caches(p.key_cache, p.value_cache, p.kv_layout)
    alibi = None if p.alibi_slopes is None else np.asarray(p.alibi_slopes, dtype=np.float64)
    starts = np.asarray(p.query_start_loc)
    out = np.zeros((p.total_q, p.num_heads, p.head_size), dtype=np.float64)
    for s in range(p.num_seqs):
        n = int(p.seq_lens[s])
        q0, q1 = int(starts[s]), int(starts[s + 1])
        q_len = q1 - q0
        if n == 0 or q_len == 0:
            continue
        k, v = _sequence_kv(p, k_cache, v_cache, s, n)
        pos = n - q_len + np.arange(q_len)  # absolute position of each query row
        rel = np.arange(n)[None, :] - pos[:, None]  # [q_len, n]: key position - query position
        logits = p.scale * np.einsum("ihd,jhd->ihj", q[q0:q1], k)
        if alibi is not None:
            logits += alibi[None, :, None] * rel[:, None, :]
        if p.bias.mode == "dense":
            logits += np.asarray(p.bias.array[s, :, :q_len, :n], dtype=np.float64).transpose(1, 0, 2)
        elif p.bias.mode == "t5":
            t5 = p.bias.source
            logits += t5_position_bias(np.asarray(p.bias.array, dtype=np.float64), pos.astype(np.int64), n,
                                       bidirectional=t5.bidirectional, num_buckets=t5.num_buckets,
                                       max_distance=t5.max_distance)
        if p.causal:
            logits = np.where((rel > 0)[:, None, :], -np.inf, logits)
        m = logits.max(axis=2, keepdims=True)
        masked = np.isneginf(m)  # every key masked: the row is zeros
        with np.errstate(invalid="ignore"):
            e = np.exp(logits - np.where(masked, 0.0, m))
        total = e.sum(axis=2, keepdims=True)
        probs = np.where(masked, 0.0, e / np.where(masked, 1.0, total))
        out[q0:q1] = np.einsum("ihj,jhd->ihd", probs, v)
    return out


def paged_prefill_attention_ref(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    *,
    causal: bool = True,
    scale: float | None = None,
    attn_bias: Any = None,
    alibi_slopes: Any = None,
    kv_layout: str = "nhd",
    out: Any = None,
    stream: Any = None,
) -> Any:
    """Reference of :func:`cupy_paged_attn.paged_prefill_attention`, same signature, float64 math on the host.

    Arrays of any supported framework are copied to NumPy first; a RelativePositionBias is materialised densely
    with :func:`cupy_paged_attn.t5_position_bias` at each query row's position. Runs the same argument checks plus
    the checks of device data (:func:`cupy_paged_attn._checks.check_prefill_host_data`), which raise
    ``ValueError``. ``stream`` is ignored.

    Returns
    -------
    numpy.ndarray
        ``[total_query_tokens, num_heads, head_size]`` float64, unless ``out`` (a NumPy array) is given: then the
        result is cast into ``out``, which is returned.
    """
    arrays = [to_numpy(a) for a in (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                    alibi_slopes)]
    bias_arrays = {name: to_numpy(a) for name, a in _checks.bias_operands(attn_bias).items()}
    _check_numpy_out(out)
    problem = _checks.check_prefill(
        *arrays[:6], causal=causal, scale=scale, attn_bias=attn_bias, alibi_slopes=arrays[6], kv_layout=kv_layout,
        out=out, bias_arrays=bias_arrays,
    )
    _checks.check_prefill_host_data(problem)
    result = prefill_math(problem)
    return _into(out, result)
