"""``paged_attention``: decode attention (one query token per sequence) over a paged KV cache, with a bias."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from . import _checks, _compile, _interop, reference

__all__ = ["paged_attention"]

_THREADS = 256  # kDecodeThreads in paged_decode.cu
_REDUCE_THREADS = 128  # kReduceThreads
_STAGE_BYTES = 3 * 2 * 2 * _THREADS * 16  # DecodeLayout::kStageBytes: kStages x (K, V) x kVecsPerThread x 16 B
_TILE_MULTIPLE = 128  # every specialisation's TILE divides this
_MIN_PART_TOKENS = 256  # a split-K partition is never shorter
_SPLIT_BELOW_CTAS_PER_SM = 2  # fewer CTAs than this per SM cannot hide memory latency: split the keys
_CTAS_PER_SM_TARGET = 4  # then split until the grid holds about this many CTAs per SM


@functools.cache
def _num_sms(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


def heads_per_cta(group_size: int) -> int:
    """Query heads one CTA serves: the group (num_heads // num_kv_heads), rounded up to 1/2/4/8, at most 8."""
    return next(g for g in _compile.HEADS_PER_CTA if g >= min(group_size, _compile.HEADS_PER_CTA[-1]))


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """How one decode problem is launched: kernel specialisation and key partitioning."""

    spec: _compile.DecodeSpec
    grid: tuple[int, int, int]
    tokens_per_part: int
    num_parts: int


def plan_decode(problem: _checks.DecodeProblem, num_sms: int) -> DecodeLaunch:
    """Choose the kernel and the split: one partition when the grid already fills the GPU, else split the keys.

    The split is chosen from shapes only (``max_len``, the block table's capacity), never from ``seq_lens``, so
    planning reads no device data.
    """
    p = problem
    hg = heads_per_cta(p.group_size)
    chunks = -(-p.group_size // hg)
    ctas = p.num_seqs * p.num_kv_heads * chunks
    parts = 1
    if ctas < _SPLIT_BELOW_CTAS_PER_SM * num_sms:
        parts = min(-(-_CTAS_PER_SM_TARGET * num_sms // ctas), max(1, -(-p.max_len // _MIN_PART_TOKENS)))
    per_part = -(-p.max_len // parts)
    tokens_per_part = max(_TILE_MULTIPLE, -(-per_part // _TILE_MULTIPLE) * _TILE_MULTIPLE)
    parts = max(1, -(-p.max_len // tokens_per_part))
    spec = _compile.DecodeSpec(p.dtype, p.head_size, p.kv_layout, hg, p.bias.mode)
    return DecodeLaunch(spec, (p.num_seqs, p.num_kv_heads * chunks, parts), tokens_per_part, parts)


def _launch(problem: _checks.DecodeProblem, launch: DecodeLaunch, out: Any, workspace: tuple[Any, Any] | None,
            stream: Any, device: int) -> None:
    p = problem
    kernel, reduce_kernel = _compile.get_decode_kernels(launch.spec, device, _STAGE_BYTES)
    ptr = _interop.kernel_arg
    null = np.uint64(0)
    q = _interop.unit_last_stride(p.query)
    tables = _interop.unit_last_stride(p.block_tables)
    seq_lens = ptr(_interop.unit_last_stride(p.seq_lens))
    alibi = null if p.alibi_slopes is None else ptr(_interop.unit_last_stride(p.alibi_slopes))
    bias = p.bias
    if bias.index is not None:
        bias = dataclasses.replace(bias, index=_interop.unit_last_stride(bias.index))
    q_strides = _checks.element_strides(q)
    out_strides = _checks.element_strides(out)
    part_acc, part_ml = (ptr(workspace[0]), ptr(workspace[1])) if workspace is not None else (null, null)
    i64, i32 = np.int64, np.int32
    kernel(
        launch.grid, (_THREADS,),
        (
            ptr(out), i64(out_strides[0]), i64(out_strides[1]), part_acc, part_ml,
            ptr(q), i64(q_strides[0]), i64(q_strides[1]),
            ptr(p.key_cache), ptr(p.value_cache), i64(p.cache.block_stride), i32(p.cache.num_blocks),
            i32(p.cache.block_size.bit_length() - 1), i32(p.num_kv_heads),
            ptr(tables), i64(_checks.element_strides(tables)[0]), seq_lens, i32(p.max_len),
            *bias.kernel_args(), alibi,
            np.float32(p.scale), i32(p.group_size), i32(launch.tokens_per_part), i32(launch.num_parts),
        ),
        stream=stream,
        shared_mem=_STAGE_BYTES,
    )
    if launch.num_parts > 1:
        reduce_kernel(
            (p.num_seqs, p.num_heads), (_REDUCE_THREADS,),
            (
                ptr(out), i64(out_strides[0]), i64(out_strides[1]), part_acc, part_ml, seq_lens, i32(p.max_len),
                i32(p.num_heads), i32(launch.tokens_per_part), i32(launch.num_parts),
            ),
            stream=stream,
        )


def paged_attention(
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
    validate: bool = False,
) -> Any:
    r"""Decode attention over a paged KV cache with an additive bias.

    For every sequence ``s``, query head ``h`` and key position ``j < seq_lens[s]``, with
    ``G = num_heads // num_kv_heads``::

        logit[j] = scale * <query[s, h], k[s, j, h // G]> + alibi_slopes[h] * (j - seq_lens[s] + 1) + attn_bias[s, h, j]
        out[s, h] = sum_j softmax(logit)[j] * v[s, j, h // G]

    where ``k[s, j]`` is row ``j % block_size`` of page ``block_tables[s, j // block_size]``. Softmax and
    accumulation run in float32 whatever the storage dtype. The bias is added after scaling, as in vLLM, xformers
    and SDPA's float mask; the formula of vLLM PR #11334, ``softmax((Q K^T + A) / sqrt(d))``, is
    ``attn_bias = A * scale``.

    Parameters
    ----------
    query : array ``[num_seqs, num_heads, head_size]``, float16 / bfloat16 / float32
        One query token per sequence. head_size is one of 32, 64, 80, 96, 112, 120, 128, 192, 256.
    key_cache, value_cache : arrays of the query's dtype
        ``kv_layout="nhd"``: both ``[num_blocks, block_size, num_kv_heads, head_size]``.
        ``kv_layout="vllm"``: key ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` with
        ``x = 16 // itemsize``, value ``[num_blocks, num_kv_heads, head_size, block_size]`` (vLLM's caches as they
        are). block_size is a power of two up to 256. Each page must be contiguous; the page stride may be larger
        than a page.
    block_tables : array ``[num_seqs, max_blocks_per_seq]``, int32
        Page ids of each sequence. Entries past a sequence's length are never read.
    seq_lens : array ``[num_seqs]``, int32
        Keys per sequence, ``0 <= seq_lens[s] <= max_blocks_per_seq * block_size``. A sequence of length 0 gets
        zeros.
    scale : float, optional
        Multiplies ``<q, k>``; default ``1 / sqrt(head_size)`` (T5 uses 1.0).
    attn_bias : optional, one of
        * an array ``[num_seqs, num_heads, L]``, float32 / float16 / bfloat16, with ``L >= max(seq_lens)``.
          Any strides: a stride of 0 broadcasts one bias over sequences or heads.
        * :class:`RaggedBias` ``(values [total, num_heads], offsets [num_seqs + 1])``: the bias of key ``j`` is
          ``values[offsets[s] + j, h]``; memory linear in the tokens used.
        * :class:`RelativePositionBias` ``(table [num_buckets, num_heads], ...)``: T5's bias
          ``table[bucket(j - (seq_lens[s] - 1)), h]``, computed in the kernel.
        Added to the logits. ``-inf`` masks a key; a row whose keys are all masked gives zeros. ``+inf`` or NaN
        give NaN.
    alibi_slopes : array ``[num_heads]``, float32, optional
        ALiBi slopes; adds ``alibi_slopes[h] * (j - seq_lens[s] + 1)``.
    kv_layout : {"nhd", "vllm"}
        Layout of the caches, see above.
    out : array like ``query``, optional
        Written in place and returned; same shape, dtype and framework as ``query``; last dimension contiguous.
        Not accepted for JAX (immutable arrays).
    stream : optional
        Stream to launch on: a CuPy stream, a ``torch.cuda.Stream`` (torch arrays) or a ``cudaStream_t`` int.
        Default: the current stream of the query's framework on the query's device (read on every call), so
        ``torch.cuda.stream(...)`` and CUDA-graph capture work. Must be None for NumPy arrays.
    validate : bool
        Also check the device data (``seq_lens`` within range, used block ids within the cache, a RaggedBias's
        offsets) and raise
        ``ValueError`` naming the first offending sequence. Copies ``seq_lens`` and ``block_tables`` to the host:
        a synchronisation, off by default (and not allowed during CUDA-graph capture). The NumPy path always does it.

    Returns
    -------
    array ``[num_seqs, num_heads, head_size]``
        In the query's framework, dtype and device (``out`` when given).

    Raises
    ------
    TypeError
        An argument is not an array; arrays come from different frameworks; ``stream`` is of another framework;
        ``out`` is given with JAX arrays.
    ValueError
        Checked before any launch, each naming the argument: rank and shape of every array (num_seqs, num_heads,
        head_size, num_kv_heads dividing num_heads, caches of one geometry, block_tables and seq_lens rows,
        attn_bias ``(num_seqs, num_heads, L)``, RaggedBias values ``(total, num_heads)`` and offsets
        ``(num_seqs + 1,)``, RelativePositionBias table ``(num_buckets, num_heads)``, alibi_slopes
        ``(num_heads,)``, out like query); dtypes (query float32/float16/bfloat16, caches and out of the query's
        dtype, block_tables, seq_lens and offsets int32, bias values float, alibi_slopes float32); caches
        contiguous within a page, 16-byte aligned, with the vLLM ``x`` matching the dtype; ``kv_layout``; a finite
        ``scale``; all arrays on one device; a torch tensor on the CPU. On the NumPy path (and with
        ``validate=True``) also the data: seq_lens within ``[0, max_blocks_per_seq * block_size]`` (and ``<= L``
        with a dense bias), the used block ids within ``[0, num_blocks)``, and a RaggedBias's rows of every
        sequence within ``values``.
    NotImplementedError
        A head_size or block_size outside the supported sets.
    RuntimeError
        Kernel compilation failed (with the NVRTC log), or NVRTC / CUDA headers are missing (naming the extra).

    Notes
    -----
    On the GPU, device data is not read on the host unless ``validate=True`` (that costs a sync): a ``seq_lens``
    entry outside its range is clamped to ``[0, max_len]``, a key whose block id lies outside the cache is
    skipped, and a sequence whose RaggedBias rows lie outside ``values`` is cut short, so no input can make the
    kernel read or write out of bounds.
    """
    named = {
        "query": query, "key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
        "seq_lens": seq_lens, **_checks.bias_operands(attn_bias), "alibi_slopes": alibi_slopes, "out": out,
    }
    framework = _interop.common_framework(named, optional=("attn_bias", "alibi_slopes", "out"))
    if framework == "numpy":
        if stream is not None:
            raise TypeError("stream: NumPy arrays run on the CPU; expected stream=None")
        result = reference.paged_attention_ref(
            query, key_cache, value_cache, block_tables, seq_lens,
            scale=scale, attn_bias=attn_bias, alibi_slopes=alibi_slopes, kv_layout=kv_layout, out=out,
        )
        return result if out is not None else result.astype(query.dtype)
    if framework == "jax" and out is not None:
        raise TypeError("out: JAX arrays are immutable; call without out= and use the returned array")

    device = _interop.device_of("query", query, framework)
    with _interop.launch_context(framework, device, stream) as launch_stream:
        arr = _interop.wrap_all(named, framework)
        problem = _checks.check_decode(
            arr["query"], arr["key_cache"], arr["value_cache"], arr["block_tables"], arr["seq_lens"],
            scale=scale, attn_bias=attn_bias, alibi_slopes=arr.get("alibi_slopes"), kv_layout=kv_layout,
            out=arr.get("out"), bias_arrays={k: v for k, v in arr.items() if k.startswith("attn_bias")},
        )
        if validate:
            bias = problem.bias
            if bias.mode == "ragged":
                bias = dataclasses.replace(bias, index=reference.to_numpy(attn_bias.offsets))
            host = dataclasses.replace(
                problem, seq_lens=reference.to_numpy(seq_lens), block_tables=reference.to_numpy(block_tables),
                bias=bias,
            )
            _checks.check_host_data(host)
        if out is not None:
            result, out_arr = out, arr["out"]
        else:
            result, out_arr = _interop.empty(
                framework, tuple(problem.query.shape), problem.query.dtype, query, launch_stream
            )
        if problem.num_seqs == 0:
            return _interop.finish(framework, result)
        launch = plan_decode(problem, _num_sms(device))
        workspace = None
        if launch.num_parts > 1:
            rows = problem.num_seqs * problem.num_heads * launch.num_parts
            workspace = (
                _interop.empty(framework, (rows, problem.head_size), np.float32, query, launch_stream)[1],
                _interop.empty(framework, (rows, 2), np.float32, query, launch_stream)[1],
            )
        _launch(problem, launch, out_arr, workspace, launch_stream, device)
    return _interop.finish(framework, result)
