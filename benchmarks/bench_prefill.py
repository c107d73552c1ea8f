"""Prefill attention with T5's relative-position bias: ours (bias computed in the kernel from the paged cache)
against the two things a PyTorch user has without a paged kernel:

* ``sdpa``: gather K/V through the block table, then ``scaled_dot_product_attention`` with the bias materialised as a
  float mask ``[B, H, L, L]`` (built once, outside the timing; the causal mask folded into it);
* ``flex``: gather K/V, then ``torch.compile(flex_attention)`` with a T5 ``score_mod`` (bucket and table lookups)
  and, when causal, a causal block mask.

``ours w/o bias`` is the same call without the bias (what the bias costs); ``ours mma.sync`` the same call on
the tensor-core kernel's mma.sync tiling (what GPUs other than H100 / H200 run), where the Hopper tiling applies.
Times are CUDA-event medians of ``--reps`` runs of 5 back-to-back calls, after warm-ups (each peer's time includes
its gather). TFLOP/s count 4·B·H·d per (query, key) pair that the mask keeps (about half of them when causal). Usage:
``PYTHONPATH=. python benchmarks/bench_prefill.py [--reps 20] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback

import numpy as np

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul on this H200 (device notes), the matrix peak we compare against
CASES = [(8, 2048, 16, 64), (4, 4096, 32, 128)]  # (B, q_len = kv_len, H, d); MHA, bf16, block 16
BLOCK = 16


def timed(fn, reps: int, warmup: int = 3, inner: int = 5) -> float:
    """Median over ``reps`` of the mean time of ``inner`` back-to-back calls (ms): the calls queue up on the stream
    behind one untimed call, so a call's host time overlaps the previous one's kernels instead of being counted
    (one call per event pair would count ours' ~0.3 ms of Python and checks as GPU time; without the untimed call,
    the first timed call's host time was counted: +0.06 ms per call at B8 L2048 d64)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # in flight while the timed calls are issued: the first one's host time is not counted either
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return statistics.median(times)


def build(b: int, length: int, h: int, d: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    dev = "cuda"
    pages = length // BLOCK
    num_blocks = b * pages + 7
    perm = torch.randperm(num_blocks, device=dev)[: b * pages].to(torch.int32)
    tables = perm.view(b, pages).contiguous()
    k_cache = torch.randn(num_blocks, BLOCK, h, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(b * length, h, d, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, device=dev, dtype=torch.int32)
    starts = torch.arange(0, b * length + 1, length, device=dev, dtype=torch.int32)
    table = torch.randn(32, h, device=dev, dtype=torch.bfloat16)
    return query, k_cache, v_cache, tables, seq_lens, starts, table


def gather(k_cache, v_cache, tables, b, length, h, d):
    k = k_cache[tables.long()].reshape(b, length, h, d).transpose(1, 2)
    v = v_cache[tables.long()].reshape(b, length, h, d).transpose(1, 2)
    return k, v


def t5_bucket_by_rel(length: int, bidirectional: bool):
    import torch

    import cupy_paged_attn as cpa

    rel = np.arange(-(length - 1), length)
    buckets = cpa.t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    return torch.as_tensor(np.asarray(buckets), device="cuda")  # index: rel + length - 1


def bench_case(data, b: int, length: int, h: int, d: int, causal: bool, reps: int, quick: bool) -> dict:
    """Time ours and the peers on one case; a peer that fails is reported and left out."""
    import torch

    import cupy_paged_attn as cpa
    from cupy_paged_attn import prefill
    from cupy_paged_attn.prefill import paged_prefill_attention

    query, k_cache, v_cache, tables, seq_lens, starts, table = data
    scale = 1.0  # T5
    name = f"B{b} L{length} H{h} d{d} {'causal' if causal else 'full'}"
    t5 = cpa.RelativePositionBias(table, num_buckets=32, max_distance=128, bidirectional=not causal)
    pairs = b * length * (length + 1) // 2 if causal else b * length * length
    flops = 4.0 * pairs * h * d
    out = torch.empty_like(query)

    def ours(bias=t5, causal=causal, out=out):
        paged_prefill_attention(query, k_cache, v_cache, tables, seq_lens, starts, causal=causal,
                                scale=scale, attn_bias=bias, out=out)

    row = {"case": name, "flops": flops}
    row["ours"] = timed(ours, reps)
    row["ours_plain"] = timed(lambda: ours(bias=None), reps)
    print(f"{name}: ours {row['ours']:.3f} ms, without bias {row['ours_plain']:.3f} ms", flush=True)
    if prefill._runs_sm90a(torch.cuda.current_device()):  # the mma.sync tiling, which other GPUs run
        prefill.WGMMA = False
        try:
            row["ours_sync"] = timed(ours, reps)
        finally:
            prefill.WGMMA = True
        print(f"{name}: ours on the mma.sync tiling {row['ours_sync']:.3f} ms", flush=True)
    buckets = t5_bucket_by_rel(length, bidirectional=not causal)
    if not quick:
        try:
            rel = torch.arange(length, device="cuda")[None, :] - torch.arange(length, device="cuda")[:, None]
            bias = table.t()[:, buckets[rel + length - 1]].to(torch.bfloat16)  # [H, L, L]
            if causal:
                bias = bias.masked_fill(rel[None] > 0, float("-inf"))
            bias = bias[None].expand(b, h, length, length)

            def sdpa(bias=bias):
                k, v = gather(k_cache, v_cache, tables, b, length, h, d)
                q = query.view(b, length, h, d).transpose(1, 2)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

            ref = sdpa().transpose(1, 2).reshape(b * length, h, d)
            ours()
            torch.cuda.synchronize()
            row["maxdiff"] = float((ref.float() - out.float()).abs().max())
            row["sdpa"] = timed(sdpa, reps)
            print(f"{name}: sdpa {row['sdpa']:.3f} ms, max |ours - sdpa| = {row['maxdiff']:.4f}", flush=True)
            del bias, ref
        except Exception:  # a peer failing (memory, backend) is reported and skipped
            traceback.print_exc(limit=2)
        torch.cuda.empty_cache()
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            table_t = table.t().contiguous()

            def score_mod(score, bb, hh, qi, kj, table_t=table_t, buckets=buckets):
                return score + table_t[hh, buckets[kj - qi + length - 1]].to(score.dtype)

            mask = None
            if causal:
                mask = create_block_mask(lambda bb, hh, qi, kj: qi >= kj, None, None, length, length)

            def flex_run(mask=mask, score_mod=score_mod):
                k, v = gather(k_cache, v_cache, tables, b, length, h, d)
                q = query.view(b, length, h, d).transpose(1, 2)
                return flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale)

            row["flex"] = timed(flex_run, reps)
            print(f"{name}: flex {row['flex']:.3f} ms", flush=True)
        except Exception:
            traceback.print_exc(limit=2)
    return row



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="ours only, no peers")
    args = parser.parse_args()

    import torch

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for b, length, h, d in CASES:
        data = build(b, length, h, d)
        for causal in (False, True):
            rows.append(bench_case(data, b, length, h, d, causal, args.reps, args.quick))
            torch.cuda.empty_cache()

    print()
    print(f"| case (bf16, T5 bias) | ours ms | ours TFLOP/s | % of {PEAK_TFLOPS:.0f} | ours w/o bias ms "
          "| ours mma.sync ms | SDPA+bias ms | FlexAttn ms | vs SDPA | vs Flex |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        tf = r["flops"] / (r["ours"] * 1e-3) / 1e12
        sd = f"{r['sdpa']:.3f}" if "sdpa" in r else "failed/skipped"
        fx = f"{r['flex']:.3f}" if "flex" in r else "failed/skipped"
        vs_sd = f"{r['sdpa'] / r['ours']:.2f}x" if "sdpa" in r else "-"
        vs_fx = f"{r['flex'] / r['ours']:.2f}x" if "flex" in r else "-"
        sync = f"{r['ours_sync']:.3f}" if "ours_sync" in r else "-"
        print(f"| {r['case']} | {r['ours']:.3f} | {tf:.0f} | {100 * tf / PEAK_TFLOPS:.1f} % | {r['ours_plain']:.3f} "
              f"| {sync} | {sd} | {fx} | {vs_sd} | {vs_fx} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
