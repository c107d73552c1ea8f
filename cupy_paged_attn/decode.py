"""``paged_attention``: decode attention (one query token per sequence) over a paged KV cache, with a bias."""

from __future__ import annotations

import array
import ctypes
import dataclasses
import functools
import threading
from typing import Any

import numpy as np

from . import _checks, _compile, _interop, reference

__all__ = ["DecodePlan", "paged_attention"]

_THREADS = _compile.DECODE_THREADS
_REDUCE_THREADS = 128  # kReduceThreads
_TILE_MULTIPLE = 128  # every specialisation's TILE divides this
# A split-K partition holds more than half this many keys. 128 rather than 256: in the latency case (B1 H16 d64 L1024)
# 8 partitions instead of 4 cost the same without a bias and less with one (H200: dense 11.8 -> 11.4 us, T5 12.5 ->
# 11.9; benchmarks/NOTES.md, session 6).
_MIN_PART_TOKENS = 128
_SPLIT_BELOW_CTAS_PER_SM = 2  # fewer CTAs than this per SM cannot hide memory latency: split the keys
_CTAS_PER_SM_TARGET = 4  # then split until the grid holds about this many CTAs per SM
# A split grid of the FP32 kernel runs at most this many CTAs per SM, though one query head per CTA leaves registers
# for four (DecodeLayout::kMinCtas): it asks for enough shared memory that a fourth does not fit. H200, B8 H16 d64
# L4096-131072 (5 partitions): 569.6 -> 534.5 us without a bias, 611.4 -> 566.1 dense (benchmarks/NOTES.md,
# session 9); unsplit grids are faster at four (B64 d64 L2048: 137.3 -> 133.1 us).
_SPLIT_CTAS_PER_SM = 3
#: Grouped-query decode runs on the tensor cores (paged_prefill.cu's decode tiling) from this group size up, for
#: float16 / bfloat16 and head sizes up to 128: its FP32 loop costs ~80 instructions per (token, query head).
TENSOR_CORE_MIN_GROUP = 2
#: Multi-head problems (one query head per KV head) run on the tensor cores too where that kernel's grid fills the
#: GPU (a wave of its CTAs or more: no split), with no bias, a dense one or T5. H200 (µs none / dense): B64 H16/16 d64
#: L∈[1024, 2048] 103.9 / 105.5 -> 99.1 / 100.5, L2048 134.7 / 135.9 -> 131.1 / 133.7, B128 H32/32 d128 L4096
#: 1950 / 1953 -> 1927 / 1942. Not with a ragged bias (the tile's copy of one head's bias per key cost more: B64 L2048
#: 136.9 -> 140.3), and not split: B8 H16 d64 L∈[4096, 131072] in 3 partitions 548 -> 712, the latency case 7.7 ->
#: 8.3 (benchmarks/NOTES.md, session 25). False: multi-head problems stay on the FP32 kernel (A/B runs).
TENSOR_CORE_MHA = True
#: Launch the split-K reduction with programmatic dependent launch where the device has it (compute capability 9.0
#: and later): its CTAs start while the attention kernel runs and wait for it in the kernel (``wait_for_primary`` in
#: common.cuh), which hides the reduction's launch. False launches it after the attention kernel (A/B runs).
DEPENDENT_REDUCE = True
#: Launch a split attention kernel with programmatic dependent launch too: it may then start while the kernel before
#: it in the stream runs (the reductions let the next call's attention kernel start at once), and waits for it at its
#: very top, before reading anything (``wait_for_primary``). The latency case (B1 H16 d64 L1024, H200): 8.0-8.1 ->
#: 7.7 us without a bias, 8.6 -> 7.9-8.0 dense. Split grids only: unsplit ones of several waves ran 0.6-1 % slower
#: launched so (B64 H16 d64 L2048, ragged lengths, B8 long ragged). False: plain launches (A/B runs).
DEPENDENT_ATTENTION = True
#: A split grid of the FP32 kernel of at most 8 partitions (DECODE_CLUSTER_MAX_PARTS: clusters of 8 are portable) and
#: at most one CTA per SM combines its partitions in a thread block cluster (sm_90 and later; the partitions of one
#: (sequence, KV head, chunk) are the CTAs of a cluster, which combine their (acc, m, l) through each other's shared
#: memory): a run is one launch, with no split-K workspace. H200, latency case (B1 H16 d64 L1024, 8 partitions):
#: 7.7 / 8.0 / 8.6 -> 7.7 / 7.9 / 7.6 us GPU (none / dense / T5), `paged_attention` with a dense bias 23-24 -> 16-17
#: us of host time; B1 L512 (4 partitions) 7.2 / 7.4 / 7.8 -> 6.6 / 6.6 / 6.5 us (benchmarks/NOTES.md, session 24).
#: One CTA per SM keeps the grid in one wave whatever the GPCs' sizes (a cluster's CTAs share a GPC): at two per
#: SM (B1 H32 d64 L1024, 256 CTAs) a dense bias ran 10.7 -> 13.8 us, and a grid of several waves of clusters far
#: slower (B8 H16 L[4096, 131072]: 546 -> 780 us, session 11). False: the reduction kernel (A/B runs).
CLUSTER_COMBINE = True
_CLUSTER_CTAS_PER_SM = 1  # a cluster-combined grid holds at most this many CTAs per SM (on average)
#: A decode grid of more than one wave over 2 to 256 sequences takes them longest first (``seq_of_rank`` in
#: common.cuh): the hardware starts CTAs in index order, so the last wave then holds the shortest sequences and the
#: grid ends evenly. The FP32 kernel orders unsplit grids only; the tensor-core kernel split ones too, sequence by
#: sequence, each cut into the partitions by its own length (paged_prefill.cu). False: sequences in index order,
#: partitions of max_len's ``tokens_per_part`` (A/B runs).
LONGEST_FIRST = True
_MAX_LONGEST_FIRST_SEQS = 256  # kMaxLongestFirstSeqs: the sequences one CTA ranks


def _longest_first(num_seqs: int, ctas: int, slots: int) -> bool:
    """Whether a grid of ``ctas`` CTAs in all (every partition's), ``slots`` of which the SMs hold at once, runs its
    sequences longest first: 2 to 256 sequences, more than one wave. Only a grid of more than one wave gains from
    the order."""
    return LONGEST_FIRST and 2 <= num_seqs <= _MAX_LONGEST_FIRST_SEQS and ctas > slots


@functools.cache
def _num_sms(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


@functools.cache
def _smem_per_sm(device: int) -> tuple[int, int]:
    """Shared memory of one SM, and what CUDA reserves of it per resident CTA (bytes)."""
    import cupy

    attributes = cupy.cuda.Device(device).attributes
    return (int(attributes["MaxSharedMemoryPerMultiprocessor"]),
            int(attributes.get("ReservedSharedMemoryPerBlock", 1024)))


def occupancy_smem(smem: int, ctas_per_sm: int, smem_per_sm: tuple[int, int]) -> int:
    """Dynamic shared memory to ask for so that at most ``ctas_per_sm`` CTAs fit on one SM: ``smem`` (what the
    kernel needs), or more when ``ctas_per_sm + 1`` CTAs of ``smem`` bytes would fit."""
    per_sm, reserved = smem_per_sm
    cap = -(-(per_sm // (ctas_per_sm + 1) - reserved + 1) // 128) * 128  # the least that keeps one more CTA out
    return max(smem, cap) if ctas_per_sm * (cap + reserved) <= per_sm else smem


def heads_per_cta(group_size: int) -> int:
    """Query heads one CTA serves: the group (num_heads // num_kv_heads), rounded up to 1/2/4/8, at most 8."""
    return next(g for g in _compile.HEADS_PER_CTA if g >= min(group_size, _compile.HEADS_PER_CTA[-1]))


@dataclasses.dataclass(frozen=True)
class _QueryShape:
    """What a plan keeps of the query (and so of out): shape ``(num_seqs, num_heads, head_size)`` and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """How one decode problem is launched, all decided by :func:`plan_decode` (a run only reads it): kernel
    specialisation (the FP32 kernel of paged_decode.cu, or the tensor-core kernel of paged_prefill.cu in its decode
    tiling), grid, threads and dynamic shared memory, key partitioning, and the split-K reduction's grid and threads
    (per (M tile, KV head) like the tensor-core CTAs and per chunk of their output elements; else per (sequence,
    query head)), which a grid that combines its partitions in clusters (``spec.cluster``) does not launch.
    Partition p holds keys ``[p·tokens_per_part, (p + 1)·tokens_per_part)``, except in a split
    tensor-core grid taken ``longest_first``, which cuts each sequence's own length into ``num_parts`` runs of
    whole tiles (at most ``tokens_per_part`` keys each)."""

    spec: _compile.DecodeSpec | _compile.PrefillSpec
    grid: tuple[int, int, int]
    tokens_per_part: int
    num_parts: int
    threads: int
    shared_mem: int
    reduce_grid: tuple[int, int, int]
    reduce_threads: int
    longest_first: bool = False

    @property
    def tensor_cores(self) -> bool:
        return isinstance(self.spec, _compile.PrefillSpec)

    @property
    def cluster(self) -> bool:
        """Whether the partitions are combined in thread block clusters of ``(1, 1, num_parts)``."""
        return isinstance(self.spec, _compile.DecodeSpec) and self.spec.cluster

    @property
    def reduces(self) -> bool:
        """Whether a run launches the split-K reduction after the attention kernel (and needs its workspace)."""
        return self.num_parts > 1 and not self.cluster


def uses_tensor_cores(problem: _checks.DecodeProblem, num_sms: int) -> bool:
    """Whether :func:`plan_decode` runs ``problem`` on the tensor cores of a device of ``num_sms`` SMs: grouped
    queries (:data:`TENSOR_CORE_MIN_GROUP`), and multi-head problems whose grid fills the GPU unsplit: a wave of
    its CTAs or more, and no tail split (:func:`tail_parts`; :data:`TENSOR_CORE_MHA`)."""
    p = problem
    if p.dtype not in ("f16", "bf16") or p.head_size not in _compile.DECODE_MMA_HEAD_SIZES:
        return False
    if p.group_size >= TENSOR_CORE_MIN_GROUP:
        return True
    if not (TENSOR_CORE_MHA and p.group_size == 1 and p.bias.mode != "ragged"):
        return False
    ctas = p.num_seqs * p.num_kv_heads  # (one CTA per sequence and head, unsplit)
    slots = _compile.decode_ctas_per_sm(p.head_size, _compile.decode_rows(1)) * num_sms
    return ctas >= slots and tail_parts(ctas, slots) == 1


def forced_kernel_switches(kernel: str) -> dict[str, Any]:
    """The values of this module's switches that make :func:`plan_decode` take one kernel wherever it can, for tests
    and A/B runs (set them with ``monkeypatch.setattr`` or ``setattr``): ``"tensor-cores"``, every float16 /
    bfloat16 problem of a head size up to 128 on the tensor cores, multi-head ones of any grid and bias too;
    ``"fp32-loop"``, every problem on the FP32 kernel."""
    if kernel not in ("tensor-cores", "fp32-loop"):
        raise ValueError(f"kernel: expected 'tensor-cores' or 'fp32-loop', got {kernel!r}")
    tensor_cores = kernel == "tensor-cores"
    return {"TENSOR_CORE_MIN_GROUP": 1 if tensor_cores else 10**9, "TENSOR_CORE_MHA": tensor_cores}


def tensor_core_bias_mode(bias: _checks.CheckedBias, head_size: int, rows: int) -> str:
    """The tensor-core decode's specialisation for ``bias``. A float16 / bfloat16 bias whose elements of one tile lie
    side by side is copied into shared memory with each tile's K and V (paged_prefill.cu, stage_bias): a dense one
    whose keys are adjacent (``"dense-rows"``, a row of keys per query head), a ragged one whose heads are adjacent
    and whose keys lie a multiple of 16 bytes apart (``"ragged-rows"``, the CTA's heads per key: values of 8, 16, ...
    heads). Any other is the bias's own mode, read element by element a few tiles ahead. Decided from dtype and
    strides only (the arrays may sit at any address), where the stages fit beside ``rows`` rows of ``head_size``
    (_compile.decode_bias_fits)."""
    staged = bias.mode
    if bias.dtype in ("f16", "bf16"):
        if bias.mode == "dense" and bias.strides[3] == 1:
            staged = "dense-rows"
        elif bias.mode == "ragged" and bias.strides[1] == 1 and bias.strides[0] > 0 and bias.strides[0] % 8 == 0:
            staged = "ragged-rows"
    return staged if _compile.decode_bias_fits(staged, head_size, rows) else bias.mode


def split_keys(ctas: int, max_len: int, num_sms: int, tile: int, resident: int | None = None) -> tuple[int, int]:
    """``(tokens_per_part, num_parts)`` for a grid of ``ctas`` CTAs over keys ``[0, max_len)``: one partition when
    the grid already fills the GPU, else partitions of whole ``tile`` multiples (at most one per
    ``_MIN_PART_TOKENS`` keys, rounded up) until it holds about ``_CTAS_PER_SM_TARGET`` CTAs per SM. No partition
    is empty. Decode and prefill split alike.

    With ``resident`` (CTAs of the kernel that one SM holds at once), a grid smaller than one wave of
    ``resident · num_sms`` CTAs is split into as many partitions as still fit in that one wave: no second, partly
    empty wave (the tensor-core decode kernel, whose CTAs each keep two tiles in flight). A grid of more than one
    wave whose last wave would hold less than half of the SMs' CTAs is split as :func:`tail_parts` says."""
    parts = 1
    most = max(1, -(-max_len // _MIN_PART_TOKENS))  # so partitions hold more than _MIN_PART_TOKENS / 2 keys
    if resident is not None:
        if 0 < ctas < resident * num_sms:
            parts = min(resident * num_sms // ctas, most)
        else:
            parts = min(tail_parts(ctas, resident * num_sms), most)
    elif 0 < ctas < _SPLIT_BELOW_CTAS_PER_SM * num_sms:
        parts = min(-(-_CTAS_PER_SM_TARGET * num_sms // ctas), most)
    return partitions(max_len, parts, tile)


def tail_parts(ctas: int, slots: int) -> int:
    """Partitions for a grid of ``ctas`` CTAs, ``slots`` of which the GPU runs at once: 1, unless the grid is
    between one wave and one and a half, whose last wave holds less than half of the slots. Equal lengths then run
    that last wave alone on a memory it cannot keep busy (H200, B64 H32/8 d128 L4096, 512 CTAs where 396 fit:
    80 % of the copy bandwidth, 90-92 % split in two or three; benchmarks/NOTES.md, session 17). Such a grid takes
    the 2 or 3 partitions whose last wave is the fuller (a whole wave counts as full); ties go to fewer."""
    if not (slots < ctas and 2 * ctas < 3 * slots):
        return 1

    def last_wave(parts: int) -> int:
        return ctas * parts % slots or slots

    return max((2, 3), key=last_wave)


def partitions(max_len: int, parts: int, tile: int) -> tuple[int, int]:
    """``(tokens_per_part, num_parts)`` of keys ``[0, max_len)`` cut into about ``parts`` partitions of whole
    ``tile`` multiples; no partition is empty."""
    per_part = -(-max_len // parts)
    tokens_per_part = max(tile, -(-per_part // tile) * tile)
    return tokens_per_part, max(1, -(-max_len // tokens_per_part))


def plan_decode(problem: _checks.DecodeProblem, num_sms: int,
                smem_per_sm: tuple[int, int] | None = None, clusters: bool = False) -> DecodeLaunch:
    """Choose the kernel and the split: one partition when the grid already fills the GPU, else split the keys.

    The split is chosen from shapes only (``max_len``, the block table's capacity), never from ``seq_lens``, so
    planning reads no device data. ``smem_per_sm`` (:func:`_smem_per_sm`) lets a split grid of the FP32 kernel cap
    its CTAs per SM (``_SPLIT_CTAS_PER_SM``); without it the kernel's shared memory alone decides. ``clusters``:
    the device launches thread block clusters, and a split grid of the FP32 kernel small enough combines its
    partitions in them (:data:`CLUSTER_COMBINE`).
    """
    p = problem
    if uses_tensor_cores(p, num_sms):
        # One CTA per (sequence, 8 or 16 query heads of a KV group, KV head) in x, KV head fastest (cta_rows in
        # paged_prefill.cu), and per partition in z.
        rows = _compile.decode_rows(p.group_size)
        ctas = p.num_seqs * -(-p.group_size // rows) * p.num_kv_heads
        resident = _compile.decode_ctas_per_sm(p.head_size, rows)
        tokens_per_part, parts = split_keys(ctas, p.max_len, num_sms, _compile.prefill_tile_keys(p.head_size, rows),
                                            resident=resident)
        bias = tensor_core_bias_mode(p.bias, p.head_size, rows)
        spec = _compile.PrefillSpec(p.dtype, p.head_size, p.kv_layout, bias, rows)
        # A reduction of one group of partitions covers the rows that hold heads (the group's, where it is smaller
        # than a tile); of several, the whole tile (paged_prefill.cu, paged_prefill_reduce).
        head_rows = min(rows, p.group_size) if _compile.reduce_vec(parts) == 4 else rows
        reduce_grid = (ctas, 1, _compile.reduce_chunks(head_rows, p.head_size, parts))
        return DecodeLaunch(spec, (ctas, 1, parts), tokens_per_part, parts, spec.threads, spec.smem_bytes,
                            reduce_grid, _compile.PREFILL_REDUCE_THREADS,
                            _longest_first(p.num_seqs, ctas * parts, resident * num_sms))
    hg = heads_per_cta(p.group_size)
    chunks = -(-p.group_size // hg)
    tokens_per_part, parts = split_keys(p.num_seqs * p.num_kv_heads * chunks, p.max_len, num_sms, _TILE_MULTIPLE)
    ctas = p.num_seqs * p.num_kv_heads * chunks
    cluster = (clusters and 1 < parts <= _compile.DECODE_CLUSTER_MAX_PARTS
               and ctas * parts <= _CLUSTER_CTAS_PER_SM * num_sms)
    spec = _compile.DecodeSpec(p.dtype, p.head_size, p.kv_layout, hg, p.bias.mode, cluster)
    smem = spec.smem_bytes
    if parts > 1 and not cluster and smem_per_sm is not None:
        smem = occupancy_smem(smem, _SPLIT_CTAS_PER_SM, smem_per_sm)
    # Unsplit grids only: the hardware starts a split grid partition by partition (blockIdx.z last), so the order
    # within each cannot change which CTAs make the last wave; ordered, the long ragged case (B8 H16 d64, 5
    # partitions, 1.6 waves) ran 0.1-0.9 % slower (benchmarks/NOTES.md, session 18). (The tensor-core kernel's ranked
    # split grids go sequence by sequence instead; not tried here: for that case's few long sequences a fluid model,
    # session 23, predicts it slower.)
    longest_first = parts == 1 and _longest_first(p.num_seqs, ctas, spec.max_ctas_per_sm * num_sms)
    return DecodeLaunch(spec, (ctas, 1, parts), tokens_per_part, parts, _THREADS, smem, (p.num_seqs, p.num_heads, 1),
                        _REDUCE_THREADS, longest_first)


# ---------------------------------------------------------------------------------------------------------------
# Launching: arguments packed once, each launch a cuLaunchKernel
# ---------------------------------------------------------------------------------------------------------------
class _PackedArgs:
    """Kernel arguments in the form ``cuLaunchKernel`` reads: one 8-byte slot per argument and the array of the
    slots' addresses. A launch then converts nothing (a CuPy ``RawKernel`` call converts every argument on every
    call); changing an argument is one item write. The slots are an ``array.array``, whose item write costs less
    than a NumPy array's (a run writes seven to nine), and which cannot move while the typed views exist."""

    def __init__(self, named: list[tuple[str, np.generic]]) -> None:
        count = max(len(named), 1)
        self.slots = array.array("Q", bytes(8 * count))
        base = self.slots.buffer_info()[0]
        self._addresses = array.array("Q", [base + 8 * i for i in range(count)])
        self.address = self._addresses.buffer_info()[0]
        raw = memoryview(self.slots).cast("B")
        # dtype -> (view, items per slot, Python type of an item); a 4-byte argument sits in its slot's low half.
        self._typed = {
            np.dtype(np.uint64): (self.slots, 1, int), np.dtype(np.int64): (raw.cast("q"), 1, int),
            np.dtype(np.int32): (raw.cast("i"), 2, int), np.dtype(np.float32): (raw.cast("f"), 2, float),
        }
        self.index = {name: i for i, (name, _) in enumerate(named)}
        for name, value in named:
            self.set(name, value)

    def set(self, name: str, value: np.generic) -> None:
        view, step, kind = self._typed[value.dtype]
        view[self.index[name] * step] = kind(value)

    def set_pointer(self, name: str, ptr: int) -> None:
        self.slots[self.index[name]] = ptr

    def launch(self, function: int, grid: tuple[int, int, int], threads: int, shared_mem: int, stream: int) -> None:
        """``cuLaunchKernel`` of ``function`` (a ``CUfunction`` of the current device) with these arguments."""
        _launch_kernel()(function, *grid, threads, 1, 1, shared_mem, stream, self.address, 0)


@functools.cache
def _launch_kernel() -> Any:
    from cupy_backends.cuda.api import driver

    return driver.launchKernel


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` whose value is an ``int`` (``value[0]``) or a cluster's dimensions (the value union is
    64 bytes, 8-byte aligned)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 3),
                ("value_pad", ctypes.c_char * 52)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def _launch_kernel_ex() -> Any:
    """The driver's ``cuLaunchKernelEx`` (CuPy wraps only ``cuLaunchKernel``), or None without it. Called with
    ready-made ctypes arguments (no ``argtypes``: nothing is converted per call)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _has_launch_ex(device: int) -> bool:
    """Whether ``device`` takes launches with programmatic dependent launch and thread block clusters (compute
    capability 9.0 and later, through ``cuLaunchKernelEx``)."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability) >= 90 and _launch_kernel_ex() is not None


class _LaunchEx:
    """A kernel launched by ``cuLaunchKernelEx`` with programmatic dependent launch after the kernel before it in
    the stream (``dependent``), in thread block clusters of ``cluster`` CTAs, or both: function, grid, block,
    dynamic shared memory, arguments and attributes fixed, one call per launch."""

    def __init__(self, function: int, grid: tuple[int, int, int], threads: int, args: _PackedArgs,
                 shared_mem: int = 0, dependent: bool = True, cluster: tuple[int, int, int] | None = None) -> None:
        values = ([(_PROGRAMMATIC_STREAM_SERIALIZATION, (1, 0, 0))] if dependent else []) + \
                 ([(_CLUSTER_DIMENSION, cluster)] if cluster is not None else [])
        self._attrs = (_LaunchAttribute * max(len(values), 1))(
            *(_LaunchAttribute(kind, b"", (ctypes.c_uint * 3)(*value)) for kind, value in values))
        self._config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), shared_mem, None,
                                     ctypes.cast(self._attrs, ctypes.POINTER(_LaunchAttribute)), len(values))
        self._call = (ctypes.byref(self._config), ctypes.c_void_p(function), ctypes.c_void_p(args.address), None)
        self._args = args  # keeps the argument slots that the call points at

    def launch(self, stream: int) -> None:
        self._config.stream = stream
        status = _launch_kernel_ex()(*self._call)
        if status != 0:
            from cupy_backends.cuda.api import driver

            raise driver.CUDADriverError(status)


def _kernel_arguments(p: _checks.DecodeProblem, launch: DecodeLaunch) -> list[tuple[str, np.generic]]:
    """The attention kernel's parameters in order, named by the operand they come from (pointers and the out
    strides are set per launch): paged_decode's, or paged_prefill's in its decode tiling, which adds the query
    rows (no query_start_loc, no tile_info: one query row per sequence), q_limit and causal. The tensor-core kernel
    reads the query element by element (q_vec 0): its address changes with every run, so 16-byte alignment cannot
    be promised."""
    i64, i32, null = np.int64, np.int32, np.uint64(0)
    q_strides = _kernel_strides(p.query)
    bias = p.bias.kernel_args()
    tc = launch.tensor_cores
    return [
        *_out_arguments(),
        ("query", null), ("query.stride_s", i64(q_strides[0])), ("query.stride_h", i64(q_strides[1])),
        *((("q_vec", i32(0)), ("query_start_loc", null), ("total_q", i32(p.num_seqs)), ("tile_info", null))
          if tc else ()),
        ("key_cache", null), ("value_cache", null), ("block_stride", i64(p.cache.block_stride)),
        ("num_blocks", i32(p.cache.num_blocks)), ("block_shift", i32(p.cache.block_size.bit_length() - 1)),
        ("num_kv_heads", i32(p.num_kv_heads)),
        ("block_tables", null), ("block_tables.stride", i64(_kernel_strides(p.block_tables)[0])),
        ("seq_lens", null), ("max_len", i32(p.max_len)), *((("q_limit", i32(1)),) if tc else ()),
        ("bias", null), ("bias.index", null), *((f"bias.stride{i}", v) for i, v in enumerate(bias[2:6])),
        ("bias.dtype", bias[6]), ("bias.n", bias[7]), ("bias.m", bias[8]),
        ("alibi_slopes", null), ("scale", np.float32(p.scale)), ("group_size", i32(p.group_size)),
        *((("causal", i32(0)),) if tc else ()),
        ("tokens_per_part", i32(launch.tokens_per_part)), ("num_parts", i32(launch.num_parts)),
        ("longest_first", i32(launch.longest_first)),
    ]


def _out_arguments() -> list[tuple[str, np.generic]]:
    """The leading parameters of every attention and reduction kernel: out, its strides, the split-K workspace."""
    null = np.uint64(0)
    return [("out", null), ("out.stride_s", np.int64(0)), ("out.stride_h", np.int64(0)), ("part_acc", null),
            ("part_ml", null)]


def _kernel_strides(arr: Any) -> tuple[int, ...]:
    """Element strides of ``arr`` as the kernel sees it: its own, or a contiguous copy's if its last stride is not 1
    (such operands are copied before each launch)."""
    strides = _checks.element_strides(arr)
    if not strides or strides[-1] == 1:
        return strides
    return _checks.contiguous_strides(tuple(arr.shape))


def _reduce_arguments(p: _checks.DecodeProblem, launch: DecodeLaunch) -> list[tuple[str, np.generic]]:
    """The split-K reduction's parameters in order: paged_prefill_reduce's or paged_decode_reduce's."""
    i32, null = np.int32, np.uint64(0)
    if launch.tensor_cores:
        rest = [("query_start_loc", null), ("total_q", i32(p.num_seqs)), ("tile_info", null),
                ("num_kv_heads", i32(p.num_kv_heads)), ("group_size", i32(p.group_size))]
    else:
        rest = [("num_heads", i32(p.num_heads))]
    return [*_out_arguments(), *rest, ("num_parts", i32(launch.num_parts))]


#: The kernel parameter each operand's address goes to (a bias kind's arrays by their names in bias_operands).
_POINTER_PARAMS = {
    "query": "query", "key_cache": "key_cache", "value_cache": "value_cache", "block_tables": "block_tables",
    "seq_lens": "seq_lens", "alibi_slopes": "alibi_slopes", "attn_bias": "bias", "attn_bias.values": "bias",
    "attn_bias.table": "bias", "attn_bias.offsets": "bias.index", "attn_bias.buckets": "bias.index",
}
#: Operands the kernels read with unit last stride (a strided one is copied first).
_UNIT_STRIDE = ("query", "block_tables", "seq_lens", "alibi_slopes", "attn_bias.offsets", "attn_bias.buckets")
#: Operands the kernels read in 16-byte vectors: their address must be a multiple of 16 (_checks.check_aligned).
_VECTOR_LOADS = ("key_cache", "value_cache")


class DecodePlan:
    """:func:`paged_attention` for repeated calls with the same shapes: everything decided once.

    The constructor takes example arrays (the arguments of :func:`paged_attention`), checks them as
    :func:`paged_attention` does, compiles or fetches the kernel, chooses the split and allocates the split-K
    workspace (a split combined by the reduction kernel needs one; one combined in thread block clusters, see
    :data:`CLUSTER_COMBINE`, does not). :meth:`run` then takes arrays of the same dtypes, shapes, strides and device
    (any data, any addresses, the caches' 16-byte aligned), compares those cheaply and launches: no allocation (with
    ``out=``), no host synchronisation, no read of device data. :func:`paged_attention` is this class used once.

    A plan owns one workspace: run it on one stream at a time (one plan per stream or thread). CUDA-graph capture
    of :meth:`run` works (build the plan before the capture). PyTorch and CuPy arrays take the fast path; JAX arrays
    are imported through DLPack on every run.

    Parameters
    ----------
    query, key_cache, value_cache, block_tables, seq_lens, scale, attn_bias, alibi_slopes, kv_layout
        As in :func:`paged_attention`. ``scale``, ``kv_layout``, the bias kind (with a RelativePositionBias's
        geometry) and whether ALiBi is used are fixed by the plan.

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
    ) -> None:
        named = _operands(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, alibi_slopes)
        framework = _interop.common_framework(named, optional=("attn_bias", "alibi_slopes"))
        if framework == "numpy":
            raise TypeError("query: a DecodePlan launches GPU kernels; NumPy arrays run through paged_attention")
        device = _interop.device_of("query", query, framework)
        with _interop.launch_context(framework, device, None) as stream:
            arr = _interop.wrap_all(named, framework)
            problem = _check_wrapped(arr, attn_bias, scale, kv_layout)
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
        self._launch = launch = plan_decode(problem, _num_sms(device), _smem_per_sm(device),
                                            clusters=CLUSTER_COMBINE and _has_launch_ex(device))
        if isinstance(launch.spec, _compile.PrefillSpec):
            kernel, reduce_kernel, _ = _compile.get_prefill_kernels(launch.spec, device)
        else:
            kernel, reduce_kernel = _compile.get_decode_kernels(launch.spec, device, launch.shared_mem)
        with _interop.on_device(device):  # CuPy holds a CUfunction per device
            self._function, self._reduce_function = kernel.kernel.ptr, reduce_kernel.kernel.ptr
        self._args = _PackedArgs(_kernel_arguments(problem, launch))
        self._reduce_args = _PackedArgs(_reduce_arguments(problem, self._launch))
        # Per operand: its argument slot, and whether it needs unit last stride / 16-byte alignment (_point_at).
        self._operand_slots = {name: (self._args.index[param], name in _UNIT_STRIDE, name in _VECTOR_LOADS)
                               for name, param in _POINTER_PARAMS.items()}
        both = (self._args, self._reduce_args)
        self._out_slots = [(a.slots, a.index["out"]) for a in both]
        self._workspace_slots = [(a.slots, a.index["part_acc"], a.index["part_ml"]) for a in both]
        _, num_heads, head_size = self._query.shape
        self._result_strides = (num_heads * head_size, head_size)  # a result of _new_out, contiguous
        # The launches that go through cuLaunchKernelEx (None: a plain cuLaunchKernel): a split grid's, as a
        # programmatic dependent of the kernel before it; the reduction, as one of the attention kernel; a grid
        # that combines its partitions in clusters, always (its clusters are a launch attribute).
        dependent = launch.num_parts > 1 and _has_launch_ex(device)
        self._reduce_launch = None
        if launch.reduces and dependent and DEPENDENT_REDUCE:
            self._reduce_launch = _LaunchEx(self._reduce_function, launch.reduce_grid, launch.reduce_threads,
                                            self._reduce_args)
        self._attention_launch = None
        if launch.cluster or (dependent and DEPENDENT_ATTENTION):
            self._attention_launch = _LaunchEx(self._function, launch.grid, launch.threads, self._args,
                                               launch.shared_mem, dependent=dependent and DEPENDENT_ATTENTION,
                                               cluster=(1, 1, launch.num_parts) if launch.cluster else None)
        self._workspace = None
        self._owns_workspace = own_workspace
        self._out_strides: tuple[int, ...] = ()  # the out strides the packed arguments hold
        if launch.reduces and own_workspace:
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
    def launch(self) -> DecodeLaunch:
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
        out: Any = None,
        stream: Any = None,
    ) -> Any:
        """Attention for arrays like the plan's; returns ``out``, or a new array in the query's framework.

        Each array must match the one the plan was built from in dtype, shape, strides and device; ``attn_bias``
        must be of the same kind and geometry (its arrays matching likewise) and ``alibi_slopes`` given iff it was.
        ``out`` is like ``query`` (last dimension contiguous, other strides free). ``stream`` as in
        :func:`paged_attention`. Raises ValueError naming the first argument that does not match (or a cache not
        16-byte aligned); TypeError for ``out`` with JAX arrays or of another framework.
        """
        named = _operands(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, alibi_slopes)
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
                  "attn_bias.offsets": problem.bias.index}
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
        if self._launch.reduces and not self._owns_workspace:
            workspace = self._new_workspace(like, launch_stream)
        for slots, slot in self._out_slots:
            slots[slot] = out_ptr
        if out_strides[:2] != self._out_strides:
            self._out_strides = tuple(out_strides[:2])
            for args in (self._args, self._reduce_args):
                args.set("out.stride_s", np.int64(out_strides[0]))
                args.set("out.stride_h", np.int64(out_strides[1]))
        launch = self._launch
        if self._attention_launch is not None:
            self._attention_launch.launch(launch_stream.ptr)
        else:
            self._args.launch(self._function, launch.grid, launch.threads, launch.shared_mem, launch_stream.ptr)
        if launch.reduces:
            if self._reduce_launch is not None:
                self._reduce_launch.launch(launch_stream.ptr)
            else:
                self._reduce_args.launch(self._reduce_function, launch.reduce_grid, launch.reduce_threads, 0,
                                         launch_stream.ptr)
        del workspace  # queued: the stream-ordered pool may reuse it
        return _interop.finish(self._framework, result)


# paged_attention's plans, per thread (a plan's packed arguments are written by each call). A plan of a call with
# torch or CuPy arrays is keyed by everything that decides it and its checks: the operands' types and signatures
# (dtype, shape, strides in elements, device), scale, kv_layout, the bias's kind and geometry, the device's SMs and
# this module's launch switches. A call whose key is there skips the checks: the call that made the plan passed
# them with the same key, and none of them reads data or addresses but the caches' alignment, which _point_at
# checks on every call. Other frameworks' plans (JAX, DLPack producers) are keyed by the checked problem. The plans
# hold no device memory: a call's split-K workspace is its own, allocated on its stream.
_PLANS = threading.local()
_MAX_PLANS_PER_THREAD = 64
_NATIVE = {"torch": "torch", "cupy": "cupy"}  # the top-level module of an operand's type -> signature's kind


def _plan_key(named: dict[str, Any], scale: Any, kv_layout: Any,
              attn_bias: Any) -> tuple[tuple[Any, ...], dict[str, tuple[Any, ...]], DecodePlan | None] | None:
    """paged_attention's key for operands ``named`` (as :func:`_operands` names them) of torch or CuPy, their
    signatures and this thread's plan of that key (None if it has none yet); None for other frameworks, or
    operands that a signature cannot read (the checks then name them)."""
    kind = _NATIVE.get(type(named["query"]).__module__.partition(".")[0])
    if kind is None:
        return None
    try:
        signatures = _interop.signatures(named, kind)
        device = signatures["query"][3]
        if device < 0:  # a torch tensor on the CPU
            return None
        key = (kind, tuple(map(type, named.values())), tuple(signatures.values()), type(scale), scale, kv_layout,
               _checks.bias_geometry(attn_bias), _num_sms(device), TENSOR_CORE_MIN_GROUP, TENSOR_CORE_MHA,
               DEPENDENT_REDUCE, DEPENDENT_ATTENTION, LONGEST_FIRST, CLUSTER_COMBINE)
        plan = _PLANS.__dict__.get("plans", {}).get(key)  # hashes the key: an unhashable scale or layout raises
    except (AttributeError, TypeError):  # not an array of the query's framework; an unhashable scale or layout
        return None
    return key, signatures, plan


def _problem_key(problem: _checks.DecodeProblem, framework: str, device: int) -> tuple[Any, ...]:
    """The key of a checked problem's plan: everything a plan fixes."""
    p, b = problem, problem.bias
    return (
        framework, device, _num_sms(device), TENSOR_CORE_MIN_GROUP, TENSOR_CORE_MHA, DEPENDENT_REDUCE,
        DEPENDENT_ATTENTION, LONGEST_FIRST, CLUSTER_COMBINE, p.dtype, p.head_size, p.kv_layout, p.num_seqs,
        p.num_heads, p.num_kv_heads, p.max_len, p.scale, _kernel_strides(p.query), _kernel_strides(p.block_tables),
        dataclasses.astuple(p.cache), b.mode, b.strides, b.dtype, b.n, b.m, p.alibi_slopes is None,
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


def host_bias(bias: _checks.CheckedBias, attn_bias: Any) -> _checks.CheckedBias:
    """``bias`` with its index array (a RaggedBias's offsets, a RelativePositionBias's buckets) copied to the host
    from the caller's ``attn_bias``, for the checks of device data (``validate=True``)."""
    index = {"ragged": "offsets", "t5": "buckets"}.get(bias.mode)
    return bias if index is None else dataclasses.replace(bias, index=reference.to_numpy(getattr(attn_bias, index)))


def _check_wrapped(arr: dict[str, Any], attn_bias: Any, scale: Any, kv_layout: Any) -> _checks.DecodeProblem:
    """check_decode on the wrapped operands (``arr``, named as :func:`_operands` names them, ``out`` optional)."""
    return _checks.check_decode(
        arr["query"], arr["key_cache"], arr["value_cache"], arr["block_tables"], arr["seq_lens"],
        scale=scale, attn_bias=attn_bias, alibi_slopes=arr.get("alibi_slopes"), kv_layout=kv_layout,
        out=arr.get("out"), bias_arrays={k: v for k, v in arr.items() if k.startswith("attn_bias")},
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
    accumulation run in float32 whatever the storage dtype. Grouped-query float16 / bfloat16 decode (two or more
    query heads per KV head, head sizes up to 128) runs on the tensor cores, which round the softmax weights to the
    storage dtype before they multiply ``v`` (as FlashAttention does); the rest runs an FP32 kernel. The bias is
    added after scaling, as in vLLM, xformers
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
        ``scale``; all arrays on one device; a torch tensor on the CPU. On the NumPy path (and with
        ``validate=True``) also the data: seq_lens within ``[0, max_blocks_per_seq * block_size]`` (and ``<= L``
        with a dense bias), the used block ids within ``[0, num_blocks)``, and a RaggedBias's rows of every
        sequence within ``values``.
    NotImplementedError
        A head_size or block_size outside the supported sets; a dense bias or RaggedBias values whose keys lie
        2**31 bytes or more apart (the kernels step from key to key by a 32-bit byte count).
    RuntimeError
        Kernel compilation failed (with the NVRTC log), or NVRTC / CUDA headers are missing (naming the extra).

    Notes
    -----
    On the GPU, device data is not read on the host unless ``validate=True`` (that costs a sync): a ``seq_lens``
    entry outside its range is clamped to ``[0, max_len]``, a key whose block id lies outside the cache is
    skipped, and a sequence whose RaggedBias rows lie outside ``values`` is cut short, so no input can make the
    kernel read or write out of bounds.

    Calls are planned once per thread and set of operand signatures (dtype, shape, strides, device of each array)
    and other arguments: a repeated call with torch or CuPy arrays runs the cached :class:`DecodePlan` without
    checking its arguments again (a different signature is checked in full, as on a first call).
    """
    operands = _operands(query, key_cache, value_cache, block_tables, seq_lens, attn_bias, alibi_slopes)
    keyed = _plan_key(operands, scale, kv_layout, attn_bias)
    if keyed is not None and keyed[2] is not None and not validate:
        return keyed[2]._run_native(operands, out, query, stream, keyed[1])
    named = {**operands, "out": out}
    framework = _interop.call_framework(named, ("attn_bias", "alibi_slopes", "out"), stream=stream, out=out)
    if framework == "numpy":
        result = reference.paged_attention_ref(
            query, key_cache, value_cache, block_tables, seq_lens,
            scale=scale, attn_bias=attn_bias, alibi_slopes=alibi_slopes, kv_layout=kv_layout, out=out,
        )
        return result if out is not None else result.astype(query.dtype)

    device = _interop.device_of("query", query, framework)
    with _interop.launch_context(framework, device, stream) as launch_stream:
        arr = _interop.wrap_all(named, framework)
        problem = _check_wrapped(arr, attn_bias, scale, kv_layout)
        if validate:
            host = dataclasses.replace(
                problem, seq_lens=reference.to_numpy(seq_lens), block_tables=reference.to_numpy(block_tables),
                bias=host_bias(problem.bias, attn_bias),
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
