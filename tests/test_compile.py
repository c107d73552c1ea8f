"""CPU: every kernel specialisation compiles with NVRTC for sm_80 and sm_90 (no GPU needed), and the plumbing
around compilation (source inlining, keys, errors, split planning) behaves.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import make_problem

from cupy_paged_attn import _checks, _compile, decode

ARCHS = ["sm_80", "sm_90"]


def _compile_all(filename: str, specs: list, arch: str) -> None:
    names = list(dict.fromkeys(n for spec in specs for n in spec.name_expressions()))
    cubin, lowered = _compile.compile_offline(filename, names, arch)
    for name in names:
        assert lowered[name].encode() in cubin, f"{name} missing from the {arch} cubin"


DECODE_COMPILES = [  # (dtype, layout, arch, cluster): thread block clusters are sm_90's
    combo for combo in itertools.product(_compile.CUDA_TYPES, _compile.KV_LAYOUTS, ARCHS, [False, True])
    if not (combo[3] and combo[2] == "sm_80")
]


@pytest.mark.parametrize(("dtype", "layout", "arch", "cluster"), DECODE_COMPILES)
def test_every_decode_specialisation_compiles(dtype, layout, arch, cluster):
    specs = [s for s in _compile.all_decode_specs() if (s.dtype, s.layout, s.cluster) == (dtype, layout, cluster)]
    assert len(specs) == len(_compile.HEAD_SIZES) * len(_compile.HEADS_PER_CTA) * len(_compile.BIAS_MODES)
    assert {s.offline_arch(arch) for s in specs} == {arch}
    _compile_all("paged_decode.cu", specs, arch)


def test_cluster_specialisations_are_not_built_for_sm_80():
    specs = _compile.all_decode_specs()
    assert len(specs) == 2 * len(_compile.CUDA_TYPES) * len(_compile.KV_LAYOUTS) * len(_compile.HEAD_SIZES) * \
        len(_compile.HEADS_PER_CTA) * len(_compile.BIAS_MODES)
    assert all(s.offline_arch("sm_80") is None and s.offline_arch("sm_90") == "sm_90" for s in specs if s.cluster)
    assert all(s.offline_arch("sm_80") == "sm_80" for s in specs if not s.cluster)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_cache_write_specialisation_compiles(arch):
    _compile_all("cache_write.cu", _compile.all_cache_write_specs(), arch)


def test_sources_inline_their_headers():
    for filename in ("paged_decode.cu", "cache_write.cu"):
        text = _compile.kernel_source(filename)
        assert '#include "common.cuh"' not in text and "namespace cpa" in text


def test_keys_are_readable():
    spec = _compile.DecodeSpec("bf16", 128, "nhd", 4, "t5")
    assert spec.key == "paged_decode_bf16_d128_nhd_g4_bias-t5"
    assert spec.name_expressions()[0] == \
        "cpa::paged_decode<__nv_bfloat16, 128, cpa::KvLayout::kNHD, 4, cpa::T5Bias, false>"
    cluster = _compile.DecodeSpec("f16", 64, "vllm", 1, "dense", cluster=True)
    assert cluster.key == "paged_decode_f16_d64_vllm_g1_bias-dense_cluster"
    assert cluster.name_expressions()[0] == \
        "cpa::paged_decode<__half, 64, cpa::KvLayout::kVLLM, 1, cpa::DenseBias, true>"
    assert _compile.CacheWriteSpec("f16", "vllm", "i64").key == "reshape_and_cache_f16_vllm_slot-i64"


def test_compile_failure_carries_the_nvrtc_log():
    with pytest.raises(RuntimeError, match=r"NVRTC compilation failed:[\s\S]*no_such_kernel"):
        _compile.compile_offline("cache_write.cu", ["cpa::no_such_kernel<float>"], "sm_90")


@pytest.mark.parametrize(
    ("seq_lens", "heads", "expect_split"),
    [([2048] * 64, (16, 16), False), ([4096] * 128, (32, 32), False), ([1024], (16, 16), True),
     ([65536], (32, 8), True), ([8192] * 32, (32, 8), True), ([100] * 2, (8, 8), False)],
)
def test_split_planning(rng, seq_lens, heads, expect_split):
    p = make_problem(rng, [1] * (len(seq_lens) - 1) + [seq_lens[-1]], num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=32, extra_table_cols=0, spare_blocks=0)
    problem = _checks.check_decode(*p.args(), scale=None, attn_bias=None, alibi_slopes=None, kv_layout="nhd",
                                   out=None)
    plan = decode.plan_decode(problem, num_sms=132)
    assert (plan.num_parts > 1) == expect_split
    assert plan.tokens_per_part % 128 == 0 and plan.num_parts * plan.tokens_per_part >= problem.max_len
    assert (plan.num_parts - 1) * plan.tokens_per_part < max(problem.max_len, 1), "no partition is empty"
    assert plan.grid == (len(seq_lens) * heads[1] * -(-(heads[0] // heads[1]) // plan.spec.heads_per_cta), 1,
                         plan.num_parts)
    assert (plan.reduce_grid, plan.reduce_threads) == ((len(seq_lens), heads[0], 1), 128)
    assert np.all(np.asarray(plan.grid) >= 1)


@pytest.mark.parametrize(
    ("num_seqs", "heads", "head_size", "num_sms", "switch", "expect"),
    [(64, (16, 16), 64, 132, True, True),      # ragged lengths: 1024 CTAs, two waves of 528
     (64, (16, 16), 64, 132, False, False),    # the switch off
     (256, (4, 4), 64, 132, True, True),       # the most sequences one ranking takes
     (257, (4, 4), 64, 132, True, False),      # one more
     (1, (16, 16), 64, 1, True, False),        # nothing to order
     (33, (16, 16), 64, 132, True, False),     # 528 CTAs: one wave (the tensor cores' 1.3, so the FP32 kernel)
     (2, (16, 16), 64, 4, True, True),         # a small GPU
     # Multi-head grids that fill the tensor cores unsplit (here 1.5 waves or more) run there, but for a ragged bias.
     # The tensor cores (bf16): group 4, 8 rows per CTA, three CTAs per SM (396 on 132 SMs).
     (64, (32, 8), 128, 132, True, True),      # 512 CTAs: 1.3 waves, split in three (tail_parts)
     (64, (32, 8), 128, 132, False, False),    # the switch off
     (49, (32, 8), 128, 132, True, False),     # 392 CTAs: one wave
     (128, (32, 8), 128, 132, True, True),     # 1024 CTAs: 2.6 waves, unsplit
     (256, (8, 2), 64, 132, True, True),       # the most sequences one ranking takes
     (257, (8, 2), 64, 132, True, False),      # one more
     (200, (32, 2), 128, 132, True, True)],    # group 16: 16 rows per CTA, two per SM (400 CTAs, 264 resident)
)
@pytest.mark.parametrize("bias", ["none", "dense", "ragged", "t5-causal"])
def test_longest_first_planning(rng, monkeypatch, num_seqs, heads, head_size, num_sms, switch, expect, bias):
    """Unsplit grids of more than one wave over 2 to 256 sequences take them longest first, on either kernel and
    whatever the bias; the kernel argument says so."""
    monkeypatch.setattr(decode, "LONGEST_FIRST", switch)
    p = make_problem(rng, [1] * (num_seqs - 1) + [2048], num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=head_size, dtype="bf16", bias=bias, bias_dtype="bf16", extra_table_cols=0,
                     spare_blocks=0)
    problem = _checks.check_decode(*p.args(), **p.kwargs(), out=None)
    launch = decode.plan_decode(problem, num_sms=num_sms)
    multi_head = heads[0] == heads[1] and bias != "ragged" and 2 * num_seqs * heads[1] >= 3 * 3 * num_sms
    assert launch.tensor_cores == (heads[0] > heads[1] or multi_head)
    assert launch.longest_first == expect
    assert launch.num_parts == 1 or launch.tensor_cores  # the FP32 kernel orders unsplit grids only
    assert dict(decode._kernel_arguments(problem, launch))["longest_first"] == np.int32(expect)


@pytest.mark.parametrize("slots", [396, 264, 3])
@pytest.mark.parametrize("wave", [0.5, 1.0, 1.001, 1.1, 1.29, 1.45, 1.5, 2.0, 2.2, 2.59])
def test_tail_parts(slots, wave):
    """Only a grid of between one and one and a half waves splits, into the 2 or 3 partitions whose last wave is the
    fuller; split, it still fills at least one wave and never more than 4.5."""
    ctas = max(1, round(wave * slots))
    parts = decode.tail_parts(ctas, slots)
    if not slots < ctas < 1.5 * slots:
        assert parts == 1
        return
    assert parts in (2, 3)
    last = {p: ctas * p % slots or slots for p in (2, 3)}
    assert last[parts] == max(last.values()) and (last[2] < last[3] or parts == 2)


@pytest.mark.parametrize(("batch", "max_len", "parts"), [(64, 4096, 3), (64, 2048, 3), (64, 256, 2), (64, 128, 1),
                                                         (128, 4096, 1), (32, 8192, 1)])
def test_tensor_core_tail_split_planning(rng, batch, max_len, parts):
    """B64 H32/8 d128 on 132 SMs is 512 CTAs where 396 fit: split in three (two where the keys allow no more: at
    most one partition per _MIN_PART_TOKENS keys, rounded up). B128 (2.6 waves) stays whole; B32 (256 CTAs, less
    than a wave) splits as before, within one wave."""
    p = make_problem(rng, [max_len] * batch, num_heads=32, num_kv_heads=8, head_size=128, dtype="bf16",
                     extra_table_cols=0, spare_blocks=0)
    problem = _checks.check_decode(*p.args(), scale=None, attn_bias=None, alibi_slopes=None, kv_layout="nhd",
                                   out=None)
    launch = decode.plan_decode(problem, num_sms=132)
    assert launch.tensor_cores and launch.grid == (batch * 8, 1, launch.num_parts)
    if batch == 32:
        assert launch.grid[0] * launch.num_parts <= 396 and not launch.longest_first
        return
    assert launch.num_parts == parts and launch.longest_first
    assert (launch.num_parts - 1) * launch.tokens_per_part < max_len <= launch.num_parts * launch.tokens_per_part


@pytest.mark.parametrize("smem_per_sm", [(233472, 1024), (167936, 1024), (101376, 1024)])
def test_split_grid_caps_its_ctas_per_sm(rng, smem_per_sm):
    """A split grid of the FP32 kernel asks for the shared memory that keeps a fourth CTA off each SM (H100/H200:
    228 KB per SM); where three already fill the SM (A100: 164 KB) or fewer fit (100 KB), the kernel's own size
    stays. An unsplit grid always asks for the kernel's own size, so the registers' four CTAs per SM fit."""
    def plan(seq_lens):
        p = make_problem(rng, seq_lens, num_heads=16, num_kv_heads=16, head_size=64, extra_table_cols=0,
                         spare_blocks=0)
        problem = _checks.check_decode(*p.args(), scale=None, attn_bias=None, alibi_slopes=None, kv_layout="nhd",
                                       out=None)
        return decode.plan_decode(problem, num_sms=132, smem_per_sm=smem_per_sm)

    per_sm, reserved = smem_per_sm
    split, whole = plan([1024]), plan([64] * 64)
    assert split.num_parts > 1 and whole.num_parts == 1
    assert whole.shared_mem == whole.spec.smem_bytes == _compile.DECODE_SMEM_BYTES
    assert split.shared_mem >= split.spec.smem_bytes and split.shared_mem % 16 == 0
    resident = per_sm // (split.shared_mem + reserved)
    own = per_sm // (split.spec.smem_bytes + reserved)
    assert resident == min(own, decode._SPLIT_CTAS_PER_SM)


@pytest.mark.parametrize(
    ("num_seqs", "max_len", "heads", "head_size", "dtype", "expect"),
    [(1, 1024, (16, 16), 64, "bf16", True),    # the latency case: 16 CTAs in 8 partitions, 128 of 132 SMs
     (1, 512, (16, 16), 64, "f16", True),      # 4 partitions
     (1, 700, (4, 1), 128, "f32", True),       # one CTA of 4 heads in 6 partitions
     (2, 1024, (16, 16), 64, "bf16", False),   # 256 CTAs: more than one per SM
     (1, 4096, (16, 16), 64, "bf16", False),   # 32 partitions: more than a cluster holds
     (64, 2048, (16, 16), 64, "bf16", False),  # unsplit
     (1, 1024, (32, 8), 128, "bf16", False)],  # the tensor-core kernel
)
@pytest.mark.parametrize("clusters", [True, False], ids=["clusters", "no-clusters"])
def test_cluster_combine_planning(rng, num_seqs, max_len, heads, head_size, dtype, expect, clusters):
    """A split grid of the FP32 kernel of at most 8 partitions and at most one CTA per SM combines its partitions
    in clusters where the device has them: the same grid and partitions, no reduction, no workspace, and the
    kernel's own shared memory (one wave whatever the cap)."""
    p = make_problem(rng, [1] * (num_seqs - 1) + [max_len], num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=head_size, dtype=dtype, extra_table_cols=0, spare_blocks=0)
    problem = _checks.check_decode(*p.args(), scale=None, attn_bias=None, alibi_slopes=None, kv_layout="nhd",
                                   out=None)
    smem_per_sm = (233472, 1024)
    launch = decode.plan_decode(problem, num_sms=132, smem_per_sm=smem_per_sm, clusters=clusters)
    plain = decode.plan_decode(problem, num_sms=132, smem_per_sm=smem_per_sm)
    assert launch.cluster == (expect and clusters) and not plain.cluster
    assert launch.tensor_cores or launch.spec.cluster == launch.cluster
    assert (launch.grid, launch.num_parts, launch.tokens_per_part) == (plain.grid, plain.num_parts,
                                                                       plain.tokens_per_part)
    assert launch.reduces == (launch.num_parts > 1 and not launch.cluster)
    if launch.cluster:
        assert 1 < launch.num_parts <= _compile.DECODE_CLUSTER_MAX_PARTS
        assert launch.grid[0] * launch.num_parts <= 132 and launch.shared_mem == launch.spec.smem_bytes
        assert launch.spec.max_ctas_per_sm == _compile.DECODE_CLUSTER_MIN_CTAS


@pytest.mark.parametrize(("dtype", "arch"), list(itertools.product(_compile.CUDA_TYPES, ARCHS)))
def test_every_prefill_specialisation_compiles(dtype, arch):
    specs = [s for s in _compile.all_prefill_specs() if s.dtype == dtype]
    prefill = len(_compile.HEAD_SIZES) * len(_compile.KV_LAYOUTS) * len(_compile.PREFILL_BIAS_MODES)
    decode_tc = len(_compile.KV_LAYOUTS) * sum(
        _compile.decode_bias_fits(bias, d, rows) for rows in _compile.DECODE_ROWS
        for d in _compile.DECODE_MMA_HEAD_SIZES for bias in _compile.DECODE_MMA_BIAS_MODES)
    assert decode_tc == len(_compile.KV_LAYOUTS) * (len(_compile.DECODE_ROWS) * len(_compile.DECODE_MMA_HEAD_SIZES)
                                                    * len(_compile.DECODE_MMA_BIAS_MODES) - 1)  # (d80, 8 rows, ragged)
    hopper = len(_compile.WGMMA_HEAD_SIZES) * len(_compile.KV_LAYOUTS) * len(_compile.WGMMA_BIAS_MODES)
    assert len(specs) == prefill + (decode_tc + hopper if dtype != "f32" else 0)
    by_arch: dict[str, list] = {}
    for spec in specs:  # the Hopper tiling compiles for sm_90a, and only there
        target = spec.offline_arch(arch)
        if target is not None:
            by_arch.setdefault(target, []).append(spec)
    assert sum(map(len, by_arch.values())) == len(specs) - (hopper if arch != "sm_90" and dtype != "f32" else 0)
    for target, group in by_arch.items():
        _compile_all("paged_prefill.cu", group, target)


def test_prefill_keys_and_shared_memory():
    spec = _compile.PrefillSpec("bf16", 128, "nhd", "t5")
    assert spec.key == "paged_prefill_bf16_d128_nhd_bias-t5"
    assert spec.name_expressions()[0] == \
        "cpa::paged_prefill<__nv_bfloat16, 128, cpa::KvLayout::kNHD, cpa::T5Bias, 0, false>"
    assert _compile.PrefillSpec("f32", 64, "vllm", "none").name_expressions()[0].startswith("cpa::paged_prefill_simt<")
    decode_spec = _compile.PrefillSpec("f16", 64, "vllm", "ragged", 8)
    assert decode_spec.key == "paged_prefill_f16_d64_vllm_bias-ragged_decode8"
    assert decode_spec.name_expressions()[:2] == (
        "cpa::paged_prefill<__half, 64, cpa::KvLayout::kVLLM, cpa::RaggedBias, 8, false>",
        "cpa::paged_prefill_reduce<__half, 64, 8>")
    # Two CTAs of the largest specialisation fit one H100/H200 SM (227 KB per CTA, 228 KB per SM), in either tiling.
    assert max(_compile.prefill_smem_bytes(dt, d) for dt in ("f16", "bf16") for d in _compile.HEAD_SIZES) <= 113 * 1024
    # The decode tiling's CTAs per SM fit likewise: three of 8 rows at head size 128 (two K/V stages).
    for rows in _compile.DECODE_ROWS:
        for d in _compile.DECODE_MMA_HEAD_SIZES:
            ctas = _compile.decode_ctas_per_sm(d, rows)
            assert ctas * (_compile.prefill_smem_bytes("bf16", d, rows) + 1024) <= 227 * 1024
    assert _compile.decode_ctas_per_sm(128, 8) == 3 and _compile.decode_stages(128, 8) == 2
    assert _compile.decode_ctas_per_sm(128, 16) == 2 and _compile.decode_stages(128, 16) == 3
    assert _compile.prefill_smem_bytes("f32", 128) == 0
    assert '#include "mma.cuh"' not in _compile.kernel_source("paged_prefill.cu")


@pytest.mark.parametrize(("dtype", "head_size", "heads", "tensor_cores", "rows"), [
    ("bf16", 128, (32, 8), True, 8), ("f16", 64, (40, 2), True, 16), ("bf16", 128, (64, 2), True, 16),
    ("f16", 96, (16, 2), True, 8), ("bf16", 128, (16, 16), False, 0), ("f32", 128, (32, 8), False, 0),
    ("bf16", 192, (32, 8), False, 0),
])
def test_tensor_core_decode_planning(rng, dtype, head_size, heads, tensor_cores, rows):
    """Grouped-query 16-bit decode up to head size 128 runs the tensor-core kernel: one CTA per (sequence, 8 or 16
    query heads of a group, KV head) in x and per partition in z, partitions a multiple of its 64-key tile."""
    p = make_problem(rng, [1, 5000], num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, dtype=dtype,
                     extra_table_cols=0, spare_blocks=0)
    problem = _checks.check_decode(*p.args(), scale=None, attn_bias=None, alibi_slopes=None, kv_layout="nhd",
                                   out=None)
    plan = decode.plan_decode(problem, num_sms=132)
    assert plan.tensor_cores == tensor_cores
    if tensor_cores:
        tiles = -(-(heads[0] // heads[1]) // rows)
        assert plan.grid == (2 * tiles * heads[1], 1, plan.num_parts)
        assert plan.spec.decode_rows == rows and plan.tokens_per_part % 64 == 0
        assert plan.threads == _compile.PREFILL_THREADS
        # One reduction thread per output element of the rows that hold heads (4 with one group of partitions) and
        # group of partitions (8 partitions a group, up to 8 groups).
        groups = min(8, 1 << (-(-plan.num_parts // 8) - 1).bit_length())
        assert groups == _compile.reduce_groups(plan.num_parts)
        vec = 4 if groups == 1 else 1
        head_rows = min(rows, heads[0] // heads[1]) if groups == 1 else rows
        assert (plan.reduce_grid, plan.reduce_threads) == (
            (2 * tiles * heads[1], 1, -(-head_rows * head_size * groups // (vec * 128))),
            _compile.PREFILL_REDUCE_THREADS)
    assert plan.num_parts * plan.tokens_per_part >= problem.max_len


@pytest.mark.parametrize(("dtype", "head_size", "num_seqs", "heads", "bias", "tensor_cores"), [
    ("bf16", 64, 64, (16, 16), "none", True),        # 1024 CTAs: 2.6 waves of 396 (three a SM)
    ("f16", 128, 128, (32, 32), "dense", True),
    ("bf16", 64, 64, (16, 16), "t5-causal", True),
    ("bf16", 64, 99, (4, 4), "none", True),          # 396 CTAs: one wave exactly
    ("bf16", 64, 64, (16, 16), "ragged", False),     # a ragged bias stays on the FP32 kernel
    ("bf16", 64, 33, (16, 16), "none", False),       # 528 CTAs: 1.3 waves, which the tensor cores would split
    ("bf16", 64, 37, (16, 16), "dense", False),      # 592 CTAs: 1.495 waves, still a tail split
    ("bf16", 64, 38, (16, 16), "dense", True),       # 608 CTAs: 1.54 waves, none
    ("bf16", 64, 1, (16, 16), "none", False),        # the latency case: split, on the FP32 kernel
    ("f32", 64, 64, (16, 16), "none", False),        # no float32 tensor-core decode
    ("bf16", 256, 64, (16, 16), "none", False),      # nor one past head size 128
])
def test_multi_head_tensor_core_planning(rng, monkeypatch, dtype, head_size, num_seqs, heads, bias, tensor_cores):
    """A multi-head problem runs on the tensor cores where their grid fills the GPU unsplit (a wave or more, no
    tail split) and the bias is not ragged; else on the FP32 kernel, and always there with the switch off."""
    p = make_problem(rng, [1] * (num_seqs - 1) + [300], num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=head_size, dtype=dtype, bias=bias, bias_dtype="bf16", extra_table_cols=0,
                     spare_blocks=0)
    problem = _checks.check_decode(*p.args(), **p.kwargs(), out=None)
    launch = decode.plan_decode(problem, num_sms=132)
    assert launch.tensor_cores == tensor_cores == decode.uses_tensor_cores(problem, 132)
    if tensor_cores:
        assert launch.num_parts == 1 and launch.spec.decode_rows == 8 and launch.grid == (num_seqs * heads[0], 1, 1)
    monkeypatch.setattr(decode, "TENSOR_CORE_MHA", False)
    assert not decode.plan_decode(problem, num_sms=132).tensor_cores


@pytest.mark.parametrize("kernel", ["tensor-cores", "fp32-loop"])
def test_forced_kernel_switches(rng, monkeypatch, kernel):
    """forced_kernel_switches puts every problem either kernel can take on it: a multi-head latency-sized problem
    with a ragged bias on the tensor cores, a grouped-query one on the FP32 kernel. A kernel it does not know is
    refused by name."""
    for name, value in decode.forced_kernel_switches(kernel).items():
        monkeypatch.setattr(decode, name, value)
    for heads, bias in (((4, 4), "ragged"), ((8, 2), "dense")):
        p = make_problem(rng, [5, 300], num_heads=heads[0], num_kv_heads=heads[1], head_size=64, dtype="bf16",
                         bias=bias, bias_dtype="bf16")
        problem = _checks.check_decode(*p.args(), **p.kwargs(), out=None)
        assert decode.plan_decode(problem, num_sms=132).tensor_cores == (kernel == "tensor-cores")
    with pytest.raises(ValueError, match="kernel: expected 'tensor-cores' or 'fp32-loop', got 'auto'"):
        decode.forced_kernel_switches("auto")


@pytest.mark.parametrize(("bias", "bias_dtype", "mode"), [
    ("dense", "bf16", "dense-rows"), ("dense", "f16", "dense-rows"), ("broadcast-seq", "bf16", "dense-rows"),
    ("broadcast-head", "f16", "dense-rows"), ("dense", "f32", "dense"), ("strided", "bf16", "dense"),
    ("ragged", "bf16", "ragged-rows"), ("ragged", "f16", "ragged-rows"), ("ragged", "f32", "ragged"),
    ("ragged-strided", "bf16", "ragged"), ("ragged-12-heads", "bf16", "ragged"), ("t5-causal", "bf16", "t5"),
    ("none", "bf16", "none"),
])
def test_tensor_core_decode_bias_mode(rng, bias, bias_dtype, mode):
    """The tensor-core decode copies a 16-bit bias whose elements of a tile lie side by side into shared memory with
    each tile: a dense one of adjacent keys (DenseRowsBias, "dense-rows"), a ragged one of adjacent heads whose keys
    lie a multiple of 8 elements apart (RaggedRowsBias, "ragged-rows"). A float32 one, a dense one whose keys are
    apart, a ragged one stored head-major or of 12 heads a key is read element by element. The FP32 kernel has one
    mode per kind."""
    num_heads = 12 if bias == "ragged-12-heads" else 32
    bias = bias.removesuffix("-12-heads")
    for heads, tensor_cores in (((num_heads, num_heads // 4), True), ((8, 8), False)):
        p = make_problem(rng, [5, 300], num_heads=heads[0], num_kv_heads=heads[1], head_size=128, dtype="bf16",
                         bias=bias, bias_dtype=bias_dtype)
        problem = _checks.check_decode(*p.args(), **{**p.kwargs(), "out": None})
        plan = decode.plan_decode(problem, num_sms=132)
        assert plan.tensor_cores == tensor_cores
        assert plan.spec.bias == (mode if tensor_cores else problem.bias.mode)


def test_staged_bias_only_where_it_fits():
    """A bias kind whose stages would not fit beside the CTAs per SM falls back to element-by-element loads: head
    size 80 at 8 rows (three CTAs of 71 KB each) has no "ragged-rows" specialisation; 128 has."""
    ragged = _checks.CheckedBias("ragged", strides=(32, 1, 0, 0), dtype="bf16")
    assert decode.tensor_core_bias_mode(ragged, 128, 8) == "ragged-rows"
    assert decode.tensor_core_bias_mode(ragged, 80, 16) == "ragged-rows"
    assert decode.tensor_core_bias_mode(ragged, 80, 8) == "ragged"
    assert all(s.bias != "ragged-rows" or (s.head_size, s.decode_rows) != (80, 8) for s in _compile.all_prefill_specs())


@pytest.mark.parametrize(("dtype", "head_size", "rows", "tile"), [
    ("bf16", 64, 128, 64), ("f16", 128, 128, 32), ("bf16", 96, 128, 32), ("bf16", 256, 64, 32), ("f32", 128, 64, 32),
])
def test_prefill_planning(rng, dtype, head_size, rows, tile):
    """Prefill M tiles: 128 packed rows (two m tiles per warp) on the tensor cores up to head size 128, 64 past it
    and on the float32 SIMT kernel; a grid of ceil(total_q·G / rows) + num_seqs tiles, partitions whole key tiles."""
    from prefill_helpers import make_prefill_problem

    from cupy_paged_attn import prefill

    p = make_prefill_problem(rng, [(300, 300), (77, 7), (0, 0), (1000, 1)], num_heads=8, num_kv_heads=2,
                             head_size=head_size, dtype=dtype)
    problem = _checks.check_prefill(*p.args(), causal=True, scale=None, attn_bias=None, alibi_slopes=None,
                                    kv_layout="nhd", out=None)
    for sms in (1, 10**6):  # never split; split as far as the keys allow
        launch = prefill.plan_prefill(problem, sms)
        assert launch.rows == rows == _compile.prefill_rows_per_cta(dtype, head_size)
        assert launch.num_tiles == -(-308 * 4 // rows) + 4
        assert launch.tokens_per_part % tile == 0 and launch.num_parts * launch.tokens_per_part >= 1000
        assert (launch.num_parts > 1) == (sms > 1)
    for parts in (1, 2, 9, 33, 200):
        elems = _compile.PREFILL_REDUCE_THREADS // _compile.reduce_groups(parts) * _compile.reduce_vec(parts)
        assert _compile.reduce_chunks(rows, head_size, parts) * elems >= rows * head_size


@pytest.mark.parametrize(("dtype", "head_size", "hopper"), [
    ("bf16", 128, True), ("f16", 64, True), ("bf16", 96, False), ("bf16", 256, False), ("f32", 128, False),
])
def test_hopper_tiling_planning(rng, dtype, head_size, hopper):
    """On a device that runs sm_90a code, 16-bit head sizes 64 and 128 take the Hopper tiling: 256 threads (two
    warpgroups), the same 128 rows per CTA (so the same grid and reduction), 64-key tiles, its own key and options."""
    from prefill_helpers import make_prefill_problem

    from cupy_paged_attn import prefill

    p = make_prefill_problem(rng, [(300, 300), (1000, 1)], num_heads=8, num_kv_heads=2, head_size=head_size,
                             dtype=dtype)
    problem = _checks.check_prefill(*p.args(), causal=True, scale=None, attn_bias=None, alibi_slopes=None,
                                    kv_layout="nhd", out=None)
    plain = prefill.plan_prefill(problem, 10**6)
    launch = prefill.plan_prefill(problem, 10**6, wgmma=True)
    assert not plain.spec.wgmma and launch.spec.wgmma == hopper
    assert (launch.rows, launch.num_tiles) == (plain.rows, plain.num_tiles)
    if hopper:
        spec = launch.spec
        assert spec.threads == _compile.WGMMA_THREADS == 256 and launch.tokens_per_part % 64 == 0
        assert spec.key.endswith("_wgmma") and "-arch=sm_90a" in spec.options
        assert spec.name_expressions()[0].endswith(", 0, true>")
        assert (spec.offline_arch("sm_90"), spec.offline_arch("sm_80")) == ("sm_90a", None)
        assert _compile.prefill_smem_bytes(dtype, head_size, wgmma=True) <= 227 * 1024
    else:
        assert launch == plain


@pytest.mark.parametrize(("kv_heads", "max_distance", "hopper"), [(8, 128, True), (2, 128, True), (1, 128, False),
                                                                  (8, 800, True), (8, 900, False), (2, 20, True)])
def test_hopper_tiling_needs_the_whole_t5_table(rng, kv_heads, max_distance, hopper):
    """The Hopper tiling reads T5 only from a CTA's table in shared memory (G·(2·(max_distance + 64 + span) + 1)
    floats of at most 2048, span the positions of its 128 rows); larger ones run on the mma.sync tiling."""
    from prefill_helpers import make_prefill_problem

    import cupy_paged_attn as cpa
    from cupy_paged_attn import prefill

    p = make_prefill_problem(rng, [(300, 300), (77, 7)], num_heads=8, num_kv_heads=kv_heads, head_size=128,
                             dtype="bf16", bias="t5-causal")
    bias = cpa.RelativePositionBias(np.asarray(p.attn_bias.table), num_buckets=32, max_distance=max_distance)
    problem = _checks.check_prefill(*p.args(), causal=True, scale=None, attn_bias=bias, alibi_slopes=None,
                                    kv_layout="nhd", out=None, bias_arrays=_checks.bias_operands(bias))
    assert prefill._t5_table_fits(problem) == hopper
    assert prefill.plan_prefill(problem, 132, wgmma=True).spec.wgmma == hopper


def test_hopper_tiling_leaves_a_dense_bias_to_mma_sync(rng):
    """A dense bias runs on the mma.sync tiling even where the Hopper tiling could (it measured faster there)."""
    from prefill_helpers import make_prefill_problem

    from cupy_paged_attn import prefill

    p = make_prefill_problem(rng, [(300, 300), (77, 7)], num_heads=8, num_kv_heads=2, head_size=128, dtype="bf16",
                             bias="dense")
    problem = _checks.check_prefill(*p.args(), causal=True, scale=None, attn_bias=p.attn_bias, alibi_slopes=None,
                                    kv_layout="nhd", out=None, bias_arrays=_checks.bias_operands(p.attn_bias))
    assert problem.bias.mode == "dense" and not prefill.plan_prefill(problem, 132, wgmma=True).spec.wgmma


@pytest.mark.parametrize("ctas", [1, 8, 32, 100, 263, 264, 1000])
@pytest.mark.parametrize("max_len", [1, 300, 8192, 65536])
def test_one_wave_split(ctas, max_len):
    """With ``resident``, a split never makes a second wave, never an empty partition, and partitions are whole
    tiles, at most one per _MIN_PART_TOKENS keys (rounded up)."""
    tokens, parts = decode.split_keys(ctas, max_len, 132, 64, resident=2)
    assert ctas * parts <= max(ctas, 2 * 132)
    assert tokens % 64 == 0 and parts * tokens >= max_len and (parts - 1) * tokens < max(max_len, 1)
    assert parts <= max(1, -(-max_len // decode._MIN_PART_TOKENS))


def test_host_mirrors_of_kernel_constants():
    """What the host computes about a kernel (shared memory to reserve, threads, CTAs per SM, key tile, rows per CTA)
    equals the kernel's own constants, for every specialisation: static_asserts compiled by NVRTC. A mismatch in
    shared memory would launch a CTA with less than it uses."""
    t = _compile.CUDA_TYPES
    checks = []
    for dt in ("f16", "bf16"):
        for d in _compile.HEAD_SIZES:
            for rows in (0, *_compile.DECODE_ROWS):
                if rows and d not in _compile.DECODE_MMA_HEAD_SIZES:
                    continue
                layout = f"cpa::PrefillLayout<{t[dt]}, {d}, {rows}>"
                checks += [f"static_assert({layout}::kSmemBytes == {_compile.prefill_smem_bytes(dt, d, rows)}, "
                           f"\"smem {dt} d{d} rows{rows}\");",
                           f"static_assert({layout}::TILE_N == {_compile.prefill_tile_keys(d, rows)}, \"tile d{d}\");",
                           f"static_assert({layout}::ROWS == {_compile.rows_per_cta(d, rows)}, \"rows d{d} {rows}\");",
                           f"static_assert({layout}::MT == {_compile.prefill_m_tiles(d, rows)}, \"m tiles d{d}\");"]
                if rows:
                    checks += [f"static_assert({layout}::kCtasPerSm == {_compile.decode_ctas_per_sm(d, rows)}, "
                               f"\"ctas d{d} rows{rows}\");",
                               f"static_assert({layout}::STAGES == {_compile.decode_stages(d, rows)}, "
                               f"\"stages d{d} rows{rows}\");"]
    for dt in ("f16", "bf16"):
        for d in _compile.WGMMA_HEAD_SIZES:
            layout = f"cpa::PrefillLayout<{t[dt]}, {d}, 0, true>"
            checks += [f"static_assert({layout}::kSmemBytes == {_compile.prefill_smem_bytes(dt, d, wgmma=True)}, "
                       f"\"hopper smem {dt} d{d}\");",
                       f"static_assert({layout}::TILE_N == {_compile.prefill_tile_keys(d, wgmma=True)}, \"tile\");",
                       f"static_assert({layout}::ROWS == {_compile.prefill_rows_per_cta(dt, d)}, \"rows\");",
                       f"static_assert({layout}::THREADS == {_compile.WGMMA_THREADS}, \"threads\");"]
    checks.append(f"static_assert(cpa::kPrefillThreads == {_compile.PREFILL_THREADS}, \"threads\");")
    checks.append(f"static_assert(cpa::kRelTableMax == {_compile.PREFILL_REL_TABLE}, \"t5 table\");")
    checks.append(f"static_assert(cpa::kPrefillReduceThreads == {_compile.PREFILL_REDUCE_THREADS}, \"reduce\");")
    checks.append(f"static_assert(cpa::kSimtRowsPerCta == {_compile.SIMT_ROWS_PER_CTA}, \"simt rows\");")
    checks.append(f"static_assert(cpa::kReduceBatch == {_compile.PREFILL_REDUCE_BATCH}, \"reduce batch\");")
    checks += [f"static_assert(cpa::reduce_groups({n}) == {_compile.reduce_groups(n)}, \"groups {n}\");"
               for n in range(1, 80)]
    checks += [f"static_assert(cpa::reduce_vec({n}) == {_compile.reduce_vec(n)}, \"vec {n}\");" for n in range(1, 80)]
    _compile.compile_offline("paged_prefill.cu", [], "sm_90", "\n" + "\n".join(checks) + "\n")

    decode_checks = [f"static_assert(cpa::kDecodeThreads == {decode._THREADS}, \"threads\");",
                     f"static_assert(cpa::kT5NearDistances == {_compile.DECODE_T5_NEAR_DISTANCES}, \"t5 near\");",
                     f"static_assert(cpa::kReduceThreads == {decode._REDUCE_THREADS}, \"reduce\");",
                     f"static_assert(cpa::kMaxLongestFirstSeqs == {decode._MAX_LONGEST_FIRST_SEQS}, \"ranking\");",
                     f"static_assert(cpa::kMaxClusterParts == {_compile.DECODE_CLUSTER_MAX_PARTS}, \"cluster\");",
                     f"static_assert(cpa::kClusterMinCtas == {_compile.DECODE_CLUSTER_MIN_CTAS}, \"cluster\");"]
    for dt in t:
        for d in _compile.HEAD_SIZES:
            for g in _compile.HEADS_PER_CTA:
                layout = f"cpa::DecodeLayout<{t[dt]}, {d}, {g}>"
                spec = _compile.DecodeSpec(dt, d, "nhd", g, "t5")
                smem = _compile.DECODE_SMEM_BYTES
                decode_checks += [f"static_assert({layout}::kSmemBytes == {smem}, \"{dt} d{d}\");",
                                  f"static_assert({layout}::kSmemBytes + {layout}::kNearBytes == {spec.smem_bytes}, "
                                  "\"t5\");",
                                  f"static_assert({decode._TILE_MULTIPLE} % {layout}::TILE == 0, \"tile\");",
                                  f"static_assert({layout}::kMinCtas == {spec.max_ctas_per_sm}, \"ctas g{g}\");"]
    _compile.compile_offline("paged_decode.cu", [], "sm_90", "\n" + "\n".join(decode_checks) + "\n")


def test_host_mirror_check_catches_a_mismatch():
    """The static_assert route above fails loudly when host and kernel disagree."""
    wrong = "\nstatic_assert(cpa::PrefillLayout<__half, 64, 4>::kSmemBytes == 1, \"smem mirror\");\n"
    with pytest.raises(RuntimeError, match="smem mirror"):
        _compile.compile_offline("paged_prefill.cu", [], "sm_90", wrong)


def test_packed_args_are_what_cuLaunchKernel_reads():
    """_PackedArgs holds one 8-byte slot per argument, a 4-byte one in the slot's low half, and an array of the slots'
    addresses (kernelParams); a write after packing lands in the slot the launch reads."""
    import ctypes

    named = [("ptr", np.uint64(2**63 + 5)), ("n", np.int32(-7)), ("scale", np.float32(0.125)), ("stride", np.int64(-3))]
    args = decode._PackedArgs(named)
    params = (ctypes.c_void_p * len(named)).from_address(args.address)
    read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_int64]
    assert [t.from_address(p).value for t, p in zip(read, params, strict=True)] == [2**63 + 5, -7, 0.125, -3]
    args.set_pointer("ptr", 0xDEAD0000)
    args.set("n", np.int32(9))
    assert ctypes.c_uint64.from_address(params[0]).value == 0xDEAD0000
    assert ctypes.c_int32.from_address(params[1]).value == 9
    assert ctypes.c_uint32.from_address(params[1] + 4).value == 0  # the high half of a 4-byte argument's slot


def test_launch_ex_structs_match_the_driver_abi():
    """The ctypes mirrors of cuLaunchKernelEx's structs have cuda.h's layout (CUDA 12 and 13, 64-bit):
    CUlaunchAttribute is an int id, 4 bytes of padding and a 64-byte value union (72 bytes); CUlaunchConfig is six
    unsigned dims and the shared-memory size (28 bytes), the stream at 32, the attributes at 40, their count at 48
    (56 bytes). Programmatic stream serialisation is attribute 6 with the value 1, a cluster's dimensions attribute
    4 with three unsigned values (CUlaunchAttributeValue's clusterDim)."""
    import ctypes

    assert ctypes.sizeof(decode._LaunchAttribute) == 72 and decode._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(decode._LaunchConfig) == 56
    assert [getattr(decode._LaunchConfig, f).offset for f in ("shared_mem", "stream", "attrs", "num_attrs")] == \
        [24, 32, 40, 48]
    args = decode._PackedArgs([("n", np.int32(5))])
    for dependent, cluster in ((True, None), (False, (1, 1, 8)), (True, (1, 1, 3)), (False, None)):
        launch = decode._LaunchEx(0x1234, (3, 2, 1), 128, args, 4096, dependent=dependent, cluster=cluster)
        assert list(launch._config.grid) == [3, 2, 1] and list(launch._config.block) == [128, 1, 1]
        assert launch._config.shared_mem == 4096
        expected = ([(6, [1, 0, 0])] if dependent else []) + ([(4, list(cluster))] if cluster else [])
        attrs = [launch._config.attrs[i] for i in range(launch._config.num_attrs)]
        assert [(a.id, list(a.value)) for a in attrs] == expected
    # Without a driver (this CPU machine) there is no cuLaunchKernelEx, and nothing fails on import or lookup.
    assert decode._launch_kernel_ex() is None or callable(decode._launch_kernel_ex())
