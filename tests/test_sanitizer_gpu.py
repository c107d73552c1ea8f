"""GPU: the hostile device data of tests/gpu/sanitize_cases.py (block ids outside the cache, negative and huge
lengths, ragged offsets outside their rows, T5 buckets outside the table, query_start_loc out of order, slots past
the cache; every decode path, prefill, fp8 caches, the cache write) under compute-sanitizer memcheck: no access
outside an allocation. Skipped where compute-sanitizer is not installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def test_hostile_device_data_under_memcheck():
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sanitizer, "--tool", "memcheck", "--leak-check", "no", "--error-exitcode", "3",
                          "--print-limit", "20", sys.executable, str(ROOT / "tests" / "gpu" / "sanitize_cases.py"),
                          "--hostile"], capture_output=True, text=True, timeout=600, env=env)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "ok  hostile indices (no fault)" in log and "ERROR SUMMARY: 0 errors" in log, log[-4000:]
