"""Kernel sources, specialisation keys and the compiled-kernel cache.

A specialisation is everything a kernel needs at compile time (dtype, head size, layout, heads per CTA, bias mode).
Its readable key, e.g. ``paged_decode_bf16_d128_nhd_g4_bias-dense``, names the cached kernel,
the log line and the test id. Compiled modules live in :func:`functools.cache` here and in CuPy's own disk cache.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_log = logging.getLogger("cupy_paged_attn")

#: Storage dtypes by short name, with the CUDA type that holds them.
CUDA_TYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16"}
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
#: Page sizes: any power of two up to 256 (a run-time parameter of the kernels, not a specialisation).
BLOCK_SIZES = tuple(2**i for i in range(9))
KV_LAYOUTS = ("nhd", "vllm")
HEADS_PER_CTA = (1, 2, 4, 8)
#: Bias kinds, each a device-side source in common.cuh (the bias's element dtype is a run-time argument).
BIAS_MODES = ("none", "dense", "ragged", "t5")
_CUDA_BIAS = {"none": "cpa::NoBias", "dense": "cpa::DenseBias", "ragged": "cpa::RaggedBias", "t5": "cpa::T5Bias",
              "dense-rows": "cpa::DenseRowsBias", "ragged-rows": "cpa::RaggedRowsBias"}

_CUDA_LAYOUT = {"nhd": "cpa::KvLayout::kNHD", "vllm": "cpa::KvLayout::kVLLM"}
_CACHE_LAYOUT = {"nhd": "cpa::CacheLayout::kNHD", "vllm": "cpa::CacheLayout::kVLLM"}
_COMPILE_OPTIONS = ("-std=c++17",)


def kernel_dir() -> Path:
    """Folder of the ``.cu`` sources: inside the installed package, else ``kernels_cu/`` of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise RuntimeError(f"cupy_paged_attn: kernel sources not found next to {here} (broken installation)")


@functools.cache
def kernel_source(filename: str) -> str:
    """The text of one kernel family with ``#include "common.cuh"`` inlined.

    CuPy's disk cache keys on the source text only, so headers are pasted in: an edit to ``common.cuh`` then
    recompiles instead of silently reusing a stale cubin.
    """
    folder = kernel_dir()
    text = (folder / filename).read_text()

    def inline(match: re.Match[str]) -> str:
        return (folder / match.group(1)).read_text().replace("#pragma once", "")

    return re.sub(r'^#include "([^"]+)"\s*$', inline, text, flags=re.MULTILINE)


DECODE_THREADS = 256  # kDecodeThreads in paged_decode.cu
#: DecodeLayout::kSmemBytes: kStages x (K, V) x kVecsPerThread x 16 B of stages, then kStages x kMaxDecodeTile key
#: flags.
DECODE_SMEM_BYTES = 3 * 2 * 2 * DECODE_THREADS * 16 + 3 * 128
DECODE_T5_NEAR_DISTANCES = 128  # kT5NearDistances in common.cuh
#: Partitions of a split grid that combines them in a thread block cluster (kMaxClusterParts: 8 is the portable
#: cluster size), and CTAs per SM the register budget of such a kernel allows (kClusterMinCtas).
DECODE_CLUSTER_MAX_PARTS = 8
DECODE_CLUSTER_MIN_CTAS = 2


@dataclass(frozen=True)
class DecodeSpec:
    """Compile-time choices of one decode kernel. ``cluster``: a split grid whose partitions are combined in a
    thread block cluster (sm_90 and later) instead of by the reduction kernel."""

    dtype: str  # "f32" | "f16" | "bf16"
    head_size: int
    layout: str  # "nhd" | "vllm"
    heads_per_cta: int
    bias: str  # one of BIAS_MODES
    cluster: bool = False

    @property
    def key(self) -> str:
        return (
            f"paged_decode_{self.dtype}_d{self.head_size}_{self.layout}"
            f"_g{self.heads_per_cta}_bias-{self.bias}{'_cluster' if self.cluster else ''}"
        )

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (DecodeLayout::kSmemBytes, plus kNearBytes with a T5 bias: a near
        table and a bucket column per head, and the CTA's sequence when ranked longest first)."""
        near = 2 * self.heads_per_cta * DECODE_T5_NEAR_DISTANCES * 4 + 16 if self.bias == "t5" else 0
        return DECODE_SMEM_BYTES + near

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
        """The kernel and its split-K reduction, as NVRTC name expressions."""
        t = CUDA_TYPES[self.dtype]
        bias = _CUDA_BIAS[self.bias]
        main = (
            f"cpa::paged_decode<{t}, {self.head_size}, {_CUDA_LAYOUT[self.layout]}, "
            f"{self.heads_per_cta}, {bias}, {'true' if self.cluster else 'false'}>"
        )
        return main, f"cpa::paged_decode_reduce<{t}, {self.head_size}>"


@dataclass(frozen=True)
class CacheWriteSpec:
    """Compile-time choices of one cache-write kernel."""

    dtype: str
    layout: str
    slot_dtype: str  # "i32" | "i64"

    @property
    def key(self) -> str:
        return f"reshape_and_cache_{self.dtype}_{self.layout}_slot-{self.slot_dtype}"

    def name_expressions(self) -> tuple[str]:
        slot = {"i32": "int", "i64": "long long"}[self.slot_dtype]
        return (f"cpa::reshape_and_cache<{CUDA_TYPES[self.dtype]}, {_CACHE_LAYOUT[self.layout]}, {slot}>",)


def all_decode_specs() -> list[DecodeSpec]:
    """Every decode specialisation the library can launch: the kernels that write their result (or partials for
    the reduction), then those that combine their partitions in a cluster."""
    return [
        DecodeSpec(dt, d, lay, g, bias, cluster)
        for cluster in (False, True)
        for dt in CUDA_TYPES
        for d in HEAD_SIZES
        for lay in KV_LAYOUTS
        for g in HEADS_PER_CTA
        for bias in BIAS_MODES
    ]


def all_cache_write_specs() -> list[CacheWriteSpec]:
    """Every cache-write specialisation the library can launch."""
    return [CacheWriteSpec(dt, lay, sl) for dt in CUDA_TYPES for lay in KV_LAYOUTS for sl in ("i32", "i64")]


_NVRTC_HINT = (
    "NVRTC or the CUDA headers were not found; install the extra matching your CUDA driver: "
    "pip install 'cupy-paged-attn[cuda13]' (or [cuda12])"
)


# What a missing NVRTC library or missing CUDA headers look like in CuPy's and NVRTC's messages.
_MISSING_TOOLKIT = re.compile(r"cuda_fp16\.h|cuda_bf16\.h|libnvrtc|nvrtc64|CUDA path could not be detected", re.I)


def _compile_error(key: str, log: str) -> RuntimeError:
    """The error for a failed compile: the hint to install NVRTC / the headers if they are missing, else the log."""
    if _MISSING_TOOLKIT.search(log):
        return RuntimeError(f"{key}: {_NVRTC_HINT}\n{log}")
    return RuntimeError(f"{key}: NVRTC compilation failed:\n{log}")


@functools.cache
def _module(filename: str, key: str, names: tuple[str, ...], device_id: int,
            options: tuple[str, ...] | None = None) -> Any:
    """The compiled module of ``names``; ``options`` default to :data:`_COMPILE_OPTIONS` as they are at the first
    compile (the benchmarks' ``--define`` extends them before any kernel is fetched)."""
    import cupy

    options = _COMPILE_OPTIONS if options is None else options

    _log.info("compiling %s for device %d", key, device_id)
    try:
        with cupy.cuda.Device(device_id):
            module = cupy.RawModule(code=kernel_source(filename), options=options, name_expressions=names)
            module.compile()
    except cupy.cuda.compiler.CompileException as exc:
        raise _compile_error(key, exc.get_message()) from exc
    except OSError as exc:  # the NVRTC library could not be loaded
        raise _compile_error(key, str(exc)) from exc
    return module


_SMEM_ATTRIBUTE_LOCK = threading.Lock()


@functools.cache
def _decode_kernels(spec: DecodeSpec, device_id: int) -> tuple[Any, Any]:
    names = spec.name_expressions()
    module = _module("paged_decode.cu", spec.key, names, device_id)
    return module.get_function(names[0]), module.get_function(names[1])


def get_decode_kernels(spec: DecodeSpec, device_id: int, dynamic_smem: int) -> tuple[Any, Any]:
    """The compiled ``(paged_decode, paged_decode_reduce)`` pair of ``spec`` on ``device_id``, the first allowed
    at least ``dynamic_smem`` bytes of dynamic shared memory (past the default 48 KB, CUDA wants it said; a split
    launch asks for more than the kernel needs, to cap its CTAs per SM)."""
    kernel, reduce_kernel = _decode_kernels(spec, device_id)
    with _SMEM_ATTRIBUTE_LOCK:  # plans of two threads must not lower each other's limit
        if kernel.max_dynamic_shared_size_bytes < dynamic_smem:
            kernel.max_dynamic_shared_size_bytes = dynamic_smem
    return kernel, reduce_kernel


@functools.cache
def get_cache_write_kernel(spec: CacheWriteSpec, device_id: int) -> Any:
    """The compiled ``reshape_and_cache`` kernel of ``spec`` on ``device_id``."""
    names = spec.name_expressions()
    return _module("cache_write.cu", spec.key, names, device_id).get_function(names[0])


def compile_offline(filename: str, names: list[str], arch: str, extra: str = "",
                    source: str | None = None) -> tuple[bytes, dict[str, str]]:
    """Compile ``names`` of one kernel family for ``arch`` (e.g. ``"sm_90"``) with no GPU present.

    Returns the cubin and each name expression's lowered (mangled) symbol. ``extra`` is appended to the source
    (tests add ``static_assert``s comparing the kernels' constants with their host-side mirrors). ``source``, when
    given, is compiled instead of the family's file (the benchmarks' own probe kernels; ``filename`` names it).

    Uses CuPy's private NVRTC bindings (``RawModule.compile`` needs a device); kept in this one function so a
    CuPy upgrade that moves them breaks one place. Raises RuntimeError with the NVRTC log on failure.
    """
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy_backends.cuda.libs import nvrtc

    options = assemble_cupy_compiler_options((*_COMPILE_OPTIONS, f"-arch={arch}"))
    text = kernel_source(filename) if source is None else source
    program = nvrtc.createProgram(text + extra, filename, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"{filename} ({arch}): NVRTC compilation failed:\n{log}") from exc
        return nvrtc.getCUBIN(program), {name: nvrtc.getLoweredName(program, name) for name in names}
    finally:
        nvrtc.destroyProgram(program)


# ---------------------------------------------------------------------------------------------------------------
# Prefill (kernels_cu/paged_prefill.cu)
# ---------------------------------------------------------------------------------------------------------------
#: Bias kinds of the prefill kernels (a ragged bias is decode-only).
PREFILL_BIAS_MODES = ("none", "dense", "t5")
#: Threads of the attention kernels (kPrefillThreads) and packed (query token, query head) rows of one float32
#: SIMT CTA (kSimtRowsPerCta); a tensor-core CTA's rows are rows_per_cta(...).
PREFILL_THREADS = 128
SIMT_ROWS_PER_CTA = 64
PREFILL_PLAN_THREADS = 1024
PREFILL_REDUCE_THREADS = 128
PREFILL_REDUCE_BATCH = 8  # partitions one thread of paged_prefill_reduce loads at once (kReduceBatch)
_PREFILL_WARPS = 4
_PREFILL_STAGES = 2
PREFILL_REL_TABLE = 2048  # floats of a CTA's T5 table (kRelTableMax)
#: Rows of a decode-tiling CTA of the tensor-core kernel (PrefillLayout's DECODE_ROWS; 0 is prefill's tiling): the
#: query heads of one KV head, one query token each. Its four warps split each tile's keys.
DECODE_ROWS = (8, 16)
#: Head sizes the decode tiling of the tensor-core kernel takes (a warp needs 16 keys of a 64-key tile).
DECODE_MMA_HEAD_SIZES = tuple(d for d in HEAD_SIZES if d <= 128)
#: Bias kinds of the decode tiling: BIAS_MODES, and two of float16 / bfloat16 copied into shared memory with each
#: tile's K and V where "dense" and "ragged" load element by element (decode.tensor_core_bias_mode): "dense-rows", a
#: dense bias whose keys are adjacent (DenseRowsBias), and "ragged-rows", a ragged one whose heads are adjacent and
#: whose keys lie a multiple of 16 bytes apart (RaggedRowsBias).
DECODE_MMA_BIAS_MODES = (*BIAS_MODES, "dense-rows", "ragged-rows")
#: The Hopper tiling of the prefill kernel (wgmma, sm_90a code: devices of compute capability 9.0 exactly): head
#: sizes, threads (two warpgroups), packed rows per CTA (64 per warpgroup) and keys per tile.
WGMMA_HEAD_SIZES = (64, 128)
WGMMA_THREADS = 256
_WGMMA_ROWS = 128
_WGMMA_TILE_KEYS = 64
#: Bias kinds of the Hopper tiling: a dense bias runs faster on the mma.sync tiling (B4 L4096 H32 d128, bf16 bias:
#: 7.36 against 8.34 ms; its bias fragments overflow the Hopper tiling's 128 registers).
WGMMA_BIAS_MODES = ("none", "t5")


def _padded_head(head_size: int) -> int:
    """The head size padded to the mma's k (PrefillLayout::HEAD_P: 120 -> 128)."""
    return -(-head_size // 16) * 16


def decode_rows(group_size: int) -> int:
    """Rows of the decode-tiling CTAs that serve a KV group of ``group_size`` query heads: 8 up to 8 heads (half the
    accumulators: three CTAs per SM), else 16 (a group of more than 16 takes several CTAs)."""
    return DECODE_ROWS[0] if group_size <= DECODE_ROWS[0] else DECODE_ROWS[1]


def prefill_tile_keys(head_size: int, decode_rows: int = 0, wgmma: bool = False) -> int:
    """Keys per K/V tile of the tensor-core kernel (PrefillLayout::TILE_N); every partition is a multiple."""
    if wgmma:
        return _WGMMA_TILE_KEYS
    two_m_tiles = prefill_m_tiles(head_size, decode_rows) == 2
    return 32 if head_size > 128 or (two_m_tiles and _padded_head(head_size) > 64) else 64


def prefill_m_tiles(head_size: int, decode_rows: int = 0) -> int:
    """16-row m tiles per warp of the tensor-core kernel (prefill_m_tiles in paged_prefill.cu)."""
    return 2 if decode_rows == 0 and head_size <= 128 else 1


def rows_per_cta(head_size: int, decode_rows: int = 0) -> int:
    """Packed (token, head) rows of one tensor-core CTA (rows_per_cta in paged_prefill.cu)."""
    return decode_rows or 16 * prefill_m_tiles(head_size) * _PREFILL_WARPS


def prefill_rows_per_cta(dtype: str, head_size: int) -> int:
    """Packed rows of one prefill CTA (its M tile): the SIMT kernel's for float32, else the tensor-core kernel's."""
    return SIMT_ROWS_PER_CTA if dtype == "f32" else rows_per_cta(head_size)


def decode_ctas_per_sm(head_size: int, rows: int) -> int:
    """CTAs per SM of the decode tiling (decode_ctas_per_sm in paged_prefill.cu)."""
    return 3 if _padded_head(head_size) <= 64 or rows == 8 else 2


def _tiling_smem_bytes(rows: int, row: int, tile: int, stages: int, page_buffers: int, rel_table: int,
                       align: int) -> int:
    """Dynamic shared memory of a tensor-core CTA (tiling_smem_bytes in paged_prefill.cu): Q and the K/V stages
    in rows of ``row`` 16-byte vectors, the page offsets, the T5 table and the far constants, the alignment."""
    return (rows + stages * 2 * tile) * row * 16 + page_buffers * tile * 8 + (rel_table + 2 * rows) * 4 + align


def decode_stages(head_size: int, rows: int) -> int:
    """K/V stages of the decode tiling (decode_stages in paged_prefill.cu): three, or two where its CTAs per SM
    would not fit three (with their four page buffers)."""
    three = _tiling_smem_bytes(rows, _padded_head(head_size) // 8 + 1, prefill_tile_keys(head_size, rows), 3, 4, 0, 0)
    return 3 if decode_ctas_per_sm(head_size, rows) * (three + 1024) <= 227 * 1024 else 2


def decode_staged_bias_bytes(bias: str, head_size: int, rows: int) -> int:
    """Static shared memory of the decode tiling's bias stages (bias_stage in paged_prefill.cu): per K/V stage, 9
    vectors of 16 bytes a row for ``"dense-rows"``, ceil((2·rows + 14) / 16) a key for ``"ragged-rows"``; none for
    the other kinds."""
    tile = prefill_tile_keys(head_size, rows)
    vectors = {"dense-rows": rows * (tile * 2 // 16 + 1), "ragged-rows": tile * (-(-(2 * rows + 14) // 16))}
    return decode_stages(head_size, rows) * vectors.get(bias, 0) * 16


def decode_bias_fits(bias: str, head_size: int, rows: int) -> bool:
    """Whether the decode tiling's CTAs per SM still fit with ``bias``'s stages (the static_assert beside
    bias_stage): at head size 80, 8 rows, three CTAs leave no room for the ragged stages, and that specialisation
    does not exist (the bias is read element by element, "ragged")."""
    smem = prefill_smem_bytes("bf16", head_size, rows) + decode_staged_bias_bytes(bias, head_size, rows)
    return decode_ctas_per_sm(head_size, rows) * (smem + 1024) <= 227 * 1024


def reduce_groups(num_parts: int) -> int:
    """Groups of threads that split the partitions in paged_prefill_reduce (reduce_groups there)."""
    for groups in (1, 2, 4):
        if num_parts <= groups * PREFILL_REDUCE_BATCH:
            return groups
    return 8


def reduce_vec(num_parts: int) -> int:
    """Adjacent output elements of one paged_prefill_reduce thread (reduce_vec there): 4 with one group, else 1."""
    return 4 if reduce_groups(num_parts) == 1 else 1


def reduce_chunks(rows: int, head_size: int, num_parts: int) -> int:
    """grid.z of paged_prefill_reduce: its CTAs each take ``PREFILL_REDUCE_THREADS / reduce_groups · reduce_vec``
    of the output elements of an M tile's ``rows`` rows."""
    per_cta = PREFILL_REDUCE_THREADS // reduce_groups(num_parts) * reduce_vec(num_parts)
    return -(-rows * head_size // per_cta)


def prefill_smem_bytes(dtype: str, head_size: int, decode_rows: int = 0, wgmma: bool = False) -> int:
    """Dynamic shared memory of one tensor-core CTA (PrefillLayout::kSmemBytes; 0 for the float32 SIMT kernel)."""
    if dtype == "f32":
        return 0
    vectors = _padded_head(head_size) // 8  # 16-byte vectors per row
    swizzled = wgmma or (decode_rows and vectors % 8 == 0)  # rows unpadded (PrefillLayout::ROW), else padded by one
    row = vectors + (0 if swizzled else 1)
    tile = prefill_tile_keys(head_size, decode_rows, wgmma)
    rows = _WGMMA_ROWS if wgmma else rows_per_cta(head_size, decode_rows)
    if wgmma:  # three stages where the P·V is deferred (wgmma_deferred), one tile of copies ahead
        stages, ahead = (3 if head_size <= 64 else 2), 1
    else:
        stages = decode_stages(head_size, decode_rows) if decode_rows else _PREFILL_STAGES
        ahead = stages - 1  # tiles in flight while one computes (PrefillLayout::AHEAD)
    rel_table = 0 if decode_rows else PREFILL_REL_TABLE  # (decode reads T5's table per logit)
    align = 1024 if wgmma else 0  # Q and the stages start on the 128-byte swizzle's period
    return _tiling_smem_bytes(rows, row, tile, stages, ahead + 2, rel_table, align)


@dataclass(frozen=True)
class PrefillSpec:
    """Compile-time choices of one tensor-core (or float32 SIMT) kernel of paged_prefill.cu; causal, ALiBi, page
    size and bias dtype are run-time. ``decode_rows`` 8 or 16 is the decode tiling (16-bit, head sizes up to 128);
    ``wgmma`` the Hopper tiling of prefill (16-bit, WGMMA_HEAD_SIZES, sm_90a code)."""

    dtype: str  # "f32" (SIMT kernel) | "f16" | "bf16" (tensor cores)
    head_size: int
    layout: str  # "nhd" | "vllm"
    bias: str  # one of PREFILL_BIAS_MODES; "ragged" too with the decode tiling
    decode_rows: int = 0
    wgmma: bool = False

    @property
    def key(self) -> str:
        tiling = "_wgmma" if self.wgmma else f"_decode{self.decode_rows}" if self.decode_rows else ""
        return f"paged_prefill_{self.dtype}_d{self.head_size}_{self.layout}_bias-{self.bias}{tiling}"

    @property
    def threads(self) -> int:
        """Threads of one attention CTA."""
        return WGMMA_THREADS if self.wgmma else PREFILL_THREADS

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one attention CTA (:func:`prefill_smem_bytes` of this tiling)."""
        return prefill_smem_bytes(self.dtype, self.head_size, self.decode_rows, self.wgmma)

    @property
    def options(self) -> tuple[str, ...]:
        """NVRTC options (the Hopper tiling needs sm_90a's wgmma; CuPy adds the device's -arch=sm_90 too)."""
        return (*_COMPILE_OPTIONS, "-arch=sm_90a") if self.wgmma else _COMPILE_OPTIONS

    def offline_arch(self, arch: str) -> str | None:
        """The architecture to compile this spec for when checking ``arch`` without a GPU; None: not built there."""
        if not self.wgmma:
            return arch
        return "sm_90a" if arch == "sm_90" else None

    def name_expressions(self) -> tuple[str, str, str]:
        """The attention kernel, its split-K reduction and the tile plan, as NVRTC name expressions."""
        t = CUDA_TYPES[self.dtype]
        args = f"{t}, {self.head_size}, {_CUDA_LAYOUT[self.layout]}, {_CUDA_BIAS[self.bias]}"
        wg = "true" if self.wgmma else "false"
        main = f"cpa::paged_prefill_simt<{args}>" if self.dtype == "f32" else \
            f"cpa::paged_prefill<{args}, {self.decode_rows}, {wg}>"
        return main, f"cpa::paged_prefill_reduce<{t}, {self.head_size}, {self.decode_rows}>", "cpa::paged_prefill_plan"


def all_prefill_specs() -> list[PrefillSpec]:
    """Every specialisation of paged_prefill.cu the library can launch: prefill's, decode's tensor-core ones, then
    prefill's Hopper ones."""
    prefill = [
        PrefillSpec(dt, d, lay, bias)
        for dt in CUDA_TYPES
        for d in HEAD_SIZES
        for lay in KV_LAYOUTS
        for bias in PREFILL_BIAS_MODES
    ]
    decode = [
        PrefillSpec(dt, d, lay, bias, rows)
        for dt in ("f16", "bf16")
        for rows in DECODE_ROWS
        for d in DECODE_MMA_HEAD_SIZES
        for lay in KV_LAYOUTS
        for bias in DECODE_MMA_BIAS_MODES
        if decode_bias_fits(bias, d, rows)
    ]
    hopper = [
        PrefillSpec(dt, d, lay, bias, wgmma=True)
        for dt in ("f16", "bf16")
        for d in WGMMA_HEAD_SIZES
        for lay in KV_LAYOUTS
        for bias in WGMMA_BIAS_MODES
    ]
    return prefill + decode + hopper


@functools.cache
def get_prefill_kernels(spec: PrefillSpec, device_id: int) -> tuple[Any, Any, Any]:
    """The compiled ``(paged_prefill, paged_prefill_reduce, paged_prefill_plan)`` of ``spec`` on ``device_id``,
    the first allowed its dynamic shared memory (past the default 48 KB, CUDA wants it said)."""
    names = spec.name_expressions()
    module = _module("paged_prefill.cu", spec.key, names, device_id, spec.options)
    kernel = module.get_function(names[0])
    smem = spec.smem_bytes
    if smem:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel, module.get_function(names[1]), module.get_function(names[2])
