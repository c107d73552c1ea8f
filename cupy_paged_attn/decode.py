"""``paged_attention``: decode attention (one query token per sequence) over a paged KV cache, with a bias."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from . import _checks, _compile, _device, _interop, _launch, planning, reference
from . import tuning as _tuning

__all__ = ["DecodePlan", "paged_attention"]


@dataclasses.dataclass(frozen=True)
class _QueryShape:
    """What a plan keeps of the query (and so of out): shape ``(num_seqs, num_heads, head_size)`` and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


def _kernel_strides(arr: Any) -> tuple[int, ...]:
    """Element strides of ``arr`` as the kernel sees it: its own, or a contiguous copy's if its last stride is not 1
    (such operands are copied before each launch)."""
    strides = _checks.element_strides(arr)
    if not strides or strides[-1] == 1:
        return strides
    return _checks.contiguous_strides(tuple(arr.shape))


#: The kernel parameter each operand's address goes to (a bias kind's arrays by their names in bias_operands).
_POINTER_PARAMS = {
    "query": "query", "key_cache": "key_cache", "value_cache": "value_cache", "block_tables": "block_tables",
    "seq_lens": "seq_lens", "alibi_slopes": "alibi_slopes", "attn_bias": "bias", "attn_bias.values": "bias",
    "attn_bias.table": "bias", "attn_bias.offsets": "bias.index", "attn_bias.buckets": "bias.index",
    "k_scale": "k_scales", "v_scale": "v_scales",  # (fp8 scales given as arrays)
}
#: Operands the kernels read with unit last stride (a strided one is copied first).
_UNIT_STRIDE = ("query", "block_tables", "seq_lens", "alibi_slopes", "attn_bias.offsets", "attn_bias.buckets",
                "k_scale", "v_scale")
#: Operands the kernels read in 16-byte vectors: their address must be a multiple of 16 (_checks.check_aligned).
_VECTOR_LOADS = ("key_cache", "value_cache")


class DecodePlan:
    """:func:`paged_attention` for repeated calls with the same shapes: everything decided once.

    The constructor takes example arrays (the arguments of :func:`paged_attention`), checks them as
    :func:`paged_attention` does, compiles or fetches the kernel, chooses the split and allocates the split-K
    workspace (a split combined by the combine kernel needs one; one combined in thread block clusters does not).
    :meth:`run` then takes arrays of the same dtypes, shapes, strides and device (any data, any addresses, the
    caches' 16-byte aligned), compares those cheaply and launches: no allocation (with ``out=``), no host
    synchronisation, no read of device data. :func:`paged_attention` is this class used once.

    A plan owns one workspace: run it on one stream at a time (one plan per stream or thread). CUDA-graph capture
    of :meth:`run` works (build the plan before the capture). PyTorch and CuPy arrays take the fast path; JAX arrays
    are imported through DLPack on every run.

    Parameters
    ----------
    query, key_cache, value_cache, block_tables, seq_lens, scale, attn_bias, alibi_slopes, kv_layout
        As in :func:`paged_attention`. ``scale``, ``kv_layout``, the bias kind (with a RelativePositionBias's
        geometry) and whether ALiBi is used are fixed by the plan.
    logits_soft_cap, window_left
        As in :func:`paged_attention`; fixed by the plan.
    kv_cache_dtype, k_scale, v_scale
        As in :func:`paged_attention`. A scale given as a number is fixed by the plan; one given as an array is an
        operand of :meth:`run` (which then takes an array like it), so a CUDA graph of the run reads its current
        value.

    Raises
    ------
    TypeError, ValueError, NotImplementedError, RuntimeError
        As :func:`paged_attention`; NumPy arrays raise TypeError (the CPU path has nothing to plan).
    """

    def __init__(
        self,
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
    ) -> None:
        options, scale_arrays = _checks.serving_options(logits_soft_cap, window_left, kv_cache_dtype, k_scale,
                                                        v_scale)
        named = {**_operands(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, alibi_slopes),
                 **scale_arrays}
        framework = _interop.common_framework(named, optional=("attn_bias", "alibi_slopes", *scale_arrays))
        if framework == "numpy":
            raise TypeError("query: a DecodePlan launches GPU kernels; NumPy arrays run through paged_attention")
        device = _interop.device_of("query", query, framework)
        with _interop.launch_context(framework, device, None) as stream:
            arr = _interop.wrap_all(named, framework)
            problem = _check_wrapped(arr, attn_bias, scale, kv_layout, options)
            self._setup(problem, framework, device, query, stream)
        # What run() compares: the caller's torch / CuPy arrays as they are, other frameworks' once imported.
        self._native = framework in ("torch", "cupy")
        kind = framework if self._native else "cupy"
        self._bias_geometry = _checks.bias_geometry(attn_bias)
        self._signatures = {
            name: _interop.signature(x if self._native else arr[name], kind)
            for name, x in named.items() if x is not None
        }

    @classmethod
    def _for_problem(cls, problem: _checks.DecodeProblem, framework: str, device: int, like: Any,
                     stream: Any) -> DecodePlan:
        """A plan for a problem already checked, for paged_attention's cache of plans: it holds no device memory
        (its split-K workspace is allocated by each call, in stream order), so nothing it keeps can outlive a CUDA
        graph's memory pool (torch's cudagraph trees check that every allocation is accounted for)."""
        plan = cls.__new__(cls)
        plan._setup(problem, framework, device, like, stream, own_workspace=False)
        return plan

    def _setup(self, problem: _checks.DecodeProblem, framework: str, device: int, like: Any, stream: Any,
               own_workspace: bool = True) -> None:
        """Everything but the operands' addresses: kernel, split, workspace (if owned), packed arguments."""
        # Only the problem's static facts are kept: a plan must not keep the caller's arrays alive (an intermediate
        # inside a torch CUDA graph would then outlive the graph's pool, which cudagraph trees refuse).
        self._query = _QueryShape(tuple(problem.query.shape), np.dtype(problem.query.dtype))
        self._framework = framework
        self._out_dtype = _interop.signature(like, framework)[0] if framework in ("torch", "cupy") else None
        self._device = device
        self._launch = launch = planning.plan_decode(problem.shape, _device.query(device))
        kernel, combine_kernel = _compile.kernels(launch.spec, device, launch.shared_mem)
        # The tensor-core kernel reads the query element by element (q_vec 0): its address changes with every run,
        # so 16-byte alignment cannot be promised.
        self._args = _launch.PackedArgs(_launch.attention_args(
            problem, tiled=launch.tensor_cores, query_strides=_kernel_strides(problem.query),
            table_stride=_kernel_strides(problem.block_tables)[0], tokens_per_part=launch.tokens_per_part,
            num_parts=launch.num_parts, longest_first=launch.longest_first, kv_scales=True))
        self._combine_args = _launch.PackedArgs(_launch.combine_args(problem, tiled=launch.tensor_cores,
                                                                     num_parts=launch.num_parts))
        # Per operand: its argument slot, and whether it needs unit last stride / 16-byte alignment (_point_at).
        self._operand_slots = {name: (self._args.index[param], name in _UNIT_STRIDE, name in _VECTOR_LOADS)
                               for name, param in _POINTER_PARAMS.items()}
        both = (self._args, self._combine_args)
        self._out_slots = [(a.slots, a.index["out"]) for a in both]
        self._workspace_slots = [(a.slots, a.index["part_acc"], a.index["part_ml"]) for a in both]
        _, num_heads, head_size = self._query.shape
        self._result_strides = (num_heads * head_size, head_size)  # a result of _new_out, contiguous
        # A split grid is launched as a programmatic dependent of the kernel before it, and its combine as one of
        # the attention kernel (launch.dependent); a grid that combines its partitions in clusters names them.
        with _interop.on_device(device):  # CuPy holds a CUfunction per device
            self._attention_launch = _launch.Launch(
                _launch.function_of(kernel), launch.grid, launch.threads, self._args, launch.shared_mem,
                dependent=launch.dependent, cluster=(1, 1, launch.num_parts) if launch.cluster else None)
            self._combine_launch = _launch.Launch(_launch.function_of(combine_kernel), launch.combine_grid,
                                                  launch.combine_threads, self._combine_args,
                                                  dependent=launch.dependent)
        self._workspace = None
        self._owns_workspace = own_workspace
        self._out_strides: tuple[int, ...] = ()  # the out strides the packed arguments hold
        if launch.combines and own_workspace:
            self._workspace = self._new_workspace(like, stream)

    def _new_workspace(self, like: Any, stream: Any) -> Any:
        """The split-K partials, one float32 buffer: acc [rows, head_size], then (m, l) [rows, 2] (16-byte aligned:
        every head size is a multiple of 4). Points the kernels at them; returns the buffer's owner."""
        num_seqs, num_heads, head_size = self._query.shape
        rows = num_seqs * num_heads * self._launch.num_parts
        owner, ptr = _interop.scratch(self._framework, rows * (head_size + 2), like, stream)
        for slots, acc, ml in self._workspace_slots:
            slots[acc], slots[ml] = ptr, ptr + 4 * rows * head_size
        return owner

    def _new_out(self, like: Any, launch_stream: Any) -> tuple[Any, int, tuple[int, ...]]:
        """A contiguous result like the query (``like``) for use on ``launch_stream``: the array for the caller, its
        address and its strides in elements."""
        if self._framework == "torch":  # torch.empty_like: about half of what torch.empty with a device costs
            result = _interop.empty_like_torch(like, launch_stream)
            return result, result.data_ptr(), self._result_strides
        q = self._query
        result, arr = _interop.empty(self._framework, q.shape, q.dtype, like, launch_stream)
        return result, _interop.data_ptr(arr), _checks.element_strides(arr)

    @property
    def launch(self) -> planning.DecodeLaunch:
        """The kernel specialisation, grid and split chosen."""
        return self._launch

    def run(
        self,
        query: Any,
        key_cache: Any,
        value_cache: Any,
        block_tables: Any,
        seq_lens: Any,
        *,
        attn_bias: Any = None,
        alibi_slopes: Any = None,
        k_scale: Any = None,
        v_scale: Any = None,
        out: Any = None,
        stream: Any = None,
    ) -> Any:
        """Attention for arrays like the plan's; returns ``out``, or a new array in the query's framework.

        Each array must match the one the plan was built from in dtype, shape, strides and device; ``attn_bias``
        must be of the same kind and geometry (its arrays matching likewise), and ``alibi_slopes``, ``k_scale`` and
        ``v_scale`` given iff they were arrays there.
        ``out`` is like ``query`` (last dimension contiguous, other strides free). ``stream`` as in
        :func:`paged_attention`. Raises ValueError naming the first argument that does not match (or a cache not
        16-byte aligned); TypeError for ``out`` with JAX arrays or of another framework.
        """
        named = _operands(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, alibi_slopes)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if (scale is None) != (name not in self._signatures):
                raise ValueError(f"{name}: expected " + ("an array" if scale is None else "None") +
                                 " like the plan's (a plan fixes a scale given as a number)")
            if scale is not None:
                named[name] = scale
        geometry = _checks.bias_geometry(attn_bias)
        if geometry != self._bias_geometry:
            raise ValueError(f"attn_bias: the plan was built for a bias of kind "
                             f"{_checks.describe_bias_geometry(self._bias_geometry)}, got "
                             f"{_checks.describe_bias_geometry(geometry)}")
        if (alibi_slopes is None) != ("alibi_slopes" not in self._signatures):
            raise ValueError("alibi_slopes: expected " + ("an array" if alibi_slopes is None else "None") +
                             " like the plan's")
        if self._native:
            return self._run_native(named, out, query, stream)
        if out is not None:  # the slow path imports the operands (JAX, DLPack producers): out= is not written there
            raise TypeError("out: JAX arrays are immutable; call without out= and use the returned array")
        with _interop.launch_context(self._framework, self._device, stream) as launch_stream:
            arrays = _interop.wrap_all({k: v for k, v in named.items() if v is not None}, self._framework)
            copies = self._point_at(arrays, "cupy", launch_stream)
            result = self._launch_into(None, query, launch_stream)
            del copies
            return result

    def _run_native(self, named: dict[str, Any], out: Any, like: Any, stream: Any,
                    signatures: dict[str, tuple[Any, ...]] | None = None) -> Any:
        """:meth:`run` for the plan's torch or CuPy arrays (``named`` as :func:`_operands` names them). With
        ``signatures`` (theirs, which the caller has matched to the plan's: paged_attention's key) they are not
        compared again."""
        if _interop.current_device() != self._device:  # a launch goes to the current device's context
            with _interop.on_device(self._device):
                return self._run_native(named, out, like, stream, signatures)
        launch_stream = _interop.resolve_stream(stream, self._framework, self._device)
        if stream is not None and self._framework == "cupy":
            # CuPy allocates (the result, a call's workspace, copies) from the current stream's pool: the given
            # stream is made current, so that nothing freed here goes to other work before the launch has run.
            with launch_stream:
                return self._launch_native(named, out, like, launch_stream, signatures)
        return self._launch_native(named, out, like, launch_stream, signatures)

    def _launch_native(self, named: dict[str, Any], out: Any, like: Any, launch_stream: Any,
                       signatures: dict[str, tuple[Any, ...]] | None) -> Any:
        copies = self._point_at(named, self._framework, launch_stream, signatures)
        result = self._launch_into(out, like, launch_stream)
        del copies  # queued: the stream-ordered pool may reuse them
        return result

    def _point_at(self, arrays: dict[str, Any], kind: str, launch_stream: Any,
                  signatures: dict[str, tuple[Any, ...]] | None = None) -> list[Any]:
        """Check each operand (torch or CuPy arrays, per ``kind``) against the plan, unless ``signatures`` holds
        theirs already matched, and point the kernel at it. An operand with a strided last dimension is copied on
        the launch stream; returns the copies, which the caller keeps until the launch is queued."""
        if signatures is None:  # run(): each operand compared with the plan's
            signatures = _interop.signatures(arrays, kind)
            for name, sig in signatures.items():
                if sig != self._signatures[name]:
                    raise ValueError(f"{name}: the plan was built for "
                                     f"{_interop.describe_signature(self._signatures[name])}, got "
                                     f"{_interop.describe_signature(sig)}")
        copies = []
        slots, operand_slots, torch_arrays = self._args.slots, self._operand_slots, kind == "torch"
        for name, sig in signatures.items():
            x = arrays[name]
            slot, unit_stride, vector_loads = operand_slots[name]
            if unit_stride and sig[2] and sig[2][-1] != 1:
                with _interop.stream_current(kind, launch_stream):
                    x = _interop.native_contiguous(x, kind)
                copies.append(x)
            ptr = x.data_ptr() if torch_arrays else x.data.ptr
            if vector_loads and ptr % 16:  # the one check of an address: the same shape may sit anywhere
                _checks.check_aligned(name, ptr)
            slots[slot] = ptr
        return copies

    def _point_at_problem(self, problem: _checks.DecodeProblem) -> list[Any]:
        """Point the kernel at a checked problem's (wrapped) arrays, copying those with a strided last dimension;
        returns the copies, which the caller keeps until the launch is queued."""
        copies = []
        arrays = {"query": problem.query, "key_cache": problem.key_cache, "value_cache": problem.value_cache,
                  "block_tables": problem.block_tables, "seq_lens": problem.seq_lens,
                  "alibi_slopes": problem.alibi_slopes, "attn_bias": problem.bias.array,
                  "attn_bias.offsets": problem.bias.index,
                  **{name: scale.array for name, scale in (("k_scale", problem.k_scale), ("v_scale", problem.v_scale))
                     if scale is not None and scale.array is not None}}
        for name, x in arrays.items():
            if x is None:
                continue
            if name in _UNIT_STRIDE:
                x = _interop.unit_last_stride(x)
                copies.append(x)
            self._args.set_pointer(_POINTER_PARAMS[name], _interop.data_ptr(x))
        return copies

    def _launch_into(self, out: Any, like: Any, launch_stream: Any) -> Any:
        """Launch with the operand addresses set; ``out`` None allocates the result like ``like`` (the query)."""
        q = self._query
        if out is None:
            result, out_ptr, out_strides = self._new_out(like, launch_stream)
        elif self._framework in ("torch", "cupy"):
            result = out
            kind = self._framework
            try:
                sig = _interop.signature(out, kind)
            except AttributeError:  # not an array of the plan's framework
                sig = None
            if sig is None or sig[0] != self._out_dtype or sig[1] != q.shape or sig[2][-1:] not in ((1,), ()) \
                    or sig[3] != self._device:
                if _interop.framework_of("out", out) != kind:
                    raise TypeError(f"out: expected a {kind} array like query, got {type(out).__name__}")
                _checks.check_out(_interop.wrap("out", out, kind).array, q)  # names what is wrong
                raise ValueError(f"out: expected an array on device {self._device} like query, got device "
                                 f"{sig[3] if sig else None}")
            out_ptr, out_strides = _interop.native_pointer(out, kind), sig[2]
        else:
            result, out_arr = out, _interop.wrap("out", out, self._framework).array
            _checks.check_out(out_arr, q)
            out_ptr, out_strides = _interop.data_ptr(out_arr), _checks.element_strides(out_arr)
        if q.shape[0] == 0:
            return _interop.finish(self._framework, result)
        workspace = None  # a call's own split-K workspace, alive until the launch is queued
        if self._launch.combines and not self._owns_workspace:
            workspace = self._new_workspace(like, launch_stream)
        for slots, slot in self._out_slots:
            slots[slot] = out_ptr
        if out_strides[:2] != self._out_strides:
            self._out_strides = tuple(out_strides[:2])
            for args in (self._args, self._combine_args):
                args.set("out.stride_s", np.int64(out_strides[0]))
                args.set("out.stride_h", np.int64(out_strides[1]))
        self._attention_launch.launch(launch_stream.ptr)
        if self._launch.combines:
            self._combine_launch.launch(launch_stream.ptr)
        del workspace  # queued: the stream-ordered pool may reuse it
        return _interop.finish(self._framework, result)


# paged_attention's plans, per thread (a plan's packed arguments are written by each call). A plan of a call with
# torch or CuPy arrays is keyed by everything that decides it and its checks: the operands' types and signatures
# (dtype, shape, strides in elements, device), scale, kv_layout, the bias's kind and geometry, and the tuning
# switches in force. A call whose key is there skips the checks: the call that made the plan passed
# them with the same key, and none of them reads data or addresses but the caches' alignment, which _point_at
# checks on every call. Other frameworks' plans (JAX, DLPack producers) are keyed by the checked problem. The plans
# hold no device memory: a call's split-K workspace is its own, allocated on its stream.
_PLANS = threading.local()
_MAX_PLANS_PER_THREAD = 64
_NATIVE = {"torch": "torch", "cupy": "cupy"}  # the top-level module of an operand's type -> signature's kind


def _plan_key(named: dict[str, Any], scale: Any, kv_layout: Any, attn_bias: Any, options: dict[str, Any] | None = None,
              ) -> tuple[tuple[Any, ...], dict[str, tuple[Any, ...]], DecodePlan | None] | None:
    """paged_attention's key for operands ``named`` (as :func:`_operands` names them) of torch or CuPy and its
    serving options (each value with its type, as ``scale``; none an array), their signatures
    and this thread's plan of that key (None if it has none yet); None for other frameworks, or operands that a
    signature cannot read (the checks then name them)."""
    kind = _NATIVE.get(type(named["query"]).__module__.partition(".")[0])
    if kind is None:
        return None
    try:
        signatures = _interop.signatures(named, kind)
        device = signatures["query"][3]
        if device < 0:  # a torch tensor on the CPU
            return None
        key = (kind, tuple(map(type, named.values())), tuple(signatures.values()), type(scale), scale, kv_layout,
               _checks.bias_geometry(attn_bias), _tuning.current(),
               tuple((name, type(value), value) for name, value in (options or {}).items()))
        plan = _PLANS.__dict__.get("plans", {}).get(key)  # hashes the key: an unhashable scale or layout raises
    except (AttributeError, TypeError):  # not an array of the query's framework; an unhashable scale or layout
        return None
    return key, signatures, plan


def _problem_key(problem: _checks.DecodeProblem, framework: str, device: int) -> tuple[Any, ...]:
    """The key of a checked problem's plan: everything a plan fixes."""
    p, b = problem, problem.bias
    return (
        framework, device, _tuning.current(), p.dtype, p.head_size, p.kv_layout, p.num_seqs,
        p.num_heads, p.num_kv_heads, p.max_len, p.scale, _kernel_strides(p.query), _kernel_strides(p.block_tables),
        dataclasses.astuple(p.cache), b.mode, b.strides, b.dtype, b.n, b.m, p.alibi_slopes is None, p.scores,
        *((s.value, None if s.array is None else tuple(s.array.shape)) if s is not None else None
          for s in (p.k_scale, p.v_scale)),
    )


def _cached_plan(key: tuple[Any, ...], problem: _checks.DecodeProblem, framework: str, device: int, like: Any,
                 stream: Any) -> DecodePlan:
    plans = _PLANS.__dict__.setdefault("plans", {})
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS_PER_THREAD:
            plans.clear()
        plan = plans[key] = DecodePlan._for_problem(problem, framework, device, like, stream)
    return plan


def _operands(query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, attn_bias: Any,
              alibi_slopes: Any) -> dict[str, Any]:
    """The array operands by name (a bias kind's arrays under their own names)."""
    return {
        "query": query, "key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
        "seq_lens": seq_lens, **_checks.bias_operands(attn_bias), "alibi_slopes": alibi_slopes,
    }


def _check_wrapped(arr: dict[str, Any], attn_bias: Any, scale: Any, kv_layout: Any,
                   options: dict[str, Any] | None = None) -> _checks.DecodeProblem:
    """check_decode on the wrapped operands (``arr``, named as :func:`_operands` names them, ``out`` optional), then
    what the kernels support. ``options``: the serving options of :func:`paged_attention` (a scale array wrapped in
    ``arr`` under its name)."""
    options = dict(options or {})
    for name in ("k_scale", "v_scale"):
        if name in arr:
            options[name] = arr[name]
    problem = _checks.check_decode(
        arr["query"], arr["key_cache"], arr["value_cache"], arr["block_tables"], arr["seq_lens"],
        scale=scale, attn_bias=attn_bias, alibi_slopes=arr.get("alibi_slopes"), kv_layout=kv_layout,
        out=arr.get("out"), bias_arrays={k: v for k, v in arr.items() if k.startswith("attn_bias")}, **options,
    )
    _checks.check_kernel_support(problem.cache, problem.dtype, "decode")
    return problem


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
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
    out: Any = None,
    stream: Any = None,
    validate: bool = False,
) -> Any:
    r"""Decode attention over a paged KV cache with an additive bias.

    For every sequence ``s``, query head ``h`` and key position ``j < seq_lens[s]``, with
    ``G = num_heads // num_kv_heads``::

        logit[j] = scale * <query[s, h], k[s, j, h // G]> + alibi_slopes[h] * (j - seq_lens[s] + 1) + attn_bias[s, h, j]
        out[s, h] = sum_j softmax(logit)[j] * v[s, j, h // G]

    (with ``logits_soft_cap = c``, the first term is ``c * tanh(scale * <q, k> / c)``; with ``window_left = w``,
    only keys ``j >= seq_lens[s] - 1 - w`` are attended)

    where ``k[s, j]`` is row ``j % block_size`` of page ``block_tables[s, j // block_size]``. Softmax and
    accumulation run in float32 whatever the storage dtype. Grouped-query float16 / bfloat16 decode (two or more
    query heads per KV head, head sizes up to 128), and multi-head decode whose grid fills the GPU, runs on the
    tensor cores, which round the softmax weights to the storage dtype before they multiply ``v`` (as FlashAttention
    does); the rest runs a SIMT kernel with float32 arithmetic (:mod:`cupy_paged_attn.planning` decides, from shapes
    alone). The bias is added after scaling, as in vLLM, xformers and SDPA's float mask; the formula of vLLM PR
    #11334, ``softmax((Q K^T + A) / sqrt(d))``, is ``attn_bias = A * scale``.

    Parameters
    ----------
    query : array ``[num_seqs, num_heads, head_size]``, float16 / bfloat16 / float32
        One query token per sequence. head_size is one of 32, 64, 80, 96, 112, 120, 128, 192, 256.
    key_cache, value_cache : arrays of the query's dtype, or fp8 (see ``kv_cache_dtype``)
        ``kv_layout="nhd"``: both ``[num_blocks, block_size, num_kv_heads, head_size]``.
        ``kv_layout="hnd"``: both ``[num_blocks, num_kv_heads, block_size, head_size]`` (FlashInfer's other layout).
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
    kv_layout : {"nhd", "vllm", "hnd"}
        Layout of the caches, see above.
    logits_soft_cap : float, optional
        Gemma 2's soft-cap ``c > 0``: ``scale * <q, k>`` becomes ``c * tanh(scale * <q, k> / c)`` before the bias and
        ALiBi are added. On the GPU, 16-bit kernels compute tanh from one exp2 and one reciprocal (absolute error
        a few units in the last place of ``c``), float32 ones with ``tanhf``.
    window_left : int, optional
        Sliding window ``w >= 0``: the query (at position ``seq_lens[s] - 1``) attends its last ``w + 1`` keys.
        The GPU kernels read only the pages that hold them (and split only them across CTAs).
    kv_cache_dtype : {"auto", "fp8_e4m3", "fp8_e5m2"}
        ``"auto"``: the caches hold the query's dtype, or ml_dtypes' / torch's ``float8_e4m3fn`` or ``float8_e5m2``.
        ``"fp8_e4m3"`` / ``"fp8_e5m2"``: fp8 caches stored as uint8 (vLLM's convention) or as that float8 dtype.
        On the GPU, fp8 caches take float16 / bfloat16 queries and head sizes that are multiples of 16: the
        tensor-core decode converts each tile once in shared memory to the query's dtype (exact: every fp8 value is
        a float16 and a bfloat16), the SIMT decode converts 16-value vectors to float32 in registers; the scales
        multiply the logits and the output in float32.
    k_scale, v_scale : float or array ``[1]`` or ``[num_kv_heads]``, float32, optional
        fp8 caches only (default 1.0): a stored value ``x`` reads as ``x * scale`` (vLLM's convention; a KV head's
        own scale with ``[num_kv_heads]``). An array keeps the scale on the device (a CUDA graph reads its current
        value).
    out : array like ``query``, optional
        Written in place and returned; same shape, dtype and framework as ``query``; last dimension contiguous.
        Not accepted for JAX (immutable arrays).
    stream : optional
        Stream to launch on: a CuPy stream, a ``torch.cuda.Stream`` (torch arrays) or a ``cudaStream_t`` int.
        Default: the current stream of the query's framework on the query's device (read on every call), so
        ``torch.cuda.stream(...)`` and CUDA-graph capture work. Must be None for NumPy arrays.
    validate : bool
        Also check the device data (``seq_lens`` within range, used block ids within the cache, a RaggedBias's
        offsets, a RelativePositionBias's buckets) and raise
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
        ``scale``; ``logits_soft_cap`` > 0, ``window_left`` >= 0, ``kv_cache_dtype`` and the caches' storage, fp8
        scales (finite, > 0, fp8 caches only, ``[1]`` or ``[num_kv_heads]`` float32); all arrays on one device;
        a torch tensor on the CPU. On the NumPy path (and with ``validate=True``) also the data: seq_lens within
        ``[0, max_blocks_per_seq * block_size]``, a dense bias at least ``seq_lens[s]`` keys long (the error names
        ``attn_bias``), the used block ids within ``[0, num_blocks)``, a RaggedBias's rows of every sequence within
        ``values``, and fp8 scale arrays' values.
    NotImplementedError
        A head_size or block_size outside the supported sets; a dense bias or RaggedBias values whose keys lie
        2**31 bytes or more apart (the kernels step from key to key by a 32-bit byte count); on the GPU, an fp8
        cache with a float32 query (``query``) or a head size that is not a multiple of 16 (``head_size``).
    RuntimeError
        Kernel compilation failed (with the NVRTC log), or NVRTC / CUDA headers are missing (naming the extra).

    Notes
    -----
    On the GPU, device data is not read on the host unless ``validate=True`` (that costs a sync). Out-of-contract
    data is made loud instead: a sequence whose ``seq_lens`` entry is negative or longer than its block table or a
    dense bias holds (``max_len``), whose RaggedBias rows do not cover its keys, or one of whose used pages has a
    block id outside the cache gets NaN in every element of its output rows. Nothing outside the arrays is read or
    written whatever they hold, and a length of 0 gives zeros. ``validate=True`` (and the NumPy path, always) raises
    a ValueError naming the argument instead.

    Calls are planned once per thread and set of operand signatures (dtype, shape, strides, device of each array)
    and other arguments: a repeated call with torch or CuPy arrays runs the cached :class:`DecodePlan` without
    checking its arguments again (a different signature is checked in full, as on a first call).
    """
    operands = _operands(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, alibi_slopes)
    options, scale_arrays = _checks.serving_options(logits_soft_cap, window_left, kv_cache_dtype, k_scale, v_scale)
    # The repeated-call fast path: calls whose options are all values (fp8 scales given as arrays are operands).
    keyed = _plan_key(operands, scale, kv_layout, attn_bias, options) if not scale_arrays else None
    if keyed is not None and keyed[2] is not None and not validate:
        return keyed[2]._run_native(operands, out, query, stream, keyed[1])
    named = {**operands, **scale_arrays, "out": out}
    framework = _interop.call_framework(named, ("attn_bias", "alibi_slopes", *scale_arrays, "out"), stream=stream,
                                        out=out)
    if framework == "numpy":
        result = reference.paged_attention_ref(
            query, key_cache, value_cache, block_tables, seq_lens,
            scale=scale, attn_bias=attn_bias, alibi_slopes=alibi_slopes, kv_layout=kv_layout, out=out, **options,
        )
        return result if out is not None else result.astype(query.dtype)

    device = _interop.device_of("query", query, framework)
    with _interop.launch_context(framework, device, stream) as launch_stream:
        arr = _interop.wrap_all(named, framework)
        problem = _check_wrapped(arr, attn_bias, scale, kv_layout, options)
        if validate:
            host = dataclasses.replace(
                problem, seq_lens=reference.to_numpy(seq_lens), block_tables=reference.to_numpy(block_tables),
                bias=_checks.host_bias(problem.bias, attn_bias),
            )
            _checks.check_host_data(host)
        if problem.num_seqs == 0:
            result = out if out is not None else _interop.empty(framework, (0, *problem.query.shape[1:]),
                                                                 problem.query.dtype, query, launch_stream)[0]
            return _interop.finish(framework, result)
        key = keyed[0] if keyed is not None else _problem_key(problem, framework, device)
        plan = _cached_plan(key, problem, framework, device, query, launch_stream)
        copies = plan._point_at_problem(problem)
        result = plan._launch_into(out, query, launch_stream)
        del copies  # queued: the stream-ordered pool may reuse them
        return result
