"""The latency case (B1 H16/16 d64 L1024, bf16) per decode kernel, split-K partition size and bias (none, dense, T5
in-kernel): GPU time per call of a CUDA graph of 20 back-to-back ``DecodePlan.run`` calls (L2 warm, unlike
bench_decode.py, which flushes it), median of 20 replays.

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/latency_split.py``. Sets ``decode._MIN_PART_TOKENS`` (the
shortest partition) and the kernel (``decode.forced_kernel_switches``) for each row. The case is host_overhead.py's,
the graph capture bench_decode.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from bench_decode import capture_graph
from host_overhead import latency_case

CALLS_PER_GRAPH = 20


def replay_us(fn: Callable[[], list[Any]], calls: int, replays: int = 20) -> float:
    """µs per call: ``fn`` (``calls`` calls, returning what they write, as ``capture_graph`` takes it) captured in
    a CUDA graph, the median of ``replays`` replays timed by CUDA events, divided by ``calls``."""
    import torch

    graph, error = capture_graph(fn)
    if graph is None:
        raise RuntimeError(error)
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def per_call_us(min_part: int, kernel: str, bias_kind: str) -> tuple[int, float]:
    """(partitions, µs per call) of the latency case with the given shortest partition, kernel and bias."""
    import torch

    import cupy_paged_attn as cpa
    from cupy_paged_attn import decode

    decode._MIN_PART_TOKENS = min_part
    for name, value in decode.forced_kernel_switches(kernel).items():
        setattr(decode, name, value)
    case = latency_case()
    operands = [case[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    heads = case["query"].shape[1]
    bias = {"none": None, "dense": case["bias"],
            "t5": cpa.RelativePositionBias(torch.randn(32, heads, device="cuda", dtype=torch.bfloat16))}[bias_kind]
    plan = cpa.DecodePlan(*operands, attn_bias=bias)

    def calls() -> list[torch.Tensor]:
        for _ in range(CALLS_PER_GRAPH):
            plan.run(*operands, attn_bias=bias, out=case["out"])
        return [case["out"]]

    return plan.launch.num_parts, replay_us(calls, CALLS_PER_GRAPH)


def main() -> None:
    for min_part, kernel, bias in itertools.product([64, 128, 256], ["fp32-loop", "tensor-cores"],
                                                    ["none", "dense", "t5"]):
        parts, us = per_call_us(min_part, kernel, bias)
        print(f"shortest partition {min_part:3d}, {kernel:12s}, bias {bias:5s}: {parts:2d} partitions, "
              f"{us:.2f} us/call")


if __name__ == "__main__":
    main()
