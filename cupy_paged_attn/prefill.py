"""``paged_prefill_attention``: prefill / chunked-prefill attention (many query tokens per sequence) over a paged KV
cache, with a bias, on the tensor cores."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from . import _checks, _compile, _interop, reference
from .decode import _num_sms, host_bias, split_keys

__all__ = ["paged_prefill_attention"]

#: Run the Hopper tiling of the tensor-core kernel (wgmma; float16 / bfloat16, head sizes 64 and 128, devices of
#: compute capability 9.0) where it applies. False keeps every call on the mma.sync tiling (A/B runs, tests).
WGMMA = True


@dataclasses.dataclass(frozen=True)
class PrefillLaunch:
    """How one prefill problem is launched: kernel specialisation, M tiles and key partitioning."""

    spec: _compile.PrefillSpec
    rows: int  # packed (query token, query head) rows per CTA, its M tile
    num_tiles: int  # grid.x: an upper bound of Σ_s ceil(q_len_s · G / rows), from shapes only
    tokens_per_part: int
    num_parts: int


def plan_prefill(problem: _checks.PrefillProblem, num_sms: int, wgmma: bool = False) -> PrefillLaunch:
    """Choose the kernel, the number of M tiles and the split, from shapes only (no device data is read).

    Sequence ``s`` needs ``ceil(q_len_s · G / rows)`` tiles of ``rows`` packed (token, head) rows (128 on the tensor
    cores up to head size 128, else 64); over all sequences that is at most ``ceil(total_q · G / rows) +
    num_seqs``, the grid's x. The device-side plan kernel maps tiles to sequences; spare tiles exit at once. When
    the tiles that surely hold rows cannot fill the GPU, the keys are split into partitions (a multiple of the
    kernel's key tile), combined by the reduction kernel. ``wgmma``: the device runs sm_90a code (the Hopper
    tiling is then used where it applies: 16-bit dtypes, head sizes 64 and 128, no bias or a T5 bias whose table
    fits; same rows per CTA).
    """
    p = problem
    g = p.group_size
    wgmma = (wgmma and p.dtype != "f32" and p.head_size in _compile.WGMMA_HEAD_SIZES
             and p.bias.mode in _compile.WGMMA_BIAS_MODES and (p.bias.mode != "t5" or _t5_table_fits(p)))
    rows = _compile.prefill_rows_per_cta(p.dtype, p.head_size)
    full_tiles = -(-p.total_q * g // rows)
    num_tiles = full_tiles + p.num_seqs
    tokens_per_part, parts = split_keys(max(1, full_tiles * p.num_kv_heads), p.max_len, num_sms,
                                        _compile.prefill_tile_keys(p.head_size, wgmma=wgmma))
    spec = _compile.PrefillSpec(p.dtype, p.head_size, p.kv_layout, p.bias.mode, wgmma=wgmma)
    return PrefillLaunch(spec, rows, num_tiles, tokens_per_part, parts)


def _t5_table_fits(problem: _checks.PrefillProblem) -> bool:
    """Whether every CTA's T5 table fits in shared memory (paged_prefill.cu, use_rel): G·(2·(max_distance + key
    tile + span) + 1) floats of at most kRelTableMax, where span bounds the positions of a CTA's rows. The Hopper
    tiling has no per-logit path for the others (they run on the mma.sync tiling)."""
    g, n = problem.group_size, problem.bias.n
    span = (_compile.prefill_rows_per_cta(problem.dtype, problem.head_size) - 1) // g + 1
    tile = _compile.prefill_tile_keys(problem.head_size, wgmma=True)
    return n <= _compile.PREFILL_REL_TABLE and g * (2 * (n + tile + span) + 1) <= _compile.PREFILL_REL_TABLE


@functools.cache
def _runs_sm90a(device: int) -> bool:
    """Whether ``device`` runs sm_90a code (wgmma): compute capability 9.0 exactly (H100, H200)."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability) == 90


def _launch(problem: _checks.PrefillProblem, launch: PrefillLaunch, out: Any, tile_info: Any,
            workspace: tuple[Any, Any] | None, stream: Any, device: int) -> None:
    p = problem
    kernel, reduce_kernel, plan_kernel = _compile.get_prefill_kernels(launch.spec, device)
    ptr = _interop.kernel_arg
    null = np.uint64(0)
    i64, i32 = np.int64, np.int32
    q = _interop.unit_last_stride(p.query)
    q_strides = _checks.element_strides(q)
    vec = 16 // q.dtype.itemsize
    q_vec = _interop.data_ptr(q) % 16 == 0 and q_strides[0] % vec == 0 and q_strides[1] % vec == 0
    tables = _interop.unit_last_stride(p.block_tables)
    seq_lens = ptr(_interop.unit_last_stride(p.seq_lens))
    starts = ptr(_interop.unit_last_stride(p.query_start_loc))
    alibi = null if p.alibi_slopes is None else ptr(_interop.unit_last_stride(p.alibi_slopes))
    bias = p.bias
    if bias.index is not None:
        bias = dataclasses.replace(bias, index=_interop.unit_last_stride(bias.index))
    out_strides = _checks.element_strides(out)
    part_acc, part_ml = (ptr(workspace[0]), ptr(workspace[1])) if workspace is not None else (null, null)
    tiles = ptr(tile_info)

    plan_kernel(
        (1,), (_compile.PREFILL_PLAN_THREADS,),
        (starts, i32(p.num_seqs), i32(p.total_q), i32(p.group_size), i32(launch.rows), tiles,
         i32(launch.num_tiles)),
        stream=stream,
    )
    grid = (launch.num_tiles, p.num_kv_heads, launch.num_parts)
    kernel(
        grid, (launch.spec.threads,),
        (
            ptr(out), i64(out_strides[0]), i64(out_strides[1]), part_acc, part_ml,
            ptr(q), i64(q_strides[0]), i64(q_strides[1]), i32(q_vec), starts, i32(p.total_q), tiles,
            ptr(p.key_cache), ptr(p.value_cache), i64(p.cache.block_stride), i32(p.cache.num_blocks),
            i32(p.cache.block_size.bit_length() - 1), i32(p.num_kv_heads),
            ptr(tables), i64(_checks.element_strides(tables)[0]), seq_lens, i32(p.max_len), i32(p.q_limit),
            *bias.kernel_args(), alibi,
            np.float32(p.scale), i32(p.group_size), i32(p.causal), i32(launch.tokens_per_part),
            i32(launch.num_parts), i32(0),  # longest_first: decode only
        ),
        stream=stream,
        shared_mem=launch.spec.smem_bytes,
    )
    if launch.num_parts > 1:
        reduce_kernel(
            (launch.num_tiles, p.num_kv_heads, _compile.reduce_chunks(launch.rows, p.head_size, launch.num_parts)),
            (_compile.PREFILL_REDUCE_THREADS,),
            (
                ptr(out), i64(out_strides[0]), i64(out_strides[1]), part_acc, part_ml, starts, i32(p.total_q),
                tiles, i32(p.num_kv_heads), i32(p.group_size), i32(launch.num_parts),
            ),
            stream=stream,
        )


def paged_prefill_attention(
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
    validate: bool = False,
) -> Any:
    r"""Prefill / chunked-prefill attention over a paged KV cache with an additive bias.

    Sequence ``s`` owns the query rows ``query_start_loc[s] : query_start_loc[s + 1]`` (``q_len`` of them); they
    are the last ``q_len`` of its ``n = seq_lens[s]`` keys, already in the cache, so query row ``i`` of the
    sequence sits at position ``p = n - q_len + i``. For query head ``h`` (``G = num_heads // num_kv_heads``) and
    key position ``j < n`` (and ``j <= p`` when ``causal``)::

        logit[j] = scale * <query[t, h], k[s, j, h // G]> + alibi_slopes[h] * (j - p) + bias(s, h, i, p, j)
        out[t, h] = sum_j softmax(logit)[j] * v[s, j, h // G]          (t = query_start_loc[s] + i)

    With ``q_len = 1`` for every sequence this is :func:`paged_attention` (``p = n - 1``). Softmax and
    accumulation run in float32. float16 / bfloat16 run on the tensor cores (``mma.sync``, float32
    accumulators; on H100 / H200, head sizes 64 and 128, Hopper's ``wgmma``); float32 runs a simple SIMT kernel
    (exact float32 math, no TF32; correct, not fast).

    Parameters
    ----------
    query : array ``[total_query_tokens, num_heads, head_size]``, float16 / bfloat16 / float32
        The query rows of all sequences, packed. head_size is one of 32, 64, 80, 96, 112, 120, 128, 192, 256.
    key_cache, value_cache : arrays of the query's dtype
        As in :func:`paged_attention` (``kv_layout`` ``"nhd"`` or ``"vllm"``); block_size a power of two up to 256.
    block_tables : array ``[num_seqs, max_blocks_per_seq]``, int32
    seq_lens : array ``[num_seqs]``, int32
        Keys per sequence, its query rows included (``q_len <= seq_lens[s]``). A sequence of length 0 is allowed.
    query_start_loc : array ``[num_seqs + 1]``, int32
        ``0 = query_start_loc[0] <= ... <= query_start_loc[num_seqs] = total_query_tokens``; ``q_len = 0`` allowed.
    causal : bool
        Mask keys after each query's position (decoder self-attention, chunked prefill). False: every query row
        attends all ``seq_lens[s]`` keys (T5's encoder, cross-attention).
    scale : float, optional
        Multiplies ``<q, k>``; default ``1 / sqrt(head_size)`` (T5 uses 1.0).
    attn_bias : optional, one of
        * an array ``[num_seqs, num_heads, max_q_len, L]``, float32 / float16 / bfloat16, any strides (0
          broadcasts), with ``L >= max(seq_lens)`` and ``max_q_len >= max(q_len)``: the bias of query row ``i`` of
          sequence ``s`` (its own index within the sequence) and key ``j`` is ``attn_bias[s, h, i, j]``.
        * :class:`RelativePositionBias`: T5's ``table[bucket(j - p), h]``, computed in the kernel (build it with
          ``bidirectional=True`` for the encoder).
        A :class:`RaggedBias` is a decode bias (NotImplementedError). ``-inf`` masks a key; a row whose keys are
        all masked gives zeros. ``+inf`` or NaN give NaN.
    alibi_slopes : array ``[num_heads]``, float32, optional
        ALiBi slopes; adds ``alibi_slopes[h] * (j - p)``.
    kv_layout : {"nhd", "vllm"}
    out : array like ``query``, optional
        Written in place and returned (last dimension contiguous). Rows of ``query`` that belong to no sequence
        are not written. Not accepted for JAX.
    stream : optional
        As in :func:`paged_attention`.
    validate : bool
        Also check the device data (seq_lens, block ids, query_start_loc, a RelativePositionBias's buckets) and
        raise ``ValueError`` naming the first offending sequence or distance: copies them to the host (a
        synchronisation). The NumPy path always does it.

    Returns
    -------
    array ``[total_query_tokens, num_heads, head_size]``
        In the query's framework, dtype and device (``out`` when given).

    Raises
    ------
    TypeError
        An argument is not an array; arrays from different frameworks; ``causal`` not a bool; ``stream`` of
        another framework; ``out`` with JAX arrays.
    ValueError
        Checked before any launch, each naming the argument: ranks, shapes and dtypes of every array (num_seqs
        from block_tables; seq_lens ``(num_seqs,)`` and query_start_loc ``(num_seqs + 1,)`` int32; attn_bias
        ``(num_seqs, num_heads, max_q_len, L)``), the caches as in :func:`paged_attention`, ``kv_layout``, a finite
        ``scale``, one device. On the NumPy path (and with ``validate=True``) also the data.
    NotImplementedError
        A head_size or block_size outside the supported sets; a RaggedBias; a dense bias whose keys lie 2**31
        bytes or more apart.
    RuntimeError
        Kernel compilation failed (with the NVRTC log), or NVRTC / CUDA headers are missing.

    Notes
    -----
    Nothing is read on the host unless ``validate=True``: the kernels clamp ``query_start_loc`` into
    ``[0, total_query_tokens]`` and ``seq_lens`` into ``[0, max_len]``, skip keys whose block id lies outside the
    cache, and give zeros to query rows past a dense bias's ``max_q_len``, so no input reads or writes out of
    bounds. One call launches a small plan kernel (tiles to sequences, on the device), the attention kernel and,
    when the keys are split, a reduction.
    """
    named = {
        "query": query, "key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
        "seq_lens": seq_lens, "query_start_loc": query_start_loc, **_checks.bias_operands(attn_bias),
        "alibi_slopes": alibi_slopes, "out": out,
    }
    framework = _interop.call_framework(named, ("attn_bias", "alibi_slopes", "out"), stream=stream, out=out)
    if framework == "numpy":
        result = reference.paged_prefill_attention_ref(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal=causal, scale=scale,
            attn_bias=attn_bias, alibi_slopes=alibi_slopes, kv_layout=kv_layout, out=out,
        )
        return result if out is not None else result.astype(query.dtype)

    device = _interop.device_of("query", query, framework)
    with _interop.launch_context(framework, device, stream) as launch_stream:
        arr = _interop.wrap_all(named, framework)
        problem = _checks.check_prefill(
            arr["query"], arr["key_cache"], arr["value_cache"], arr["block_tables"], arr["seq_lens"],
            arr["query_start_loc"], causal=causal, scale=scale, attn_bias=attn_bias,
            alibi_slopes=arr.get("alibi_slopes"), kv_layout=kv_layout, out=arr.get("out"),
            bias_arrays={k: v for k, v in arr.items() if k.startswith("attn_bias")},
        )
        if validate:
            host = dataclasses.replace(
                problem, seq_lens=reference.to_numpy(seq_lens), block_tables=reference.to_numpy(block_tables),
                query_start_loc=reference.to_numpy(query_start_loc), bias=host_bias(problem.bias, attn_bias),
            )
            _checks.check_prefill_host_data(host)
        if out is not None:
            result, out_arr = out, arr["out"]
        else:
            result, out_arr = _interop.empty(
                framework, tuple(problem.query.shape), problem.query.dtype, query, launch_stream
            )
        if problem.total_q == 0 or problem.num_seqs == 0:
            return _interop.finish(framework, result)
        launch = plan_prefill(problem, _num_sms(device), WGMMA and _runs_sm90a(device))
        tile_info = _interop.empty(framework, (launch.num_tiles, 2), np.int32, query, launch_stream)[1]
        workspace = None
        if launch.num_parts > 1:
            rows = launch.num_parts * problem.total_q * problem.num_heads
            workspace = (
                _interop.empty(framework, (rows, problem.head_size), np.float32, query, launch_stream)[1],
                _interop.empty(framework, (rows, 2), np.float32, query, launch_stream)[1],
            )
        _launch(problem, launch, out_arr, tile_info, workspace, launch_stream, device)
    return _interop.finish(framework, result)
