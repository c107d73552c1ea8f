// The split-K combines: a kernel whose keys are split into partitions writes each partition's (acc, m, l), m in base 2,
// and a combine kernel merges them per output row:
//   M = max_p m_p,  w_p = 2^(m_p − M),  out = Σ_p w_p·acc_p / Σ_p w_p·l_p   (zeros when no key contributes).
// tile_combine serves the tiled kernels (decode_mma.cu, prefill.cu, prefill_wgmma.cu: partials [part][query row]
// [head]), decode_simt_combine the SIMT decode (decode_simt.cu: partials [sequence][head][part]). Both are launched as
// programmatic dependents of the attention kernel where the device allows (common.cuh): their CTAs start early and
// wait for its partials before reading them.
#pragma once

#include "tile_rows.cuh"

namespace cpa {

constexpr int kCombineThreads = 128;  // tile_combine
constexpr int kCombineBatch = 8;      // partitions whose partials a tile_combine thread loads at once
constexpr int kDecodeCombineThreads = 128;

// ---------------------------------------------------------------------------------------------------------------
// tile_combine: the partitions of the tiled kernels, per (M tile, KV head) as their CTAs (same blockIdx.x, y):
//   M = max_p m_p,  w_p = 2^(m_p − M),  out = Σ_p w_p·acc_p / Σ_p w_p·l_p   (zeros when no key contributes).
// With few CTAs (a long sequence split into many partitions) this kernel is a chain of memory latencies, not
// bandwidth: each thread loads kCombineBatch partitions' partials at once, and past kCombineBatch partitions the
// partitions are spread over groups of threads (combine_groups: the warps of a CTA in 1, 2, 4 or 8 groups), each an
// online combine of its own, merged in shared memory; a CTA takes kCombineThreads / groups output elements.
// With one group (at most kCombineBatch partitions) a thread takes 4 adjacent elements of one row instead (one
// (m, l) and one 16-byte acc load per partition), a CTA 4 · kCombineThreads, and a decode grid covers only
// the rows that hold heads: a quarter of the CTAs or fewer, which a grid of many tiles and few partitions needs
// (H200, B64 H32/8 d128 L∈[1024, 2048], 3 partitions: 112.8 -> 108.6 us; B64 L∈[128, 8192] 287.7 -> 283.9). A
// version that did the same with several groups made B1 H32/8 L65536 (49 partitions) and B4 L32768 (12) 0.7-1.0 us
// slower, the cause not separated: that path keeps one element a thread. The host's grid.z covers every element:
// combine_chunks in _specs.py.
// ---------------------------------------------------------------------------------------------------------------
__host__ __device__ constexpr int combine_groups(int num_parts) {
  return num_parts <= kCombineBatch ? 1 : num_parts <= 2 * kCombineBatch ? 2 : num_parts <= 4 * kCombineBatch ? 4 : 8;
}
__host__ __device__ constexpr int combine_vec(int num_parts) { return combine_groups(num_parts) == 1 ? 4 : 1; }

// (m, l, acc) of VEC adjacent elements: an online combine of partials.
template <int VEC>
struct CombinePartial {
  float m, l, o[VEC];
  __device__ __forceinline__ void add(float m_p, float l_p, const float (&acc)[VEC]) {
    // A partial that saw no key of this row (m = −inf, l = 0, acc = 0) weighs nothing.
    const float m_new = fmaxf(m, m_p);
    const float alpha = m == -inf() ? 0.0f : fast_exp2(m - m_new);
    const float w = m_p == -inf() ? 0.0f : fast_exp2(m_p - m_new);
    l = l * alpha + w * l_p;
#pragma unroll
    for (int v = 0; v < VEC; ++v) o[v] = o[v] * alpha + w * acc[v];
    m = m_new;
  }
};

// One group of threads (num_parts <= kCombineBatch), each thread VEC adjacent elements of one row.
template <typename T, int HEAD, int ROWS, int VEC>
__device__ __forceinline__ void combine_rows_vec(T* __restrict__ out, long long out_stride_t, long long out_stride_h,
                                            const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                            const CtaRows& cta, int total_q, int num_kv_heads, int G, int num_parts) {
  static_assert(HEAD % VEC == 0 && VEC == 4, "a thread's elements lie in one row, one 16-byte load");
  const int m0 = cta.tile * ROWS;
  const int rows = min(cta.q_len * G - m0, ROWS);
  const int num_heads = num_kv_heads * G;
  const long long part_stride = static_cast<long long>(total_q) * num_heads;
  const float2* ml2 = reinterpret_cast<const float2*>(part_ml);
  const int elems = rows * HEAD;
  for (int base = blockIdx.z * kCombineThreads * VEC; base < elems;
       base += gridDim.z * kCombineThreads * VEC) {  // (uniform over the CTA)
    const int idx = min(base + threadIdx.x * VEC, elems - VEC);  // (past the end: the last elements again)
    const int R = m0 + idx / HEAD;
    const int d = idx % HEAD;
    const long long q_row = cta.q0 + R / G;
    const int h = cta.kvh * G + R % G;
    const long long at = q_row * num_heads + h;
    float2 ml[kCombineBatch];
    float a[kCombineBatch][VEC];
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {  // unpredicated loads (past the last partition: the last again)
      const long long slot = min(i, num_parts - 1) * part_stride + at;
      ml[i] = ml2[slot];
      const float4 v = *reinterpret_cast<const float4*>(part_acc + slot * HEAD + d);  // (16 bytes: d % 4 == 0)
      a[i][0] = v.x, a[i][1] = v.y, a[i][2] = v.z, a[i][3] = v.w;
    }
    CombinePartial<VEC> r{-inf(), 0.0f, {}};
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i)  // one past the last partition counts as one that saw no key
      r.add(i < num_parts ? ml[i].x : -inf(), ml[i].y, a[i]);
    if (base + threadIdx.x * VEC < elems) {
      T* dst = out + q_row * out_stride_t + h * out_stride_h + d;
#pragma unroll
      for (int v = 0; v < VEC; ++v) dst[v] = from_float<T>(normalized(r.o[v], r.l));
    }
  }
}

template <typename T, int HEAD, int ROWS>
__global__ void __launch_bounds__(kCombineThreads) tile_combine(
    T* __restrict__ out, long long out_stride_t, long long out_stride_h,
    const float* __restrict__ part_acc, const float* __restrict__ part_ml,
    const int* __restrict__ query_start_loc, int total_q, const int2* __restrict__ tile_info,
    int num_kv_heads, int group_size, int num_parts) {
  __shared__ float3 merge_s[kCombineThreads];  // (m, l, o) of each thread, when groups > 1
  const CtaRows cta = cta_rows(tile_info, query_start_loc, total_q, group_size, num_kv_heads, ROWS);
  if (cta.s < 0) return;
  launch_dependents();  // the next decode call's attention kernel may start (it waits for this grid before reading)
  wait_for_primary();   // decode launches this combine early: the attention kernel's partials are now complete
  if (combine_vec(num_parts) == 4) {  // (uniform over the grid)
    combine_rows_vec<T, HEAD, ROWS, 4>(out, out_stride_t, out_stride_h, part_acc, part_ml, cta, total_q, num_kv_heads,
                                  group_size, num_parts);
  } else {  // several groups, one element a thread
    const int G = group_size;
    const int m0 = cta.tile * ROWS;
    const int rows = min(cta.q_len * G - m0, ROWS);
    const int num_heads = num_kv_heads * G;
    const int groups = combine_groups(num_parts);
    const int elems = kCombineThreads / groups;  // output elements per CTA
    const int e = threadIdx.x % elems;
    const int group = threadIdx.x / elems;  // this thread's partitions: group, group + groups, ...
    const long long part_stride = static_cast<long long>(total_q) * num_heads;
    const float2* ml2 = reinterpret_cast<const float2*>(part_ml);
    for (int base = blockIdx.z * elems; base < rows * HEAD; base += gridDim.z * elems) {  // (uniform over the CTA)
      const int idx = min(base + e, rows * HEAD - 1);  // (a thread past the end computes the last element again)
      const int R = m0 + idx / HEAD;
      const int d = idx % HEAD;
      const long long q_row = cta.q0 + R / G;
      const int h = cta.kvh * G + R % G;
      const long long at = q_row * num_heads + h;
      // One online pass over this group's partitions, kCombineBatch at a time: their (m, l) and acc are loaded
      // together, then combined (a pass for the max and a second for the sums, each waiting on a load per partition,
      // took 10 us for 32 partitions at B1 H32/8 L65536: the long-context decode's tail).
      float big_m = -inf(), big_l = 0.0f, o = 0.0f;
      for (int p0 = group; p0 < num_parts; p0 += kCombineBatch * groups) {
        float2 ml[kCombineBatch];
        float a[kCombineBatch];
#pragma unroll
        for (int i = 0; i < kCombineBatch; ++i) {  // unpredicated loads (past the last partition: the last again)
          const long long slot = min(p0 + i * groups, num_parts - 1) * part_stride + at;
          ml[i] = ml2[slot];
          a[i] = part_acc[slot * HEAD + d];
        }
#pragma unroll
        for (int i = 0; i < kCombineBatch; ++i) {
          // A partition that saw no key of this row (m = −inf, l = 0, acc = 0) weighs nothing; one past the last
          // counts as such.
          if (p0 + i * groups >= num_parts) ml[i].x = -inf();
          const float m_new = fmaxf(big_m, ml[i].x);
          const float alpha = big_m == -inf() ? 0.0f : fast_exp2(big_m - m_new);
          const float w = ml[i].x == -inf() ? 0.0f : fast_exp2(ml[i].x - m_new);
          big_l = big_l * alpha + w * ml[i].y;
          o = o * alpha + w * a[i];
          big_m = m_new;
        }
      }
      if (groups > 1) {  // group 0 merges the groups' (m, l, o) of its element, as the partitions were merged
        merge_s[threadIdx.x] = make_float3(big_m, big_l, o);
        __syncthreads();  // every group's (m, l, o) of this element is in merge_s before group 0 reads them
        if (group == 0) {
          for (int g = 1; g < groups; ++g) {
            const float3 v = merge_s[g * elems + e];
            const float m_new = fmaxf(big_m, v.x);
            const float alpha = big_m == -inf() ? 0.0f : fast_exp2(big_m - m_new);
            const float w = v.x == -inf() ? 0.0f : fast_exp2(v.x - m_new);
            big_l = big_l * alpha + w * v.y;
            o = o * alpha + w * v.z;
            big_m = m_new;
          }
        }
        __syncthreads();  // merge_s is free for the next element
      }
      if (group == 0 && base + e < rows * HEAD)
        out[q_row * out_stride_t + h * out_stride_h + d] = from_float<T>(normalized(o, big_l));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// decode_simt_combine: the SIMT decode's partitions, for each (sequence, head) those that hold keys:
//   M = max_p m_p,  w_p = 2^(m_p − M),  out = Σ_p w_p·acc_p / Σ_p w_p·l_p   (zeros when no key contributes;
// m in log2 units, as the attention kernel writes it).
// Every partition's CTA writes its (acc, m, l), an empty one (no key: past seq_lens[s]) m = −inf, so the combine,
// like tile_combine, needs no seq_lens: a partition with m = −inf weighs nothing.
// A CTA per (sequence, head): LANES threads per partition, each a float4 of acc, PG partitions side by side, each
// thread an online combine over its partitions p = g, g + PG, ..., every load issued before any is needed; then
// the PG groups combine in shared memory. Launched with programmatic dependent launch where the device has it:
// the CTAs start while the attention kernel runs and wait for it only before reading its partials.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD>
__global__ void __launch_bounds__(kDecodeCombineThreads) decode_simt_combine(
    T* __restrict__ out, long long out_stride_s, long long out_stride_h,
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, int num_heads, int num_parts) {
  static_assert(HEAD % 4 == 0 && HEAD / 4 <= kDecodeCombineThreads,
                "a partition's acc is whole float4s, one per thread");
  constexpr int LANES = HEAD / 4;
  constexpr int PG = kDecodeCombineThreads / LANES;
  __shared__ float4 acc_s[PG][LANES];
  __shared__ float2 ml_s[PG];
  const int s = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = static_cast<int>(threadIdx.x) % LANES;
  const int g = static_cast<int>(threadIdx.x) / LANES;
  launch_dependents();  // the next call's attention kernel may start (it waits for this grid before reading)
  wait_for_primary();   // the attention kernel's partials are complete and visible
  const long long slot0 = (static_cast<long long>(s) * num_heads + h) * num_parts;
  const float4* acc4 = reinterpret_cast<const float4*>(part_acc);
  const float2* ml2 = reinterpret_cast<const float2*>(part_ml);

  float m = -inf();
  float l = 0.0f;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (g < PG) {
#pragma unroll 4
    for (int p = g; p < num_parts; p += PG) {
      const float2 ml = ml2[slot0 + p];
      const float4 a = acc4[(slot0 + p) * LANES + lane];
      if (ml.x != -inf()) {  // an empty partition (no key) weighs nothing
        const float m_new = fmaxf(m, ml.x);
        const float alpha = fast_exp2(m - m_new);  // 0 while m = −inf
        const float w = fast_exp2(ml.x - m_new);
        l = l * alpha + w * ml.y;
        o = make_float4(o.x * alpha + w * a.x, o.y * alpha + w * a.y, o.z * alpha + w * a.z, o.w * alpha + w * a.w);
        m = m_new;
      } else {
        l += ml.y;  // its l is 0, or NaN where the sequence is poisoned (paged_cache.cuh): carried through
      }
    }
    acc_s[g][lane] = o;
    if (lane == 0) ml_s[g] = make_float2(m, l);
  }
  __syncthreads();
  if (g != 0) return;
  float big_m = -inf();
#pragma unroll
  for (int q = 0; q < PG; ++q) big_m = fmaxf(big_m, ml_s[q].x);
  float big_l = 0.0f;
  o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int q = 0; q < PG; ++q) {
    const float w = ml_s[q].x == -inf() ? 0.0f : fast_exp2(ml_s[q].x - big_m);
    const float4 a = acc_s[q][lane];
    big_l += w * ml_s[q].y;
    o = make_float4(o.x + w * a.x, o.y + w * a.y, o.z + w * a.z, o.w + w * a.w);
  }
  const float inv = inv_sum(big_l);
  T* dst = out + s * out_stride_s + h * out_stride_h + lane * 4;
  dst[0] = from_float<T>(o.x * inv);
  dst[1] = from_float<T>(o.y * inv);
  dst[2] = from_float<T>(o.z * inv);
  dst[3] = from_float<T>(o.w * inv);
}

}  // namespace cpa
