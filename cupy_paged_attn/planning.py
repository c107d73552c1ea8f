"""Which kernel, tiling, grid and split a call runs: decided from shapes and dtypes alone, never from device data.

``plan_decode`` and ``plan_prefill`` take a problem's shape (:class:`DecodeShape`, :class:`PrefillShape`; a checked
call builds them from its arguments), the GPU's facts (:class:`Device`) and the switches of
:mod:`cupy_paged_attn.tuning`, and return the launch: the kernel specialisation, its grid and how the keys are split
into partitions. Nothing here touches a GPU, so ``python -m cupy_paged_attn info`` and the tests can ask about any
shape on any machine::

    from cupy_paged_attn import planning
    shape = planning.DecodeShape(num_seqs=64, num_heads=32, num_kv_heads=8, head_size=128, max_len=4096)
    launch = planning.plan_decode(shape, planning.Device.h200())
    launch.spec.key, launch.grid, launch.num_parts    # 'decode_mma_bf16_d128_nhd_r8_bias-none', (512, 1, 3), 3

Why each rule holds (with the measurements behind it) is in docs/performance.md: "Split-K", "Longest first",
"Tensor-core decode" and "Bias staging".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _specs
from . import tuning as _tuning
from ._specs import DecodeMmaSpec, DecodeSimtSpec, PrefillSpec

__all__ = [
    "DecodeLaunch", "DecodeShape", "Device", "PrefillLaunch", "PrefillShape", "plan_decode", "plan_prefill",
    "split_keys",
]

# A split-K partition holds more than half this many keys. 128 rather than 256: in the latency case (B1 H16 d64
# L1024) 8 partitions instead of 4 cost the same without a bias and less with one (H200: dense 11.8 -> 11.4 us, T5
# 12.5 -> 11.9).
_MIN_PART_TOKENS = 128
_SPLIT_BELOW_CTAS_PER_SM = 2  # fewer CTAs than this per SM cannot hide memory latency: split the keys
_CTAS_PER_SM_TARGET = 4  # then split until the grid holds about this many CTAs per SM
# A split grid of the SIMT decode runs at most this many CTAs per SM, though one query head per CTA leaves
# registers for four (DecodeLayout::kMinCtas): it asks for enough shared memory that a fourth does not fit. H200,
# B8 H16 d64 L4096-131072 (5 partitions): 569.6 -> 534.5 us without a bias, 611.4 -> 566.1 dense; unsplit grids are
# faster at four (B64 d64 L2048: 137.3 -> 133.1 us).
_SPLIT_CTAS_PER_SM = 3
# A split grid of the SIMT decode combines its partitions in clusters only where it holds at most this many CTAs per
# SM on average: one keeps the grid in one wave whatever the GPCs' sizes (a cluster's CTAs share a GPC); at two per
# SM (B1 H32 d64 L1024, 256 CTAs) a dense bias ran 10.7 -> 13.8 us.
_CLUSTER_CTAS_PER_SM = 1
# Grouped-query decode runs on the tensor cores from this group size up: the SIMT loop costs ~80 instructions per
# (token, query head).
_TENSOR_CORE_MIN_GROUP = 2


@dataclass(frozen=True)
class Device:
    """What planning needs to know of a GPU. :func:`cupy_paged_attn._device.query` reads a real one.

    ``launch_ex``: the driver has ``cuLaunchKernelEx`` (programmatic dependent launch and clusters go through it).
    """

    num_sms: int
    smem_per_sm: int = 233472  # bytes of shared memory of one SM (an H100 / H200's 228 KB)
    reserved_smem_per_cta: int = 1024  # what CUDA reserves of it per resident CTA
    compute_capability: int = 90
    launch_ex: bool = True

    @classmethod
    def h200(cls) -> Device:
        """An H200 (or H100 SXM): 132 SMs of compute capability 9.0."""
        return cls(132)

    @property
    def clusters(self) -> bool:
        """Thread block clusters can be launched (compute capability 9.0 and later)."""
        return self.compute_capability >= 90 and self.launch_ex

    @property
    def dependent_launch(self) -> bool:
        """Programmatic dependent launch is available (compute capability 9.0 and later)."""
        return self.compute_capability >= 90 and self.launch_ex

    @property
    def sm90a(self) -> bool:
        """The device runs sm_90a code (wgmma): compute capability 9.0 exactly (H100, H200)."""
        return self.compute_capability == 90


@dataclass(frozen=True)
class DecodeShape:
    """What planning reads of a decode call: shapes and dtypes, no data.

    ``bias`` is the bias kind (``"none"``, ``"dense"``, ``"ragged"``, ``"t5"``) and ``bias_dtype`` its elements'
    dtype. ``bias_strides`` are the kernels' four bias strides in elements (dense: sequence, head, query row, key;
    ragged: row, head, 0, 0); None means a C-ordered bias (dense ``[num_seqs, num_heads, max_len]``, ragged
    ``[total, num_heads]``). ``t5_max_distance`` is a T5 bias's ``max_distance``. ``window_left``: a sliding window
    (None: none); the split then cuts the window's keys, not ``max_len``. ``soft_cap``: the call has a logit soft-cap.
    Either option runs the kernels compiled with the score options (``score_options``). ``kv_cache``: the caches'
    fp8 format (``"fp8_e4m3"``, ``"fp8_e5m2"``), None when they hold ``dtype`` (grouped queries over fp8 caches always
    run the tensor-core decode where its head sizes allow).
    """

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_len: int  # most keys a sequence can have (the block table's capacity)
    dtype: str = "bf16"  # "f32" | "f16" | "bf16"
    kv_layout: str = "nhd"
    bias: str = "none"
    bias_dtype: str = "bf16"
    bias_strides: tuple[int, int, int, int] | None = field(default=None)
    t5_max_distance: int = 0
    window_left: int | None = None
    soft_cap: bool = False
    kv_cache: str | None = None

    @property
    def score_options(self) -> bool:
        """The kernels compiled with the score options (soft-cap, sliding window) run this call."""
        return self.soft_cap or self.window_left is not None

    @property
    def window(self) -> int | None:
        """The sliding window where it masks a key (:func:`masking_window`)."""
        return masking_window(self.window_left, self.max_len)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def strides(self) -> tuple[int, int, int, int]:
        """The bias strides, C-ordered ones where none were given."""
        if self.bias_strides is not None:
            return self.bias_strides
        if self.bias == "dense":
            return (self.num_heads * self.max_len, self.max_len, 0, 1)
        if self.bias == "ragged":
            return (self.num_heads, 1, 0, 0)
        return (0, 0, 0, 0)


@dataclass(frozen=True)
class PrefillShape(DecodeShape):
    """What planning reads of a prefill call: a decode shape's fields plus the query rows of all sequences and
    whether keys after a query are masked."""

    total_q: int = 0
    causal: bool = False


# ---------------------------------------------------------------------------------------------------------------
# The split of the keys
# ---------------------------------------------------------------------------------------------------------------
def split_keys(ctas: int, max_len: int, num_sms: int, tile: int, resident: int | None = None) -> tuple[int, int]:
    """``(tokens_per_part, num_parts)`` for a grid of ``ctas`` CTAs over keys ``[0, max_len)``: one partition when
    the grid already fills the GPU, else partitions of whole ``tile`` multiples (at most one per
    ``_MIN_PART_TOKENS`` keys, rounded up) until it holds about ``_CTAS_PER_SM_TARGET`` CTAs per SM. No partition
    is empty. Decode and prefill split alike.

    With ``resident`` (CTAs of the kernel that one SM holds at once), a grid smaller than one wave of
    ``resident · num_sms`` CTAs is split into as many partitions as still fit in that one wave: no second, partly
    empty wave (the tensor-core decode, whose CTAs each keep two tiles in flight). A grid of more than one wave whose
    last wave would hold less than half of the SMs' CTAs is split as :func:`tail_parts` says."""
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


def masking_window(window_left: int | None, max_len: int) -> int | None:
    """``window_left`` where it masks a key: below ``max_len``. A wider window masks nothing: None, as for no window
    (planning then chooses as without one, and the kernels get none)."""
    return window_left if window_left is not None and window_left < max_len else None


def window_keys(shape: DecodeShape, tile: int, span: int = 1) -> int:
    """The most keys one CTA's rows can see: ``max_len``, or with a sliding window ``w`` the window (``w`` keys
    before the first of the CTA's ``span`` query positions, through the last) plus the ``tile - 1`` keys before it
    that the kernels' first tile starts with (they start on a multiple of ``tile``). Prefill without ``causal`` sees
    every key from the window's first on."""
    w = shape.window
    if w is None or (isinstance(shape, PrefillShape) and not shape.causal):
        return shape.max_len
    return min(shape.max_len, w + span + tile - 1)


def tail_parts(ctas: int, slots: int) -> int:
    """Partitions for a grid of ``ctas`` CTAs, ``slots`` of which the GPU runs at once: 1, unless the grid is
    between one wave and one and a half, whose last wave holds less than half of the slots. Equal lengths then run
    that last wave alone on a memory it cannot keep busy (H200, B64 H32/8 d128 L4096, 512 CTAs where 396 fit:
    80 % of the copy bandwidth, 90-92 % split in two or three). Such a grid takes the 2 or 3 partitions whose last
    wave is the fuller (a whole wave counts as full); ties go to fewer."""
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


def occupancy_smem(smem: int, ctas_per_sm: int, device: Device) -> int:
    """Dynamic shared memory to ask for so that at most ``ctas_per_sm`` CTAs fit on one SM: ``smem`` (what the
    kernel needs), or more when ``ctas_per_sm + 1`` CTAs of ``smem`` bytes would fit."""
    per_sm, reserved = device.smem_per_sm, device.reserved_smem_per_cta
    cap = -(-(per_sm // (ctas_per_sm + 1) - reserved + 1) // 128) * 128  # the least that keeps one more CTA out
    return max(smem, cap) if ctas_per_sm * (cap + reserved) <= per_sm else smem


def longest_first(num_seqs: int, ctas: int, slots: int, tuning: _tuning.Tuning) -> bool:
    """Whether a grid of ``ctas`` CTAs in all (every partition's), ``slots`` of which the SMs hold at once, takes
    its sequences longest first (``seq_of_rank``, longest_first.cuh): 2 to 256 sequences, more than one wave. The
    hardware starts CTAs in index order, so the last wave then holds the shortest sequences and the grid ends
    evenly; only a grid of more than one wave gains from the order."""
    return tuning.longest_first and 2 <= num_seqs <= _specs.MAX_LONGEST_FIRST_SEQS and ctas > slots


# ---------------------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeLaunch:
    """How one decode problem is launched, all decided by :func:`plan_decode` (a run only reads it): kernel
    specialisation (the SIMT decode, or the tensor-core decode tiling), grid, threads and dynamic shared memory, key
    partitioning, and the split-K combine's grid and threads, which a grid that combines its partitions in clusters
    (``spec.cluster``) does not launch. Partition p holds keys ``[p·tokens_per_part, (p + 1)·tokens_per_part)``,
    except in a split tensor-core grid taken ``longest_first``, which cuts each sequence's own length into
    ``num_parts`` runs of whole tiles (at most ``tokens_per_part`` keys each). ``dependent``: a split grid is
    launched as a programmatic dependent of the kernel before it, and its combine of it."""

    spec: DecodeSimtSpec | DecodeMmaSpec
    grid: tuple[int, int, int]
    tokens_per_part: int
    num_parts: int
    threads: int
    shared_mem: int
    combine_grid: tuple[int, int, int]
    combine_threads: int
    longest_first: bool = False
    dependent: bool = False

    @property
    def tensor_cores(self) -> bool:
        return isinstance(self.spec, DecodeMmaSpec)

    @property
    def cluster(self) -> bool:
        """Whether the partitions are combined in thread block clusters of ``(1, 1, num_parts)``."""
        return isinstance(self.spec, DecodeSimtSpec) and self.spec.cluster

    @property
    def combines(self) -> bool:
        """Whether a run launches the split-K combine after the attention kernel (and needs its workspace)."""
        return self.num_parts > 1 and not self.cluster


def heads_per_cta(group_size: int) -> int:
    """Query heads one SIMT decode CTA serves: the group (num_heads // num_kv_heads), rounded up to 1/2/4/8, at most
    8."""
    return next(g for g in _specs.HEADS_PER_CTA if g >= min(group_size, _specs.HEADS_PER_CTA[-1]))


def uses_tensor_cores(shape: DecodeShape, num_sms: int, tuning: _tuning.Tuning) -> bool:
    """Whether :func:`plan_decode` runs ``shape`` on the tensor cores of a device of ``num_sms`` SMs: float16 /
    bfloat16 (caches of the query's dtype or fp8) of a head size up to 128 with grouped queries, or multi-head
    queries whose grid fills the GPU unsplit (a wave of its CTAs or more, and no tail split: :func:`tail_parts`) and
    whose bias is not ragged (the tile's copy of one head's bias per key cost more: B64 H16 d64 L2048 136.9 -> 140.3
    us; split grids ran slower too: B8 H16 d64 L∈[4096, 131072] in 3 partitions 548 -> 712 us, the latency case 7.7
    -> 8.3 us)."""
    if shape.dtype not in ("f16", "bf16") or shape.head_size not in _specs.DECODE_MMA_HEAD_SIZES:
        return False
    if tuning.decode_kernel != "auto":  # (grouped queries over fp8 caches have no SIMT kernel here: fp8_simt_heads)
        return tuning.decode_kernel == "tensor-cores" or (shape.kv_cache is not None and shape.group_size > 1)
    if shape.group_size >= _TENSOR_CORE_MIN_GROUP:
        return True
    if not (tuning.multi_head_tensor_cores and shape.bias != "ragged"):
        return False
    ctas = shape.num_seqs * shape.num_kv_heads  # (one CTA per sequence and head, unsplit)
    slots = _specs.decode_ctas_per_sm(shape.head_size, _specs.decode_rows(1)) * num_sms
    return ctas >= slots and tail_parts(ctas, slots) == 1


def tensor_core_bias_mode(shape: DecodeShape, rows: int) -> str:
    """The tensor-core decode's specialisation for ``shape``'s bias. A bias whose elements of one tile lie side by
    side is copied into shared memory with each tile's K and V (StagedBias in decode_mma.cu): a dense one whose keys
    are adjacent (``"dense-rows"``, a row of keys per query head), a ragged one whose heads are adjacent and whose
    keys lie a multiple of 16 bytes apart (``"ragged-rows"``, the CTA's heads per key: values of 8, 16, ... heads in
    16 bits, 4, 8, ... in float32). Any other is the bias's own mode, read element by element a few tiles ahead.
    Decided from dtype and strides only (the arrays may sit at any address), where the stages fit beside ``rows``
    rows of the head size with room for the bias's elements (_specs.decode_bias_fits: a float32 bias takes twice
    the room of a 16-bit one)."""
    staged = shape.bias
    strides = shape.strides
    size = 4 if shape.bias_dtype == "f32" else 2
    if shape.bias == "dense" and strides[3] == 1:
        staged = "dense-rows"
    elif shape.bias == "ragged" and strides[1] == 1 and strides[0] > 0 and strides[0] * size % 16 == 0:
        staged = "ragged-rows"
    fp8 = shape.kv_cache is not None
    return staged if _specs.decode_bias_fits(staged, shape.head_size, rows, fp8, element_bytes=size) else shape.bias


def plan_decode(shape: DecodeShape, device: Device, tuning: _tuning.Tuning | None = None) -> DecodeLaunch:
    """Choose the kernel and the split: one partition when the grid already fills the GPU, else split the keys.

    The split is chosen from shapes only (``max_len``, the block table's capacity), never from ``seq_lens``, so
    planning reads no device data. A split grid of the SIMT kernel caps its CTAs per SM (``_SPLIT_CTAS_PER_SM``) by
    asking for more shared memory; one small enough combines its partitions in clusters where the device can.
    ``tuning``: default, the switches in force (:func:`cupy_paged_attn.tuning.current`).
    """
    t = _tuning.current() if tuning is None else tuning
    p = shape
    num_sms = t.num_sms or device.num_sms
    dependent = t.dependent_launch and device.dependent_launch
    if uses_tensor_cores(p, num_sms, t):
        # One CTA per (sequence, 8 or 16 query heads of a KV group, KV head) in x, KV head fastest (cta_rows in
        # tile_rows.cuh), and per partition in z.
        rows = _specs.decode_rows(p.group_size)
        ctas = p.num_seqs * -(-p.group_size // rows) * p.num_kv_heads
        resident = _specs.decode_ctas_per_sm(p.head_size, rows)
        tile = _specs.tile_keys(p.head_size, rows)
        tokens_per_part, parts = split_keys(ctas, window_keys(p, tile), num_sms, tile, resident=resident)
        spec = DecodeMmaSpec(p.dtype, p.head_size, p.kv_layout, tensor_core_bias_mode(p, rows), rows,
                             p.score_options, p.kv_cache)
        # A combine of few partitions (one group) covers the rows that hold heads (the group's, where it is smaller
        # than a tile); of several, the whole tile (tile_combine in split_k.cuh).
        head_rows = min(rows, p.group_size) if _specs.combine_vec(parts) == 4 else rows
        combine_grid = (ctas, 1, _specs.combine_chunks(head_rows, p.head_size, parts))
        return DecodeLaunch(spec, (ctas, 1, parts), tokens_per_part, parts, spec.threads, spec.smem_bytes,
                            combine_grid, _specs.COMBINE_THREADS,
                            p.window is None and longest_first(p.num_seqs, ctas * parts, resident * num_sms, t),
                            dependent and parts > 1)
    hg = heads_per_cta(p.group_size)
    chunks = -(-p.group_size // hg)
    ctas = p.num_seqs * p.num_kv_heads * chunks
    tokens_per_part, parts = split_keys(ctas, window_keys(p, _specs.DECODE_SIMT_TILE_MULTIPLE), num_sms,
                                        _specs.DECODE_SIMT_TILE_MULTIPLE)
    # (The kernels with the score options combine through decode_simt_combine: clusters of them would add 1,296
    # specialisations to the compile sweep for a path that saves microseconds on small split grids.)
    cluster = (t.cluster_combine and device.clusters and 1 < parts <= _specs.DECODE_CLUSTER_MAX_PARTS
               and ctas * parts <= _CLUSTER_CTAS_PER_SM * num_sms and not p.score_options and not p.kv_cache)
    spec = DecodeSimtSpec(p.dtype, p.head_size, p.kv_layout, hg, p.bias, cluster, p.score_options, p.kv_cache)
    smem = spec.smem_bytes
    if parts > 1 and not cluster:
        smem = occupancy_smem(smem, _SPLIT_CTAS_PER_SM, device)
    # Unsplit grids only: the hardware starts a split grid partition by partition (blockIdx.z last), so the order
    # within each cannot change which CTAs make the last wave; ordered, the long ragged case (B8 H16 d64, 5
    # partitions, 1.6 waves) ran 0.1-0.9 % slower. (The tensor-core decode's ranked split grids go sequence by
    # sequence instead; for that case's few long sequences a fluid model of the waves predicts it slower here.)
    # (Not with a sliding window: the kernel's ranking reads the first keys' block ids before it knows the window.)
    ordered = (parts == 1 and p.window is None
               and longest_first(p.num_seqs, ctas, spec.max_ctas_per_sm * num_sms, t))
    return DecodeLaunch(spec, (ctas, 1, parts), tokens_per_part, parts, spec.threads, smem,
                        (p.num_seqs, p.num_heads, 1), _specs.DECODE_COMBINE_THREADS, ordered, dependent and parts > 1)


# ---------------------------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillLaunch:
    """How one prefill problem is launched: kernel specialisation, M tiles and key partitioning. ``num_tiles`` is
    grid.x, an upper bound of Σ_s ceil(q_len_s · G / rows) from shapes only (the plan kernel maps tiles to
    sequences on the device; spare tiles exit at once)."""

    spec: PrefillSpec
    num_tiles: int
    tokens_per_part: int
    num_parts: int

    @property
    def rows(self) -> int:
        """Packed (query token, query head) rows per CTA: its M tile."""
        return self.spec.rows


def t5_table_fits(shape: DecodeShape) -> bool:
    """Whether every prefill CTA's T5 table fits in shared memory (prefill.cu, use_rel): G·(2·(max_distance + key
    tile + span) + 1) floats of at most REL_TABLE, where span bounds the positions of a CTA's rows. The Hopper
    tiling has no per-logit path for the others (they run on the mma.sync tiling)."""
    g, n = shape.group_size, shape.t5_max_distance
    span = (_specs.prefill_rows_per_cta(shape.dtype, shape.head_size) - 1) // g + 1
    tile = _specs.tile_keys(shape.head_size, wgmma=True)
    return n <= _specs.REL_TABLE and g * (2 * (n + tile + span) + 1) <= _specs.REL_TABLE


def plan_prefill(shape: PrefillShape, device: Device, tuning: _tuning.Tuning | None = None) -> PrefillLaunch:
    """Choose the kernel, the number of M tiles and the split, from shapes only (no device data is read).

    Sequence ``s`` needs ``ceil(q_len_s · G / rows)`` tiles of ``rows`` packed (token, head) rows (128 on the
    tensor cores up to head size 128, else 64); over all sequences that is at most ``ceil(total_q · G / rows) +
    num_seqs``, the grid's x. When the tiles that surely hold rows cannot fill the GPU, the keys are split into
    partitions (a multiple of the kernel's key tile), combined by the combine kernel. On a device that runs sm_90a
    code the Hopper tiling is used where it applies: 16-bit dtypes, head sizes 64 and 128, no bias or a T5 bias
    whose table fits (same rows per CTA).
    """
    t = _tuning.current() if tuning is None else tuning
    p = shape
    wgmma = (t.wgmma and device.sm90a and p.dtype != "f32" and p.head_size in _specs.WGMMA_HEAD_SIZES
             and p.bias in _specs.WGMMA_BIAS_MODES and (p.bias != "t5" or t5_table_fits(p)))
    rows = _specs.prefill_rows_per_cta(p.dtype, p.head_size)
    full_tiles = -(-p.total_q * p.group_size // rows)
    tile = _specs.tile_keys(p.head_size, wgmma=wgmma)
    span = (rows - 1) // p.group_size + 1  # query positions of one CTA
    tokens_per_part, parts = split_keys(max(1, full_tiles * p.num_kv_heads), window_keys(p, tile, span),
                                        t.num_sms or device.num_sms, tile)
    spec = PrefillSpec(p.dtype, p.head_size, p.kv_layout, p.bias, wgmma=wgmma, scores=p.score_options)
    return PrefillLaunch(spec, full_tiles + p.num_seqs, tokens_per_part, parts)
