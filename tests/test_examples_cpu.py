"""The serving-loop example runs on the CPU (NumPy path) as a subprocess, small and fast, and ends with its check
line; the tensor-parallel example exits cleanly where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_serving_loop_on_the_cpu():
    done = run_example("examples/serving_loop.py", "--cpu", "--steps", "16", "--sequences", "6", "--head-size",
                       "32", "--num-blocks", "16", "--block-size", "8")
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("serving loop: ") and last.endswith(" OK"), done.stdout


def test_tensor_parallel_exits_cleanly_without_two_gpus():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the example runs for real (a GPU command)")
    done = run_example("examples/tensor_parallel.py")
    assert done.returncode == 0, done.stderr
    assert "needs 2 CUDA GPUs" in done.stdout
