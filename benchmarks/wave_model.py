"""A fluid model of a decode grid's waves: how the order in which the GPU starts CTAs, and how a split cuts each
sequence's keys, shape the end of the grid. A prediction to set beside measurements (``benchmarks/NOTES.md``),
not a measurement. No GPU needed::

    PYTHONPATH=. python3 benchmarks/wave_model.py                  # bench_decode's case 11 in 3 partitions
    PYTHONPATH=. python3 benchmarks/wave_model.py --cases 11,12 --parts 2,3,4 --saturate 264,330

The model: ``slots`` CTAs run at once (the SMs times the CTAs that one SM holds of the tensor-core decode's
tiling); the hardware starts CTAs in issue order as slots free. A CTA first spends ``--start-us`` with nothing in
flight (ranking, block ids, pipeline fill), then reads its keys' bytes; while ``n`` CTAs run, each reads
``bandwidth / max(n, N)``, ``N`` (``--saturate``) being the CTAs that saturate the memory. So a grid's last CTAs,
fewer than ``N``, leave the memory part idle: the tail. Printed: each order's time over the floor (every byte at
the full bandwidth).

Orders (a grid of ``rows`` CTAs per sequence and partition, sequences ranked longest first):

- ``by-partition``: partition 0 of every sequence, then partition 1, ...; partitions of ``max_len / parts`` keys
  (the tensor-core decode's ranked split grids before session 23).
- ``by-sequence``: every partition of the longest sequence, then of the next, ...; each sequence's own keys cut into
  ``parts`` runs (paged_prefill.cu since session 23).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import bench_decode as bd
import numpy as np

from cupy_paged_attn import _compile

ORDERS = ("by-partition", "by-sequence")


def round_up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def issue_order(lens: Sequence[int], rows: int, parts: int, tile: int, order: str) -> list[int]:
    """Keys of each CTA of a split grid over sequences ``lens``, in the order the GPU starts them (0: an empty
    partition)."""
    ranked = sorted(lens, reverse=True)
    if order == "by-partition":
        per = max(tile, round_up(-(-max(lens) // parts), tile))
        return [max(0, min(per, n - z * per)) for z in range(parts) for n in ranked for _ in range(rows)]
    if order == "by-sequence":
        keys = []
        for n in ranked:
            per = max(tile, round_up(-(-n // parts), tile))
            keys += [max(0, min(per, n - z * per)) for z in range(parts) for _ in range(rows)]
        return keys
    raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")


def grid_time(work: Sequence[float], slots: int, saturate: int, start: float) -> float:
    """Time for CTAs of ``work`` (each the seconds its bytes take at the whole bandwidth) started in order into
    ``slots``, each first idle for ``start`` seconds, each reading at 1 / max(CTAs running, ``saturate``) of the
    bandwidth."""
    queue = list(work)[::-1]
    idle = np.zeros(0)
    left = np.zeros(0)
    now = 0.0
    while queue or left.size:
        free = slots - left.size
        if free > 0 and queue:
            take = [queue.pop() for _ in range(min(free, len(queue)))]
            idle = np.concatenate([idle, np.full(len(take), start)])
            left = np.concatenate([left, np.array(take, dtype=float)])
        rate = 1.0 / max(left.size, saturate)  # of the memory, per CTA reading
        reading = idle <= 0
        step = min(np.min(idle[~reading], initial=np.inf), np.min(left[reading] / rate, initial=np.inf))
        now += step
        idle = np.where(reading, idle, idle - step)
        left = np.where(reading, left - rate * step, left)
        done = (idle <= 1e-12) & (left <= 1e-9)
        idle, left = idle[~done], left[~done]
    return now


def predict(case: bd.Case, seed: int, parts: int, num_sms: int, saturate: int, start_us: float,
            bandwidth: float) -> dict[str, float]:
    """Each order's predicted time over the floor for ``case`` (its lengths as bench_decode draws them) on the
    tensor-core decode's tiling: CTAs of 8 or 16 query heads of one KV head, as many resident per SM as it holds."""
    lens = bd.draw_seq_lens(case, seed)
    group = case.num_heads // case.num_kv_heads
    tile_rows = _compile.decode_rows(group)
    rows = -(-group // tile_rows) * case.num_kv_heads  # CTAs per (sequence, partition)
    slots = _compile.decode_ctas_per_sm(case.head_size, tile_rows) * num_sms
    tile = _compile.prefill_tile_keys(case.head_size, tile_rows)
    unit = 2 * case.head_size * case.itemsize / bandwidth  # seconds per key of one KV head at the whole bandwidth
    floor = sum(lens) * case.num_kv_heads * unit
    return {order: grid_time([k * unit for k in issue_order(lens, rows, parts, tile, order)], slots, saturate,
                             start_us * 1e-6) / floor for order in ORDERS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=bd.parse_case_indices, default=[11], help="bench_decode cases (default 11)")
    parser.add_argument("--parts", default="3", help="partitions, comma-separated (default 3)")
    parser.add_argument("--sms", type=int, default=132, help="SMs (default 132, the H200's)")
    parser.add_argument("--saturate", default="264,330", help="CTAs that saturate the memory, comma-separated")
    parser.add_argument("--start-us", type=float, default=2.0, help="a CTA's start before its first byte (µs)")
    parser.add_argument("--seed", type=int, default=0, help="bench_decode's seed (default 0)")
    args = parser.parse_args(argv)
    print(f"{'case':26s} | parts | N   | " + " | ".join(f"{o:>12s}" for o in ORDERS))
    for index in args.cases:
        case = bd.CASES[index]
        for parts in map(int, args.parts.split(",")):
            for saturate in map(int, args.saturate.split(",")):
                ratio = predict(case, args.seed + index, parts, args.sms, saturate, args.start_us, 4.27e12)
                print(f"{case.name:26s} | {parts:5d} | {saturate:3d} | "
                      + " | ".join(f"{ratio[o]:11.3f}x" for o in ORDERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
