"""The examples as subprocesses: the serving loop and transformers' continuous batching on the CPU (NumPy path), small
and fast, each ending with its check line; an example that cannot run here says why and exits 3, or 0 with
--skip-missing; on a GPU, each quickstart checks its result against the float64 reference and prints OK (the serving
loop and T5 generation run there in benchmarks/gpu.sh, at full size)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_serving_loop_on_the_cpu():
    done = run_example("examples/serving_loop.py", "--cpu", "--steps", "16", "--sequences", "6", "--head-size",
                       "32", "--num-blocks", "16", "--block-size", "8")
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("serving loop: ") and last.endswith(" OK"), done.stdout


def test_transformers_serving_on_the_cpu():
    pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5.24")
    done = run_example("examples/transformers_serving.py", "--cpu", "--requests", "5", "--tokens", "8")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "tokens identical to sdpa: True" in done.stdout and lines[-1] == "OK", done.stdout
    gpu_only = run_example("examples/transformers_serving.py", "--cpu", "--preset", "1b")
    assert gpu_only.returncode == 3 and "--preset 1b needs a CUDA GPU" in gpu_only.stderr, gpu_only.stderr


@pytest.mark.parametrize("example", ["tensor_parallel", "quickstart_torch", "quickstart_jax", "quickstart_cupy",
                                     "t5_generate", "transformers_serving"])
def test_an_example_that_cannot_run_says_why(example):
    if example in ("t5_generate", "transformers_serving") and all(
            importlib.util.find_spec(m) for m in ("torch", "transformers")):
        pytest.skip(f"{example} runs here (on the CPU without a GPU): tested on the CPU")
    done = run_example(f"examples/{example}.py")
    if done.returncode == 0:
        pytest.skip(f"{example} runs here (it needs a GPU command)")
    assert done.returncode == 3 and done.stderr.startswith("cannot run: "), done.stderr
    assert "--skip-missing" in done.stderr
    skipped = run_example(f"examples/{example}.py", "--skip-missing")
    assert skipped.returncode == 0 and skipped.stdout.startswith("skipped: "), skipped.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("example", ["quickstart_cupy", "quickstart_torch", "quickstart_jax"])
def test_quickstart_on_the_gpu(example):
    done = run_example(f"examples/{example}.py", timeout=300)
    if done.returncode == 3:  # a framework missing on this GPU machine
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "OK", done.stdout
