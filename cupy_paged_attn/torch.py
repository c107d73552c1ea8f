"""PyTorch custom operators: paged attention inside ``torch.compile(fullgraph=True)`` and CUDA graphs.

The library's functions take torch tensors as they are, but to ``torch.compile`` they are opaque Python: a graph
break. This module registers them as ``torch.library.custom_op`` operators in the namespace ``cupy_paged_attn``,
each with a fake (meta) implementation giving the output's shape, so a compiled graph holds them whole:

========================================================  =====================================================
``torch.ops.cupy_paged_attn.paged_attention``             decode, dense bias or none
``torch.ops.cupy_paged_attn.paged_attention_ragged``      decode, :class:`~cupy_paged_attn.RaggedBias`
``torch.ops.cupy_paged_attn.paged_attention_t5``          decode, :class:`~cupy_paged_attn.RelativePositionBias`
``torch.ops.cupy_paged_attn.paged_prefill_attention``     prefill, dense bias or none
``torch.ops.cupy_paged_attn.paged_prefill_attention_t5``  prefill, RelativePositionBias
``torch.ops.cupy_paged_attn.reshape_and_cache``           writes ``key_cache`` and ``value_cache`` in place
========================================================  =====================================================

A bias object cannot cross an operator boundary, so the operators take its tensors (and a T5 bias's geometry as
ints); the wrappers below (:func:`paged_attention`, :func:`paged_prefill_attention`, :func:`reshape_and_cache`)
take any bias kind and pick the operator. The operators launch on torch's current stream, so CUDA-graph capture
(``torch.cuda.graph``, ``mode="reduce-overhead"``) records them; build a :class:`RelativePositionBias` before a
capture. CUDA tensors run the kernels; CPU tensors run the float64 NumPy reference (the library's CPU path), which
makes the operators testable without a GPU. There are no autograd formulas (inference kernels).

Calling :func:`cupy_paged_attn.paged_attention` directly stays the fastest eager path (an operator call adds
dispatcher overhead, about 20 µs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _interop
from . import cache as _cache
from . import decode as _decode
from . import prefill as _prefill
from .bias import RaggedBias, RelativePositionBias

__all__ = ["paged_attention", "paged_prefill_attention", "reshape_and_cache"]

Tensor = torch.Tensor
_NS = "cupy_paged_attn"
_KV = "Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens"
_T5 = "Tensor bias_table, Tensor bias_buckets, int num_buckets, int max_distance, bool bidirectional"
# fp8 caches' options: the format, and each scale as a tensor (on the device: a CUDA graph reads its current value) or
# as a number.
_FP8 = ("str kv_cache_dtype=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None, float? k_scale_value=None, "
        "float? v_scale_value=None")
_TAIL = ("Tensor? alibi_slopes, float? scale, str kv_layout, float? logits_soft_cap=None, "
         f"int? window_left=None, {_FP8}")
_TAIL_DEFAULTS = (None, None, "auto", None, None, None, None)  # what the dispatcher leaves out, from logits_soft_cap on


# ---------------------------------------------------------------------------------------------------------------
# Tensors in the library's terms: CUDA tensors as they are, CPU tensors as NumPy views of the same memory
# ---------------------------------------------------------------------------------------------------------------
def _host_view(t: Tensor | None) -> np.ndarray | None:
    """A NumPy view sharing ``t``'s memory (a CPU tensor; bfloat16 through ml_dtypes), strides kept."""
    return None if t is None else _interop.to_array_module("tensor", t)[0]


def _lib(t: Tensor | None) -> Any:
    """What the library takes for ``t``: the tensor itself on CUDA, a NumPy view on the CPU (reference path)."""
    return t if t is None or t.device.type == "cuda" else _host_view(t)


def _empty_like_query(query: Tensor) -> Tensor:
    """The output: contiguous, the query's shape, dtype and device (the fake implementations give the same)."""
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def _options(tail: tuple[Any, ...]) -> tuple[Any, Any, Any, dict[str, Any]]:
    """``(alibi_slopes, scale, kv_layout, serving options)`` of the operators' common last arguments (``_TAIL``;
    the dispatcher leaves out trailing ones that equal their defaults): each fp8 scale its tensor, else its number."""
    alibi_slopes, scale, kv_layout, cap, window, kv_cache_dtype, k_scale, v_scale, k_value, v_value = (
        *tail, *_TAIL_DEFAULTS[len(tail) - 3:])
    return alibi_slopes, scale, kv_layout, {
        "logits_soft_cap": cap, "window_left": window, "kv_cache_dtype": kv_cache_dtype,
        "k_scale": _lib(k_scale) if k_scale is not None else k_value,
        "v_scale": _lib(v_scale) if v_scale is not None else v_value}


def _decode_into(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 bias: Any, *tail: Any) -> Tensor:
    """The decode into a new output; ``tail``: the operators' common last arguments (:func:`_options`)."""
    alibi_slopes, scale, kv_layout, options = _options(tail)
    out = _empty_like_query(query)
    _decode.paged_attention(
        _lib(query), _lib(key_cache), _lib(value_cache), _lib(block_tables), _lib(seq_lens), scale=scale,
        attn_bias=bias, alibi_slopes=_lib(alibi_slopes), kv_layout=kv_layout, out=_lib(out), **options,
    )
    return out


def _prefill_into(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                  query_start_loc: Tensor, causal: bool, bias: Any, *tail: Any) -> Tensor:
    """The prefill into a new output; ``tail`` as in :func:`_decode_into`."""
    alibi_slopes, scale, kv_layout, options = _options(tail)
    out = _empty_like_query(query)
    _prefill.paged_prefill_attention(
        _lib(query), _lib(key_cache), _lib(value_cache), _lib(block_tables), _lib(seq_lens), _lib(query_start_loc),
        causal=causal, scale=scale, attn_bias=bias, alibi_slopes=_lib(alibi_slopes), kv_layout=kv_layout,
        out=_lib(out), **options,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# The operators. Each: the CUDA implementation, the CPU one (reference), the fake one (shapes only). Their last
# arguments are _TAIL's, passed on as they come (``*tail``).
# ---------------------------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::paged_attention", mutates_args=(), device_types="cuda",
                         schema=f"({_KV}, Tensor? attn_bias, {_TAIL}) -> Tensor")
def _paged_attention_op(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor, attn_bias: Tensor | None, *tail: Any) -> Tensor:
    return _decode_into(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, *tail)


@_paged_attention_op.register_kernel("cpu")
def _(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, *tail):
    return _decode_into(query, key_cache, value_cache, block_tables, seq_lens, _lib(attn_bias), *tail)


@_paged_attention_op.register_fake
def _(query, *rest):
    return query.new_empty(query.shape)


@torch.library.custom_op(f"{_NS}::paged_attention_ragged", mutates_args=(), device_types="cuda",
                         schema=f"({_KV}, Tensor bias_values, Tensor bias_offsets, {_TAIL}) -> Tensor")
def _paged_attention_ragged_op(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                               seq_lens: Tensor, bias_values: Tensor, bias_offsets: Tensor, *tail: Any) -> Tensor:
    return _decode_into(query, key_cache, value_cache, block_tables, seq_lens, RaggedBias(bias_values, bias_offsets),
                        *tail)


@_paged_attention_ragged_op.register_kernel("cpu")
def _(query, key_cache, value_cache, block_tables, seq_lens, bias_values, bias_offsets, *tail):
    bias = RaggedBias(_host_view(bias_values), _host_view(bias_offsets))
    return _decode_into(query, key_cache, value_cache, block_tables, seq_lens, bias, *tail)


@_paged_attention_ragged_op.register_fake
def _(query, *rest):
    return query.new_empty(query.shape)


@torch.library.custom_op(f"{_NS}::paged_attention_t5", mutates_args=(), device_types="cuda",
                         schema=f"({_KV}, {_T5}, {_TAIL}) -> Tensor")
def _paged_attention_t5_op(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                           seq_lens: Tensor, bias_table: Tensor, bias_buckets: Tensor, num_buckets: int,
                           max_distance: int, bidirectional: bool, *tail: Any) -> Tensor:
    bias = RelativePositionBias.from_buckets(bias_table, bias_buckets, num_buckets=num_buckets,
                                             max_distance=max_distance, bidirectional=bidirectional)
    return _decode_into(query, key_cache, value_cache, block_tables, seq_lens, bias, *tail)


@_paged_attention_t5_op.register_kernel("cpu")
def _(query, key_cache, value_cache, block_tables, seq_lens, bias_table, bias_buckets, num_buckets, max_distance,
      bidirectional, *tail):
    bias = RelativePositionBias.from_buckets(_host_view(bias_table), _host_view(bias_buckets), num_buckets=num_buckets,
                                             max_distance=max_distance, bidirectional=bidirectional)
    return _decode_into(query, key_cache, value_cache, block_tables, seq_lens, bias, *tail)


@_paged_attention_t5_op.register_fake
def _(query, *rest):
    return query.new_empty(query.shape)


@torch.library.custom_op(
    f"{_NS}::paged_prefill_attention", mutates_args=(), device_types="cuda",
    schema=f"({_KV}, Tensor query_start_loc, bool causal, Tensor? attn_bias, {_TAIL}) -> Tensor",
)
def _paged_prefill_attention_op(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                                seq_lens: Tensor, query_start_loc: Tensor, causal: bool, attn_bias: Tensor | None,
                                *tail: Any) -> Tensor:
    return _prefill_into(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal, attn_bias,
                         *tail)


@_paged_prefill_attention_op.register_kernel("cpu")
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal, attn_bias, *tail):
    return _prefill_into(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal,
                         _lib(attn_bias), *tail)


@_paged_prefill_attention_op.register_fake
def _(query, *rest):
    return query.new_empty(query.shape)


@torch.library.custom_op(
    f"{_NS}::paged_prefill_attention_t5", mutates_args=(), device_types="cuda",
    schema=f"({_KV}, Tensor query_start_loc, bool causal, {_T5}, {_TAIL}) -> Tensor",
)
def _paged_prefill_attention_t5_op(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                                   seq_lens: Tensor, query_start_loc: Tensor, causal: bool, bias_table: Tensor,
                                   bias_buckets: Tensor, num_buckets: int, max_distance: int, bidirectional: bool,
                                   *tail: Any) -> Tensor:
    bias = RelativePositionBias.from_buckets(bias_table, bias_buckets, num_buckets=num_buckets,
                                             max_distance=max_distance, bidirectional=bidirectional)
    return _prefill_into(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal, bias, *tail)


@_paged_prefill_attention_t5_op.register_kernel("cpu")
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal, bias_table, bias_buckets,
      num_buckets, max_distance, bidirectional, *tail):
    bias = RelativePositionBias.from_buckets(_host_view(bias_table), _host_view(bias_buckets), num_buckets=num_buckets,
                                             max_distance=max_distance, bidirectional=bidirectional)
    return _prefill_into(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal, bias, *tail)


@_paged_prefill_attention_t5_op.register_fake
def _(query, *rest):
    return query.new_empty(query.shape)


@torch.library.custom_op(
    f"{_NS}::reshape_and_cache", mutates_args=("key_cache", "value_cache"), device_types="cuda",
    schema="(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
           f"str kv_layout, {_FP8}) -> ()",
)
def _reshape_and_cache_op(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                          kv_layout: str, *fp8: Any) -> None:
    options = _options((None, None, kv_layout, None, None, *fp8))[3]
    _cache.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_layout=kv_layout,
                             kv_cache_dtype=options["kv_cache_dtype"], k_scale=options["k_scale"],
                             v_scale=options["v_scale"])


@_reshape_and_cache_op.register_kernel("cpu")
def _(key, value, key_cache, value_cache, slot_mapping, kv_layout, *fp8):
    options = _options((None, None, kv_layout, None, None, *fp8))[3]
    _cache.reshape_and_cache(_host_view(key), _host_view(value), _host_view(key_cache), _host_view(value_cache),
                             _host_view(slot_mapping), kv_layout=kv_layout, kv_cache_dtype=options["kv_cache_dtype"],
                             k_scale=options["k_scale"], v_scale=options["v_scale"])


@_reshape_and_cache_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, kv_layout, *fp8):
    return None


# ---------------------------------------------------------------------------------------------------------------
# The wrappers: any bias kind in, the right operator called
# ---------------------------------------------------------------------------------------------------------------
def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    attn_bias: Tensor | RaggedBias | RelativePositionBias | None = None,
    alibi_slopes: Tensor | None = None,
    kv_layout: str = "nhd",
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: Tensor | float | None = None,
    v_scale: Tensor | float | None = None,
) -> Tensor:
    """:func:`cupy_paged_attn.paged_attention` as a torch operator: traceable by ``torch.compile(fullgraph=True)``.

    Parameters
    ----------
    query : Tensor ``[num_seqs, num_heads, head_size]``, float16 / bfloat16 / float32
    key_cache, value_cache : Tensor of the query's dtype
        ``"nhd"``: ``[num_blocks, block_size, num_kv_heads, head_size]``; ``"vllm"``: vLLM's layouts (see
        :func:`cupy_paged_attn.paged_attention`).
    block_tables : Tensor ``[num_seqs, max_blocks_per_seq]``, int32
    seq_lens : Tensor ``[num_seqs]``, int32
    scale : float, optional
        Default ``1 / sqrt(head_size)``.
    attn_bias : optional
        A dense Tensor ``[num_seqs, num_heads, L >= max(seq_lens)]`` (float32 / float16 / bfloat16, any strides),
        a :class:`~cupy_paged_attn.RaggedBias` of tensors (``values [total, num_heads]``, ``offsets [num_seqs + 1]``
        int32) or a :class:`~cupy_paged_attn.RelativePositionBias` built from a tensor table (build it once, outside
        the compiled function or CUDA-graph capture).
    alibi_slopes : Tensor ``[num_heads]``, float32, optional
    kv_layout : {"nhd", "vllm", "hnd"}
    logits_soft_cap : float, optional
        Gemma 2's soft-cap: a logit is ``c * tanh(scale * <q, k> / c)`` before the bias and ALiBi.
    window_left : int, optional
        A sliding window: the query at position ``p`` attends keys ``p - window_left ... p``.
    kv_cache_dtype, k_scale, v_scale
        fp8 caches, as in :func:`cupy_paged_attn.paged_attention`: caches of ``torch.float8_e4m3fn`` /
        ``float8_e5m2`` (or uint8 with ``kv_cache_dtype``); a scale is a number or a float32 tensor ``[1]`` or
        ``[num_kv_heads]`` (read by the kernel: a CUDA graph follows its value).

    Returns
    -------
    Tensor ``[num_seqs, num_heads, head_size]``
        New, contiguous, of the query's dtype and device.

    Raises
    ------
    TypeError, ValueError, NotImplementedError, RuntimeError
        As :func:`cupy_paged_attn.paged_attention`, when the operator runs (a fake tensor is not checked).
    """
    args = (query, key_cache, value_cache, block_tables, seq_lens)
    tail = (alibi_slopes, scale, kv_layout, logits_soft_cap, window_left, *_fp8_args(kv_cache_dtype, k_scale, v_scale))
    if isinstance(attn_bias, RaggedBias):
        return torch.ops.cupy_paged_attn.paged_attention_ragged(
            *args, attn_bias.values, attn_bias.offsets, *tail)
    if isinstance(attn_bias, RelativePositionBias):
        return torch.ops.cupy_paged_attn.paged_attention_t5(
            *args, *_t5_args(attn_bias), *tail)
    return torch.ops.cupy_paged_attn.paged_attention(*args, attn_bias, *tail)


def paged_prefill_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    attn_bias: Tensor | RelativePositionBias | None = None,
    alibi_slopes: Tensor | None = None,
    kv_layout: str = "nhd",
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: Tensor | float | None = None,
    v_scale: Tensor | float | None = None,
) -> Tensor:
    """:func:`cupy_paged_attn.prefill.paged_prefill_attention` as a torch operator.

    Parameters
    ----------
    query : Tensor ``[total_query_tokens, num_heads, head_size]``, float16 / bfloat16 / float32
        The query rows of all sequences, packed; sequence ``s``'s rows are the last ``q_len`` of its
        ``seq_lens[s]`` keys.
    key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, kv_layout, logits_soft_cap
    kv_cache_dtype, k_scale, v_scale
        As in :func:`paged_attention`.
    window_left : int, optional
        A sliding window: query row ``i`` at position ``p`` attends keys ``p - window_left`` on (through ``p`` when
        ``causal``; without ``causal`` only the keys before ``p - window_left`` are masked).
    query_start_loc : Tensor ``[num_seqs + 1]``, int32
        Sequence ``s`` owns query rows ``query_start_loc[s] : query_start_loc[s + 1]``.
    causal : bool
        Mask keys after each query row's position.
    attn_bias : optional
        A dense Tensor ``[num_seqs, num_heads, max_q_len, L]`` or a :class:`~cupy_paged_attn.RelativePositionBias`
        (a RaggedBias is a decode bias: NotImplementedError).

    Returns
    -------
    Tensor ``[total_query_tokens, num_heads, head_size]``
        New, contiguous, of the query's dtype and device. Rows that belong to no sequence are left unwritten.
    """
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal)
    tail = (alibi_slopes, scale, kv_layout, logits_soft_cap, window_left, *_fp8_args(kv_cache_dtype, k_scale, v_scale))
    if isinstance(attn_bias, RaggedBias):
        raise NotImplementedError("attn_bias: RaggedBias is a decode bias; pass a dense tensor or a "
                                  "RelativePositionBias to prefill")
    if isinstance(attn_bias, RelativePositionBias):
        return torch.ops.cupy_paged_attn.paged_prefill_attention_t5(
            *args, *_t5_args(attn_bias), *tail)
    return torch.ops.cupy_paged_attn.paged_prefill_attention(*args, attn_bias, *tail)


def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    *,
    kv_layout: str = "nhd",
    kv_cache_dtype: str = "auto",
    k_scale: Tensor | float | None = None,
    v_scale: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`cupy_paged_attn.reshape_and_cache` as a torch operator that mutates the caches (declared, so
    ``torch.compile`` orders it before the attention that reads them).

    Parameters
    ----------
    key, value : Tensor ``[num_tokens, num_kv_heads, head_size]``, float16 / bfloat16 / float32
    key_cache, value_cache : Tensor of the key's dtype, in ``kv_layout``
        Written in place: token ``t`` goes to slot ``slot_mapping[t] = block * block_size + offset``.
    slot_mapping : Tensor ``[num_tokens]``, int32 or int64
        Negative slots are skipped.
    kv_layout : {"nhd", "vllm", "hnd"}
    kv_cache_dtype, k_scale, v_scale
        fp8 caches, as in :func:`cupy_paged_attn.reshape_and_cache` (stored: ``value / scale``, rounded to the
        nearest, saturated).

    Returns
    -------
    (key_cache, value_cache)
        The arguments, written.
    """
    torch.ops.cupy_paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_layout,
                                                *_fp8_args(kv_cache_dtype, k_scale, v_scale))
    return key_cache, value_cache


def _fp8_args(kv_cache_dtype: str, k_scale: Tensor | float | None, v_scale: Tensor | float | None) -> tuple[Any, ...]:
    """The operators' fp8 arguments (``_FP8``): the format, the scales given as tensors, those given as numbers."""
    def tensor(x: Any) -> Tensor | None:
        return x if isinstance(x, torch.Tensor) else None

    def number(x: Any) -> float | None:
        return None if x is None or isinstance(x, torch.Tensor) else float(x)

    return kv_cache_dtype, tensor(k_scale), tensor(v_scale), number(k_scale), number(v_scale)


def _t5_args(bias: RelativePositionBias) -> tuple[Any, ...]:
    return bias.table, bias.buckets, bias.num_buckets, bias.max_distance, bias.bidirectional
