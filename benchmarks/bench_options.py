"""Serving options benchmark: what Gemma 2's logit soft-cap and a sliding window cost in decode and prefill, and
FlexAttention with the same options.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_options.py [--reps 30] [--skip-flex]

Decode (bf16 unless the case says fp16, ``block_size`` 16, pages scattered; bench_decode.py's inputs and timer:
``triton.testing.do_bench`` medians with L2 flushed before each repetition)
    ``ours``, ``ours+cap``              no bias, without and with ``logits_soft_cap=30``
    ``ours+nowindow``                   ``window_left=max_len``: the kernels compiled with the options, with nothing
                                        to mask (what the options' code costs by itself)
    ``ours+dense``, ``ours+dense+cap``  a dense bias of the query's dtype, without and with the cap
    ``ours+window``                     ``window_left=1024`` (the case's sequences are longer: most pages lie before
                                        the window)
    ``ours+window+cap+dense``           all three (FlexAttention's row below does the same)
    ``ours@1025``                       the same case with every sequence 1025 keys long and no window: the time a
                                        window of 1024 can at best reach
    ``flex+window+cap+dense``           ``torch.compile``d FlexAttention on contiguous K/V with the same bias, cap
                                        (``score_mod``) and window (``BlockMask``), checked against ours
Prefill (B4 L4096 H32/32 d128 causal, bf16; bench_prefill.py's timer)
    ``ours``, ``ours+nowindow``, ``ours+cap``, ``ours+window`` (1024), ``ours+window+cap``, ``flex+window+cap``

The table's last columns give each row's time over ``ours`` of its case (the cap's and the window's cost, or
saving) and, for ``ours+window``, over ``ours@1025``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import bench_decode as bd
import bench_prefill as bp

CAP = 30.0
WINDOW = 1024
DECODE_CASES = (bd.CASES[0], bd.CASES[3], bd.CASES[5], bd.CASES[11])  # d64 MHA, d128 GQA, fp16 16k, ragged GQA
PREFILL_CASE = (4, 4096, 32, 128, True)


def decode_rows(case: bd.Case, timer: bd.Timer, flex: bool) -> list[tuple[str, float, str]]:
    """``(row, µs, note)`` of one decode case."""
    import torch

    import cupy_paged_attn as cpa

    lens = bd.draw_seq_lens(case, 0)
    s = bd.build_inputs(case, lens, 1, 0)[0][0]

    def ours(**options: Any) -> Any:
        return cpa.paged_attention(s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, out=s.out,
                                   **options)

    rows = []
    for name, options in (("ours", {}), ("ours+nowindow", {"window_left": case.max_len}),
                          ("ours+cap", {"logits_soft_cap": CAP}), ("ours+dense", {"attn_bias": s.bias}),
                          ("ours+dense+cap", {"attn_bias": s.bias, "logits_soft_cap": CAP}),
                          ("ours+window", {"window_left": WINDOW}),
                          ("ours+window+cap+dense", {"window_left": WINDOW, "logits_soft_cap": CAP,
                                                     "attn_bias": s.bias})):
        rows.append((name, 1e3 * timer.median_ms(lambda o=options: ours(**o)), ""))
    short = bd.Case(case.batch, case.num_heads, case.num_kv_heads, case.head_size, WINDOW + 1, case.dtype)
    t = bd.build_inputs(short, [WINDOW + 1] * case.batch, 1, 1)[0][0]
    rows.append(("ours@1025", 1e3 * timer.median_ms(
        lambda: cpa.paged_attention(t.query, t.key_cache, t.value_cache, t.block_tables, t.seq_lens, out=t.out)), ""))
    if not flex:
        return rows
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return [*rows, ("flex+window+cap+dense", float("nan"), f"skipped: {bd.first_line(exc)}")]
    key = bd.gather_dense(s.key_cache, s.block_tables, case.max_len).contiguous()
    value = bd.gather_dense(s.value_cache, s.block_tables, case.max_len).contiguous()
    seq_lens, bias = s.seq_lens, s.bias

    def in_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < seq_lens[b]) & (kv_idx >= seq_lens[b] - 1 - WINDOW)

    def capped(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return CAP * torch.tanh(score / CAP) + bias[b, h, kv_idx]

    try:
        block_mask = create_block_mask(in_window, case.batch, None, 1, case.max_len, device="cuda")
        run = torch.compile(lambda q: flex_attention(q, key, value, score_mod=capped, block_mask=block_mask,
                                                     enable_gqa=case.num_heads != case.num_kv_heads))
        q = s.query[:, :, None, :]
        got = run(q)[:, :, 0, :]
        want = ours(attn_bias=bias, logits_soft_cap=CAP, window_left=WINDOW)
        diff = (got.float() - want.float()).abs().max().item()
        us = 1e3 * timer.median_ms(lambda: run(q))
    except Exception as exc:  # a compile failure is a peer's result, reported
        return [*rows, ("flex+window+cap+dense", float("nan"), f"failed: {bd.first_line(exc)}")]
    flag = "" if diff <= bd.TOLERANCE[case.dtype] else "  MISMATCH"
    return [*rows, ("flex+window+cap+dense", us, f"max |flex - ours| {diff:.2e}{flag}")]


def prefill_rows(reps: int, flex: bool) -> list[tuple[str, float, str]]:
    """``(row, µs, note)`` of the prefill case."""
    import torch

    import cupy_paged_attn as cpa

    b, length, h, d, causal = PREFILL_CASE
    data = bp.build(b, length, h, d)
    out = torch.empty_like(data["query"])

    def ours(**options: Any) -> Any:
        return cpa.paged_prefill_attention(data["query"], data["key_cache"], data["value_cache"],
                                           data["block_tables"], data["seq_lens"], data["starts"], causal=causal,
                                           out=out, **options)

    rows = []
    for name, options in (("ours", {}), ("ours+nowindow", {"window_left": length}),
                          ("ours+cap", {"logits_soft_cap": CAP}), ("ours+window", {"window_left": WINDOW}),
                          ("ours+window+cap", {"window_left": WINDOW, "logits_soft_cap": CAP})):
        rows.append((name, 1e3 * bp.timed(lambda o=options: ours(**o), reps), ""))
    if not flex:
        return rows
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def in_window(b_: Any, h_: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - WINDOW)

        def capped(score: Any, b_: Any, h_: Any, q_idx: Any, kv_idx: Any) -> Any:
            return CAP * torch.tanh(score / CAP)

        block_mask = create_block_mask(in_window, None, None, length, length, device="cuda")
        run = torch.compile(lambda: flex_attention(data["q"], data["k"], data["v"], score_mod=capped,
                                                   block_mask=block_mask))
        got = run().transpose(1, 2).reshape(b * length, h, d)
        want = ours(window_left=WINDOW, logits_soft_cap=CAP)
        diff = (got.float() - want.float()).abs().max().item()
        us = 1e3 * bp.timed(run, reps)
    except Exception as exc:  # a compile failure is a peer's result, reported
        return [*rows, ("flex+window+cap", float("nan"), f"failed: {bd.first_line(exc)}")]
    flag = "" if diff <= bp.TOLERANCE else "  MISMATCH"
    return [*rows, ("flex+window+cap", us, f"max |flex - ours| {diff:.2e}{flag}")]


def table(name: str, rows: list[tuple[str, float, str]]) -> list[str]:
    times = {row: us for row, us, _ in rows}
    lines = []
    for row, us, note in rows:
        over = f"{us / times['ours']:.3f}" if us == us else "-"
        window = f"{us / times['ours@1025']:.3f}" if row == "ours+window" and "ours@1025" in times else ""
        lines.append(f"| {name} | {row} | {us:.1f} | {over} | {window} | {note} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--skip-flex", action="store_true", help="our rows only")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_options.py needs a CUDA GPU", file=sys.stderr)
        return 2
    timer = bd.Timer("auto", args.reps, 3)
    lines = ["| case | row | µs | / ours | / ours@1025 | note |", "| --- | --- | --- | --- | --- | --- |"]
    for case in DECODE_CASES:
        print(f"decode {case.name} ...", file=sys.stderr, flush=True)
        lines += table(f"decode {case.name}", decode_rows(case, timer, not args.skip_flex))
        torch.cuda.empty_cache()
    print("prefill ...", file=sys.stderr, flush=True)
    lines += table("prefill " + bp.case_name(*PREFILL_CASE), prefill_rows(args.reps, not args.skip_flex))
    print(f"{torch.cuda.get_device_name()}, {timer.backend}, soft-cap {CAP}, window {WINDOW}")
    print("\n".join(lines))
    return 1 if any("MISMATCH" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
