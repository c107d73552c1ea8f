"""Quickstart, CPU path: NumPy arrays in, NumPy out. Needs no GPU and no CuPy.

Run: python examples/quickstart_numpy.py

Builds a paged KV cache from per-sequence keys and values with ``reshape_and_cache``, runs ``paged_attention``
with a T5-style additive bias and grouped-query attention (8 query heads over 2 KV heads), and checks the result
against a dense softmax(q K^T * scale + bias) V computed straight from the per-sequence keys and values.
"""

import numpy as np

import cupy_paged_attn as cpa

rng = np.random.default_rng(0)
num_heads, num_kv_heads, head_size, block_size, num_blocks = 8, 2, 64, 16, 16
seq_lens = np.array([5, 40, 17], dtype=np.int32)  # one partial page, three pages, a page and one token
num_seqs, max_len = len(seq_lens), int(seq_lens.max())
scale = head_size**-0.5  # T5 itself uses scale=1.0

# What a model produced so far: each sequence's keys and values, token by token.
keys = [rng.standard_normal((n, num_kv_heads, head_size), dtype=np.float32) for n in seq_lens]
values = [rng.standard_normal((n, num_kv_heads, head_size), dtype=np.float32) for n in seq_lens]

# Pages come from a shuffled free list, so a sequence's pages lie scattered over the cache.
free_pages = rng.permutation(num_blocks).tolist()
block_tables = np.zeros((num_seqs, -(-max_len // block_size)), dtype=np.int32)  # entries past a sequence: unused
for s, n in enumerate(seq_lens):
    for b in range(-(-n // block_size)):
        block_tables[s, b] = free_pages.pop()

# Token j of sequence s goes to slot page * block_size + offset, page = block_tables[s, j // block_size].
pos = np.arange(max_len)
slots = [block_tables[s, pos[:n] // block_size] * block_size + pos[:n] % block_size for s, n in enumerate(seq_lens)]
slot_mapping = np.concatenate(slots).astype(np.int64)

# Caches [num_blocks, block_size, num_kv_heads, head_size] ("nhd"); NaN marks slots that must never be read.
key_cache = np.full((num_blocks, block_size, num_kv_heads, head_size), np.nan, dtype=np.float32)
value_cache = np.full_like(key_cache, np.nan)
key_cache, value_cache = cpa.reshape_and_cache(
    np.concatenate(keys), np.concatenate(values), key_cache, value_cache, slot_mapping
)

query = rng.standard_normal((num_seqs, num_heads, head_size), dtype=np.float32)  # one new token per sequence
attn_bias = rng.standard_normal((num_seqs, num_heads, max_len), dtype=np.float32)  # e.g. T5 relative positions

out = cpa.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale, attn_bias=attn_bias)
print(f"out: {out.shape} {out.dtype}")

# Independent check: dense attention per sequence, from the keys and values as the model made them.
group = num_heads // num_kv_heads  # query head h reads KV head h // group
max_err = 0.0
for s, n in enumerate(seq_lens):
    k = np.repeat(keys[s].astype(np.float64), group, axis=1)  # [n, num_heads, head_size]
    v = np.repeat(values[s].astype(np.float64), group, axis=1)
    logits = scale * np.einsum("hd,jhd->hj", query[s].astype(np.float64), k) + attn_bias[s, :, :n]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    expected = np.einsum("hj,jhd->hd", probs, v)
    max_err = max(max_err, float(np.abs(out[s] - expected).max()))

print(f"max abs error vs dense softmax: {max_err:.2e}")
if not max_err < 1e-5:  # float32 output of float64 math
    print("FAILED")
    raise SystemExit(1)
print("OK")
