"""Quickstart with CuPy: paged decode attention on float16 CUDA arrays, with a T5-style bias and GQA.

Run: python examples/quickstart_cupy.py

Needs a CUDA GPU and CuPy (``pip install 'cupy-paged-attn[cuda12]'``, or ``[cuda13]``); without them it prints "cannot
run: ..." and exits 3 (0 with ``--skip-missing``). Builds the paged cache with ``reshape_and_cache``, calls
``paged_attention`` and checks the result against the float64 NumPy reference.
"""

import numpy as np
from _missing import cannot_run


def skip_reason() -> str | None:
    """Why this example cannot run here, or None."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'cupy-paged-attn[cuda12]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA GPU"
    except cupy.cuda.runtime.CUDARuntimeError:  # no driver, or no device
        return "no CUDA GPU"
    return None


def main() -> None:
    import cupy

    import cupy_paged_attn as cpa
    from cupy_paged_attn.reference import paged_attention_ref, to_numpy

    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 8, 2, 128, 16, 64
    lens = [5, 300, 17, 64]  # different lengths, partial last pages
    num_seqs, max_len = len(lens), max(lens)

    def randn(*shape: int, dtype: type = cupy.float16) -> cupy.ndarray:
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)

    # Each sequence's keys and values as the model made them; pages from a shuffled free list.
    keys = [randn(n, num_kv_heads, head_size) for n in lens]
    values = [randn(n, num_kv_heads, head_size) for n in lens]
    free_pages = rng.permutation(num_blocks).tolist()
    tables = np.zeros((num_seqs, -(-max_len // block_size)), dtype=np.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            tables[s, b] = free_pages.pop()
    # Token j of sequence s goes to slot page * block_size + offset.
    slots = [tables[s, np.arange(n) // block_size] * block_size + np.arange(n) % block_size for s, n in enumerate(lens)]
    slot_mapping = cupy.asarray(np.concatenate(slots), dtype=cupy.int64)
    block_tables = cupy.asarray(tables)

    key_cache = cupy.zeros((num_blocks, block_size, num_kv_heads, head_size), dtype=cupy.float16)  # "nhd"
    value_cache = cupy.zeros_like(key_cache)
    cpa.reshape_and_cache(cupy.concatenate(keys), cupy.concatenate(values), key_cache, value_cache, slot_mapping)

    query = randn(num_seqs, num_heads, head_size)
    attn_bias = randn(num_seqs, num_heads, max_len, dtype=cupy.float32)  # e.g. T5 relative positions
    seq_lens = cupy.asarray(lens, dtype=cupy.int32)
    args = (query, key_cache, value_cache, block_tables, seq_lens)

    out = cpa.paged_attention(*args, attn_bias=attn_bias)  # on CuPy's current stream; a CuPy array back

    expected = paged_attention_ref(*args, attn_bias=attn_bias)  # float64 NumPy
    err = float(np.abs(to_numpy(out).astype(np.float64) - expected).max())
    print(f"out: {out.shape} {out.dtype} on {out.device}, max abs error {err:.2e}")
    if not err < 5e-3:  # float16 tolerance
        print("FAILED")
        raise SystemExit(1)
    print("OK")


if __name__ == "__main__":
    reason = skip_reason()
    if reason:
        cannot_run(reason)
    main()
