"""The launch layer: every kernel of the library is launched here, decode, prefill and the cache write alike.

A launch is a :class:`Launch`: function, grid, block, dynamic shared memory and :class:`PackedArgs`, the arguments
in the form ``cuLaunchKernel`` reads (one 8-byte slot each), plus launch attributes where a launch has them
(programmatic dependent launch, thread block clusters: ``cuLaunchKernelEx``). Building one converts every argument
once; launching it converts nothing, so a plan that keeps its launches (``DecodePlan``) pays one driver call per
kernel and run. The argument lists of the kernels, in their parameters' order, are built here too
(:func:`attention_args`, :func:`combine_args`): the kernels' ABI has one home.
"""

from __future__ import annotations

import array
import ctypes
import functools
import struct
from typing import Any

import numpy as np

from ._specs import NO_WINDOW
from .planning import masking_window

#: struct format of one 8-byte slot per argument dtype (a 4-byte value in the slot's low half, little-endian).
_SLOT_FORMAT = {np.uint64: "Q", np.int64: "q", np.int32: "i4x", np.float32: "f4x"}


class PackedArgs:
    """Kernel arguments in the form ``cuLaunchKernel`` reads: one 8-byte slot per argument and the array of the
    slots' addresses. Changing an argument is one item write. The slots are an ``array.array``, whose item write
    costs less than a NumPy array's (a decode run writes seven to nine), and which cannot move while the typed views
    exist."""

    def __init__(self, named: list[tuple[str, np.generic]]) -> None:
        count = max(len(named), 1)
        # All slots in one struct.pack (a launch of prefill builds three of these per call).
        packed = struct.pack("=" + "".join(_SLOT_FORMAT[type(v)] for _, v in named), *(v for _, v in named))
        self.slots = array.array("Q", packed or bytes(8))
        base = self.slots.buffer_info()[0]
        self._addresses = array.array("Q", range(base, base + 8 * count, 8))
        self.address = self._addresses.buffer_info()[0]
        self._named = named

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """Each argument's slot, by name."""
        return {name: i for i, (name, _) in enumerate(self._named)}

    @functools.cached_property
    def _typed(self) -> dict[np.dtype, tuple[Any, int, type]]:
        """dtype -> (view of the slots, items per slot, Python type of an item); a 4-byte argument sits in its slot's
        low half."""
        raw = memoryview(self.slots).cast("B")
        return {np.dtype(np.uint64): (self.slots, 1, int), np.dtype(np.int64): (raw.cast("q"), 1, int),
                np.dtype(np.int32): (raw.cast("i"), 2, int), np.dtype(np.float32): (raw.cast("f"), 2, float)}

    def set(self, name: str, value: np.generic) -> None:
        view, step, kind = self._typed[value.dtype]
        view[self.index[name] * step] = kind(value)

    def set_pointer(self, name: str, ptr: int) -> None:
        self.slots[self.index[name]] = ptr


# ---------------------------------------------------------------------------------------------------------------
# The driver's launch calls
# ---------------------------------------------------------------------------------------------------------------
@functools.cache
def _launch_kernel() -> Any:
    from cupy_backends.cuda.api import driver

    return driver.launchKernel


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` whose value is an ``int`` (``value[0]``) or a cluster's dimensions (the value union is
    64 bytes, 8-byte aligned)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 3),
                ("value_pad", ctypes.c_char * 52)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def launch_kernel_ex() -> Any:
    """The driver's ``cuLaunchKernelEx`` (CuPy wraps only ``cuLaunchKernel``), or None without it. Called with
    ready-made ctypes arguments (no ``argtypes``: nothing is converted per call)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


class Launch:
    """One kernel launch with everything but the stream fixed. ``dependent``: a programmatic dependent of the kernel
    before it in the stream (it may start while that one runs, and waits for it in the kernel); ``cluster``: thread
    block clusters of these dimensions. Either goes through ``cuLaunchKernelEx``, a plain launch through
    ``cuLaunchKernel``. ``function`` is a ``CUfunction`` of the device current at launch."""

    def __init__(self, function: int, grid: tuple[int, int, int], threads: int, args: PackedArgs,
                 shared_mem: int = 0, dependent: bool = False, cluster: tuple[int, int, int] | None = None) -> None:
        self.function, self.grid, self.threads, self.shared_mem, self.args = function, grid, threads, shared_mem, args
        values = ([(PROGRAMMATIC_STREAM_SERIALIZATION, (1, 0, 0))] if dependent else []) + \
                 ([(CLUSTER_DIMENSION, cluster)] if cluster is not None else [])
        self._config = None
        if values:
            self._attrs = (LaunchAttribute * len(values))(
                *(LaunchAttribute(kind, b"", (ctypes.c_uint * 3)(*value)) for kind, value in values))
            self._config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), shared_mem,
                                        None, ctypes.cast(self._attrs, ctypes.POINTER(LaunchAttribute)), len(values))
            self._call = (ctypes.byref(self._config), ctypes.c_void_p(function), ctypes.c_void_p(args.address), None)

    def launch(self, stream: int) -> None:
        """Launch on ``stream`` (a ``cudaStream_t``)."""
        if self._config is None:
            _launch_kernel()(self.function, *self.grid, self.threads, 1, 1, self.shared_mem, stream,
                             self.args.address, 0)
            return
        self._config.stream = stream
        status = launch_kernel_ex()(*self._call)
        if status != 0:
            from cupy_backends.cuda.api import driver

            raise driver.CUDADriverError(status)


def function_of(kernel: Any) -> int:
    """The ``CUfunction`` of a compiled kernel (``cupy.RawKernel``) on the current device."""
    return kernel.kernel.ptr


# ---------------------------------------------------------------------------------------------------------------
# The kernels' parameters, in order. Pointers are named by the operand they come from; a value left out of
# ``pointers`` is null (a plan writes its operands' addresses before each launch).
# ---------------------------------------------------------------------------------------------------------------
def _out_args(pointers: dict[str, int], out_strides: tuple[int, int]) -> list[tuple[str, np.generic]]:
    """The leading parameters of every attention and combine kernel: out, its strides, the split-K workspace."""
    ptr = _pointer(pointers)
    return [("out", ptr("out")), ("out.stride_s", np.int64(out_strides[0])),
            ("out.stride_h", np.int64(out_strides[1])), ("part_acc", ptr("part_acc")), ("part_ml", ptr("part_ml"))]


def _pointer(pointers: dict[str, int]) -> Any:
    return lambda name: np.uint64(pointers.get(name, 0))


def attention_args(p: Any, *, tiled: bool, query_strides: tuple[int, ...], table_stride: int,
                   tokens_per_part: int, num_parts: int, longest_first: bool | None,
                   pointers: dict[str, int] | None = None, out_strides: tuple[int, int] = (0, 0), q_vec: bool = False,
                   total_q: int | None = None, q_limit: int = 1, causal: bool = False,
                   kv_scales: bool = False) -> list[tuple[str, np.generic]]:
    """The parameters of an attention kernel for checked problem ``p`` (``_checks.DecodeProblem`` or
    ``PrefillProblem``): the SIMT decode's, or with ``tiled`` the tensor-core tile's (decode_mma, prefill_mma,
    prefill_simt, prefill_wgmma), which add the query rows (``q_vec``: the query may be read in 16-byte vectors;
    ``query_start_loc``, ``total_q``, ``tile_info``), ``q_limit`` (the rows a dense bias holds) and ``causal``.
    ``longest_first``: decode's parameter (None: the kernel has none, prefill); ``kv_scales``: the kernel ends with
    the fp8 scales' parameters (:func:`kv_scale_args`: decode's kernels)."""
    i64, i32 = np.int64, np.int32
    ptr = _pointer(pointers or {})
    bias = p.bias
    return [
        *_out_args(pointers or {}, out_strides),
        ("query", ptr("query")), ("query.stride_s", i64(query_strides[0])), ("query.stride_h", i64(query_strides[1])),
        *((("q_vec", i32(q_vec)), ("query_start_loc", ptr("query_start_loc")),
           ("total_q", i32(p.num_seqs if total_q is None else total_q)), ("tile_info", ptr("tile_info")))
          if tiled else ()),
        ("key_cache", ptr("key_cache")), ("value_cache", ptr("value_cache")),
        ("block_stride", i64(p.cache.block_stride)), ("num_blocks", i32(p.cache.num_blocks)),
        ("block_shift", i32(p.cache.block_size.bit_length() - 1)), ("num_kv_heads", i32(p.num_kv_heads)),
        ("block_tables", ptr("block_tables")), ("block_tables.stride", i64(table_stride)),
        ("seq_lens", ptr("seq_lens")), ("max_len", i32(p.max_len)), *((("q_limit", i32(q_limit)),) if tiled else ()),
        ("bias", ptr("bias")), ("bias.index", ptr("bias.index")),
        *((f"bias.stride{i}", i64(s)) for i, s in enumerate(bias.strides)),
        ("bias.dtype", i32(bias.dtype_code)), ("bias.n", i32(bias.n)), ("bias.m", i32(bias.m)),
        ("alibi_slopes", ptr("alibi_slopes")), ("scale", np.float32(p.scale)), ("group_size", i32(p.group_size)),
        *((("causal", i32(causal)),) if tiled else ()),
        ("tokens_per_part", i32(tokens_per_part)), ("num_parts", i32(num_parts)),
        *((("longest_first", i32(longest_first)),) if longest_first is not None else ()),
        # The score options last: the kernels compiled without them keep every other parameter where it was.
        ("soft_cap", np.float32(p.scores.soft_cap or 0.0)),
        ("window_left", i32(NO_WINDOW if (w := masking_window(p.scores.window_left, p.max_len)) is None else w)),
        *(kv_scale_args(p.k_scale, p.v_scale, pointers or {}) if kv_scales else ()),
    ]


def kv_scale_args(k_scale: Any, v_scale: Any, pointers: dict[str, int]) -> list[tuple[str, np.generic]]:
    """The fp8 scales' parameters (the last ones of the decode kernels, the cache write and the page dequantize):
    the arrays' addresses (the operands ``k_scale`` / ``v_scale``; null for a number or no fp8 cache), their strides
    by KV head (0: one scale for all), then the numbers (1.0 where an array holds the scale). ``k_scale``,
    ``v_scale``: the checked ``_checks.KvScale`` or None."""
    ptr = _pointer(pointers)

    def stride(scale: Any) -> np.int32:
        return np.int32(scale is not None and scale.array is not None and scale.array.shape[0] > 1)

    def value(scale: Any) -> np.float32:
        return np.float32(1.0 if scale is None or scale.value is None else scale.value)

    return [("k_scales", ptr("k_scale")), ("v_scales", ptr("v_scale")), ("k_scale.stride", stride(k_scale)),
            ("v_scale.stride", stride(v_scale)), ("k_scale", value(k_scale)), ("v_scale", value(v_scale))]


def combine_args(p: Any, *, tiled: bool, num_parts: int, pointers: dict[str, int] | None = None,
                 out_strides: tuple[int, int] = (0, 0), total_q: int | None = None) -> list[tuple[str, np.generic]]:
    """The parameters of a split-K combine: tile_combine's (``tiled``: the tensor-core tile's partitions, by M tile
    and KV head) or decode_simt_combine's (by sequence and head)."""
    i32 = np.int32
    ptr = _pointer(pointers or {})
    if tiled:
        rows = p.num_seqs if total_q is None else total_q
        rest = [("query_start_loc", ptr("query_start_loc")), ("total_q", i32(rows)), ("tile_info", ptr("tile_info")),
                ("num_kv_heads", i32(p.num_kv_heads)), ("group_size", i32(p.group_size))]
    else:
        rest = [("num_heads", i32(p.num_heads))]
    return [*_out_args(pointers or {}, out_strides), *rest, ("num_parts", i32(num_parts))]
