// Which rows a CTA of the tiled kernels serves (the tensor-core tilings, the float32 prefill and the split-K
// combine of their partitions): its sequence, M tile of packed (query token, query head) rows, and KV head.
#pragma once

#include "common.cuh"

namespace cpa {

// The query rows of sequence s, clamped into [0, total_q] whatever query_start_loc holds (the plan and the kernels
// agree on them, so every tile the plan made exists for the kernels).
__device__ __forceinline__ int2 query_rows(const int* query_start_loc, int s, int total_q) {
  const int q0 = min(max(query_start_loc[s], 0), total_q);
  const int q1 = min(max(query_start_loc[s + 1], q0), total_q);
  return make_int2(q0, q1 - q0);
}

// The rows of this CTA: sequence s (−1 for a spare tile of the host-sized grid), its M tile, the sequence's first
// query row q0 and q_len, and the KV head. Prefill: blockIdx.x is a tile of the plan's tile_info (last first),
// blockIdx.y the KV head. Decode passes no query_start_loc: one query row per sequence (row s), ceil(G / rows) M
// tiles per sequence, and blockIdx.x = (s·tiles + tile)·num_kv_heads + kvh, so that the CTAs of one sequence run
// side by side (a RaggedBias row holds every head of a key: each sector is then fetched once, not once per KV head).
// With longest_first the decode kernel then takes the sequence of rank s instead (seq_of_rank, longest_first.cuh).
struct CtaRows {
  int s, tile, q0, q_len, kvh;
};
__device__ __forceinline__ CtaRows cta_rows(const int2* tile_info, const int* query_start_loc, int total_q, int G,
                                            int num_kv_heads, int rows) {
  if (query_start_loc == nullptr) {
    const int tiles = (G + rows - 1) / rows;
    const int kvh = static_cast<int>(blockIdx.x) % num_kv_heads;
    const int st = static_cast<int>(blockIdx.x) / num_kv_heads;
    return {st / tiles, st % tiles, st / tiles, 1, kvh};
  }
  // Last entry first: a sequence's later tiles come first, which under a causal mask are its longest (more keys
  // than the tiles before them), so the GPU's last wave is of short ones. (The spare tiles, last in tile_info,
  // exit at once.)
  const int2 info = tile_info[gridDim.x - 1 - blockIdx.x];
  if (info.x < 0) return {-1, 0, 0, 0, 0};
  const int2 q = query_rows(query_start_loc, info.x, total_q);
  return {info.x, info.y, q.x, q.y, static_cast<int>(blockIdx.y)};
}

}  // namespace cpa
