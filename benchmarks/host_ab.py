"""Host time per call of two source trees of the library, loaded into one process and timed in interleaved rounds.

Host timings of separate processes differ by up to ~50 % on the same machine (the same code took 17 µs in one
process and 25 µs in the next); one process that imports both trees and alternates between them compares like with
like. Each round times every call of both trees (``DecodePlan.run`` without a bias and with a dense one,
``paged_attention`` with a dense one, all with ``out=``; both with a dense bias and the result allocated) in the
latency case of ``host_overhead.py``, and prints the median of each round.

Run on a GPU machine from the repository root, with trees made by ``git archive`` (``A`` and ``B`` each hold a
``cupy_paged_attn`` package): ``python3 benchmarks/host_ab.py A B [--rounds 6] [--calls 600]``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from host_overhead import host_times, latency_case


def load_tree(path: str) -> ModuleType:
    """``cupy_paged_attn`` from ``path``, as a fresh set of modules (the package has no imports inside functions, so
    each tree's functions keep using their own modules)."""
    for name in [n for n in sys.modules if n == "cupy_paged_attn" or n.startswith("cupy_paged_attn.")]:
        del sys.modules[name]
    path = os.path.abspath(path)
    sys.path.insert(0, path)
    try:
        return importlib.import_module("cupy_paged_attn")
    finally:
        sys.path.remove(path)


def calls_of(cpa: ModuleType, case: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    q, k, v, tables, lens, bias, out = (case[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                                                          "seq_lens", "bias", "out"))
    plan_none = cpa.DecodePlan(q, k, v, tables, lens)
    plan_dense = cpa.DecodePlan(q, k, v, tables, lens, attn_bias=bias)
    return {
        "plan.run, no bias, out=": lambda: plan_none.run(q, k, v, tables, lens, out=out),
        "plan.run, dense, out=": lambda: plan_dense.run(q, k, v, tables, lens, attn_bias=bias, out=out),
        "paged_attention, dense, out=": lambda: cpa.paged_attention(q, k, v, tables, lens, attn_bias=bias, out=out),
        "plan.run, dense (result allocated)": lambda: plan_dense.run(q, k, v, tables, lens, attn_bias=bias),
        "paged_attention, dense (result allocated)": lambda: cpa.paged_attention(q, k, v, tables, lens, attn_bias=bias),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs=2, help="two folders, each holding a cupy_paged_attn package")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=600)
    args = parser.parse_args()

    case = latency_case()
    calls = {}
    for tree in args.trees:
        for label, call in calls_of(load_tree(tree), case).items():
            calls[f"{tree}: {label}"] = call
    medians: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            medians[name].append(statistics.median(host_times(call, args.calls)) * 1e6)
    width = max(map(len, calls))
    print(f"host time per call, µs, median of {args.calls} calls in each of {args.rounds} interleaved rounds")
    for name, values in medians.items():
        print(f"{name:{width}s}  " + " ".join(f"{x:6.1f}" for x in values) + f"   min {min(values):6.1f}")


if __name__ == "__main__":
    main()
