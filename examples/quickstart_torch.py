"""Quickstart with PyTorch: paged decode attention on bfloat16 CUDA tensors, with a T5-style bias and GQA.

Run: python examples/quickstart_torch.py

Needs a CUDA GPU, PyTorch with CUDA and CuPy (``pip install 'cupy-paged-attn[cuda12]'``, or ``[cuda13]``); without them
it prints "cannot run: ..." and exits 3 (0 with ``--skip-missing``). Calls ``paged_attention`` plainly, then into
``out=`` on a side stream under ``torch.cuda.stream``, and checks both against the float64 NumPy reference.
"""

import importlib.util

import numpy as np
from _missing import cannot_run


def skip_reason() -> str | None:
    """Why this example cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'cupy-paged-attn[cuda12]')"
    return None


def main() -> None:
    import torch

    import cupy_paged_attn as cpa
    from cupy_paged_attn.reference import paged_attention_ref, to_numpy

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 8, 2, 128, 16, 64
    lens = [5, 300, 17, 64]  # different lengths, partial last pages
    num_seqs, max_len = len(lens), max(lens)

    # Each sequence's keys and values as the model made them; pages from a shuffled free list.
    keys = [torch.randn(n, num_kv_heads, head_size, device=dev, dtype=dtype) for n in lens]
    values = [torch.randn(n, num_kv_heads, head_size, device=dev, dtype=dtype) for n in lens]
    free_pages = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(num_seqs, -(-max_len // block_size), dtype=torch.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            block_tables[s, b] = free_pages.pop()
    # Token j of sequence s goes to slot page * block_size + offset.
    pos = torch.arange(max_len)
    slots = [block_tables[s, pos[:n] // block_size] * block_size + pos[:n] % block_size for s, n in enumerate(lens)]
    slot_mapping, block_tables = torch.cat(slots).to(dev), block_tables.to(dev)

    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_size, device=dev, dtype=dtype)  # "nhd"
    value_cache = torch.zeros_like(key_cache)
    cpa.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, slot_mapping)  # in place

    query = torch.randn(num_seqs, num_heads, head_size, device=dev, dtype=dtype)
    attn_bias = torch.randn(num_seqs, num_heads, max_len, device=dev)  # float32, e.g. T5 relative positions
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    args = (query, key_cache, value_cache, block_tables, seq_lens)

    out = cpa.paged_attention(*args, attn_bias=attn_bias)  # on torch's current stream; a torch tensor back

    # Into a buffer of yours, on a side stream: the library launches on torch's current stream.
    out_buf = torch.empty_like(query)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs were written on the default stream
    with torch.cuda.stream(side):
        cpa.paged_attention(*args, attn_bias=attn_bias, out=out_buf)
    torch.cuda.current_stream().wait_stream(side)

    expected = paged_attention_ref(*args, attn_bias=attn_bias)  # float64 NumPy
    for name, result in (("returned", out), ("out=", out_buf)):
        err = float(np.abs(to_numpy(result).astype(np.float64) - expected).max())
        print(f"{name}: {tuple(result.shape)} {result.dtype} on {result.device}, max abs error {err:.2e}")
        if not err < 2e-2:  # bfloat16 tolerance
            print("FAILED")
            raise SystemExit(1)
    print("OK")


if __name__ == "__main__":
    reason = skip_reason()
    if reason:
        cannot_run(reason)
    main()
