"""NumPy references, float64 math: the definition the kernels are tested against, and the library's CPU path.

They gather each sequence's keys and values page by page through ``block_tables`` and apply the formula of
:func:`cupy_paged_attn.paged_attention` directly, with no tiling, no online softmax and no split.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from . import _checks
from ._interop import to_numpy
from .bias import t5_position_bias

__all__ = [
    "dense_bias", "fp8_quantize", "paged_attention_ref", "paged_prefill_attention_ref", "reshape_and_cache_ref",
    "to_numpy",
]


def _nhd_caches(key_cache: np.ndarray, value_cache: np.ndarray, kv_layout: str,
                fp8: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Views of the caches as [num_blocks, block_size, num_kv_heads, head_size], in the stored values' dtype (an fp8
    cache stored as uint8 is viewed as its format's ml_dtypes dtype)."""
    if fp8 is not None:
        key_cache, value_cache = (c.view(_checks.FP8_FORMATS[fp8]) for c in (key_cache, value_cache))
    if kv_layout == "nhd":
        return key_cache, value_cache
    if kv_layout == "hnd":
        return key_cache.transpose(0, 2, 1, 3), value_cache.transpose(0, 2, 1, 3)
    n, h, dx, b, x = key_cache.shape
    k = key_cache.transpose(0, 3, 1, 2, 4).reshape(n, b, h, dx * x)
    v = value_cache.transpose(0, 3, 1, 2)
    return k, v


def _sequence_kv(p: Any, k_cache: np.ndarray, v_cache: np.ndarray, s: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence ``s``'s first ``n`` keys and values, float64 ``[n, num_heads, head_size]`` (each KV head repeated for
    the query heads of its group), gathered token by token through the block table: token j lives in page
    ``block_tables[s, j // block_size]`` at offset ``j % block_size``. An fp8 cache's values are multiplied by their
    KV head's ``k_scale`` / ``v_scale``."""
    pages = p.block_tables[s, : -(-n // p.cache.block_size)]
    k = k_cache[pages].reshape(-1, p.num_kv_heads, p.head_size)[:n].astype(np.float64)
    v = v_cache[pages].reshape(-1, p.num_kv_heads, p.head_size)[:n].astype(np.float64)
    if p.k_scale is not None:
        k *= p.k_scale.per_head(p.num_kv_heads)[None, :, None]
        v *= p.v_scale.per_head(p.num_kv_heads)[None, :, None]
    g = p.num_heads // p.num_kv_heads
    return np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)


def _scores(p: Any, q: np.ndarray, k: np.ndarray, subscripts: str) -> np.ndarray:
    """``scale * <q, k>``, soft-capped when the problem asks (Gemma 2: the cap before the bias and ALiBi)."""
    logits = p.scale * np.einsum(subscripts, q, k)
    cap = p.scores.soft_cap
    return logits if cap is None else cap * np.tanh(logits / cap)


def _softmax_rows(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; a row whose logits are all ``-inf`` (every key masked) gives zeros."""
    m = logits.max(axis=-1, keepdims=True)
    masked = np.isneginf(m)
    with np.errstate(invalid="ignore"):
        e = np.exp(logits - np.where(masked, 0.0, m))
    total = e.sum(axis=-1, keepdims=True)
    return np.where(masked, 0.0, e / np.where(masked, 1.0, total))


def fp8_quantize(values: Any, scale: Any = 1.0, kv_cache_dtype: str = "fp8_e4m3") -> np.ndarray:
    """What :func:`cupy_paged_attn.reshape_and_cache` stores in an fp8 cache: ``values / scale`` in float32,
    saturated to the format's largest finite value (so finite input never becomes NaN or inf), rounded to the
    nearest fp8 value (ties to even).

    Parameters
    ----------
    values : array ``[..., num_kv_heads, head_size]``, float16 / bfloat16 / float32
    scale : float or array ``[1]`` or ``[num_kv_heads]``
    kv_cache_dtype : {"fp8_e4m3", "fp8_e5m2"}

    Returns
    -------
    numpy.ndarray
        Of ml_dtypes' ``float8_e4m3fn`` or ``float8_e5m2``; ``.view(np.uint8)`` gives vLLM's storage.
    """
    fmt = _checks.FP8_FORMATS[kv_cache_dtype]
    x = np.asarray(to_numpy(values), dtype=np.float32)
    per_head = np.asarray(to_numpy(scale), dtype=np.float32).reshape(-1)
    if per_head.size not in (1, x.shape[-2]):
        raise ValueError(f"scale: expected one value or one per KV head ({x.shape[-2]}), got {per_head.size}")
    largest = np.float32(ml_dtypes.finfo(fmt).max)
    return np.clip(x / per_head[:, None], -largest, largest).astype(fmt)


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
    k_cache, v_cache = _nhd_caches(p.key_cache, p.value_cache, p.kv_layout, p.cache.fp8)
    bias = dense_bias(p.bias, np.asarray(p.seq_lens), p.num_seqs, p.num_heads)
    alibi = None if p.alibi_slopes is None else np.asarray(p.alibi_slopes, dtype=np.float64)
    window = p.scores.window_left
    out = np.zeros((p.num_seqs, p.num_heads, p.head_size), dtype=np.float64)
    for s in range(p.num_seqs):
        n = int(p.seq_lens[s])
        if n == 0:
            continue
        k, v = _sequence_kv(p, k_cache, v_cache, s, n)
        logits = _scores(p, q[s], k, "hd,jhd->hj")
        rel = np.arange(n) - n + 1  # key position - the query's (n - 1)
        if alibi is not None:
            logits += alibi[:, None] * rel[None, :]
        if bias is not None:
            logits += bias[s, :, :n]
        if window is not None:
            logits[:, rel < -window] = -np.inf
        out[s] = np.einsum("hj,jhd->hd", _softmax_rows(logits), v)
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
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
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
        bias_arrays=bias_arrays, logits_soft_cap=logits_soft_cap, window_left=window_left,
        kv_cache_dtype=kv_cache_dtype, k_scale=_host_scale(k_scale), v_scale=_host_scale(v_scale),
    )
    _checks.check_host_data(problem)
    result = decode_math(problem)
    return _into(out, result)


def _host_scale(scale: Any) -> Any:
    """An fp8 scale as the checks take it on the host: a number as it is, an array as a NumPy copy."""
    return scale if scale is None or isinstance(scale, (int, float, np.generic)) else to_numpy(scale)


def reshape_and_cache_ref(
    key: Any, value: Any, key_cache: np.ndarray, value_cache: np.ndarray, slot_mapping: Any, *, kv_layout: str = "nhd",
    kv_cache_dtype: str = "auto", k_scale: Any = None, v_scale: Any = None, validate: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Reference of :func:`cupy_paged_attn.reshape_and_cache`: writes the NumPy caches in place and returns them.

    An fp8 cache receives :func:`fp8_quantize` of the values. Slots past the cache always raise ``ValueError``
    (``validate`` cannot turn that off)."""
    key, value, slot_mapping = to_numpy(key), to_numpy(value), to_numpy(slot_mapping)
    problem = _checks.check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_layout, kv_cache_dtype,
                                        _host_scale(k_scale), _host_scale(v_scale))
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not cache.flags.writeable:
            raise ValueError(f"{name}: expected a writeable array (the cache is written in place), got a read-only one")
    _checks.check_slots_host(problem)
    fp8 = problem.cache.fp8
    if fp8 is not None:
        heads = problem.cache.num_kv_heads
        key = fp8_quantize(key, problem.k_scale.per_head(heads), fp8).view(key_cache.dtype)
        value = fp8_quantize(value, problem.v_scale.per_head(heads), fp8).view(value_cache.dtype)
    bs = problem.cache.block_size
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, bs)
        if problem.kv_layout == "nhd":
            key_cache[blk, off] = key[t]
            value_cache[blk, off] = value[t]
        elif problem.kv_layout == "hnd":
            key_cache[blk, :, off] = key[t]
            value_cache[blk, :, off] = value[t]
        else:
            x = key_cache.shape[-1]
            key_cache[blk, :, :, off, :] = key[t].reshape(key.shape[1], -1, x)
            value_cache[blk, :, :, off] = value[t]
    return key_cache, value_cache


def prefill_math(problem: _checks.PrefillProblem) -> np.ndarray:
    """out[t, h] in float64 for a checked prefill problem whose arrays are NumPy arrays."""
    p = problem
    q = np.asarray(p.query, dtype=np.float64)
    k_cache, v_cache = _nhd_caches(p.key_cache, p.value_cache, p.kv_layout, p.cache.fp8)
    alibi = None if p.alibi_slopes is None else np.asarray(p.alibi_slopes, dtype=np.float64)
    window = p.scores.window_left
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
        logits = _scores(p, q[q0:q1], k, "ihd,jhd->ihj")
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
        if window is not None:
            logits = np.where((rel < -window)[:, None, :], -np.inf, logits)
        out[q0:q1] = np.einsum("ihj,jhd->ihd", _softmax_rows(logits), v)
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
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
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
        out=out, bias_arrays=bias_arrays, logits_soft_cap=logits_soft_cap, window_left=window_left,
        kv_cache_dtype=kv_cache_dtype, k_scale=_host_scale(k_scale), v_scale=_host_scale(v_scale),
    )
    _checks.check_prefill_host_data(problem)
    result = prefill_math(problem)
    return _into(out, result)
