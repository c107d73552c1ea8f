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


@pytest.mark.parametrize(("dtype", "layout", "arch"), list(itertools.product(_compile.CUDA_TYPES, _compile.KV_LAYOUTS,
                                                                            ARCHS)))
def test_every_decode_specialisation_compiles(dtype, layout, arch):
    specs = [s for s in _compile.all_decode_specs() if s.dtype == dtype and s.layout == layout]
    assert len(specs) == len(_compile.HEAD_SIZES) * len(_compile.HEADS_PER_CTA) * len(_compile.BIAS_MODES)
    _compile_all("paged_decode.cu", specs, arch)


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
    assert plan.grid == (len(seq_lens), heads[1] * -(-(heads[0] // heads[1]) // plan.spec.heads_per_cta),
                         plan.num_parts)
    assert np.all(np.asarray(plan.grid) >= 1)


@pytest.mark.parametrize(("dtype", "arch"), list(itertools.product(_compile.CUDA_TYPES, ARCHS)))
def test_every_prefill_specialisation_compiles(dtype, arch):
    specs = [s for s in _compile.all_prefill_specs() if s.dtype == dtype]
    assert len(specs) == len(_compile.HEAD_SIZES) * len(_compile.KV_LAYOUTS) * len(_compile.PREFILL_BIAS_MODES)
    _compile_all("paged_prefill.cu", specs, arch)


def test_prefill_keys_and_shared_memory():
    spec = _compile.PrefillSpec("bf16", 128, "nhd", "t5")
    assert spec.key == "paged_prefill_bf16_d128_nhd_bias-t5"
    assert spec.name_expressions()[0] == "cpa::paged_prefill<__nv_bfloat16, 128, cpa::KvLayout::kNHD, cpa::T5Bias>"
    assert _compile.PrefillSpec("f32", 64, "vllm", "none").name_expressions()[0].startswith("cpa::paged_prefill_simt<")
    # Two CTAs of the largest specialisation fit one H100/H200 SM (227 KB per CTA, 228 KB per SM).
    assert max(_compile.prefill_smem_bytes(dt, d) for dt in ("f16", "bf16") for d in _compile.HEAD_SIZES) <= 113 * 1024
    assert _compile.prefill_smem_bytes("f32", 128) == 0
    assert '#include "mma.cuh"' not in _compile.kernel_source("paged_prefill.cu")
