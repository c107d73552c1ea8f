"""Host cost of one ``paged_attention`` call with torch tensors in and out (the latency case of bench_decode).

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/host_overhead.py [--calls 2000] [--profile]``.
Times each call on the host alone (``time.perf_counter`` around the call, no synchronisation inside the loop) and
prints the median; ``--profile`` adds the functions that cost most, from ``cProfile``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import torch

    import cupy_paged_attn as cpa

    batch, heads, head_size, length, block = 1, 16, 64, 1024, 16
    pages = batch * length // block
    q = torch.randn(batch, heads, head_size, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(pages, block, heads, head_size, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    bias = torch.randn(batch, heads, length, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)

    variants = {"no bias": {}, "dense bias": {"attn_bias": bias}, "dense bias, out=": {"attn_bias": bias, "out": out}}
    for label, kwargs in variants.items():
        for _ in range(50):
            cpa.paged_attention(q, k, v, tables, lens, **kwargs)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            cpa.paged_attention(q, k, v, tables, lens, **kwargs)
            times.append(time.perf_counter() - t0)
            if len(times) % 200 == 0:
                torch.cuda.synchronize()  # keep the launch queue short
        torch.cuda.synchronize()
        print(f"host time per call, {label:18s}: median {statistics.median(times) * 1e6:7.1f} us "
              f"(p10 {sorted(times)[len(times) // 10] * 1e6:.1f}, p90 {sorted(times)[9 * len(times) // 10] * 1e6:.1f})")

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            cpa.paged_attention(q, k, v, tables, lens, attn_bias=bias)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
