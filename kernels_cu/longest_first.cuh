// Longest first (the decode kernels). The hardware starts a grid's CTAs in index order, so a grid of several waves
// over sequences of unequal length ends with CTAs of any length running while fewer and fewer others keep the
// memory busy. With longest_first, a decode kernel's CTA row r (the CTAs of one sequence) takes the sequence of
// rank r in decreasing length (ties by index): the longest start first and the last wave holds the shortest, which
// end together. Every CTA ranks the same clamped lengths, so the ranks are a permutation of the sequences.
// Each of the CTA's THREADS threads ranks kMaxLongestFirstSeqs / THREADS sequences (t, t + THREADS, ...): it counts
// the sequences before its own in broadcast reads of shared memory, and the one of rank `rank` writes *seq_out.
#pragma once

#include "paged_cache.cuh"

namespace cpa {

constexpr int kMaxLongestFirstSeqs = 256;

// Before the ranking, a CTA sends its first block ids on their way: num_ids (at most MAX_IDS) ids of the row's own
// sequence, row_ids[0 ... num_ids), are copied by cp.async to ids_s (MAX_IDS ints of shared memory, free until the
// caller's next barrier). The caller reads them when the ranked sequence is the row's own (a batch already longest
// first, equal lengths included), with no second round trip to L2 after the ranking. (Its own call, not part of
// seq_of_rank: issued before the caller works out seq_of_rank's arguments, the SIMT kernels' code stays as it was;
// issued after, one of them spilled.)
template <int THREADS, int MAX_IDS>
__device__ __forceinline__ void copy_row_ids(const int* __restrict__ row_ids, int num_ids, int* ids_s) {
#pragma unroll
  for (int k = 0; k < (MAX_IDS + THREADS - 1) / THREADS; ++k) {
    const int i = threadIdx.x + k * THREADS;
    if (i < num_ids) cp_async4(ids_s + i, row_ids + i);
  }
  cp_async_commit();
}

// The ranking. lens_s: kMaxLongestFirstSeqs + 4 ints of shared memory, 16-byte aligned, free until the caller's next
// barrier. Returns the sequence; copy_row_ids's copies, and any other cp.async the caller issued before, have then
// landed, visible to the whole CTA.
template <int THREADS>
__device__ __forceinline__ int seq_of_rank(const int* __restrict__ seq_lens, int num_seqs, int max_len, int rank,
                                           int* lens_s, volatile int* seq_out) {
  static_assert(kMaxLongestFirstSeqs % THREADS == 0, "whole sequences per thread");
  constexpr int kPerThread = kMaxLongestFirstSeqs / THREADS;
  const int t = threadIdx.x;
  const int padded = (num_seqs + 3) & ~3;
  // Lengths are >= 0; a padding entry of -1 is neither longer nor as long as any.
  int mine[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int me = t + k * THREADS;
    mine[k] = me < num_seqs ? clamped_len(seq_lens, me, max_len) : -1;
    if (me < padded) lens_s[me] = mine[k];
  }
  __syncthreads();  // every sequence's length is in shared memory before any thread ranks its own
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int me = t + k * THREADS;
    // (Compared as a scalar: against the array element, NVVM made a branch of each ||, and the SIMT kernel's
    // one-head T5 and ragged forms spilled 8 bytes.)
    const int len = mine[k];
    if (me < num_seqs) {  // (k > 0: uniform over the CTA when num_seqs <= THREADS)
      int before = 0;  // sequences before `me` in the order: longer, or as long with a lower index
#pragma unroll 8
      for (int u = 0; u < padded; u += 4) {  // unrolled: eight loads in flight, not one at a time
        const int4 l4 = *reinterpret_cast<const int4*>(lens_s + u);
        before += (l4.x > len || (l4.x == len && u < me)) + (l4.y > len || (l4.y == len && u + 1 < me)) +
                  (l4.z > len || (l4.z == len && u + 2 < me)) + (l4.w > len || (l4.w == len && u + 3 < me));
      }
      if (before == rank) *seq_out = me;
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the sequence of this CTA's rank, and every thread's copies, are in shared memory
  return *seq_out;
}

}  // namespace cpa
