"""Host cost of one ``paged_attention`` call, and of one ``DecodePlan.run``, with torch tensors in and out (the
latency case of bench_decode).

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
from collections.abc import Callable
from typing import Any


def latency_case(heads: int = 16, kv_heads: int = 16) -> dict[str, Any]:
    """The latency case of bench_decode (B1, d64, L1024, block 16, bf16) as torch tensors: the operands ``query``,
    ``key_cache``, ``value_cache``, ``block_tables``, ``seq_lens``, a dense ``bias`` and an ``out``."""
    import torch

    batch, head_size, length, block = 1, 64, 1024, 16
    pages = batch * length // block
    q = torch.randn(batch, heads, head_size, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(pages, block, kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
    return {
        "query": q, "key_cache": k, "value_cache": torch.randn_like(k),
        "block_tables": torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1),
        "seq_lens": torch.full((batch,), length, device="cuda", dtype=torch.int32),
        "bias": torch.randn(batch, heads, length, device="cuda", dtype=torch.bfloat16), "out": torch.empty_like(q),
    }


def host_times(call: Callable[[], Any], calls: int, warmup: int = 50) -> list[float]:
    """Seconds on the host of each of ``calls`` calls of ``call`` (after ``warmup`` calls), with no synchronisation
    inside a call; the GPU is synchronised every 200 calls, to keep the launch queue short."""
    import torch

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if len(times) % 200 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rows", default="", help="time only the rows whose label holds this text (e.g. plan.run)")
    parser.add_argument("--heads", default="16/16",
                        help="query/KV heads (default 16/16, the latency case; e.g. 32/8 takes the tensor-core kernel)")
    args = parser.parse_args()

    import torch

    import cupy_paged_attn as cpa

    heads, kv_heads = map(int, args.heads.split("/"))
    case = latency_case(heads, kv_heads)
    q, k, v, tables, lens = (case[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))
    bias, out = case["bias"], case["out"]
    batch, head_size, length = q.shape[0], q.shape[2], tables.shape[1] * k.shape[1]

    t5 = cpa.RelativePositionBias(torch.randn(32, heads, device="cuda", dtype=torch.bfloat16))
    plan = cpa.DecodePlan(q, k, v, tables, lens, attn_bias=bias)
    plan_none = cpa.DecodePlan(q, k, v, tables, lens)
    plan_t5 = cpa.DecodePlan(q, k, v, tables, lens, attn_bias=t5)
    variants = {
        "paged_attention, no bias": (cpa.paged_attention, {}),
        "paged_attention, dense bias": (cpa.paged_attention, {"attn_bias": bias}),
        "paged_attention, dense, out=": (cpa.paged_attention, {"attn_bias": bias, "out": out}),
        "paged_attention, no bias, out=": (cpa.paged_attention, {"out": out}),
        "paged_attention, T5 bias, out=": (cpa.paged_attention, {"attn_bias": t5, "out": out}),
        "plan.run, no bias, out=": (plan_none.run, {"out": out}),
        "plan.run, dense bias": (plan.run, {"attn_bias": bias}),
        "plan.run, dense bias, out=": (plan.run, {"attn_bias": bias, "out": out}),
        "plan.run, T5 bias, out=": (plan_t5.run, {"attn_bias": t5, "out": out}),
    }
    print(f"B{batch} H{heads}/{kv_heads} d{head_size} L{length}, bf16: "
          f"{'tensor cores' if plan.launch.tensor_cores else 'SIMT kernel'}, {plan.launch.num_parts} partitions")
    for label, (call, kwargs) in variants.items():
        if args.rows and args.rows not in label:
            continue
        times = host_times(lambda call=call, kwargs=kwargs: call(q, k, v, tables, lens, **kwargs), args.calls)
        print(f"host time per call, {label:30s}: median {statistics.median(times) * 1e6:7.1f} us "
              f"(p10 {sorted(times)[len(times) // 10] * 1e6:.1f}, p90 {sorted(times)[9 * len(times) // 10] * 1e6:.1f})")

    if args.profile:
        for label, call in (("plan.run", plan.run), ("paged_attention", cpa.paged_attention)):
            print(f"cProfile of 500 calls of {label}, dense bias, out=")
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(500):
                call(q, k, v, tables, lens, attn_bias=bias, out=out)
            profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
