"""CPU: the kernel sources compile with NVRTC for sm_80, sm_90 and sm_90a with no GPU present, their keys read well,
and the host's mirrors of each kernel's geometry equal the kernel's own constants.

The default run compiles a representative specialisation of each kernel family on each architecture; the full sweep,
marked ``sweep`` (``pytest -m sweep``), compiles every specialisation the library can launch to PTX and ptxas builds
every kernel shape (about a quarter of an hour on two cores).
"""

from __future__ import annotations

import itertools

import pytest

from cupy_paged_attn import _compile, _specs, planning, tuning

ARCHS = ["sm_80", "sm_90"]

#: One specialisation of each family, every bias mode of it (bf16, head size 128: the common serving shape).
REPRESENTATIVES = {
    "decode_simt": [_specs.DecodeSimtSpec("bf16", 128, "nhd", 4, bias) for bias in _specs.BIAS_MODES],
    "decode_simt_cluster": [_specs.DecodeSimtSpec("bf16", 128, "vllm", 1, "t5", cluster=True)],
    "decode_mma": [_specs.DecodeMmaSpec("bf16", 128, "nhd", bias, 8) for bias in _specs.DECODE_MMA_BIAS_MODES],
    "prefill_mma": [_specs.PrefillSpec("bf16", 128, "nhd", bias) for bias in _specs.PREFILL_BIAS_MODES],
    "prefill_simt": [_specs.PrefillSpec("f32", 96, "vllm", "t5")],
    "prefill_wgmma": [_specs.PrefillSpec("bf16", 128, "nhd", bias, wgmma=True) for bias in _specs.WGMMA_BIAS_MODES],
    "cache_write": [_specs.CacheWriteSpec("bf16", "nhd", "i32"), _specs.CacheWriteSpec("f16", "vllm", "i64"),
                    _specs.CacheWriteSpec("bf16", "hnd", "i64")],
    "decode_mma_hnd": [_specs.DecodeMmaSpec("f16", 64, "hnd", "t5", 8)],
    "prefill_wgmma_hnd": [_specs.PrefillSpec("f16", 64, "hnd", "none", wgmma=True)],
    # the score options (soft-cap, sliding window), in each attention kernel
    "decode_simt_scores": [_specs.DecodeSimtSpec("f32", 64, "nhd", 2, "dense", scores=True),
                           _specs.DecodeSimtSpec("bf16", 128, "hnd", 1, "t5", scores=True)],
    "decode_mma_scores": [_specs.DecodeMmaSpec("bf16", 128, "nhd", "t5", 8, scores=True)],
    "prefill_mma_scores": [_specs.PrefillSpec("f16", 64, "vllm", "dense", scores=True),
                           _specs.PrefillSpec("f32", 128, "nhd", "none", scores=True)],
    "prefill_wgmma_scores": [_specs.PrefillSpec("bf16", 128, "nhd", "t5", wgmma=True, scores=True)],
    # fp8 caches
    "decode_simt_fp8": [_specs.DecodeSimtSpec("bf16", 128, "nhd", 1, "none", kv_cache="fp8_e4m3"),
                        _specs.DecodeSimtSpec("f16", 192, "vllm", 4, "t5", scores=True, kv_cache="fp8_e5m2"),
                        _specs.DecodeSimtSpec("bf16", 32, "hnd", 1, "ragged", kv_cache="fp8_e4m3")],
    "decode_mma_fp8": [_specs.DecodeMmaSpec("bf16", 128, "nhd", "dense-rows", 8, kv_cache="fp8_e4m3"),
                       _specs.DecodeMmaSpec("f16", 64, "vllm", "t5", 16, scores=True, kv_cache="fp8_e5m2"),
                       _specs.DecodeMmaSpec("bf16", 80, "hnd", "ragged-rows", 8, kv_cache="fp8_e4m3")],
    "cache_write_fp8": [_specs.CacheWriteSpec("bf16", "vllm", "i64", "fp8_e4m3"),
                        _specs.CacheWriteSpec("f32", "nhd", "i32", "fp8_e5m2")],
    "cache_dequantize": [_specs.CacheDequantizeSpec("bf16", "fp8_e4m3", 128, "vllm"),
                         _specs.CacheDequantizeSpec("f32", "fp8_e5m2", 80, "hnd")],
}


def _compile_all(specs: list, arch: str, optimise: bool = True) -> None:
    """Compile ``specs`` (one kernel family) for ``arch`` in one NVRTC program; every kernel is in the binary."""
    targets = {spec.offline_arch(arch) for spec in specs}
    assert len(targets) == 1 and None not in targets, targets
    names = list(dict.fromkeys(n for spec in specs for n in spec.name_expressions()))
    binary, lowered = _compile.compile_offline(specs[0].source, names, targets.pop(), optimise=optimise)
    for name in names:
        assert lowered[name].encode() in binary, f"{name} missing from the {arch} build"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", sorted(REPRESENTATIVES))
def test_each_kernel_family_compiles(family, arch):
    specs = [s for s in REPRESENTATIVES[family] if s.offline_arch(arch) is not None]
    if not specs:
        pytest.skip(f"{family} is not built for {arch}")
    _compile_all(specs, arch)


def _group_key(spec, arch: str) -> tuple[str, ...]:
    """One NVRTC program per source, dtype, layout, target architecture, fp8 format, score options and combine (the
    SIMT decode's cluster kernels apart: groups of similar size share two workers evenly)."""
    kind = ("-cluster" if getattr(spec, "cluster", False) else "") + \
           (f"-{kv}" if (kv := getattr(spec, "kv_cache", None)) else "") + \
           ("-scores" if getattr(spec, "scores", False) else "")
    return spec.source, spec.dtype, spec.layout, spec.offline_arch(arch), kind, arch


def _groups(specs: list, archs: list[str]) -> list[tuple[str, str, list]]:
    groups: dict[tuple[str, ...], list] = {}
    for spec in specs:
        for arch in archs:
            if spec.offline_arch(arch) is not None:
                groups.setdefault(_group_key(spec, arch), []).append(spec)
    return [(f"{src}-{dt}-{lay}-{target}{kind}", arch, group)
            for (src, dt, lay, target, kind, arch), group in sorted(groups.items())]


def _sweep_groups() -> list[tuple[str, str, list]]:
    """Every specialisation on every architecture it is built for."""
    return _groups(_specs.all_specs(), ARCHS)


def _optimised_sweep_groups() -> list[tuple[str, str, list]]:
    """The specialisations ptxas also builds in the sweep: every head size, bias mode, head grouping, row count,
    score option and fp8 format of each family, in one dtype (bfloat16; float32 for the SIMT prefill, which has no
    16-bit form of its own) and one layout (``nhd``), for sm_90 (sm_90a for the Hopper tiling)."""
    def chosen(spec) -> bool:
        dtype = "f32" if isinstance(spec, _specs.PrefillSpec) and spec.dtype == "f32" else "bf16"
        return spec.dtype == dtype and spec.layout == "nhd"
    return _groups([s for s in _specs.all_specs() if chosen(s)], ["sm_90"])


@pytest.mark.sweep
@pytest.mark.parametrize(("group", "arch", "specs"), _sweep_groups(), ids=[g[0] for g in _sweep_groups()])
def test_every_specialisation_compiles(group, arch, specs):
    """Unoptimised PTX (the front end: templates, ``static_assert``s, lowering), for every specialisation."""
    _compile_all(specs, arch, optimise=False)


@pytest.mark.sweep
@pytest.mark.parametrize(("group", "arch", "specs"), _optimised_sweep_groups(),
                         ids=[g[0] for g in _optimised_sweep_groups()])
def test_every_kernel_shape_builds_with_ptxas(group, arch, specs):
    """Optimised cubins, through ptxas (inline assembly against the target, shared memory per kernel), for every
    template parameter that changes the code's shape."""
    _compile_all(specs, arch)


def test_the_sweep_covers_every_specialisation():
    """The library launches 8,688 specialisations; the sweep compiles each to PTX on every architecture it is built
    for (clusters need sm_90, the Hopper tiling sm_90a, and the rest builds for both sm_80 and sm_90), and the
    bfloat16 ``nhd`` ones (float32 for the SIMT prefill) to cubins for sm_90, which leaves out no value of any other
    template parameter."""
    specs = _specs.all_specs()
    assert len(specs) == len(set(specs)) == len({s.key for s in specs})
    swept = [(arch, s) for _, arch, group in _sweep_groups() for s in group]
    assert all(s.offline_arch(arch) is not None for arch, s in swept), "a sweep group names an architecture it skips"
    assert len(swept) == len(set(swept)) == sum(s.offline_arch(a) is not None for s in specs for a in ARCHS)
    built = [s for _, _, group in _optimised_sweep_groups() for s in group]
    assert len(built) == len(set(built))
    for field in ("head_size", "heads_per_cta", "bias", "rows", "cluster", "scores", "kv_cache", "wgmma",
                  "slot_dtype"):
        for kind in {type(s) for s in specs if hasattr(s, field)}:
            values = {getattr(s, field) for s in specs if isinstance(s, kind)}
            assert values == {getattr(s, field) for s in built if isinstance(s, kind)}, (kind.__name__, field)
    counts = {kind: sum(isinstance(s, kind) for s in specs) for kind in (
        _specs.DecodeSimtSpec, _specs.DecodeMmaSpec, _specs.PrefillSpec, _specs.CacheWriteSpec,
        _specs.CacheDequantizeSpec)}
    # (each attention kernel with and without the score options; the SIMT decode's cluster kernels without them; the
    # decode kernels of fp8 caches with 16-bit queries and head sizes that are multiples of 16, the SIMT one without
    # clusters and with one query head per CTA up to head size 128; every staged bias fits beside fp8 stages)
    assert counts == {_specs.DecodeSimtSpec: 3 * 3 * 9 * 3 * 4 * 4 + 2 * 2 * 2 * 3 * 4 * (6 * 1 + 2 * 4),
                      _specs.DecodeMmaSpec: 2 * 2 * (2 * 7 * 3 * 6 - 3) + 2 * 2 * 2 * 2 * 6 * 3 * 6,
                      _specs.PrefillSpec: 2 * (3 * 9 * 3 * 3 + 2 * 2 * 3 * 2), _specs.CacheWriteSpec: 3 * 18,
                      _specs.CacheDequantizeSpec: 2 * 3 * 8 * 3}


def test_sources_inline_their_headers_once():
    for spec in (REPRESENTATIVES[f][0] for f in REPRESENTATIVES):
        text = _compile.kernel_source(spec.source)
        assert "#include \"" not in text and "namespace cpa" in text
        assert text.count("__device__ __forceinline__ float inf()") == 1  # common.cuh, through several headers
        assert spec.source == "cache_write.cu" or text.count("struct PagedCache {") == 1


def test_keys_and_name_expressions_are_readable():
    spec = _specs.DecodeSimtSpec("bf16", 128, "nhd", 4, "t5")
    assert spec.key == "decode_simt_bf16_d128_nhd_g4_bias-t5"
    assert spec.name_expressions() == (
        "cpa::decode_simt<__nv_bfloat16, __nv_bfloat16, 128, cpa::KvLayout::kNHD, 4, cpa::T5Bias, false, false>",
        "cpa::decode_simt_combine<__nv_bfloat16, 128>")
    fp8 = _specs.DecodeSimtSpec("f16", 64, "hnd", 2, "none", kv_cache="fp8_e4m3")
    assert fp8.key == "decode_simt_f16_kv-fp8_e4m3_d64_hnd_g2_bias-none"
    assert fp8.name_expressions()[0] == \
        "cpa::decode_simt<__half, cpa::Fp8E4M3, 64, cpa::KvLayout::kHND, 2, cpa::NoBias, false, false>"
    assert _specs.CacheWriteSpec("bf16", "vllm", "i32", "fp8_e5m2").name_expressions() == (
        "cpa::reshape_and_cache<__nv_bfloat16, cpa::Fp8E5M2, cpa::CacheLayout::kVLLM, int>",)
    assert _specs.DecodeSimtSpec("f16", 64, "vllm", 1, "dense", cluster=True).key == \
        "decode_simt_f16_d64_vllm_g1_bias-dense_cluster"
    mma = _specs.DecodeMmaSpec("f16", 64, "vllm", "ragged-rows", 16)
    assert mma.key == "decode_mma_f16_d64_vllm_r16_bias-ragged-rows"
    assert mma.name_expressions() == (
        "cpa::decode_mma<__half, __half, 64, cpa::KvLayout::kVLLM, cpa::RaggedRowsBias, 16, false>",
        "cpa::tile_combine<__half, 64, 16>")
    prefill = _specs.PrefillSpec("bf16", 256, "nhd", "dense")
    assert prefill.key == "prefill_mma_bf16_d256_nhd_bias-dense"
    assert prefill.name_expressions() == (
        "cpa::prefill_mma<__nv_bfloat16, 256, cpa::KvLayout::kNHD, cpa::DenseBias, false>",
        "cpa::tile_combine<__nv_bfloat16, 256, 64>", "cpa::prefill_plan")
    assert _specs.PrefillSpec("f32", 64, "nhd", "none").key == "prefill_simt_f32_d64_nhd_bias-none"
    assert _specs.PrefillSpec("f16", 64, "nhd", "t5", wgmma=True).name_expressions()[0] == \
        "cpa::prefill_wgmma<__half, 64, cpa::KvLayout::kNHD, cpa::T5Bias, false>"
    scored = _specs.DecodeMmaSpec("bf16", 64, "hnd", "none", 8, scores=True)
    assert scored.key == "decode_mma_bf16_d64_hnd_r8_bias-none_scores"
    assert scored.name_expressions()[0] == \
        "cpa::decode_mma<__nv_bfloat16, __nv_bfloat16, 64, cpa::KvLayout::kHND, cpa::NoBias, 8, true>"
    assert _specs.CacheWriteSpec("f16", "vllm", "i64").key == "cache_write_f16_vllm_slot-i64"


def test_compile_failure_carries_the_nvrtc_log():
    with pytest.raises(RuntimeError, match=r"NVRTC compilation failed:[\s\S]*no_such_kernel"):
        _compile.compile_offline("cache_write.cu", ["cpa::no_such_kernel<float>"], "sm_90")


def test_shared_memory_fits_the_ctas_per_sm():
    """Two CTAs of the largest prefill specialisation fit one H100/H200 SM (227 KB per CTA, 228 KB per SM), and the
    decode tiling's CTAs per SM fit likewise (three of 8 rows at head size 128, with two K/V stages)."""
    assert max(_specs.tile_smem_bytes(dt, d) for dt in ("f16", "bf16") for d in _specs.HEAD_SIZES) <= 113 * 1024
    for rows, d in itertools.product(_specs.DECODE_ROWS, _specs.DECODE_MMA_HEAD_SIZES):
        assert _specs.decode_ctas_per_sm(d, rows) * (_specs.tile_smem_bytes("bf16", d, rows) + 1024) <= 227 * 1024
    assert _specs.decode_ctas_per_sm(128, 8) == 3 and _specs.decode_stages(128, 8) == 2
    assert _specs.decode_ctas_per_sm(128, 16) == 2 and _specs.decode_stages(128, 16) == 3
    assert _specs.tile_smem_bytes("f32", 128) == 0


def _tile_mirrors() -> list[str]:
    t = _specs.CUDA_TYPES
    checks = []
    for dt, d, rows in itertools.product(("f16", "bf16"), _specs.HEAD_SIZES, (0, *_specs.DECODE_ROWS)):
        if rows and d not in _specs.DECODE_MMA_HEAD_SIZES:
            continue
        layout = f"cpa::TileLayout<{t[dt]}, {d}, {rows}>"
        checks += [f"static_assert({layout}::kSmemBytes == {_specs.tile_smem_bytes(dt, d, rows)}, "
                   f"\"smem {dt} d{d} rows{rows}\");",
                   f"static_assert({layout}::TILE_N == {_specs.tile_keys(d, rows)}, \"tile d{d}\");",
                   f"static_assert({layout}::ROWS == {_specs.rows_per_cta(d, rows)}, \"rows d{d} {rows}\");",
                   f"static_assert({layout}::MT == {_specs.m_tiles(d, rows)}, \"m tiles d{d}\");",
                   f"static_assert({layout}::THREADS == {_specs.TILE_THREADS}, \"threads\");"]
        if rows:
            checks += [f"static_assert({layout}::kCtasPerSm == {_specs.decode_ctas_per_sm(d, rows)}, "
                       f"\"ctas d{d} rows{rows}\");",
                       f"static_assert({layout}::STAGES == {_specs.decode_stages(d, rows)}, \"stages d{d} {rows}\");"]
        if rows and d in _specs.FP8_HEAD_SIZES:  # the decode tiling over fp8 caches
            fp8 = f"cpa::TileLayout<{t[dt]}, {d}, {rows}, false, false, true>"
            checks += [f"static_assert({fp8}::kSmemBytes == {_specs.tile_smem_bytes(dt, d, rows, fp8=True)}, "
                       f"\"fp8 smem {dt} d{d} rows{rows}\");"]
    checks += [f"static_assert(cpa::kRelTableMax == {_specs.REL_TABLE}, \"t5 table\");",
               f"static_assert(cpa::kCombineThreads == {_specs.COMBINE_THREADS}, \"combine\");",
               f"static_assert(cpa::kCombineBatch == {_specs.COMBINE_BATCH}, \"combine batch\");",
               f"static_assert(cpa::kNoWindow == {_specs.NO_WINDOW}, \"no window\");"]
    checks += [f"static_assert(cpa::combine_groups({n}) == {_specs.combine_groups(n)}, \"groups {n}\");"
               for n in range(1, 80)]
    checks += [f"static_assert(cpa::combine_vec({n}) == {_specs.combine_vec(n)}, \"vec {n}\");" for n in range(1, 80)]
    return checks


def test_host_mirrors_of_kernel_constants():
    """What the host computes about a kernel (shared memory to reserve, threads, CTAs per SM, key tile, rows per CTA)
    equals the kernel's own constants, for every specialisation: static_asserts compiled by NVRTC. A mismatch in
    shared memory would launch a CTA with less than it uses."""
    t = _specs.CUDA_TYPES
    prefill = [*_tile_mirrors(),
               f"static_assert(cpa::kSimtThreads == {_specs.SIMT_PREFILL_THREADS}, \"simt threads\");",
               f"static_assert(cpa::kSimtRowsPerCta == {_specs.SIMT_PREFILL_ROWS}, \"simt rows\");",
               f"static_assert(cpa::kPrefillPlanThreads == {_specs.PREFILL_PLAN_THREADS}, \"plan\");"]
    _compile.compile_offline("prefill.cu", [], "sm_90", "\n" + "\n".join(prefill) + "\n", optimise=False)

    hopper = []
    for dt, d in itertools.product(("f16", "bf16"), _specs.WGMMA_HEAD_SIZES):
        layout = f"cpa::TileLayout<{t[dt]}, {d}, 0, true>"
        hopper += [f"static_assert({layout}::kSmemBytes == {_specs.tile_smem_bytes(dt, d, wgmma=True)}, "
                   f"\"hopper smem {dt} d{d}\");",
                   f"static_assert({layout}::TILE_N == {_specs.tile_keys(d, wgmma=True)}, \"tile\");",
                   f"static_assert({layout}::ROWS == {_specs.WGMMA_ROWS}, \"rows\");",
                   f"static_assert({layout}::THREADS == {_specs.WGMMA_THREADS}, \"threads\");"]
    _compile.compile_offline("prefill_wgmma.cu", [], "sm_90a", "\n" + "\n".join(hopper) + "\n", optimise=False)

    decode = [f"static_assert(cpa::kDecodeThreads == {_specs.DECODE_SIMT_THREADS}, \"threads\");",
              f"static_assert(cpa::kT5NearDistances == {_specs.DECODE_T5_NEAR_DISTANCES}, \"t5 near\");",
              f"static_assert(cpa::kDecodeCombineThreads == {_specs.DECODE_COMBINE_THREADS}, \"combine\");",
              f"static_assert(cpa::kMaxLongestFirstSeqs == {_specs.MAX_LONGEST_FIRST_SEQS}, \"ranking\");",
              f"static_assert(cpa::kMaxClusterParts == {_specs.DECODE_CLUSTER_MAX_PARTS}, \"cluster\");",
              f"static_assert(cpa::kClusterMinCtas == {_specs.DECODE_CLUSTER_MIN_CTAS}, \"cluster\");"]
    for dt, d, g in itertools.product(t, _specs.HEAD_SIZES, _specs.HEADS_PER_CTA):
        layout = f"cpa::DecodeLayout<{t[dt]}, {d}, {g}>"
        spec = _specs.DecodeSimtSpec(dt, d, "nhd", g, "t5")
        decode += [f"static_assert({layout}::kSmemBytes == {_specs.DECODE_SIMT_SMEM_BYTES}, \"{dt} d{d}\");",
                   f"static_assert({layout}::kSmemBytes + {layout}::kNearBytes == {spec.smem_bytes}, \"t5\");",
                   f"static_assert({_specs.DECODE_SIMT_TILE_MULTIPLE} % {layout}::TILE == 0, \"tile\");",
                   f"static_assert({layout}::kMinCtas == {spec.max_ctas_per_sm}, \"ctas g{g}\");"]
    _compile.compile_offline("decode_simt.cu", [], "sm_90", "\n" + "\n".join(decode) + "\n", optimise=False)

    staged = []  # which decode-tiling specialisations have room to stage a float32 bias (StagedBias::kWide)
    for d, rows, fp8, bias in itertools.product(_specs.DECODE_MMA_HEAD_SIZES, _specs.DECODE_ROWS, (False, True),
                                                ("DenseRowsBias", "RaggedRowsBias")):
        if fp8 and d not in _specs.FP8_HEAD_SIZES:
            continue
        layout = f"cpa::TileLayout<__nv_bfloat16, {d}, {rows}, false, false, {str(fp8).lower()}>"
        wide = _specs.decode_bias_fits("dense-rows" if bias == "DenseRowsBias" else "ragged-rows", d, rows, fp8,
                                       element_bytes=4)
        staged.append(f"static_assert(cpa::StagedBias<{layout}, cpa::{bias}>::kWide == "
                      f"{str(wide).lower()}, \"float32 stages {bias} d{d} rows{rows} fp8 {fp8}\");")
    _compile.compile_offline("decode_mma.cu", [], "sm_90", "\n" + "\n".join(staged) + "\n", optimise=False)
    threads = f"\nstatic_assert(cpa::kCacheThreads == {_specs.CACHE_WRITE_THREADS}, \"threads\");\n"
    _compile.compile_offline("cache_write.cu", [], "sm_90", threads, optimise=False)


def test_host_mirror_check_catches_a_mismatch():
    """The static_assert route above fails loudly when host and kernel disagree."""
    wrong = "\nstatic_assert(cpa::TileLayout<__half, 64, 8>::kSmemBytes == 1, \"smem mirror\");\n"
    with pytest.raises(RuntimeError, match="smem mirror"):
        _compile.compile_offline("decode_mma.cu", [], "sm_90", wrong, optimise=False)


def test_planning_names_only_specialisations_that_exist():
    """Whatever shape planning sees, the kernel it names is one of the specialisations the sweep compiles."""
    known = set(_specs.all_specs())
    device = planning.Device.h200()
    for dt, d, heads, bias, layout in itertools.product(("f32", "f16", "bf16"), _specs.HEAD_SIZES,
                                                        ((16, 16), (32, 8), (40, 2), (8, 1)),
                                                        ("none", "dense", "ragged", "t5"), _specs.KV_LAYOUTS):
        for num_seqs, max_len in ((1, 1024), (64, 2048), (256, 65536)):
            shape = planning.DecodeShape(num_seqs, heads[0], heads[1], d, max_len, dt, layout, bias, bias_dtype=dt)
            assert planning.plan_decode(shape, device).spec in known
            if bias != "ragged":
                prefill = planning.PrefillShape(num_seqs, heads[0], heads[1], d, max_len, dt, layout, bias,
                                                bias_dtype=dt, t5_max_distance=128, total_q=num_seqs * 300)
                assert planning.plan_prefill(prefill, device).spec in known
    # fp8 caches (16-bit queries, head sizes that are multiples of 16), under every decode_kernel switch
    for kernel, fmt, dt, d, heads, bias, options in itertools.product(
            ("auto", "simt", "tensor-cores"), _specs.FP8_TYPES, ("f16", "bf16"), _specs.FP8_HEAD_SIZES,
            ((16, 16), (32, 8), (40, 2), (8, 1)), ("none", "dense", "ragged", "t5"),
            ({}, {"soft_cap": True}, {"window_left": 100})):
        for num_seqs, max_len in ((1, 1024), (64, 2048), (256, 65536)):
            shape = planning.DecodeShape(num_seqs, heads[0], heads[1], d, max_len, dt, "nhd", bias, bias_dtype=dt,
                                         kv_cache=fmt, **options)
            assert planning.plan_decode(shape, device, tuning.Tuning(decode_kernel=kernel)).spec in known
