"""Tensor-parallel decode on 2 GPUs: query and KV heads split across ranks, results gathered with NCCL.

Run: python examples/tensor_parallel.py                      (spawns one process per GPU)
     torchrun --nproc_per_node 2 examples/tensor_parallel.py  (the same, launched by torchrun)

As in Megatron-style attention, rank ``r`` owns query heads ``[r*H/2, (r+1)*H/2)`` and the KV heads they read
(GQA groups stay whole), its own slice of the paged caches, and its slice of the bias (a strided view: the library
takes any strides). Each rank runs ``paged_attention`` on its GPU; ``all_gather`` concatenates the heads, and
rank 0 compares the result with the single-GPU call on the full problem and with the float64 reference. Needs 2
CUDA GPUs, PyTorch with NCCL and CuPy; with fewer GPUs it says so and exits 3 (0 with ``--skip-missing``).
NVLink multicast (NVLS) is left off.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before NCCL initialises: NVLink multicast stays off

import importlib.util
import socket

import numpy as np
from _missing import cannot_run

WORLD = 2
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 4, 128, 16
SEQ_LENS = [1, 37, 300, 1024, 513, 64]


def make_problem(seed: int) -> dict[str, np.ndarray]:
    """The full problem, the same on every rank (same seed): float16 caches with pages scattered at random."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    num_blocks = sum(pages) + 4
    free = list(rng.permutation(num_blocks))
    tables = np.zeros((len(SEQ_LENS), max(pages)), np.int32)
    for s, n in enumerate(pages):
        tables[s, :n] = [free.pop() for _ in range(n)]
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    return {
        "query": rng.standard_normal((len(SEQ_LENS), NUM_HEADS, HEAD_SIZE)).astype(np.float16),
        "key_cache": rng.standard_normal(shape).astype(np.float16),
        "value_cache": rng.standard_normal(shape).astype(np.float16),
        "block_tables": tables,
        "seq_lens": np.asarray(SEQ_LENS, np.int32),
        "attn_bias": rng.standard_normal((len(SEQ_LENS), NUM_HEADS, max(SEQ_LENS))).astype(np.float32),
    }


def worker(rank: int, world: int, port: int | None) -> None:
    """One rank: its heads' attention on its GPU, then the gather and (rank 0) the check."""
    import torch
    import torch.distributed as dist

    import cupy_paged_attn as cpa
    from cupy_paged_attn.reference import paged_attention_ref

    if port is not None:  # spawned here; torchrun sets these itself
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        full = {k: torch.from_numpy(v).to(device) for k, v in make_problem(seed=0).items()}
        heads, kv_heads = NUM_HEADS // world, NUM_KV_HEADS // world  # GQA groups stay on one rank
        q_heads, kv = slice(rank * heads, (rank + 1) * heads), slice(rank * kv_heads, (rank + 1) * kv_heads)
        local = cpa.paged_attention(
            full["query"][:, q_heads].contiguous(),
            full["key_cache"][:, :, kv].contiguous(),  # a rank holds only its KV heads' pages
            full["value_cache"][:, :, kv].contiguous(),
            full["block_tables"], full["seq_lens"],
            attn_bias=full["attn_bias"][:, q_heads],  # a strided view of the bias
        )
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        gathered = torch.cat(parts, dim=1)  # [num_seqs, num_heads, head_size], heads in order

        if rank == 0:
            args = [full[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
            single = cpa.paged_attention(*args, attn_bias=full["attn_bias"])
            expected = paged_attention_ref(*args, attn_bias=full["attn_bias"])
            vs_single = float((gathered.float() - single.float()).abs().max())
            vs_ref = float(np.abs(gathered.float().cpu().numpy() - expected).max())
            ok = vs_single <= 2e-3 and vs_ref <= 4e-3  # float16 outputs
            print(f"tensor parallel: {world} ranks x {heads} query heads / {kv_heads} KV heads, {len(SEQ_LENS)} "
                  f"sequences; max |diff| {vs_single:.2e} vs one GPU, {vs_ref:.2e} vs reference "
                  + ("OK" if ok else "FAILED"), flush=True)
            if not ok:
                raise SystemExit(1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    try:
        import torch
    except ImportError:
        cannot_run("tensor parallel needs PyTorch (with CUDA and NCCL)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None)
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < WORLD:
        cannot_run(f"tensor parallel needs {WORLD} CUDA GPUs, found {found}")
    if importlib.util.find_spec("cupy") is None:
        cannot_run("tensor parallel needs CuPy (pip install 'cupy-paged-attn[cuda13]')")
    torch.multiprocessing.spawn(worker, args=(WORLD, free_port()), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
