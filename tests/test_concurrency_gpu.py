"""GPU: ``paged_attention`` under concurrency.

* Threads: two Python threads, each on its own ``torch.cuda.Stream``, call ``paged_attention`` at once for a few
  seconds (first calls included, so both may compile at the same time), on problems of different
  specialisations and of the same one. Every result is checked against the float64 reference. Each launch reads
  a query that was rewritten on the thread's stream behind a GPU sleep just before: a launch on any other stream
  would read the previous query and give the other answer.
* Processes: two fresh interpreters compile the same unusual specialisation into one empty kernel cache
  (``CUPY_CACHE_DIR``, read when CuPy is imported) at the same moment; both must be right and leave whole cubin
  files; a third process on the warm cache must be right without adding or rewriting any file.

A second GPU is covered in ``test_decode_gpu.py::test_second_gpu``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import DTYPES, Problem, assert_close, make_problem

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import paged_attention_ref, to_numpy

pytestmark = pytest.mark.gpu

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

THREAD_SECONDS = 3.0  # each thread launches until this much time has passed since both started
MIN_LAUNCHES = 20  # and at least this many launches, however slow the first (compiling) call was
SLEEP_CYCLES = 1_000_000  # GPU sleep before each query rewrite (~0.5 ms): longer than a call's host time
JOIN_SLACK_S = 300.0  # beyond THREAD_SECONDS, for the first calls' compiles
# Two specialisations that differ in dtype, head size, page size, GQA ratio and bias mode.
SPEC_A = {"seq_lens": [1, 37, 300, 2000], "num_heads": 8, "num_kv_heads": 2, "head_size": 128, "dtype": "bf16",
          "bias": "dense", "bias_dtype": "bf16", "alibi": True}
SPEC_B = {"seq_lens": [513, 16, 2, 1500], "num_heads": 4, "num_kv_heads": 4, "head_size": 64, "dtype": "f16",
          "block_size": 8, "bias": "none"}

# The process test's specialisation: no other test is likely to have it cached (head size 112, f16, vLLM layout,
# GQA ratio 7, f16 bias).
PROCESS_PROBLEM = {"num_heads": 14, "num_kv_heads": 2, "head_size": 112, "dtype": "f16", "kv_layout": "vllm",
                   "bias": "dense", "bias_dtype": "f16"}
PROCESS_SEQ_LENS = [77, 5, 300]
PROCESS_TIMEOUT_S = 300
CHILD_SCRIPT = """
import json, os, sys, time
import cupy
import numpy as np
from helpers import assert_close, make_problem
import cupy_paged_attn as cpa
from cupy_paged_attn.reference import paged_attention_ref, to_numpy

sync_dir, name, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
p = make_problem(np.random.default_rng(), spec.pop("seq_lens"), **spec)
args = [cupy.asarray(np.ascontiguousarray(a)) for a in p.args()]
kwargs = {**p.kwargs(), "attn_bias": cupy.asarray(np.ascontiguousarray(p.attn_bias))}
cupy.cuda.Device().synchronize()
open(os.path.join(sync_dir, "ready-" + name), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(sync_dir, "go")):  # start the first call together with the other process
    if time.monotonic() > deadline:
        sys.exit(name + ": no go signal")
    time.sleep(0.001)
start = time.perf_counter()
out = cpa.paged_attention(*args, **kwargs)
cupy.cuda.get_current_stream().synchronize()
seconds = time.perf_counter() - start
result, expected = to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs())
assert_close(result, expected, spec["dtype"], name)
print(f"max_err={float(np.abs(result.astype(np.float64) - expected).max())!r} first_call_s={seconds!r}")
"""


# ---------------------------------------------------------------------------------------------------------------
# Threads on their own streams
# ---------------------------------------------------------------------------------------------------------------
def to_torch(arr: np.ndarray | None) -> Any:
    """A contiguous torch CUDA copy of a NumPy array (bfloat16 through its bits)."""
    import torch

    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    if arr.dtype == DTYPES["bf16"]:
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16).to("cuda")
    return torch.from_numpy(arr).to("cuda")


@dataclass
class ThreadJob:
    """One thread's problem, two queries it alternates between, and the reference answer for each."""

    problem: Problem
    dtype: str
    queries: tuple[np.ndarray, np.ndarray]
    expected: tuple[np.ndarray, np.ndarray]


def make_job(rng: np.random.Generator, spec: dict[str, Any]) -> ThreadJob:
    spec = dict(spec)
    p = make_problem(rng, spec.pop("seq_lens"), **spec)
    other = rng.standard_normal(p.query.shape).astype(p.query.dtype)
    expected = []
    for query in (p.query, other):
        expected.append(paged_attention_ref(query, *p.args()[1:], **p.kwargs()))
    assert not np.allclose(expected[0], expected[1]), "the two queries must give different answers"
    return ThreadJob(p, spec["dtype"], (p.query, other), (expected[0], expected[1]))


def launch_loop(job: ThreadJob, barrier: threading.Barrier, stop: threading.Event) -> dict[str, float]:
    """Launch on a private stream until time is up, checking every result; returns launches and the interval."""
    import torch

    p = job.problem
    args = [to_torch(a) for a in p.args()]
    kwargs = {**p.kwargs(), "attn_bias": to_torch(p.attn_bias), "alibi_slopes": to_torch(p.alibi_slopes)}
    queries = [to_torch(q) for q in job.queries]
    query, out = args[0], torch.empty_like(args[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the copies above ran on this thread's default stream
    barrier.wait(timeout=120)
    started = time.monotonic()
    deadline = started + THREAD_SECONDS
    launches = 0
    with torch.cuda.stream(stream):
        while (time.monotonic() < deadline or launches < MIN_LAUNCHES) and not stop.is_set():
            k = launches % 2
            torch.cuda._sleep(SLEEP_CYCLES)  # a launch on another stream would overtake the rewrite below
            query.copy_(queries[k])
            use_out = launches % 4 >= 2  # both the allocating path and out=
            if use_out:
                out.fill_(float("nan"))
            result = cpa.paged_attention(query, *args[1:], **kwargs, out=out if use_out else None)
            assert result is out or not use_out, "out= must be returned"
            stream.synchronize()
            assert_close(to_numpy(result), job.expected[k], job.dtype, f"launch {launches}, query {k}")
            launches += 1
    return {"launches": launches, "start": started, "end": time.monotonic()}


def run_threads(jobs: list[ThreadJob]) -> list[dict[str, float]]:
    """Run one thread per job at once; any exception in any thread fails the test with its traceback."""
    barrier, stop = threading.Barrier(len(jobs)), threading.Event()
    errors: list[str] = []
    stats: list[dict[str, float]] = [{} for _ in jobs]

    def worker(i: int) -> None:
        try:
            stats[i] = launch_loop(jobs[i], barrier, stop)
        except BaseException:
            errors.append(f"thread {i}:\n{traceback.format_exc()}")
            stop.set()  # end the other threads early
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,), name=f"paged-attention-{i}") for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=THREAD_SECONDS + JOIN_SLACK_S)
    stop.set()
    assert not any(t.is_alive() for t in threads), "a thread did not finish in time"
    assert not errors, "\n".join(errors)
    return stats


@pytest.mark.parametrize("specs", [(SPEC_A, SPEC_B), (SPEC_A, SPEC_A)],
                         ids=["different-specialisations", "same-specialisation"])
def test_threads_on_own_streams(rng, specs):
    pytest.importorskip("torch")
    jobs = [make_job(rng, spec) for spec in specs]
    stats = run_threads(jobs)
    for i, s in enumerate(stats):
        assert s["launches"] >= MIN_LAUNCHES, f"thread {i} launched {s['launches']} times"
        assert s["end"] - s["start"] >= THREAD_SECONDS, f"thread {i} stopped early"
    assert max(s["start"] for s in stats) < min(s["end"] for s in stats), "the threads did not run at the same time"
    print(f"launches per thread: {[s['launches'] for s in stats]}")


# ---------------------------------------------------------------------------------------------------------------
# Processes sharing one kernel cache
# ---------------------------------------------------------------------------------------------------------------
def child_env(cache_dir: Path) -> dict[str, str]:
    """The environment of a child: a given CuPy kernel cache on disk, the repository and tests/ importable."""
    env = dict(os.environ)
    env.pop("CUPY_CACHE_IN_MEMORY", None)  # the disk cache is what is tested, and only its cubins are expected
    env.pop("CUPY_CACHE_SAVE_CUDA_SOURCE", None)
    env["CUPY_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


def start_child(name: str, cache_dir: Path, sync_dir: Path) -> subprocess.Popen[str]:
    spec = json.dumps({"seq_lens": PROCESS_SEQ_LENS, **PROCESS_PROBLEM})
    return subprocess.Popen([sys.executable, "-c", CHILD_SCRIPT, str(sync_dir), name, spec], env=child_env(cache_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_child(name: str, proc: subprocess.Popen[str]) -> dict[str, float]:
    """Wait for a child; it must exit 0 and report its error and first-call time."""
    try:
        stdout, stderr = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{name}: no answer in {PROCESS_TIMEOUT_S} s\n{stdout}\n{stderr}")
    assert proc.returncode == 0, f"{name}: exit status {proc.returncode}\n{stdout}\n{stderr}"
    match = re.search(r"max_err=(\S+) first_call_s=(\S+)", stdout)
    assert match, f"{name}: no result line in\n{stdout}\n{stderr}"
    return {"max_err": float(match.group(1)), "first_call_s": float(match.group(2))}


def wait_ready(names: list[str], procs: list[subprocess.Popen[str]], sync_dir: Path) -> None:
    """Wait until every child has imported and built its inputs (or fail with the one that died)."""
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while not all((sync_dir / f"ready-{name}").exists() for name in names):
        for name, proc in zip(names, procs, strict=True):
            if proc.poll() is not None and not (sync_dir / f"ready-{name}").exists():
                finish_child(name, proc)  # reports its output
                pytest.fail(f"{name} exited before it was ready")
        assert time.monotonic() < deadline, "the children did not get ready in time"
        time.sleep(0.01)


def cache_files(cache_dir: Path) -> dict[str, tuple[int, int]]:
    """File name -> (inode, mtime in ns): a rewritten file shows as a changed entry."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache_dir.iterdir()}


def test_processes_share_an_empty_kernel_cache(tmp_path):
    cache_dir, sync_dir = tmp_path / "kernel_cache", tmp_path / "sync"
    sync_dir.mkdir()
    assert not cache_dir.exists()

    names = ["cold-1", "cold-2"]
    procs = [start_child(name, cache_dir, sync_dir) for name in names]
    try:
        wait_ready(names, procs, sync_dir)
        (sync_dir / "go").touch()  # both compile the same specialisation now
        cold = [finish_child(name, proc) for name, proc in zip(names, procs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:  # a failure above left it waiting
                proc.kill()
                proc.communicate()

    files = cache_files(cache_dir)
    cubins = [name for name in files if name.endswith(".cubin")]
    assert cubins, f"no cubin in the cache: {sorted(files)}"
    assert len(cubins) == len(files), f"partial or temporary files left in the cache: {sorted(files)}"

    warm_proc = start_child("warm", cache_dir, sync_dir)  # "go" exists: it starts at once
    warm = finish_child("warm", warm_proc)
    assert cache_files(cache_dir) == files, "the warm process compiled again (a cache file was added or rewritten)"
    cold_s = min(c["first_call_s"] for c in cold)
    assert warm["first_call_s"] < cold_s, f"warm first call {warm['first_call_s']:.3f} s, cold {cold_s:.3f} s"
    print(f"{len(cubins)} cubin files; first call: cold {[round(c['first_call_s'], 3) for c in cold]} s, "
          f"warm {warm['first_call_s']:.3f} s; max errors {[c['max_err'] for c in [*cold, warm]]}")
