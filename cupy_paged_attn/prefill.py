"""``paged_prefill_attention``: prefill / chunked-prefill attention (many query tokens per sequence) over a paged KV
cache, with a bias, on the tensor cores."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _checks, _compile, _device, _interop, _launch, _specs, cache, planning, reference

__all__ = ["paged_prefill_attention"]


def _launch_prefill(problem: _checks.PrefillProblem, launch: planning.PrefillLaunch, out: Any, tile_info: Any,
                    workspace: tuple[Any, Any] | None, stream: Any, device: int) -> None:
    """The plan kernel (tiles to sequences, on the device), the attention kernel and, with several partitions, the
    combine, on ``stream``."""
    p = problem
    kernel, combine_kernel, plan_kernel = _compile.kernels(launch.spec, device)
    # The operands as the kernels read them: those with a strided last dimension as contiguous copies, which live
    # until the launches are queued (the stream-ordered pool may then reuse them).
    arrays = {
        "out": out, "query": _interop.unit_last_stride(p.query), "tile_info": tile_info,
        "query_start_loc": _interop.unit_last_stride(p.query_start_loc), "key_cache": p.key_cache,
        "value_cache": p.value_cache, "block_tables": _interop.unit_last_stride(p.block_tables),
        "seq_lens": _interop.unit_last_stride(p.seq_lens), "bias": p.bias.array,
        "bias.index": None if p.bias.index is None else _interop.unit_last_stride(p.bias.index),
        "alibi_slopes": None if p.alibi_slopes is None else _interop.unit_last_stride(p.alibi_slopes),
        "part_acc": None if workspace is None else workspace[0], "part_ml": None if workspace is None else workspace[1],
    }
    pointers = {name: _interop.data_ptr(x) for name, x in arrays.items() if x is not None}
    q_strides = _checks.element_strides(arrays["query"])
    vec = 16 // p.query.dtype.itemsize
    out_strides = _checks.element_strides(out)[:2]
    attention = _launch.attention_args(
        p, tiled=True, query_strides=q_strides, table_stride=_checks.element_strides(arrays["block_tables"])[0],
        tokens_per_part=launch.tokens_per_part, num_parts=launch.num_parts, longest_first=None, pointers=pointers,
        out_strides=out_strides, total_q=p.total_q, q_limit=p.q_limit, causal=p.causal,
        q_vec=pointers["query"] % 16 == 0 and q_strides[0] % vec == 0 and q_strides[1] % vec == 0)
    i32 = np.int32
    plan_args = [("query_start_loc", np.uint64(pointers["query_start_loc"])), ("num_seqs", i32(p.num_seqs)),
                 ("total_q", i32(p.total_q)), ("group_size", i32(p.group_size)), ("rows", i32(launch.rows)),
                 ("tile_info", np.uint64(pointers["tile_info"])), ("num_tiles", i32(launch.num_tiles))]
    spec = launch.spec
    launches = [
        _launch.Launch(_launch.function_of(plan_kernel), (1, 1, 1), _specs.PREFILL_PLAN_THREADS,
                       _launch.PackedArgs(plan_args)),
        _launch.Launch(_launch.function_of(kernel), (launch.num_tiles, p.num_kv_heads, launch.num_parts),
                       spec.threads, _launch.PackedArgs(attention), spec.smem_bytes),
    ]
    if launch.num_parts > 1:
        combine = _launch.combine_args(p, tiled=True, num_parts=launch.num_parts, pointers=pointers,
                                       out_strides=out_strides, total_q=p.total_q)
        chunks = _specs.combine_chunks(launch.rows, p.head_size, launch.num_parts)
        launches.append(_launch.Launch(_launch.function_of(combine_kernel), (launch.num_tiles, p.num_kv_heads, chunks),
                                       _specs.COMBINE_THREADS, _launch.PackedArgs(combine)))
    for one in launches:
        one.launch(stream.ptr)


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
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
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

    (with ``logits_soft_cap = c``, the first term is ``c * tanh(scale * <q, k> / c)``; with ``window_left = w``,
    keys ``j < p - w`` are masked too)

    With ``q_len = 1`` for every sequence this is :func:`paged_attention` (``p = n - 1``). Softmax and
    accumulation run in float32. float16 / bfloat16 run on the tensor cores (``mma.sync``, float32
    accumulators; on H100 / H200, head sizes 64 and 128, Hopper's ``wgmma``); float32 runs a simple SIMT kernel
    (exact float32 math, no TF32; correct, not fast).

    Parameters
    ----------
    query : array ``[total_query_tokens, num_heads, head_size]``, float16 / bfloat16 / float32
        The query rows of all sequences, packed. head_size is one of 32, 64, 80, 96, 112, 120, 128, 192, 256.
    key_cache, value_cache : arrays of the query's dtype, or fp8
        As in :func:`paged_attention`; block_size a power of two up to 256.
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
    kv_layout : {"nhd", "vllm", "hnd"}
    logits_soft_cap, window_left, kv_cache_dtype, k_scale, v_scale
        As in :func:`paged_attention`. On the GPU the pages an fp8 call reads are first dequantized into a scratch
        cache of the query's dtype (``num_seqs * max_blocks_per_seq`` pages), which the 16-bit tilings then read.
        With ``causal=False`` a window masks only the keys before ``p - window_left``.
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
        bytes or more apart; on the GPU, an fp8 cache of a head size that is not a multiple of 16.
    RuntimeError
        Kernel compilation failed (with the NVRTC log), or NVRTC / CUDA headers are missing.

    Notes
    -----
    Nothing is read on the host unless ``validate=True``, and no input reads or writes out of bounds: the kernels
    clamp ``query_start_loc`` into ``[0, total_query_tokens]`` and give zeros to query rows past a dense bias's
    ``max_q_len``. A sequence whose ``seq_lens`` entry is negative or longer than its block table or a dense bias
    holds gets NaN in all its output rows, and the query rows whose tile reads a page with a block id outside the
    cache get NaN (``validate=True`` and the NumPy path raise a ValueError naming the argument instead). One call
    launches a small plan kernel (tiles to sequences, on the device), the attention kernel and, when the keys are
    split, a reduction.
    """
    options, scale_arrays = _checks.serving_options(logits_soft_cap, window_left, kv_cache_dtype, k_scale, v_scale)
    named = {
        "query": query, "key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
        "seq_lens": seq_lens, "query_start_loc": query_start_loc, **_checks.bias_operands(attn_bias),
        "alibi_slopes": alibi_slopes, **scale_arrays, "out": out,
    }
    framework = _interop.call_framework(named, ("attn_bias", "alibi_slopes", *scale_arrays, "out"), stream=stream,
                                        out=out)
    if framework == "numpy":
        result = reference.paged_prefill_attention_ref(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal=causal, scale=scale,
            attn_bias=attn_bias, alibi_slopes=alibi_slopes, kv_layout=kv_layout, out=out, **options,
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
            **{**options, **{name: arr[name] for name in scale_arrays}},
        )
        _checks.check_kernel_support(problem.cache, problem.dtype, "prefill")
        if validate:
            host = dataclasses.replace(
                problem, seq_lens=reference.to_numpy(seq_lens), block_tables=reference.to_numpy(block_tables),
                query_start_loc=reference.to_numpy(query_start_loc), bias=_checks.host_bias(problem.bias, attn_bias),
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
        if problem.cache.fp8 is not None:  # the pages it reads, dequantized (kept with the problem until queued)
            problem = cache.dequantize_pages(problem, framework, query, launch_stream, device)
        launch = planning.plan_prefill(problem.shape, _device.query(device))
        tile_info = _interop.empty(framework, (launch.num_tiles, 2), np.int32, query, launch_stream)[1]
        workspace = None
        if launch.num_parts > 1:
            rows = launch.num_parts * problem.total_q * problem.num_heads
            workspace = (
                _interop.empty(framework, (rows, problem.head_size), np.float32, query, launch_stream)[1],
                _interop.empty(framework, (rows, 2), np.float32, query, launch_stream)[1],
            )
        _launch_prefill(problem, launch, out_arr, tile_info, workspace, launch_stream, device)
    return _interop.finish(framework, result)
