"""Same-call A/B of two source trees of the library: GPU time of the decode and prefill benchmarks, host time per call.

Each tree (a checkout, or a ``git archive`` of one commit) runs its own ``benchmarks/bench_decode.py`` (``--peers
none``) and ``benchmarks/bench_prefill.py --quick``, the trees taking turns for ``--rounds`` rounds on the same GPU;
then ``host_ab.py`` times both trees' host path in one process. Prints, per case and row, each tree's times and
new / old (ratio of the medians; the spread of each tree's rounds beside it). From the repository root of a source
checkout on a GPU machine::

    python3 benchmarks/ab.py OLD NEW [--rounds 2] [--decode-cases 0,2,3,4,6,8,11] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
PREFILL_LINE = re.compile(r"^(?P<case>B\d+ L\d+ H\d+ d\d+ \w+): "
                          r"ours (?P<t5>[\d.]+) ms, without bias (?P<none>[\d.]+) ms")
PREFILL_SYNC = re.compile(r"^(?P<case>B\d+ L\d+ H\d+ d\d+ \w+): ours on the mma.sync tiling (?P<ms>[\d.]+) ms")


def run(tree: str, argv: list[str], log: list[str]) -> str:
    """``python3 ARGV`` in ``tree`` with the tree's package first on the path; its output (also kept in ``log``)."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, check=False)
    log.append(f"== {tree}: {' '.join(argv)} (exit {result.returncode})\n{result.stdout}\n{result.stderr}")
    if result.returncode != 0:
        print(f"{tree}: {' '.join(argv)} failed (exit {result.returncode}):\n{result.stderr[-1500:]}", file=sys.stderr)
    return result.stdout


def decode_times(tree: str, cases: str, reps: int, log: list[str]) -> dict[tuple[str, str], float]:
    with tempfile.TemporaryDirectory() as out:
        run(tree, ["benchmarks/bench_decode.py", "--cases", cases, "--peers", "none", "--reps", str(reps),
                   "--out", out], log)
        path = os.path.join(out, "decode.json")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            table = json.load(f)["table"]
    return {(row["case"], row["impl"]): row["us"] for row in table if row["us"] is not None}


def prefill_times(tree: str, reps: int, log: list[str]) -> dict[tuple[str, str], float]:
    times = {}
    for line in run(tree, ["benchmarks/bench_prefill.py", "--quick", "--reps", str(reps)], log).splitlines():
        if m := PREFILL_LINE.match(line):
            times[(m["case"], "ours+t5")] = 1e3 * float(m["t5"])
            times[(m["case"], "ours")] = 1e3 * float(m["none"])
        elif m := PREFILL_SYNC.match(line):
            times[(m["case"], "ours mma.sync+t5")] = 1e3 * float(m["ms"])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", metavar="OLD", help="the source tree to compare against")
    parser.add_argument("new", metavar="NEW", help="the source tree under test")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-cases", default="0,2,3,4,6,8,11", help="bench_decode.py's case indices")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-decode", action="store_true", help="skip bench_decode.py")
    parser.add_argument("--no-prefill", action="store_true", help="skip bench_prefill.py")
    parser.add_argument("--no-host", action="store_true", help="skip host_ab.py")
    parser.add_argument("--out", metavar="DIR", help="write DIR/ab-runs.log (every run's output)")
    args = parser.parse_args()
    old, new = args.old, args.new
    times: dict[str, dict[tuple[str, str, str], list[float]]] = {old: defaultdict(list), new: defaultdict(list)}
    log: list[str] = []
    for r in range(args.rounds):
        for tree in (old, new) if r % 2 == 0 else (new, old):
            print(f"round {r + 1}: {tree}", file=sys.stderr, flush=True)
            if not args.no_decode:
                for (case, impl), us in decode_times(tree, args.decode_cases, args.reps, log).items():
                    times[tree][("decode", case, impl)].append(us)
            if not args.no_prefill:
                for (case, impl), us in prefill_times(tree, max(5, args.reps // 2), log).items():
                    times[tree][("prefill", case, impl)].append(us)
    keys = [k for k in times[new] if k in times[old]]
    width = max((len(f"{k[0]} {k[1]} {k[2]}") for k in keys), default=10)
    print(f"same-call A/B, {args.rounds} rounds; µs per call (GPU time), new / old = ratio of the medians")
    print(f"{'case':{width}s}  {'old':>19s}  {'new':>19s}  new/old")
    worst = 1.0
    for key in keys:
        a, b = times[old][key], times[new][key]
        ratio = statistics.median(b) / statistics.median(a)
        worst = max(worst, ratio)
        print(f"{' '.join(key):{width}s}  {min(a):9.1f}-{max(a):9.1f}  {min(b):9.1f}-{max(b):9.1f}  {ratio:7.3f}")
    print(f"largest new/old: {worst:.3f}")
    if not args.no_host:
        print("\nhost time (host_ab.py, both trees in one process):", flush=True)
        sys.stdout.write(run(HERE, ["host_ab.py", os.path.abspath(old), os.path.abspath(new)], log))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ab-runs.log"), "w") as f:
            f.write("\n".join(log))
    return 0 if keys or (args.no_decode and args.no_prefill) else 1


if __name__ == "__main__":
    sys.exit(main())
