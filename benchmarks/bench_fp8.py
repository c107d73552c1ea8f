"""fp8 KV-cache benchmark: decode over float8 caches against the physical floor of their bytes, against the same
decode over 16-bit caches, and against gather + dequantize + SDPA.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_fp8.py [--reps 30] [--cases 0,3]

Per case (bench_decode.py's cases, inputs and timer: ``triton.testing.do_bench`` medians with L2 flushed before each
repetition; ``block_size`` 16, ``kv_layout="nhd"``, pages scattered), with caches quantized from bench_decode's
random ones as ``(x / 0.5).to(float8)`` and read with ``k_scale = v_scale = 0.5``:

    ``16-bit``          ``paged_attention`` over the dequantized caches in the query's dtype (the same values: a
                        power-of-two scale dequantizes exactly), no bias: what fp8 is compared with
    ``e4m3``, ``e5m2``  the fp8 caches (torch's float8 dtypes), no bias
    ``e4m3+dense``      with bench_decode's dense bias (the query's dtype)
    ``e4m3+t5``         with T5's bias computed in the kernel
    ``sdpa-dequant``    what PyTorch offers without a paged fp8 kernel: gather the fp8 pages, convert and scale them
                        to the query's dtype, repeat the KV heads, SDPA with the lengths as a float mask

Columns: the time; the floor, the bytes the row cannot avoid (bench_decode.floor_bytes with one byte per fp8 K/V
element) over the copy bandwidth measured in the same run; the floor's share of the time (``% copy``); and the
16-bit row's time over the row's. Every fp8 row's output is checked against the 16-bit row's (the same values),
the biased rows against the 16-bit decode with the same bias.

Prefill (B4 L4096 H32/32 d128 causal, bf16; bench_prefill.py's inputs and timer): ``16-bit`` and ``e4m3`` caches of
the same values. Over fp8 caches prefill first dequantizes the pages it reads (cache_dequantize.cu), then runs the
16-bit tilings: the row's time includes that pass.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import bench_decode as bd
import bench_prefill as bp

SCALE = 0.5
DEFAULT_CASES = (0, 2, 3, 5, 9, 11)  # MHA d64 and d128, GQA d128, fp16 16k, two ragged batches
PREFILL_CASE = (4, 4096, 32, 128, True)


def fp8_floor(case: bd.Case, lens: list[int], kind: str) -> int:
    """bench_decode's floor with one byte per K and V element."""
    kv_saved = sum(lens) * case.num_kv_heads * case.head_size * 2 * (case.itemsize - 1)
    return bd.floor_bytes(case, lens, kind) - kv_saved


def sdpa_dequant(s: Any, k8: Any, v8: Any, max_len: int) -> Any:
    """Gather the fp8 pages, dequantize to the query's dtype, SDPA with a float mask of the lengths."""
    import torch
    import torch.nn.functional as F

    num_heads, num_kv_heads = s.query.shape[1], k8.shape[2]
    key = bd.gather_dense(k8.view(torch.uint8), s.block_tables, max_len)
    value = bd.gather_dense(v8.view(torch.uint8), s.block_tables, max_len)
    key = key.view(k8.dtype).to(s.query.dtype) * SCALE
    value = value.view(v8.dtype).to(s.query.dtype) * SCALE
    if num_heads != num_kv_heads:
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
    position = torch.arange(max_len, device=s.query.device)
    mask = torch.zeros((s.query.shape[0], 1, 1, max_len), dtype=s.query.dtype, device=s.query.device)
    mask = mask.masked_fill(position >= s.seq_lens[:, None, None, None], float("-inf"))
    return F.scaled_dot_product_attention(s.query[:, :, None, :], key, value, attn_mask=mask)[:, :, 0, :]


def case_rows(case: bd.Case, timer: bd.Timer, copy_bps: float) -> list[tuple[str, float, float, str]]:
    """``(row, µs, floor µs, note)`` of one case."""
    import torch

    import cupy_paged_attn as cpa

    lens = bd.draw_seq_lens(case, 0)
    s = bd.build_inputs(case, lens, 1, 0)[0][0]
    s.make_bias_object("t5")
    caches = {}
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        caches[fmt] = ((s.key_cache / SCALE).to(dtype), (s.value_cache / SCALE).to(dtype))
    k16, v16 = (c.to(s.query.dtype) * SCALE for c in caches["e4m3"])  # the e4m3 values, exactly

    def ours(k: Any, v: Any, bias: Any = None, **options: Any) -> Any:
        return cpa.paged_attention(s.query, k, v, s.block_tables, s.seq_lens, attn_bias=bias, out=s.out, **options)

    fp8 = {"k_scale": SCALE, "v_scale": SCALE}
    plans = [("16-bit", "none", lambda: ours(k16, v16), None),
             ("e4m3", "none", lambda: ours(*caches["e4m3"], **fp8), lambda: ours(k16, v16)),
             ("e5m2", "none", lambda: ours(*caches["e5m2"], **fp8), None),
             ("e4m3+dense", "dense", lambda: ours(*caches["e4m3"], s.bias, **fp8), lambda: ours(k16, v16, s.bias)),
             ("e4m3+t5", "t5", lambda: ours(*caches["e4m3"], s.t5_bias, **fp8), lambda: ours(k16, v16, s.t5_bias)),
             ("sdpa-dequant", "none", lambda: sdpa_dequant(s, *caches["e4m3"], case.max_len),
              lambda: ours(k16, v16))]
    rows = []
    for name, kind, call, reference in plans:
        note = ""
        try:
            got = call().float()
            if reference is not None:
                diff = (got - reference().float()).abs().max().item()
                flag = " MISMATCH" if not diff <= bd.TOLERANCE[case.dtype] else ""
                note = f"max diff {diff:.1e}{flag}"
            us = 1e3 * timer.median_ms(call)
        except (RuntimeError, NotImplementedError, torch.cuda.OutOfMemoryError) as exc:
            us, note = float("nan"), f"skipped: {bd.first_line(exc)}"
        floor = (bd.floor_bytes(case, lens, kind) if name == "16-bit" else fp8_floor(case, lens, kind)) / copy_bps
        rows.append((name, us, 1e6 * floor, note))
    return rows


def prefill_rows(reps: int) -> list[tuple[str, float, str]]:
    """``(row, µs, note)`` of the prefill case over 16-bit and over e4m3 caches (the same values)."""
    import torch

    import cupy_paged_attn as cpa

    b, length, h, d, causal = PREFILL_CASE
    data = bp.build(b, length, h, d)
    k8, v8 = ((data[name] / SCALE).to(torch.float8_e4m3fn) for name in ("key_cache", "value_cache"))
    k16, v16 = (c.to(data["query"].dtype) * SCALE for c in (k8, v8))
    out = torch.empty_like(data["query"])

    def ours(k: Any, v: Any, **options: Any) -> Any:
        return cpa.paged_prefill_attention(data["query"], k, v, data["block_tables"], data["seq_lens"],
                                           data["starts"], causal=causal, out=out, **options)

    want = ours(k16, v16).float()
    rows = [("16-bit", 1e3 * bp.timed(lambda: ours(k16, v16), reps), "")]
    diff = (ours(k8, v8, k_scale=SCALE, v_scale=SCALE).float() - want).abs().max().item()
    flag = "" if diff <= bp.TOLERANCE else " MISMATCH"
    rows.append(("e4m3", 1e3 * bp.timed(lambda: ours(k8, v8, k_scale=SCALE, v_scale=SCALE), reps),
                 f"max diff {diff:.1e}{flag}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cases", type=bd.parse_case_indices, default=list(DEFAULT_CASES),
                        help="bench_decode.py's case indices (--list there shows them)")
    parser.add_argument("--skip-prefill", action="store_true", help="decode cases only")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_fp8.py needs a CUDA GPU", file=sys.stderr)
        return 2
    timer = bd.Timer("auto", args.reps, 3)
    copy = bd.measure_copy_bandwidth(timer)
    lines = ["| case | row | µs | floor µs | % copy | 16-bit / row | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for index in args.cases:
        case = bd.CASES[index]
        print(f"{case.name} ...", file=sys.stderr, flush=True)
        rows = case_rows(case, timer, copy["bytes_per_s"])
        base = rows[0][1]
        for name, us, floor, note in rows:
            share = f"{100 * floor / us:.0f}" if us == us else "-"
            lines.append(f"| {case.name} | {name} | {us:.1f} | {floor:.1f} | {share} | {base / us:.2f} | {note} |")
        torch.cuda.empty_cache()
    if not args.skip_prefill:
        print("prefill ...", file=sys.stderr, flush=True)
        rows = prefill_rows(args.reps)
        for name, us, note in rows:
            lines.append(f"| prefill {bp.case_name(*PREFILL_CASE)} | {name} | {us:.1f} | - | - | "
                         f"{rows[0][1] / us:.2f} | {note} |")
    print(f"{torch.cuda.get_device_name()}, {timer.backend}, copy {copy['bytes_per_s'] / 1e9:.0f} GB/s, "
          f"k_scale = v_scale = {SCALE}")
    print("\n".join(lines))
    return 1 if any("MISMATCH" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
