"""Quickstart with JAX: paged decode attention on bfloat16 GPU arrays, with a T5-style bias and GQA.

Run: python examples/quickstart_jax.py

Needs a CUDA GPU, JAX with CUDA (``pip install 'jax[cuda12]'``) and CuPy (``pip install 'cupy-paged-attn[cuda12]'``);
without them it prints "cannot run: ..." and exits 3 (0 with ``--skip-missing``). Block tables, seq_lens and slots are
int32 (JAX's default integer). JAX arrays are immutable: ``reshape_and_cache`` returns new caches, and ``out=`` is not
accepted.
"""

import importlib.util

import numpy as np
from _missing import cannot_run


def skip_reason() -> str | None:
    """Why this example cannot run here, or None."""
    try:
        import jax
    except ImportError:
        return "JAX is not installed"
    try:
        jax.devices("gpu")
    except RuntimeError:  # JAX without CUDA, or no GPU
        return "no CUDA GPU"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'cupy-paged-attn[cuda12]')"
    return None


def main() -> None:
    import jax.numpy as jnp

    import cupy_paged_attn as cpa
    from cupy_paged_attn.reference import paged_attention_ref, to_numpy

    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 8, 2, 128, 16, 64
    lens = [5, 300, 17, 64]  # different lengths, partial last pages
    num_seqs, max_len = len(lens), max(lens)

    def randn(*shape: int, dtype: type = jnp.bfloat16) -> jnp.ndarray:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)  # on the default GPU

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
    slot_mapping = jnp.asarray(np.concatenate(slots), dtype=jnp.int32)
    block_tables = jnp.asarray(tables, dtype=jnp.int32)

    key_cache = jnp.zeros((num_blocks, block_size, num_kv_heads, head_size), dtype=jnp.bfloat16)  # "nhd"
    value_cache = jnp.zeros_like(key_cache)
    # Immutable arrays: the written caches come back as new arrays; the old ones are left as they were.
    key_cache, value_cache = cpa.reshape_and_cache(
        jnp.concatenate(keys), jnp.concatenate(values), key_cache, value_cache, slot_mapping
    )

    query = randn(num_seqs, num_heads, head_size)
    attn_bias = randn(num_seqs, num_heads, max_len, dtype=jnp.float32)  # e.g. T5 relative positions
    seq_lens = jnp.asarray(lens, dtype=jnp.int32)
    args = (query, key_cache, value_cache, block_tables, seq_lens)

    out = cpa.paged_attention(*args, attn_bias=attn_bias)  # a JAX array back, on the query's GPU

    expected = paged_attention_ref(*args, attn_bias=attn_bias)  # float64 NumPy
    err = float(np.abs(to_numpy(out).astype(np.float64) - expected).max())
    print(f"out: {out.shape} {out.dtype} on {out.devices()}, max abs error {err:.2e}")
    if not err < 2e-2:  # bfloat16 tolerance
        print("FAILED")
        raise SystemExit(1)
    print("OK")


if __name__ == "__main__":
    reason = skip_reason()
    if reason:
        cannot_run(reason)
    main()
