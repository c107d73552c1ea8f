"""The command line (``python -m cupy_paged_attn``): info plans a shape, check passes here, errors name the option.
GPU-only parts (the GPU check, bench) run in ``test_cli_gpu``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPU_COUNT

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cupy_paged_attn", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_info_plans_a_decode_and_a_prefill_shape():
    result = cli("info", "--decode", "64,32/8,128,4096", "--prefill", "4,32/32,128,4096,512", "--bias", "t5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("cupy-paged-attn ") and "NVRTC:" in out and "kernel cache" in out and "tuning:" in out
    if not GPU_COUNT:  # planned for an H200, where the answer is known
        assert "kernel decode_mma_bf16_d128_nhd_r8_bias-t5" in out and "grid (512, 1, 3)" in out
        assert "3 partition(s) of 1408, combined by the combine kernel, sequences longest first" in out
        assert "kernel prefill_wgmma_bf16_d128_nhd_bias-t5" in out and "q_len 512" in out


@pytest.mark.parametrize(("args", "message"), [
    (["info", "--decode", "1,33/8,128,4096"], "--decode: expected B,HQ/HKV,D,L"),
    (["info", "--prefill", "1,8/8,100,64"], "head size 100 is not supported"),
    (["info", "--dtype", "f64"], "invalid choice: 'f64'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_are_named(args, message):
    result = cli(*args)
    assert result.returncode != 0 and message in result.stderr + result.stdout


@pytest.mark.skipif(GPU_COUNT > 0, reason="the CPU check")
def test_check_and_bench_without_a_gpu():
    check = cli("check")
    assert check.returncode == 0, check.stderr
    assert "checking the NumPy path" in check.stderr and "every case matches the float64 reference" in check.stdout
    bench = cli("bench")
    assert bench.returncode == 2 and "no GPU found" in bench.stderr


@pytest.mark.gpu
def test_cli_gpu(tmp_path):
    check = cli("check", "--quick", timeout=600)
    assert check.returncode == 0 and "every case matches" in check.stdout, check.stdout + check.stderr
    bench = cli("bench", "--reps", "3", "--out", str(tmp_path), timeout=600)
    assert bench.returncode == 0, bench.stderr
    assert (tmp_path / "bench.md").read_text().count("| decode B") == 9
