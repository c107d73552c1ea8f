"""CPU: the benchmark scripts without a GPU, so that a mistake there shows here rather than at the end of a GPU run:
``benchmarks/bench_decode.py``'s dry run, command line, floor bytes and report (from made-up times),
``benchmarks/bench_prefill.py``'s command line and report, ``benchmarks/compile_time.py``'s offline mode, and what
``benchmarks/ab.py`` and ``benchmarks/host_ab.py`` read of the trees they compare.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "benchmarks" / "bench_decode.py"
ALL_API = {"RaggedBias": True, "RelativePositionBias": True}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_decode"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_decode"]


def run_script(*args: str, script: Path = SCRIPT, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO_ROOT)


def test_dry_run_prints_every_case_and_floor(bench):
    result = run_script("--dry-run")
    assert result.returncode == 0, result.stderr
    for case in bench.CASES:
        assert case.name in result.stdout
    assert "rows per case: ours, ours+dense" in result.stdout
    assert "sdpa, flex, flex-nobias" in result.stdout
    assert "floors at 4270 GB/s" in result.stdout


def test_dry_run_selection(bench):
    result = run_script("--dry-run", "--cases", "6,8", "--peers", "none", "--copy-gbps", "1000")
    assert result.returncode == 0, result.stderr
    assert bench.CASES[6].name in result.stdout and bench.CASES[8].name in result.stdout
    assert bench.CASES[0].name not in result.stdout
    assert "sdpa" not in result.stdout and "flex" not in result.stdout
    assert "floors at 1000 GB/s" in result.stdout


@pytest.mark.parametrize("args", [["--peers", "sdpa,bogus"], ["--cases", "13"], ["--sets", "1"]])
def test_bad_options_exit_2(args):
    result = run_script("--dry-run", *args)
    assert result.returncode == 2
    assert "error:" in result.stderr


def test_cases_and_sets(bench):
    assert len(bench.CASES) == 13
    long_cases = [(c.batch, c.num_heads, c.num_kv_heads, c.head_size, c.max_len) for c in bench.CASES[6:9]]
    assert long_cases == [(1, 32, 8, 128, 65536), (4, 32, 8, 128, 32768), (8, 16, 16, 64, 131072)]
    assert bench.CASES[8].min_len is not None, "the longest case is ragged"
    assert [c.num_sets(4) for c in bench.CASES] == [4] * 6 + [2] * 3 + [4] * 4
    assert len({c.name for c in bench.CASES}) == 13


def test_floor_bytes(bench):
    case = bench.CASES[0]  # B64 H16/16 d64 L2048 bf16
    lens = bench.draw_seq_lens(case, 0)
    kv = 64 * 2048 * 16 * 64 * 2 * 2
    q_out = 2 * 64 * 16 * 64 * 2
    tables = 4 * 64 * 2048 // 16 + 4 * 64
    assert bench.floor_bytes(case, lens, "none") == kv + q_out + tables
    assert bench.floor_bytes(case, lens, "dense") == kv + q_out + tables + 64 * 16 * 2048 * 2
    assert bench.floor_bytes(case, lens, "ragged") == bench.floor_bytes(case, lens, "dense")
    assert bench.floor_bytes(case, lens, "t5") == bench.floor_bytes(case, lens, "none")
    assert bench.floor_bytes(case, lens, "dense-f32") == kv + q_out + tables + 64 * 16 * 2048 * 4
    assert bench.floor_bytes(case, lens, "ragged-f32") == bench.floor_bytes(case, lens, "dense-f32")


def test_ragged_lengths_are_seeded_and_in_range(bench):
    case = bench.CASES[8]
    lens = bench.draw_seq_lens(case, 8)
    assert lens == bench.draw_seq_lens(case, 8)
    assert len(lens) == case.batch and all(case.min_len <= n <= case.max_len for n in lens)


def test_planned_rows(bench):
    all_rows = [impl for impl, _ in bench.planned_impls(["sdpa", "flex", "flex-nobias"], ALL_API)]
    assert all_rows == ["ours", "ours+dense", "ours+ragged", "ours+dense-f32", "ours+ragged-f32", "ours+t5", "sdpa",
                        "flex", "flex-nobias"]
    without_api = bench.planned_impls([], dict.fromkeys(ALL_API, False))
    assert without_api == [("ours", "none"), ("ours+dense", "dense"), ("ours+dense-f32", "dense-f32")]
    assert bench.parse_peers("none") == [] and bench.parse_peers("flex,sdpa") == ["sdpa", "flex"]


def made_up_results(bench):
    """Timings of two cases as a run would leave them: graph and eager times, a failure, an OOM, a bad check."""
    T = bench.Timing
    results = []
    for index in (0, 8):
        case = bench.CASES[index]
        lens = bench.draw_seq_lens(case, index)

        def floor(kind, case=case, lens=lens):
            return bench.floor_bytes(case, lens, kind)

        timings = [
            T("ours", "none", floor("none"), 150.0, 140.0),
            T("ours+dense", "dense", floor("dense"), 160.0, 150.0),
            T("ours+ragged", "ragged", floor("ragged"), 165.0, None, graph_error="capture failed: X",
              check_against="ours+dense", max_abs_diff=0.0, tolerance=2e-2),
            T("ours+t5", "t5", floor("t5"), skipped="FAILED: ValueError: no"),
            T("sdpa", "dense", floor("dense"), skipped="skipped (OOM)") if index == 8 else
            T("sdpa", "dense", floor("dense"), 450.0, 420.0, check_against="ours+dense", max_abs_diff=1e-3,
              tolerance=2e-2),
            T("flex", "dense", floor("dense"), 200.0, 180.0, setup_s=9.0, check_against="ours+dense",
              max_abs_diff=float("nan"), tolerance=2e-2),
            T("flex-nobias", "none", floor("none"), 190.0, 175.0, check_against="ours", max_abs_diff=0.0,
              tolerance=2e-2),
        ]
        results.append({"name": case.name, "timings": timings})
    return results


def test_rows_and_report(bench, capsys):
    table = bench.rows(made_up_results(bench), 4.0e12)
    by = {(r["case"], r["impl"]): r for r in table}
    first = bench.CASES[0].name
    assert by[(first, "sdpa")]["speedup"] == pytest.approx(420.0 / 150.0)
    assert by[(first, "sdpa")]["speedup_via"] == "graph"
    assert by[(first, "flex-nobias")]["speedup"] == pytest.approx(175.0 / 140.0)
    assert by[(first, "ours+ragged")]["via"] == "eager" and by[(first, "ours+ragged")]["us"] == 165.0
    assert by[(first, "ours+dense")]["pct_copy"] == pytest.approx(
        100 * by[(first, "ours+dense")]["bytes"] / 150e-6 / 4.0e12)
    assert by[(first, "flex")]["check_ok"] is False  # NaN never passes
    assert by[(bench.CASES[8].name, "sdpa")]["speedup"] is None
    assert by[(first, "ours+t5")]["us"] is None

    env = {"device": "GPU", "sm_count": 1, "torch": "t", "cupy": "c", "date": "d"}
    bench.print_report(table, {"bytes_per_s": 4.0e12}, env)
    out = capsys.readouterr().out
    assert "skipped (OOM)" in out and "FAILED: ValueError: no" in out
    assert "WARNING" in out and "flex" in out
    assert out.rstrip().splitlines()[-1].startswith(bench.CASES[8].name), "the speed-ups per case come last"
    json.dumps(table)  # JSON-ready


def test_plot_or_reason(bench, tmp_path):
    table = bench.rows(made_up_results(bench), 4.0e12)
    path = tmp_path / "decode.png"
    why_not = bench.plot(table, str(path), "title")
    if why_not is None:
        assert path.stat().st_size > 0
    else:
        assert "matplotlib" in why_not and not path.exists()


def test_json_record(bench, tmp_path):
    args = bench.parse_args(["--cases", "0,8", "--peers", "sdpa,flex"])
    copy = {"bytes": 2, "us": 1.0, "bytes_per_s": 4.0e12}
    path = bench.write_json(str(tmp_path / "out"), {"device": "GPU"}, args, copy, made_up_results(bench), None)
    record = json.loads(Path(path).read_text())
    assert record["args"]["cases"] == [0, 8] and record["args"]["peers"] == ["sdpa", "flex"]
    assert len(record["cases"]) == 2 and len(record["table"]) == 14
    ours_dense = record["cases"][0]["timings"][1]
    assert ours_dense["impl"] == "ours+dense" and ours_dense["us"] == 150.0  # the graph time
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_compile_time_offline_and_bad_specs():
    """benchmarks/compile_time.py without a GPU: the NVRTC-only mode times a specialisation; a bad --specs exits 2."""
    script = REPO_ROOT / "benchmarks" / "compile_time.py"
    result = run_script("--offline", "sm_90", "--specs", "cache-write", script=script, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "cache_write_bf16_nhd_slot-i32" in result.stdout and " s" in result.stdout
    bad = run_script("--specs", "nope", script=script)
    assert bad.returncode == 2 and "--specs" in bad.stderr


def test_host_ab_loads_each_tree_apart(tmp_path):
    """benchmarks/host_ab.py gives each source tree its own modules, whose functions keep using their own tree."""
    import shutil

    shutil.copytree(REPO_ROOT / "cupy_paged_attn", tmp_path / "b" / "cupy_paged_attn")
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT / 'benchmarks')!r})\n"
        "import host_ab\n"
        f"a = host_ab.load_tree({str(REPO_ROOT)!r})\n"
        f"b = host_ab.load_tree({str(tmp_path / 'b')!r})\n"
        "assert a is not b and a.decode is not b.decode\n"
        f"assert a.decode.__file__.startswith({str(REPO_ROOT)!r}), a.decode.__file__\n"
        f"assert b.decode.__file__.startswith({str(tmp_path / 'b')!r}), b.decode.__file__\n"
        "assert a.decode._interop is not b.decode._interop and b.decode._interop.__file__.startswith("
        f"{str(tmp_path / 'b')!r})\n"
        "print('two trees')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "two trees" in result.stdout, result.stderr


def load_benchmark(name: str):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))


def test_prefill_report_and_bad_cases():
    """bench_prefill.py's table from made-up times: ms, TFLOP/s, each other row's time over ours with the same
    bias, a mismatch flagged; a case index out of range exits 2."""
    bench = load_benchmark("bench_prefill")
    flops = 4.0 * 4 * 4096 * 4096 * 32 * 128
    result = {"case": "B4 L4096 H32 d128 full", "flops": flops, "errors": {"flex+t5": "failed"},
              "rows": {"ours": 2.0, "ours+t5": 2.2, "sdpa-cudnn": 1.6, "sdpa+t5": 3.6, "flex+t5": None},
              "diffs": {"sdpa-cudnn": 0.01, "sdpa+t5": 0.5}}
    table = bench.report([result]).splitlines()
    assert table[0].startswith("| case (bf16) | ours | ours+t5 | ours+dense |")
    cells = table[2].split(" | ")
    assert cells[1] == f"2.000 ({flops / 2e-3 / 1e12:.0f})"
    assert "1.600" in table[2] and "0.80x" in table[2]  # cuDNN over ours, no bias
    assert "3.600" in table[2] and "1.64x MISMATCH 0.500" in table[2]  # SDPA with T5 over ours+t5
    assert "| failed |" in table[2] and "| — |" in table[2]
    bad = run_script("--cases", "9", script=REPO_ROOT / "benchmarks" / "bench_prefill.py")
    assert bad.returncode == 2 and "--cases" in bad.stderr


def test_ab_reads_the_prefill_lines_of_either_tree():
    """ab.py reads the lines that bench_prefill.py prints per case (the same in trees before and after this
    layout): T5, no bias, and T5 on the mma.sync tiling."""
    ab = load_benchmark("ab")
    line = ab.PREFILL_LINE.match("B4 L4096 H32 d128 causal: ours 1.674 ms, without bias 1.541 ms")
    assert line and (line["case"], line["t5"], line["none"]) == ("B4 L4096 H32 d128 causal", "1.674", "1.541")
    sync = ab.PREFILL_SYNC.match("B8 L2048 H16 d64 full: ours on the mma.sync tiling 0.669 ms")
    assert sync and sync["ms"] == "0.669"
