"""Prefill benchmark: ``cupy_paged_attn.paged_prefill_attention`` against PyTorch's attention, with and without a bias.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_prefill.py [--reps 20] [--cases 0,2] [--quick] [--out bench_out]

Cases (bf16, MHA, ``block_size`` 16, every sequence's whole length as its query rows): B4 L4096 H32 d128 and B8 L2048
H16 d64, causal and full, and B1 L16384 H32 d128 causal.

Rows
    ``ours``            no bias, from the paged cache.
    ``ours+t5``         T5's bias computed in the kernel (``RelativePositionBias``, scale 1).
    ``ours+dense``      a dense bf16 bias ``[B, H, L, L]`` (left out where it would pass ``--max-bias-gb``).
    ``ours mma.sync``, ``ours mma.sync+t5``   the same on the mma.sync tiling, what GPUs other than the H100 / H200
                        run (rows only on those two, where the Hopper tiling is the default).
    ``sdpa-cudnn``, ``sdpa-flash``   ``scaled_dot_product_attention`` with its cuDNN / flash backend, no bias.
    ``sdpa+t5``, ``sdpa+dense``      SDPA given the same bias as a float mask (T5's materialised, the causal mask
                        folded in as -inf), backend left to SDPA (cuDNN or the memory-efficient kernel); left out
                        where the mask would pass ``--max-bias-gb``.
    ``flex+t5``         ``torch.compile``d FlexAttention with T5 as ``score_mod`` (and a causal block mask).
The peers read K and V contiguous (``[B, H, L, d]``, gathered once, untimed): the layout they take natively.

Times are CUDA-event medians over ``--reps`` of the mean of 5 back-to-back calls queued behind an untimed one (so a
call's host time overlaps the previous call's kernels). TFLOP/s count 4·B·H·d per (query, key) pair the mask keeps,
about half of them when causal. Every row's output is checked against ``ours`` with the same bias (ours against
SDPA's cuDNN result). ``--quick``: our rows only. ``--out DIR`` writes ``DIR/prefill.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

CASES = [(4, 4096, 32, 128, True), (4, 4096, 32, 128, False), (8, 2048, 16, 64, True), (8, 2048, 16, 64, False),
         (1, 16384, 32, 128, True)]  # (B, L, H, d, causal)
BLOCK = 16
TOLERANCE = 0.05  # max |a - b| between two bf16 attentions of unit-variance data


def case_name(b: int, length: int, h: int, d: int, causal: bool) -> str:
    return f"B{b} L{length} H{h} d{d} {'causal' if causal else 'full'}"


def timed(fn: Callable[[], Any], reps: int, warmup: int = 3, inner: int = 5) -> float:
    """Median over ``reps`` of the mean time of ``inner`` back-to-back calls (ms), queued behind one untimed call."""
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


def build(b: int, length: int, h: int, d: int, seed: int = 0) -> dict[str, Any]:
    """Paged caches (pages scattered at random), packed queries, a T5 table and the contiguous K/V of the peers."""
    import torch

    torch.manual_seed(seed)
    dev = "cuda"
    pages = length // BLOCK
    num_blocks = b * pages + 7
    tables = torch.randperm(num_blocks, device=dev)[: b * pages].to(torch.int32).view(b, pages).contiguous()
    k_cache = torch.randn(num_blocks, BLOCK, h, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(b * length, h, d, device=dev, dtype=torch.bfloat16)
    return {
        "query": query, "key_cache": k_cache, "value_cache": v_cache, "block_tables": tables,
        "seq_lens": torch.full((b,), length, device=dev, dtype=torch.int32),
        "starts": torch.arange(0, b * length + 1, length, device=dev, dtype=torch.int32),
        "table": torch.randn(32, h, device=dev, dtype=torch.bfloat16),
        "q": query.view(b, length, h, d).transpose(1, 2),
        "k": k_cache[tables.long()].reshape(b, length, h, d).transpose(1, 2).contiguous(),
        "v": v_cache[tables.long()].reshape(b, length, h, d).transpose(1, 2).contiguous(),
    }


def t5_buckets(length: int, bidirectional: bool) -> Any:
    """Bucket of each relative position ``rel + length - 1`` (transformers' formula, through ours)."""
    import torch

    import cupy_paged_attn as cpa

    rel = np.arange(-(length - 1), length)
    buckets = cpa.t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    return torch.as_tensor(np.asarray(buckets), device="cuda")


def run_case(index: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every row of one case: ``{"case", "flops", "rows": {row: ms or None}, "errors": {row: message}}``."""
    import torch

    import cupy_paged_attn as cpa

    b, length, h, d, causal = CASES[index]
    name = case_name(b, length, h, d, causal)
    data = build(b, length, h, d)
    q, k, v = data["q"], data["k"], data["v"]
    pairs = b * length * (length + 1) // 2 if causal else b * length * length
    result: dict[str, Any] = {"case": name, "flops": 4.0 * pairs * h * d, "rows": {}, "errors": {}, "diffs": {}}
    out = torch.empty_like(data["query"])
    t5 = cpa.RelativePositionBias(data["table"], num_buckets=32, max_distance=128, bidirectional=not causal)
    bias_gb = b * h * length * length * 2 / 1e9
    dense = torch.randn(b, h, length, length, device="cuda", dtype=torch.bfloat16) if bias_gb <= args.max_bias_gb \
        else None

    def ours(bias: Any = None) -> Callable[[], Any]:
        def call() -> Any:
            return cpa.paged_prefill_attention(data["query"], data["key_cache"], data["value_cache"],
                                               data["block_tables"], data["seq_lens"], data["starts"],
                                               causal=causal, scale=1.0 if bias is t5 else None, attn_bias=bias,
                                               out=out)
        return call

    def row(label: str, fn: Callable[[], Any], reference: Any = None) -> None:
        try:
            got = fn().clone()
            if reference is not None:
                result["diffs"][label] = float((got.float() - reference.float()).abs().max())
            result["rows"][label] = timed(fn, args.reps)
        except Exception as exc:  # a peer failing (memory, backend, compile) is reported and left out
            result["rows"][label] = None
            result["errors"][label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            traceback.print_exc(limit=2, file=sys.stderr)
        ms = result["rows"][label]
        print(f"{name}: {label} " + (f"{ms:.3f} ms" if ms is not None else f"failed ({result['errors'][label]})"),
              file=sys.stderr, flush=True)

    reference = {"none": ours()().clone(), "t5": ours(t5)().clone()}
    row("ours", ours())
    row("ours+t5", ours(t5))
    if dense is not None:
        reference["dense"] = ours(dense)().clone()
        row("ours+dense", ours(dense))
    if cpa.planning.plan_prefill(_shape(data, causal), _device()).spec.wgmma:
        with cpa.tuning.override(wgmma=False):
            row("ours mma.sync", ours(), reference["none"])
            row("ours mma.sync+t5", ours(t5), reference["t5"])
    # The A/B lines (benchmarks/ab.py reads them): T5, no bias, T5 on the mma.sync tiling.
    print(f"{name}: ours {result['rows']['ours+t5']:.3f} ms, without bias {result['rows']['ours']:.3f} ms", flush=True)
    if "ours mma.sync+t5" in result["rows"]:
        print(f"{name}: ours on the mma.sync tiling {result['rows']['ours mma.sync+t5']:.3f} ms", flush=True)
    if args.quick:
        return result

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(mask: Any = None, backend: Any = None, scale: float | None = None) -> Callable[[], Any]:
        def call() -> Any:
            attend = torch.nn.functional.scaled_dot_product_attention
            if backend is None:
                return attend(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale)
            with sdpa_kernel(backend):
                return attend(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale)
        return lambda: call().transpose(1, 2).reshape(b * length, h, d)

    row("sdpa-cudnn", sdpa(backend=SDPBackend.CUDNN_ATTENTION), reference["none"])
    row("sdpa-flash", sdpa(backend=SDPBackend.FLASH_ATTENTION), reference["none"])
    buckets = t5_buckets(length, bidirectional=not causal)
    rel = torch.arange(length, device="cuda")[None, :] - torch.arange(length, device="cuda")[:, None]
    causal_mask = rel[None, None] > 0
    if h * length * length * 2 / 1e9 <= args.max_bias_gb:  # T5's bias materialised, [H, L, L] (broadcast over B)
        t5_mask = data["table"].t()[:, buckets[rel + length - 1]][None].expand(b, h, length, length)
        if causal:
            t5_mask = t5_mask.masked_fill(causal_mask, float("-inf"))
        row("sdpa+t5", sdpa(t5_mask, scale=1.0), reference["t5"])
        del t5_mask
        torch.cuda.empty_cache()
    if dense is not None:
        dense_mask = dense.masked_fill(causal_mask, float("-inf")) if causal else dense
        row("sdpa+dense", sdpa(dense_mask), reference["dense"])
        del dense_mask
        torch.cuda.empty_cache()
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        table_t = data["table"].t().contiguous()

        def score_mod(score: Any, bb: Any, hh: Any, qi: Any, kj: Any) -> Any:
            return score + table_t[hh, buckets[kj - qi + length - 1]].to(score.dtype)

        mask = create_block_mask(lambda bb, hh, qi, kj: qi >= kj, None, None, length, length) if causal else None
        row("flex+t5", lambda: flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=1.0).transpose(1, 2)
            .reshape(b * length, h, d), reference["t5"])
    except Exception as exc:
        result["rows"]["flex+t5"], result["errors"]["flex+t5"] = None, f"{type(exc).__name__}: {exc}"[:160]
    return result


def _shape(data: dict[str, Any], causal: bool) -> Any:
    from cupy_paged_attn import planning

    b, h, length, d = data["k"].shape
    return planning.PrefillShape(num_seqs=b, num_heads=h, num_kv_heads=h, head_size=d, max_len=length,
                                 dtype="bf16", total_q=b * length)


def _device() -> Any:
    import torch

    from cupy_paged_attn import _device as device

    return device.query(torch.cuda.current_device())


ROWS = ["ours", "ours+t5", "ours+dense", "ours mma.sync", "ours mma.sync+t5", "sdpa-cudnn", "sdpa-flash", "sdpa+t5",
        "sdpa+dense", "flex+t5"]
#: Each peer row's counterpart among ours (the same bias): the speed-up column.
VERSUS = {"sdpa-cudnn": "ours", "sdpa-flash": "ours", "sdpa+t5": "ours+t5", "sdpa+dense": "ours+dense",
          "flex+t5": "ours+t5", "ours mma.sync": "ours", "ours mma.sync+t5": "ours+t5"}


def report(results: list[dict[str, Any]]) -> str:
    """The results as a markdown table: ms (TFLOP/s), and for each other row ours' speed-up over it."""
    lines = ["| case (bf16) | " + " | ".join(r for r in ROWS) + " |", "| --- " * (len(ROWS) + 1) + "|"]
    for res in results:
        cells = []
        for label in ROWS:
            ms = res["rows"].get(label)
            if label not in res["rows"]:
                cells.append("—")
                continue
            if ms is None:
                cells.append("failed")
                continue
            text = f"{ms:.3f} ({res['flops'] / (ms * 1e-3) / 1e12:.0f})"
            ours = res["rows"].get(VERSUS.get(label, ""))
            if ours:
                text += f" {ms / ours:.2f}x"
            diff = res["diffs"].get(label)
            if diff is not None and diff > TOLERANCE:
                text += f" MISMATCH {diff:.3f}"
            cells.append(text)
        lines.append(f"| {res['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cases", default=",".join(map(str, range(len(CASES)))),
                        help="comma-separated indices: " + "; ".join(f"{i} {case_name(*c)}"
                                                                      for i, c in enumerate(CASES)))
    parser.add_argument("--quick", action="store_true", help="our rows only, no peers")
    parser.add_argument("--max-bias-gb", type=float, default=8.0, help="largest dense bias to build (default 8 GB)")
    parser.add_argument("--out", metavar="DIR", help="write DIR/prefill.json")
    args = parser.parse_args(argv)
    try:
        indices = [int(i) for i in args.cases.split(",") if i]
        if any(not 0 <= i < len(CASES) for i in indices):
            raise ValueError
    except ValueError:
        parser.error(f"--cases: expected indices from 0 to {len(CASES) - 1}, got {args.cases!r}")
    import torch

    if not torch.cuda.is_available():
        print("bench_prefill: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = []
    for index in indices:
        results.append(run_case(index, args))
        torch.cuda.empty_cache()
    table = report(results)
    print("\nms (TFLOP/s); x = that row's time over ours with the same bias\n" + table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "prefill.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
                       "results": results, "table": table}, f, indent=2)
    return 1 if any("ours" in label and ms is None for r in results for label, ms in r["rows"].items()) else 0


if __name__ == "__main__":
    sys.exit(main())
