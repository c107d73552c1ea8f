"""The kernels' specialisations: what each kernel of ``kernels_cu/`` needs at compile time, its readable key, its
NVRTC name expressions, and the host's mirrors of its geometry (threads, shared memory, tiles, CTAs per SM).

A specialisation's key, e.g. ``decode_mma_bf16_d128_nhd_r8_bias-dense-rows``, names the cached kernel, the log line
and the test id. Every mirror here has a ``static_assert`` twin compiled by the tests (``test_kernel_sources.py``),
so host and kernel cannot drift apart unnoticed.

Kernel families (one ``.cu`` file each):

=====================  ===================  =========================================================================
spec                   source               kernels
=====================  ===================  =========================================================================
DecodeSimtSpec         decode_simt.cu       ``decode_simt`` (float32 arithmetic on the CUDA cores), its combine
DecodeMmaSpec          decode_mma.cu        ``decode_mma`` (the tensor-core decode tiling), ``tile_combine``
PrefillSpec            prefill.cu           ``prefill_mma`` (mma.sync) or ``prefill_simt`` (float32), ``tile_combine``,
                       prefill_wgmma.cu     ``prefill_plan``; or ``prefill_wgmma`` (Hopper) with the same two
CacheWriteSpec         cache_write.cu       ``reshape_and_cache``
CacheDequantizeSpec    cache_dequantize.cu  ``dequantize_pages`` (prefill over fp8 caches)
=====================  ===================  =========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

#: Storage dtypes by short name, with the CUDA type that holds them.
CUDA_TYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16"}
#: fp8 cache formats (``kv_cache_dtype``), with the CUDA type of their elements (common.cuh).
FP8_TYPES = {"fp8_e4m3": "cpa::Fp8E4M3", "fp8_e5m2": "cpa::Fp8E5M2"}
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
#: Head sizes of fp8 caches on the GPU: whole 16-byte vectors of one-byte elements.
FP8_HEAD_SIZES = tuple(d for d in HEAD_SIZES if d % 16 == 0)
#: Query dtypes of fp8 caches on the GPU (a float32 query with an fp8 cache runs on the NumPy path only: its 2,304
#: more specialisations would not fit the compile sweep into CI's time).
FP8_QUERY_DTYPES = ("f16", "bf16")
#: Page sizes: any power of two up to 256 (a run-time parameter of the kernels, not a specialisation).
BLOCK_SIZES = tuple(2**i for i in range(9))
KV_LAYOUTS = ("nhd", "vllm", "hnd")
#: Bias kinds, each a device-side source in bias.cuh (the bias's element dtype is a run-time argument).
BIAS_MODES = ("none", "dense", "ragged", "t5")
_CUDA_BIAS = {"none": "cpa::NoBias", "dense": "cpa::DenseBias", "ragged": "cpa::RaggedBias", "t5": "cpa::T5Bias",
              "dense-rows": "cpa::DenseRowsBias", "ragged-rows": "cpa::RaggedRowsBias"}
_CUDA_LAYOUT = {"nhd": "cpa::KvLayout::kNHD", "vllm": "cpa::KvLayout::kVLLM", "hnd": "cpa::KvLayout::kHND"}
_CACHE_LAYOUT = {"nhd": "cpa::CacheLayout::kNHD", "vllm": "cpa::CacheLayout::kVLLM", "hnd": "cpa::CacheLayout::kHND"}
#: NVRTC options of every kernel (CuPy adds -arch=sm_<device> and -ftz=true).
COMPILE_OPTIONS = ("-std=c++17",)
#: The window_left a kernel receives when there is no sliding window (kNoWindow, common.cuh).
NO_WINDOW = 1 << 30

# ---------------------------------------------------------------------------------------------------------------
# The SIMT decode (decode_simt.cu)
# ---------------------------------------------------------------------------------------------------------------
DECODE_SIMT_THREADS = 256  # kDecodeThreads
#: Query heads one CTA serves (the group rounded up to these; a larger group takes several CTAs).
HEADS_PER_CTA = (1, 2, 4, 8)
#: DecodeLayout::kSmemBytes: kStages x (K, V) x kVecsPerThread x 16 B of stages, then kStages x kMaxDecodeTile key
#: flags, then 16 B of the warps' out-of-contract flags.
DECODE_SIMT_SMEM_BYTES = 3 * 2 * 2 * DECODE_SIMT_THREADS * 16 + 3 * 128 + 16
DECODE_SIMT_TILE_MULTIPLE = 128  # every specialisation's TILE divides this
DECODE_T5_NEAR_DISTANCES = 128  # kT5NearDistances (bias.cuh)
DECODE_COMBINE_THREADS = 128  # kDecodeCombineThreads (split_k.cuh)
#: Partitions of a split grid that combines them in a thread block cluster (kMaxClusterParts: 8 is the portable
#: cluster size), and CTAs per SM the register budget of such a kernel allows (kClusterMinCtas).
DECODE_CLUSTER_MAX_PARTS = 8
DECODE_CLUSTER_MIN_CTAS = 2
MAX_LONGEST_FIRST_SEQS = 256  # kMaxLongestFirstSeqs (longest_first.cuh): the sequences one CTA ranks


@dataclass(frozen=True)
class DecodeSimtSpec:
    """Compile-time choices of one SIMT decode kernel. ``cluster``: a split grid whose partitions are combined in a
    thread block cluster (sm_90 and later) instead of by the combine kernel."""

    dtype: str  # "f32" | "f16" | "bf16"
    head_size: int
    layout: str  # "nhd" | "vllm"
    heads_per_cta: int
    bias: str  # one of BIAS_MODES
    cluster: bool = False
    scores: bool = False  # the score options (soft-cap, sliding window) compiled in
    kv_cache: str | None = None  # an fp8 format of the caches (a key of FP8_TYPES); None: the query's dtype

    source: ClassVar[str] = "decode_simt.cu"
    options: ClassVar[tuple[str, ...]] = COMPILE_OPTIONS
    threads: ClassVar[int] = DECODE_SIMT_THREADS

    @property
    def key(self) -> str:
        return (f"decode_simt_{self.dtype}{_kv_suffix(self.kv_cache)}_d{self.head_size}_{self.layout}"
                f"_g{self.heads_per_cta}_bias-{self.bias}{'_cluster' if self.cluster else ''}"
                f"{_scores_suffix(self.scores)}")

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (DecodeLayout::kSmemBytes, plus kNearBytes with a T5 bias: a near
        table and a bucket column per head, and the CTA's sequence when ranked longest first)."""
        near = 2 * self.heads_per_cta * DECODE_T5_NEAR_DISTANCES * 4 + 16 if self.bias == "t5" else 0
        return DECODE_SIMT_SMEM_BYTES + near

    @property
    def max_ctas_per_sm(self) -> int:
        """CTAs per SM the kernel's register budget allows (DecodeLayout::kMinCtas): four with one query head per
        CTA, three with more; a cluster-combined kernel's, DECODE_CLUSTER_MIN_CTAS. Shared memory may allow fewer."""
        if self.cluster:
            return DECODE_CLUSTER_MIN_CTAS
        return 4 if self.heads_per_cta == 1 else 3

    def offline_arch(self, arch: str) -> str | None:
        """The architecture to compile this spec for when checking ``arch`` without a GPU; None: not built there
        (clusters need sm_90)."""
        return None if self.cluster and arch == "sm_80" else arch

    def name_expressions(self) -> tuple[str, str]:
        """The attention kernel and its split-K combine, as NVRTC name expressions."""
        t = CUDA_TYPES[self.dtype]
        kv = _cuda_kv(self.dtype, self.kv_cache)
        main = (f"cpa::decode_simt<{t}, {kv}, {self.head_size}, {_CUDA_LAYOUT[self.layout]}, {self.heads_per_cta}, "
                f"{_CUDA_BIAS[self.bias]}, {_cuda_bool(self.cluster)}, {_cuda_bool(self.scores)}>")
        return main, f"cpa::decode_simt_combine<{t}, {self.head_size}>"


# ---------------------------------------------------------------------------------------------------------------
# The tensor-core tile (mma_tile.cuh) and its kernels: decode_mma.cu, prefill.cu, prefill_wgmma.cu
# ---------------------------------------------------------------------------------------------------------------
TILE_THREADS = 128  # kTileThreads: the mma.sync tilings' CTA
_TILE_WARPS = 4
_PREFILL_STAGES = 2
REL_TABLE = 2048  # floats of a prefill CTA's T5 table (kRelTableMax)
SIMT_PREFILL_THREADS = 128  # kSimtThreads (prefill.cu)
SIMT_PREFILL_ROWS = 64  # kSimtRowsPerCta: packed (token, head) rows of a float32 prefill CTA
PREFILL_PLAN_THREADS = 1024  # kPrefillPlanThreads (prefill_plan.cuh)
COMBINE_THREADS = 128  # kCombineThreads (split_k.cuh, tile_combine)
COMBINE_BATCH = 8  # partitions one tile_combine thread loads at once (kCombineBatch)
#: Rows of a decode-tiling CTA: the query heads of one KV head, one query token each. Its four warps split each
#: tile's keys.
DECODE_ROWS = (8, 16)
#: Head sizes the decode tiling takes (a warp needs 16 keys of a 64-key tile).
DECODE_MMA_HEAD_SIZES = tuple(d for d in HEAD_SIZES if d <= 128)
#: Bias kinds of the decode tiling: BIAS_MODES, and two of float16 / bfloat16 copied into shared memory with each
#: tile's K and V where "dense" and "ragged" load element by element (planning.tensor_core_bias_mode):
#: "dense-rows", a dense bias whose keys are adjacent (DenseRowsBias), and "ragged-rows", a ragged one whose heads
#: are adjacent and whose keys lie a multiple of 16 bytes apart (RaggedRowsBias).
DECODE_MMA_BIAS_MODES = (*BIAS_MODES, "dense-rows", "ragged-rows")
#: Bias kinds of prefill (a ragged bias is decode-only).
PREFILL_BIAS_MODES = ("none", "dense", "t5")
#: The Hopper tiling (wgmma, sm_90a code: devices of compute capability 9.0 exactly): head sizes, threads (two
#: warpgroups), packed rows per CTA (64 per warpgroup) and keys per tile.
WGMMA_HEAD_SIZES = (64, 128)
WGMMA_THREADS = 256
WGMMA_ROWS = 128
_WGMMA_TILE_KEYS = 64
#: Bias kinds of the Hopper tiling: a dense bias runs faster on the mma.sync tiling (B4 L4096 H32 d128, bf16 bias:
#: 7.36 against 8.34 ms; its bias fragments overflow the Hopper tiling's 128 registers).
WGMMA_BIAS_MODES = ("none", "t5")


def padded_head(head_size: int) -> int:
    """The head size padded to the mma's k (TileLayout::HEAD_P: 120 -> 128)."""
    return -(-head_size // 16) * 16


def decode_rows(group_size: int) -> int:
    """Rows of the decode-tiling CTAs that serve a KV group of ``group_size`` query heads: 8 up to 8 heads (half the
    accumulators: three CTAs per SM), else 16 (a group of more than 16 takes several CTAs)."""
    return DECODE_ROWS[0] if group_size <= DECODE_ROWS[0] else DECODE_ROWS[1]


def m_tiles(head_size: int, decode_rows: int = 0) -> int:
    """16-row m tiles per warp of the mma.sync tilings (prefill_m_tiles in mma_tile.cuh)."""
    return 2 if decode_rows == 0 and head_size <= 128 else 1


def tile_keys(head_size: int, decode_rows: int = 0, wgmma: bool = False) -> int:
    """Keys per K/V tile (TileLayout::TILE_N); every partition is a multiple."""
    if wgmma:
        return _WGMMA_TILE_KEYS
    two_m_tiles = m_tiles(head_size, decode_rows) == 2
    return 32 if head_size > 128 or (two_m_tiles and padded_head(head_size) > 64) else 64


def rows_per_cta(head_size: int, decode_rows: int = 0) -> int:
    """Packed (token, head) rows of one mma.sync CTA (rows_per_cta in mma_tile.cuh)."""
    return decode_rows or 16 * m_tiles(head_size) * _TILE_WARPS


def prefill_rows_per_cta(dtype: str, head_size: int) -> int:
    """Packed rows of one prefill CTA (its M tile): the float32 kernel's, else the tensor-core tilings' (the Hopper
    tiling has as many as the mma.sync one at its head sizes)."""
    return SIMT_PREFILL_ROWS if dtype == "f32" else rows_per_cta(head_size)


def decode_ctas_per_sm(head_size: int, rows: int) -> int:
    """CTAs per SM of the decode tiling (decode_ctas_per_sm in mma_tile.cuh)."""
    return 3 if padded_head(head_size) <= 64 or rows == 8 else 2


def _tiling_smem_bytes(rows: int, row: int, tile: int, stages: int, page_buffers: int, rel_table: int,
                       align: int) -> int:
    """Dynamic shared memory of a tensor-core CTA (tiling_smem_bytes in mma_tile.cuh): Q and the K/V stages in rows
    of ``row`` 16-byte vectors, the page offsets, the T5 table and the far constants, the alignment."""
    return (rows + stages * 2 * tile) * row * 16 + page_buffers * tile * 8 + (rel_table + 2 * rows) * 4 + align


def decode_stages(head_size: int, rows: int) -> int:
    """K/V stages of the decode tiling (decode_stages in mma_tile.cuh): three, or two where its CTAs per SM would not
    fit three (with their four page buffers)."""
    three = _tiling_smem_bytes(rows, padded_head(head_size) // 8 + 1, tile_keys(head_size, rows), 3, 4, 0, 0)
    return 3 if decode_ctas_per_sm(head_size, rows) * (three + 1024) <= 227 * 1024 else 2


def tile_smem_bytes(dtype: str, head_size: int, decode_rows: int = 0, wgmma: bool = False, fp8: bool = False) -> int:
    """Dynamic shared memory of one tensor-core CTA (TileLayout::kSmemBytes; 0 for the float32 prefill kernel).
    ``fp8``: the decode tiling over fp8 caches, whose K/V region is one 16-bit stage and its stages of fp8."""
    if dtype == "f32":
        return 0
    vectors = padded_head(head_size) // 8  # 16-byte vectors per row
    swizzled = wgmma or (decode_rows and vectors % 8 == 0)  # rows unpadded (TileLayout::ROW), else padded by one
    row = vectors + (0 if swizzled else 1)
    tile = tile_keys(head_size, decode_rows, wgmma)
    rows = WGMMA_ROWS if wgmma else rows_per_cta(head_size, decode_rows)
    if wgmma:  # three stages where the P·V is deferred (wgmma_deferred), one tile of copies ahead
        stages, ahead = (3 if head_size <= 64 else 2), 1
    else:
        stages = decode_stages(head_size, decode_rows) if decode_rows else _PREFILL_STAGES
        ahead = stages - 1  # tiles in flight while one computes (TileLayout::AHEAD)
    rel_table = 0 if decode_rows else REL_TABLE  # (decode reads T5 through its own tables)
    align = 1024 if wgmma else 0  # Q and the stages start on the 128-byte swizzle's period
    if fp8:
        return _tiling_smem_bytes(rows, row, tile, 1, ahead + 2, rel_table, 0) + stages * 2 * tile * vectors // 2 * 16
    return _tiling_smem_bytes(rows, row, tile, stages, ahead + 2, rel_table, align)


def decode_staged_bias_bytes(bias: str, head_size: int, rows: int, element_bytes: int = 2) -> int:
    """Static shared memory of the decode tiling's bias stages (StagedBias in decode_mma.cu) with room for elements
    of ``element_bytes`` (2, or 4 for float32): per K/V stage, tile·size / 16 + 1 vectors of 16 bytes a row for
    ``"dense-rows"``, ceil((size·rows + 16 - size) / 16) a key for ``"ragged-rows"``; none for the other kinds."""
    tile = tile_keys(head_size, rows)
    size = element_bytes
    vectors = {"dense-rows": rows * (tile * size // 16 + 1),
               "ragged-rows": tile * (-(-(size * rows + 16 - size) // 16))}
    return decode_stages(head_size, rows) * vectors.get(bias, 0) * 16


def decode_bias_fits(bias: str, head_size: int, rows: int, fp8: bool = False, element_bytes: int = 2) -> bool:
    """Whether the decode tiling's CTAs per SM still fit with ``bias``'s stages of ``element_bytes`` elements (the
    static_assert beside bias_stage): at head size 80, 8 rows, three CTAs leave no room for the ragged stages, and
    that specialisation does not exist (the bias is read element by element, "ragged"). With ``element_bytes=4``:
    whether the specialisation has room to stage a float32 bias (StagedBias::kWide)."""
    smem = tile_smem_bytes("bf16", head_size, rows, fp8=fp8) + decode_staged_bias_bytes(bias, head_size, rows,
                                                                                         element_bytes)
    return decode_ctas_per_sm(head_size, rows) * (smem + 1024) <= 227 * 1024


def combine_groups(num_parts: int) -> int:
    """Groups of threads that split the partitions in tile_combine (combine_groups in split_k.cuh)."""
    for groups in (1, 2, 4):
        if num_parts <= groups * COMBINE_BATCH:
            return groups
    return 8


def combine_vec(num_parts: int) -> int:
    """Adjacent output elements of one tile_combine thread (combine_vec in split_k.cuh): 4 with one group, else 1."""
    return 4 if combine_groups(num_parts) == 1 else 1


def combine_chunks(rows: int, head_size: int, num_parts: int) -> int:
    """grid.z of tile_combine: its CTAs each take ``COMBINE_THREADS / combine_groups · combine_vec`` of the output
    elements of an M tile's ``rows`` rows."""
    per_cta = COMBINE_THREADS // combine_groups(num_parts) * combine_vec(num_parts)
    return -(-rows * head_size // per_cta)


def _cuda_bool(value: bool) -> str:
    return "true" if value else "false"


def _scores_suffix(scores: bool) -> str:
    """A spec key's mark of the score options."""
    return "_scores" if scores else ""


def _kv_suffix(kv_cache: str | None) -> str:
    """A spec key's mark of an fp8 cache, after the query's dtype: ``_kv-fp8_e4m3``."""
    return f"_kv-{kv_cache}" if kv_cache else ""


def _cuda_kv(dtype: str, kv_cache: str | None) -> str:
    """The CUDA type of the caches' elements: the fp8 format's, else the query's."""
    return FP8_TYPES[kv_cache] if kv_cache else CUDA_TYPES[dtype]


def _tile_args(dtype: str, head_size: int, layout: str, bias: str) -> str:
    return f"{CUDA_TYPES[dtype]}, {head_size}, {_CUDA_LAYOUT[layout]}, {_CUDA_BIAS[bias]}"


@dataclass(frozen=True)
class DecodeMmaSpec:
    """Compile-time choices of one tensor-core decode kernel (the decode tiling: float16 / bfloat16, head sizes up
    to 128, ``rows`` 8 or 16 query heads per CTA)."""

    dtype: str  # "f16" | "bf16"
    head_size: int
    layout: str
    bias: str  # one of DECODE_MMA_BIAS_MODES
    rows: int
    scores: bool = False  # the score options (soft-cap, sliding window) compiled in
    kv_cache: str | None = None  # an fp8 format of the caches (a key of FP8_TYPES); None: the query's dtype

    source: ClassVar[str] = "decode_mma.cu"
    options: ClassVar[tuple[str, ...]] = COMPILE_OPTIONS
    threads: ClassVar[int] = TILE_THREADS

    @property
    def key(self) -> str:
        return (f"decode_mma_{self.dtype}{_kv_suffix(self.kv_cache)}_d{self.head_size}_{self.layout}_r{self.rows}"
                f"_bias-{self.bias}{_scores_suffix(self.scores)}")

    @property
    def smem_bytes(self) -> int:
        return tile_smem_bytes(self.dtype, self.head_size, self.rows, fp8=self.kv_cache is not None)

    @property
    def ctas_per_sm(self) -> int:
        return decode_ctas_per_sm(self.head_size, self.rows)

    def offline_arch(self, arch: str) -> str | None:
        return arch

    def name_expressions(self) -> tuple[str, str]:
        """The attention kernel and its split-K combine."""
        args = (f"{CUDA_TYPES[self.dtype]}, {_cuda_kv(self.dtype, self.kv_cache)}, {self.head_size}, "
                f"{_CUDA_LAYOUT[self.layout]}, {_CUDA_BIAS[self.bias]}")
        return (f"cpa::decode_mma<{args}, {self.rows}, {_cuda_bool(self.scores)}>",
                f"cpa::tile_combine<{CUDA_TYPES[self.dtype]}, {self.head_size}, {self.rows}>")


@dataclass(frozen=True)
class PrefillSpec:
    """Compile-time choices of one prefill kernel; causal, ALiBi, page size and bias dtype are run-time. float32
    runs ``prefill_simt``, float16 / bfloat16 ``prefill_mma`` or, with ``wgmma``, the Hopper tiling (WGMMA_HEAD_SIZES,
    sm_90a code)."""

    dtype: str  # "f32" | "f16" | "bf16"
    head_size: int
    layout: str
    bias: str  # one of PREFILL_BIAS_MODES
    wgmma: bool = False
    scores: bool = False  # the score options (soft-cap, sliding window) compiled in


    @property
    def tiling(self) -> str:
        return "wgmma" if self.wgmma else "simt" if self.dtype == "f32" else "mma"

    @property
    def source(self) -> str:
        return "prefill_wgmma.cu" if self.wgmma else "prefill.cu"

    @property
    def key(self) -> str:
        return (f"prefill_{self.tiling}_{self.dtype}_d{self.head_size}_{self.layout}_bias-{self.bias}"
                f"{_scores_suffix(self.scores)}")

    @property
    def rows(self) -> int:
        """Packed (query token, query head) rows of one CTA: its M tile."""
        return WGMMA_ROWS if self.wgmma else prefill_rows_per_cta(self.dtype, self.head_size)

    @property
    def threads(self) -> int:
        """Threads of one attention CTA."""
        return WGMMA_THREADS if self.wgmma else SIMT_PREFILL_THREADS if self.dtype == "f32" else TILE_THREADS

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one attention CTA (:func:`tile_smem_bytes` of this tiling)."""
        return tile_smem_bytes(self.dtype, self.head_size, wgmma=self.wgmma)

    @property
    def options(self) -> tuple[str, ...]:
        """NVRTC options (the Hopper tiling needs sm_90a's wgmma; CuPy adds the device's -arch=sm_90 too)."""
        return (*COMPILE_OPTIONS, "-arch=sm_90a") if self.wgmma else COMPILE_OPTIONS

    def offline_arch(self, arch: str) -> str | None:
        """The architecture to compile this spec for when checking ``arch`` without a GPU; None: not built there."""
        if not self.wgmma:
            return arch
        return "sm_90a" if arch == "sm_90" else None

    def name_expressions(self) -> tuple[str, str, str]:
        """The attention kernel, its split-K combine and the tile plan."""
        args = _tile_args(self.dtype, self.head_size, self.layout, self.bias)
        main = f"cpa::prefill_{self.tiling}<{args}, {_cuda_bool(self.scores)}>"
        combine = f"cpa::tile_combine<{CUDA_TYPES[self.dtype]}, {self.head_size}, {self.rows}>"
        return main, combine, "cpa::prefill_plan"


# ---------------------------------------------------------------------------------------------------------------
# The cache write (cache_write.cu)
# ---------------------------------------------------------------------------------------------------------------
CACHE_WRITE_THREADS = 128  # kCacheThreads


@dataclass(frozen=True)
class CacheWriteSpec:
    """Compile-time choices of one cache-write kernel."""

    dtype: str
    layout: str
    slot_dtype: str  # "i32" | "i64"
    kv_cache: str | None = None  # an fp8 format of the caches; None: the key's dtype

    source: ClassVar[str] = "cache_write.cu"
    options: ClassVar[tuple[str, ...]] = COMPILE_OPTIONS
    threads: ClassVar[int] = CACHE_WRITE_THREADS
    smem_bytes: ClassVar[int] = 0

    @property
    def key(self) -> str:
        return f"cache_write_{self.dtype}{_kv_suffix(self.kv_cache)}_{self.layout}_slot-{self.slot_dtype}"

    def offline_arch(self, arch: str) -> str | None:
        return arch

    def name_expressions(self) -> tuple[str]:
        slot = {"i32": "int", "i64": "long long"}[self.slot_dtype]
        return (f"cpa::reshape_and_cache<{CUDA_TYPES[self.dtype]}, {_cuda_kv(self.dtype, self.kv_cache)}, "
                f"{_CACHE_LAYOUT[self.layout]}, {slot}>",)


# ---------------------------------------------------------------------------------------------------------------
# The pages of fp8 caches dequantized for prefill (cache_dequantize.cu)
# ---------------------------------------------------------------------------------------------------------------
CACHE_DEQUANTIZE_THREADS = 128  # kDequantizeThreads


@dataclass(frozen=True)
class CacheDequantizeSpec:
    """Compile-time choices of one page-dequantizing kernel: the output's dtype (the query's), the fp8 format, the
    head size and the input's layout."""

    dtype: str
    kv_cache: str  # a key of FP8_TYPES
    head_size: int
    layout: str

    source: ClassVar[str] = "cache_dequantize.cu"
    options: ClassVar[tuple[str, ...]] = COMPILE_OPTIONS
    threads: ClassVar[int] = CACHE_DEQUANTIZE_THREADS
    smem_bytes: ClassVar[int] = 0

    @property
    def key(self) -> str:
        return f"cache_dequantize_{self.dtype}{_kv_suffix(self.kv_cache)}_d{self.head_size}_{self.layout}"

    def offline_arch(self, arch: str) -> str | None:
        return arch

    def name_expressions(self) -> tuple[str]:
        return (f"cpa::dequantize_pages<{CUDA_TYPES[self.dtype]}, {FP8_TYPES[self.kv_cache]}, {self.head_size}, "
                f"{_CUDA_LAYOUT[self.layout]}>",)


KernelSpec = DecodeSimtSpec | DecodeMmaSpec | PrefillSpec | CacheWriteSpec | CacheDequantizeSpec


# ---------------------------------------------------------------------------------------------------------------
# Every specialisation the library can launch
# ---------------------------------------------------------------------------------------------------------------
def decode_simt_specs() -> list[DecodeSimtSpec]:
    """The SIMT decode's: the kernels that write their result (or partials for the combine), then those that
    combine their partitions in a cluster (without the score options), then those of fp8 caches (no clusters;
    fp8_simt_heads)."""
    return [DecodeSimtSpec(dt, d, lay, g, bias, cluster, scores)
            for scores, cluster in ((False, False), (False, True), (True, False)) for dt in CUDA_TYPES
            for d in HEAD_SIZES for lay in KV_LAYOUTS for g in HEADS_PER_CTA for bias in BIAS_MODES] + [
            DecodeSimtSpec(dt, d, lay, g, bias, False, scores, kv)
            for kv in FP8_TYPES for scores in (False, True) for dt in FP8_QUERY_DTYPES
            for d in FP8_HEAD_SIZES for lay in KV_LAYOUTS for g in fp8_simt_heads(d) for bias in BIAS_MODES]


def fp8_simt_heads(head_size: int) -> tuple[int, ...]:
    """Query heads per CTA of the SIMT decode of fp8 caches: one (multi-head decode whose grid the tensor cores do
    not take) where grouped queries run on the tensor cores (head sizes up to 128), else every count."""
    return (1,) if head_size in DECODE_MMA_HEAD_SIZES else HEADS_PER_CTA


def decode_mma_specs() -> list[DecodeMmaSpec]:
    """The tensor-core decode's (a staged bias only where its stages fit: decode_bias_fits), then those of fp8
    caches."""
    return [DecodeMmaSpec(dt, d, lay, bias, rows, scores, kv)
            for kv in (None, *FP8_TYPES) for scores in (False, True) for dt in ("f16", "bf16") for rows in DECODE_ROWS
            for d in DECODE_MMA_HEAD_SIZES if kv is None or d in FP8_HEAD_SIZES for lay in KV_LAYOUTS
            for bias in DECODE_MMA_BIAS_MODES if decode_bias_fits(bias, d, rows, kv is not None)]


def prefill_specs() -> list[PrefillSpec]:
    """Prefill's: the mma.sync and float32 tilings, then the Hopper tiling."""
    everywhere = [PrefillSpec(dt, d, lay, bias, scores=scores) for scores in (False, True)
                  for dt in CUDA_TYPES for d in HEAD_SIZES for lay in KV_LAYOUTS for bias in PREFILL_BIAS_MODES]
    hopper = [PrefillSpec(dt, d, lay, bias, wgmma=True, scores=scores) for scores in (False, True)
              for dt in ("f16", "bf16") for d in WGMMA_HEAD_SIZES for lay in KV_LAYOUTS for bias in WGMMA_BIAS_MODES]
    return everywhere + hopper


def cache_write_specs() -> list[CacheWriteSpec]:
    return [CacheWriteSpec(dt, lay, sl, kv) for kv in (None, *FP8_TYPES) for dt in CUDA_TYPES for lay in KV_LAYOUTS
            for sl in ("i32", "i64")]


def cache_dequantize_specs() -> list[CacheDequantizeSpec]:
    return [CacheDequantizeSpec(dt, kv, d, lay) for kv in FP8_TYPES for dt in CUDA_TYPES for d in FP8_HEAD_SIZES
            for lay in KV_LAYOUTS]


def all_specs() -> list[KernelSpec]:
    """Every specialisation of every kernel family."""
    return [*decode_simt_specs(), *decode_mma_specs(), *prefill_specs(), *cache_write_specs(),
            *cache_dequantize_specs()]
