"""A minimal serving loop: a block allocator, a scheduler, sequences that join and finish at different steps.

Run: python examples/serving_loop.py            (a CUDA GPU with PyTorch and CuPy: float16 torch tensors)
     python examples/serving_loop.py --cpu      (anywhere: NumPy arrays, the library's float64 CPU path)

Every step, each running sequence appends one token (a new one its whole prompt): its key and value go into the
paged cache with ``reshape_and_cache``, its bias row (a per-token prior, e.g. a retrieval score, kept ragged) into
a ``RaggedBias``, then ``paged_attention`` decodes one query per sequence. Pages are allocated as sequences grow
and returned when they finish; a sequence is admitted only when the pages every running sequence may still need
remain free. Each step is checked against ``paged_attention_ref`` and against a dense attention over each
sequence's own token history (which the paging must reproduce). Ends with "serving loop: ... OK".
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import paged_attention_ref, to_numpy


class BlockAllocator:
    """Page ids of the cache, handed out and taken back (a free list)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))

    def allocate(self) -> int:
        return self.free.pop()

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


@dataclass
class Sequence:
    sid: int
    arrival: int  # the step it asks to join
    prompt_len: int
    target_len: int  # it finishes when it holds this many tokens
    blocks: list[int] = field(default_factory=list)
    keys: list[np.ndarray] = field(default_factory=list)  # [num_kv_heads, head_size] per token, for the check
    values: list[np.ndarray] = field(default_factory=list)
    bias: list[np.ndarray] = field(default_factory=list)  # [num_heads] per token

    @property
    def length(self) -> int:
        return len(self.keys)


def pages(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """One sequence, float64: q [H, D], k and v [n, Hkv, D], bias [n, H] -> [H, D]."""
    group = q.shape[0] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    logits = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[1]) + bias.T
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    return np.einsum("hn,nhd->hd", w / w.sum(axis=1, keepdims=True), v)


class Device:
    """Where the arrays live: torch CUDA tensors (float16), or NumPy (float32, the CPU path)."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        if not cpu:
            import torch

            self.torch = torch
        self.dtype = np.float32 if cpu else np.float16

    def put(self, arr: np.ndarray) -> Any:
        """The same array where the loop runs (dtype kept: K/V and queries are made in ``self.dtype``)."""
        arr = np.ascontiguousarray(arr)
        return arr if self.cpu else self.torch.from_numpy(arr).to("cuda")

    def zeros(self, shape: tuple[int, ...]) -> Any:
        if self.cpu:
            return np.zeros(shape, self.dtype)
        return self.torch.zeros(shape, dtype=self.torch.float16, device="cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="NumPy arrays on the CPU (default when no GPU)")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--sequences", type=int, default=12)
    parser.add_argument("--num-blocks", type=int, default=40)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    cpu = opts.cpu or gpu_missing() is not None
    if cpu and not opts.cpu:
        print(f"no GPU path ({gpu_missing()}): running on the CPU")
    dev = Device(cpu)
    rng = np.random.default_rng(opts.seed)
    num_heads, num_kv_heads, head_size, bs = 8, 2, opts.head_size, opts.block_size
    atol = 1e-5 if cpu else 5e-3

    key_cache = dev.zeros((opts.num_blocks, bs, num_kv_heads, head_size))
    value_cache = dev.zeros((opts.num_blocks, bs, num_kv_heads, head_size))
    allocator = BlockAllocator(opts.num_blocks)
    waiting = sorted(
        (Sequence(i, int(rng.integers(0, opts.steps // 2)), p := int(rng.integers(1, 3 * bs)),
                  p + int(rng.integers(2, opts.steps // 2))) for i in range(opts.sequences)),
        key=lambda s: s.arrival,
    )
    running: list[Sequence] = []
    finished, worst, worst_dense, steps = 0, 0.0, 0.0, 0
    for step in range(opts.steps):
        # Schedule: admit in arrival order while the pages every running sequence may still need stay free.
        owed = sum(pages(s.target_len, bs) - len(s.blocks) for s in running)
        while waiting and waiting[0].arrival <= step and \
                len(allocator.free) - owed >= pages(waiting[0].target_len, bs):
            owed += pages(waiting[0].target_len, bs)
            running.append(waiting.pop(0))
        if not running:
            continue
        steps += 1

        # New tokens (a newcomer's whole prompt): pages as needed, a slot each, K/V into the cache.
        keys, values, slots = [], [], []
        for seq in running:
            for _ in range(seq.prompt_len if seq.length == 0 else 1):
                if seq.length % bs == 0:
                    seq.blocks.append(allocator.allocate())
                slots.append(seq.blocks[-1] * bs + seq.length % bs)
                k, v = rng.standard_normal((2, num_kv_heads, head_size)).astype(dev.dtype)
                seq.keys.append(k)
                seq.values.append(v)
                seq.bias.append(rng.standard_normal(num_heads).astype(np.float32))
                keys.append(k)
                values.append(v)
        cpa.reshape_and_cache(dev.put(np.stack(keys)), dev.put(np.stack(values)), key_cache, value_cache,
                              dev.put(np.asarray(slots, np.int64)))

        # Decode one query per running sequence, with each sequence's ragged bias.
        lens = [s.length for s in running]
        tables = np.full((len(running), max(len(s.blocks) for s in running)), -1, np.int32)  # -1: never read
        for i, seq in enumerate(running):
            tables[i, : len(seq.blocks)] = seq.blocks
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        bias_rows = np.concatenate([np.stack(s.bias) for s in running])  # [sum(lens), num_heads]
        query = rng.standard_normal((len(running), num_heads, head_size)).astype(dev.dtype)
        args = (dev.put(query), key_cache, value_cache, dev.put(tables), dev.put(np.asarray(lens, np.int32)))
        bias = cpa.RaggedBias(dev.put(bias_rows), dev.put(offsets))
        out = to_numpy(cpa.paged_attention(*args, attn_bias=bias)).astype(np.float64)

        expected = paged_attention_ref(*args, attn_bias=bias)
        dense = np.stack([dense_attention(query[i].astype(np.float64), np.stack(s.keys).astype(np.float64),
                                          np.stack(s.values).astype(np.float64), np.stack(s.bias))
                          for i, s in enumerate(running)])
        worst = max(worst, float(np.abs(out - expected).max()))
        worst_dense = max(worst_dense, float(np.abs(expected - dense).max()))
        if not (worst <= atol and worst_dense <= 1e-6):
            raise SystemExit(f"step {step}: max |diff| {worst:.2e} vs reference, {worst_dense:.2e} reference vs "
                             "dense history: FAILED")

        # Finish: sequences at their target length give their pages back.
        for seq in [s for s in running if s.length >= s.target_len]:
            allocator.release(seq.blocks)
            running.remove(seq)
            finished += 1
    where = "NumPy on the CPU" if cpu else "float16 torch tensors on the GPU"
    print(f"serving loop: {steps} steps, {finished + len(running)} sequences ({finished} finished), "
          f"max |diff| {worst:.2e} vs reference ({where}) OK")


def gpu_missing() -> str | None:
    """Why the GPU path cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    return None


if __name__ == "__main__":
    main()
