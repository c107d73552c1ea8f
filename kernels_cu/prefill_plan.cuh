// The prefill plan: tile_info[t] = (sequence, M tile within it) for t < Σ_s ceil(q_len_s·G / rows), (−1, 0) for the
// rest of the host-sized grid (num_tiles >= that sum for any valid query_start_loc; extra tiles are dropped).
// One CTA, sequences in chunks of kPrefillPlanThreads with an exclusive scan of their tile counts.
#pragma once

#include "tile_rows.cuh"

namespace cpa {

constexpr int kPrefillPlanThreads = 1024;

__global__ void __launch_bounds__(kPrefillPlanThreads) prefill_plan(const int* __restrict__ query_start_loc,
                                                                    int num_seqs, int total_q, int group_size,
                                                                    int rows_per_tile, int2* __restrict__ tile_info,
                                                                    int num_tiles) {
  __shared__ int scan_s[kPrefillPlanThreads];
  const int tid = threadIdx.x;
  for (int t = tid; t < num_tiles; t += kPrefillPlanThreads) tile_info[t] = make_int2(-1, 0);
  // Every (−1, 0) is written before any tile is assigned (the writes below may land on the same entries).
  __syncthreads();
  int carry = 0;
  for (int base = 0; base < num_seqs; base += kPrefillPlanThreads) {
    const int s = base + tid;
    int n = 0;
    if (s < num_seqs) {
      const long long rows = static_cast<long long>(query_rows(query_start_loc, s, total_q).y) * group_size;
      n = static_cast<int>(min((rows + rows_per_tile - 1) / rows_per_tile, static_cast<long long>(num_tiles)));
    }
    scan_s[tid] = n;
    __syncthreads();  // every count is in before the scan reads its neighbours
    // Hillis-Steele inclusive scan; each step reads, syncs, then writes.
    for (int o = 1; o < kPrefillPlanThreads; o *= 2) {
      const int add = tid >= o ? scan_s[tid - o] : 0;
      __syncthreads();  // all reads of this step are done before anyone writes
      scan_s[tid] += add;
      __syncthreads();  // all writes of this step are done before the next step reads
    }
    const long long first = static_cast<long long>(carry) + scan_s[tid] - n;
    for (int k = 0; k < n && first + k < num_tiles; ++k) tile_info[first + k] = make_int2(s, k);
    carry = static_cast<int>(min(static_cast<long long>(carry) + scan_s[kPrefillPlanThreads - 1],
                                 static_cast<long long>(num_tiles)));
    __syncthreads();  // scan_s is rewritten by the next chunk
  }
}

}  // namespace cpa
