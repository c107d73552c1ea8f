"""The latency case (B1 H16/16 d64 L1024, bf16) per decode kernel and split-K partition size: GPU time per call of a
CUDA graph of 20 back-to-back ``DecodePlan.run`` calls (L2 warm), median of 20 replays.

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/latency_split.py``. Sets ``decode._MIN_PART_TOKENS`` (the
shortest partition) and ``decode.TENSOR_CORE_MIN_GROUP`` (1 forces the tensor-core kernel) for each row.
"""

from __future__ import annotations

import itertools


def per_call_us(min_part: int, kernel: str, bias_kind: str) -> tuple[int, float]:
    """(partitions, µs per call) of the latency case with the given shortest partition, kernel and bias."""
    import torch

    import cupy_paged_attn as cpa
    from cupy_paged_attn import decode

    decode._MIN_PART_TOKENS = min_part
    decode.TENSOR_CORE_MIN_GROUP = 1 if kernel == "tensor-cores" else 10**9
    batch, heads, head_size, length, block = 1, 16, 64, 1024, 16
    pages = batch * length // block
    q = torch.randn(batch, heads, head_size, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(pages, block, heads, head_size, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    bias = None if bias_kind == "none" else torch.randn(batch, heads, length, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    plan = cpa.DecodePlan(q, k, v, tables, lens, attn_bias=bias)

    def call() -> None:
        plan.run(q, k, v, tables, lens, attn_bias=bias, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / 20)
    return plan.launch.num_parts, sorted(times)[len(times) // 2]


def main() -> None:
    for min_part, kernel, bias in itertools.product([64, 128, 256], ["fp32-loop", "tensor-cores"], ["none", "dense"]):
        parts, us = per_call_us(min_part, kernel, bias)
        print(f"shortest partition {min_part:3d}, {kernel:12s}, bias {bias:5s}: {parts:2d} partitions, "
              f"{us:.2f} us/call")


if __name__ == "__main__":
    main()
