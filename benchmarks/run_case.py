"""Run one decode or prefill case a few times (for ``ncu`` / ``compute-sanitizer`` runs, and quick timing by CUDA
events). ``--prefill`` runs paged_prefill_attention with every sequence's whole length as its query rows
(``--causal`` to mask); TFLOP/s count 4·d per (query, head, key) pair kept.

Run on a GPU machine, e.g.::

    PYTHONPATH=. python3 benchmarks/run_case.py --batch 32 --heads 32/8 --head-size 128 --length 8192 --bias dense
    ncu --clock-control none -k regex:decode_ -c 1 --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/run_case.py ...
"""

from __future__ import annotations

import argparse
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", default="32/8", help="query/KV heads")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bias", default="none", choices=["none", "dense", "ragged", "t5"])
    parser.add_argument("--layout", default="nhd", choices=["nhd", "hnd", "vllm"])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--prefill", action="store_true", help="q_len = length for every sequence")
    parser.add_argument("--causal", action="store_true", help="prefill: mask keys after each query")
    parser.add_argument("--q-len", type=int, default=0, help="prefill: query rows per sequence (default: length)")
    parser.add_argument("--kernel", default="auto", choices=["auto", "tensor-cores", "simt"],
                        help="decode: force the tensor-core kernel (16-bit, head size <= 128) or the SIMT one")
    args = parser.parse_args()

    import torch

    import cupy_paged_attn as cpa

    with cpa.tuning.override(decode_kernel=args.kernel):
        run(args, torch, cpa)


def run(args: argparse.Namespace, torch: Any, cpa: Any) -> None:

    hq, hkv = map(int, args.heads.split("/"))
    dtype = getattr(torch, args.dtype)
    b, d, n, bs = args.batch, args.head_size, args.length, args.block_size
    pages = b * (n // bs)
    q_len = args.q_len or n
    if args.prefill:  # q_len query rows per sequence, packed
        q = torch.randn(b * q_len, hq, d, device="cuda", dtype=dtype)
        starts = torch.arange(0, (b + 1) * q_len, q_len, device="cuda", dtype=torch.int32)
    else:
        q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
    if args.layout in ("nhd", "hnd"):
        shape = (pages, bs, hkv, d) if args.layout == "nhd" else (pages, hkv, bs, d)
        k = torch.randn(*shape, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
    else:
        x = 16 // q.element_size()
        k = torch.randn(pages, hkv, d // x, bs, x, device="cuda", dtype=dtype)
        v = torch.randn(pages, hkv, d, bs, device="cuda", dtype=dtype)
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    bias = None
    if args.bias == "dense":
        rows = (q_len,) if args.prefill else ()
        bias = torch.randn(b, hq, *rows, n, device="cuda", dtype=dtype)
    elif args.bias == "ragged":
        offsets = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
        bias = cpa.RaggedBias(torch.randn(b * n, hq, device="cuda", dtype=dtype), offsets)
    elif args.bias == "t5":
        table = torch.randn(32, hq, device="cuda", dtype=dtype)
        bias = cpa.RelativePositionBias(table, bidirectional=args.prefill and not args.causal)
    out = torch.empty_like(q)

    def call() -> None:
        if args.prefill:
            cpa.paged_prefill_attention(q, k, v, tables, lens, starts, causal=args.causal, attn_bias=bias,
                                        kv_layout=args.layout, out=out)
        else:
            cpa.paged_attention(q, k, v, tables, lens, attn_bias=bias, kv_layout=args.layout, out=out)

    for _ in range(3):
        call()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.calls):
        call()
    stop.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(stop) * 1e3 / args.calls
    if args.prefill:
        pairs = b * q_len * (n - (q_len - 1) / 2) if args.causal else b * q_len * n
        nbytes = 2 * b * n * hkv * d * q.element_size()
        print(f"prefill B{b} H{hq}/{hkv} d{d} L{n} q_len {q_len} {'causal' if args.causal else 'full'} "
              f"bias={args.bias} {args.layout}: {us:.1f} us/call, "
              f"{4 * pairs * hq * d / us / 1e6:.0f} TFLOP/s, {nbytes / us / 1e3:.0f} GB/s (K+V bytes)")
        return
    bias_bytes = b * hq * n * q.element_size() if args.bias in ("dense", "ragged") else 0
    nbytes = 2 * b * n * hkv * d * q.element_size() + bias_bytes
    print(f"B{b} H{hq}/{hkv} d{d} L{n} bias={args.bias} {args.layout} kernel={args.kernel}: {us:.1f} us/call, "
          f"{nbytes / us / 1e3:.0f} GB/s (K+V+bias bytes)")


if __name__ == "__main__":
    main()
