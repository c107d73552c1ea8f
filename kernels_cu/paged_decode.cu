// Paged decode attention with an additive bias: one query token per sequence, keys and values read through a
// block table.
//
//   x_h(j)   = scale·<q_h, k_j> + alibi_h·(j − len + 1) + bias(s, h, j)        for key positions j < len
//   out_h    = Σ_j softmax_j(x_h)·v_j                                          (float32 math, any storage dtype)
//
// One CTA per (sequence, KV head, chunk of up to HG query heads of that KV head's group, partition of the keys).
// The CTA reads each key/value page of its partition once for all its query heads, in tiles of TILE tokens
// pipelined through shared memory, with an online softmax across tiles:
//   m = running max of x, l = running sum of exp(x − m), acc = running Σ exp(x − m)·v.
// With one partition the CTA writes out = acc / l. With several (split-K, for long contexts or few CTAs) each
// writes (acc, m, l) to a workspace and paged_decode_reduce combines the partitions.
#include "common.cuh"

namespace cpa {

// ---------------------------------------------------------------------------------------------------------------
// Constants
// ---------------------------------------------------------------------------------------------------------------
constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
constexpr int kVecsPerThread = 2;  // 16-byte key (and as many value) vectors each thread copies per tile
constexpr int kStages = 3;         // shared-memory pipeline depth: kStages − 1 tiles in flight while one computes
constexpr int kReduceThreads = 128;

enum class KvLayout : int {
  kNHD = 0,   // key, value: [num_blocks, block_size, num_kv_heads, head_size]
  kVLLM = 1,  // key: [num_blocks, num_kv_heads, head_size / VEC, block_size, VEC]; value: [.., head_size, block_size]
};

// ---------------------------------------------------------------------------------------------------------------
// Addressing of the paged caches. A "vector" is VEC consecutive elements of head_size, at index c < HEAD / VEC.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD, KvLayout LAYOUT>
struct PagedCache {
  static constexpr int VEC = vec_elems<T>();
  // vLLM's value pages are head_size-major: a token's VEC elements are block_size apart, too scattered for one copy.
  static constexpr bool kValueIsVector = LAYOUT == KvLayout::kNHD;
  const T* key;
  const T* value;
  long long block_stride;  // elements between consecutive pages (the caches may be views of a larger array)
  int num_kv_heads;
  int block_shift;  // log2(block_size): pages hold a power of two of tokens

  __device__ __forceinline__ const T* key_vec(long long blk, int off, int kvh, int c) const {
    if constexpr (LAYOUT == KvLayout::kNHD) {
      return key + blk * block_stride + (static_cast<long long>(off) * num_kv_heads + kvh) * HEAD + c * VEC;
    } else {
      return key + blk * block_stride + ((((static_cast<long long>(kvh) * (HEAD / VEC) + c) << block_shift) + off) * VEC);
    }
  }

  // NHD only: the value vector is contiguous.
  __device__ __forceinline__ const T* value_vec(long long blk, int off, int kvh, int c) const {
    return value + blk * block_stride + (static_cast<long long>(off) * num_kv_heads + kvh) * HEAD + c * VEC;
  }

  // vLLM only: gather the value vector element by element.
  __device__ __forceinline__ uint4 gather_value(long long blk, int off, int kvh, int c) const {
    const T* p = value + blk * block_stride + ((static_cast<long long>(kvh) * HEAD + c * VEC) << block_shift) + off;
    union {
      uint4 raw;
      T elem[VEC];
    } u;
#pragma unroll
    for (int i = 0; i < VEC; ++i) u.elem[i] = p[i << block_shift];
    return u.raw;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Thread layout of one specialisation: LANES consecutive lanes share one token row (VPL vectors each); GROUPS such
// lane groups per CTA take consecutive tokens; each thread holds UNROLL tokens of a tile, TILE = GROUPS·UNROLL.
// Every tile is kVecsPerThread 16-byte vectors of K and as many of V per thread: 16 KB per CTA, whatever the shape.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD, int HG>
struct DecodeLayout {
  static constexpr int VEC = vec_elems<T>();
  static constexpr int NVEC = HEAD / VEC;
  static constexpr int LANES = pow2_ceil(NVEC) < kWarpSize ? pow2_ceil(NVEC) : kWarpSize;
  static constexpr int VPL = (NVEC + LANES - 1) / LANES;
  static constexpr int GROUPS = kDecodeThreads / LANES;
  static constexpr int UNROLL = kVecsPerThread / VPL;
  static constexpr int TILE = GROUPS * UNROLL;
  static constexpr int HPL = (HG + LANES - 1) / LANES;  // query heads whose bias one lane fetches
  // Dynamic shared memory: the K and V stages of the pipeline, reused by the epilogue.
  static constexpr int kStageBytes = kStages * 2 * kVecsPerThread * kDecodeThreads * kVecBytes;
  static_assert(HEAD % VEC == 0, "head size must be a whole number of 16-byte vectors");
  static_assert(VPL <= kVecsPerThread, "a token row must fit one thread's vectors");
  static_assert(HEAD <= kDecodeThreads, "the epilogue gives each output element one thread");
  static_assert(HG <= kDecodeWarps, "the softmax gives each query head one warp");
  static_assert(kDecodeWarps * HEAD * sizeof(float) <= kStageBytes, "the epilogue reuses the stage buffers");
};

// ---------------------------------------------------------------------------------------------------------------
// The attention kernel. Template parameters: storage dtype T, head size HEAD, cache LAYOUT, HG = query heads per
// CTA (1, 2, 4 or 8), Bias = NoBias or DenseBias<B>. The page size is a run-time power of two (block_shift).
//
// Pipeline: tile i's K and V travel by cp.async into stage i % kStages of shared memory while the CTA computes
// tile i − kStages + 1, so kStages − 1 tiles (16 KB each) are always in flight. Each thread reads back only the
// vectors it copied itself, so the copies need no barrier. Block ids are fetched one tile before their copies are
// issued, bias values kStages − 1 tiles before they are used; both wait in small register rings indexed by the
// stage, which the unrolled stage loop makes a compile-time constant.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD, KvLayout LAYOUT, int HG, typename Bias>
__global__ void __launch_bounds__(kDecodeThreads, 2) paged_decode(
    T* __restrict__ out, long long out_stride_s, long long out_stride_h,  // [num_seqs, num_heads, HEAD]
    float* __restrict__ part_acc,  // [num_seqs, num_heads, num_parts, HEAD], used when num_parts > 1
    float* __restrict__ part_ml,   // [num_seqs, num_heads, num_parts, 2] = (m, l), used when num_parts > 1
    const T* __restrict__ query, long long q_stride_s, long long q_stride_h,  // [num_seqs, num_heads, HEAD]
    const T* __restrict__ key_cache, const T* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens, int max_len,                        // [num_seqs]
    const void* __restrict__ bias_ptr, long long bias_stride_s, long long bias_stride_h, long long bias_stride_j,
    const float* __restrict__ alibi_slopes,  // [num_heads] or null
    float scale, int group_size, int tokens_per_part, int num_parts) {
  using L = DecodeLayout<T, HEAD, HG>;
  using Cache = PagedCache<T, HEAD, LAYOUT>;
  constexpr int VEC = L::VEC, NVEC = L::NVEC, LANES = L::LANES, VPL = L::VPL, GROUPS = L::GROUPS;
  constexpr int UNROLL = L::UNROLL, TILE = L::TILE, HPL = L::HPL;

  extern __shared__ uint4 stage_s[];              // [kStages][K, V][kVecsPerThread][kDecodeThreads]
  __shared__ __align__(16) float q_s[HG][HEAD];  // scale·q for the CTA's query heads (zero for unused heads)
  __shared__ float x_s[kStages][HG][TILE];       // a tile's logits, then its probabilities
  __shared__ float alpha_s[kStages][HG];         // exp(m_old − m_new) of a tile
  __shared__ float m_s[HG], l_s[HG];

  const int s = blockIdx.x;
  const int num_chunks = (group_size + HG - 1) / HG;
  const int kvh = blockIdx.y / num_chunks;
  const int head0 = kvh * group_size + (blockIdx.y % num_chunks) * HG;  // first query head of this CTA
  const int nh = min(HG, group_size - (blockIdx.y % num_chunks) * HG);  // query heads in use
  const int part = blockIdx.z;

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int grp = tid / LANES;  // token slot within a tile
  const int lg = tid % LANES;   // lane within the token's group

  const int len = clamped_len(seq_lens, s, max_len);
  const int start = part * tokens_per_part;
  const int end = min(start + tokens_per_part, len);

  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const int block_mask = (1 << block_shift) - 1;
  const Bias bias = Bias::make(bias_ptr, bias_stride_s, bias_stride_h, bias_stride_j);
  const int* table = block_tables + s * block_table_stride;

  for (int i = tid; i < HG * HEAD; i += kDecodeThreads) {
    const int g = i / HEAD;
    const int d = i % HEAD;
    q_s[g][d] = g < nh ? scale * to_float(query[s * q_stride_s + (head0 + g) * q_stride_h + d]) : 0.0f;
  }

  // ---- Prefetch rings, one slot per stage; a tile's slot is its index mod kStages. Loads land in registers that
  // nothing reads until the tile is computed, so no thread waits on them early: block ids are fetched 2·kAhead
  // tiles ahead (their copies are issued kAhead tiles ahead), bias values with the copies, in storage form.
  constexpr int kAhead = kStages - 1;
  int blk_r[kStages][UNROLL];                          // block id of each of the thread's tokens
  bool ok_r[kStages][UNROLL];                          // the token is a key (inside the sequence and the cache)
  typename Bias::Raw bias_r[kStages][UNROLL][HPL];     // bias of heads lg, lg + LANES, ...
  uint4 v_r[kStages][UNROLL][VPL];                     // vLLM layout only: values gathered into registers
  float alibi_r[HPL];                                  // alibi slopes of heads lg, lg + LANES, ...
#pragma unroll
  for (int i = 0; i < HPL; ++i) {
    const int g = lg + i * LANES;
    alibi_r[i] = alibi_slopes != nullptr && g < nh ? alibi_slopes[head0 + g] : 0.0f;
  }

  auto slot = [&](int st, int kv, int u, int v) -> uint4* {
    return &stage_s[((st * 2 + kv) * kVecsPerThread + u * VPL + v) * kDecodeThreads + tid];
  };
  // Block ids of tile t0 into ring slot st.
  auto fetch_ids = [&](int st, int t0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int j = t0 + u * GROUPS + grp;
      blk_r[st][u] = -1;
      if (j < end) blk_r[st][u] = table[j >> block_shift];
    }
  };
  // Copies of tile t0's keys and values into stage st (one cp.async group), its bias into bias_r[st].
  auto issue = [&](int st, int t0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int j = t0 + u * GROUPS + grp;
      const long long blk = blk_r[st][u];
      // A block id outside the cache is never dereferenced: the key is skipped (validate=True reports it).
      const bool ok = j < end && blk >= 0 && blk < num_blocks;
      ok_r[st][u] = ok;
#pragma unroll
      for (int v = 0; v < VPL; ++v) {
        const int c = lg + v * LANES;
        const bool copy = ok && c < NVEC;
        const int off = j & block_mask;
        cp_async16(slot(st, 0, u, v), copy ? cache.key_vec(blk, off, kvh, c) : key_cache, copy ? kVecBytes : 0);
        if constexpr (Cache::kValueIsVector) {
          cp_async16(slot(st, 1, u, v), copy ? cache.value_vec(blk, off, kvh, c) : value_cache, copy ? kVecBytes : 0);
        } else {
          v_r[st][u][v] = make_uint4(0u, 0u, 0u, 0u);
          if (copy) v_r[st][u][v] = cache.gather_value(blk, off, kvh, c);
        }
      }
      if constexpr (Bias::enabled) {
#pragma unroll
        for (int i = 0; i < HPL; ++i) {
          const int g = lg + i * LANES;
          bias_r[st][u][i] = typename Bias::Raw{};
          if (ok && g < nh) bias_r[st][u][i] = bias.load(s, head0 + g, j);
        }
      }
    }
    cp_async_commit();
  };

  // Warp g keeps head g's running max and sum; every thread keeps acc for its vectors of every head.
  float m = -inf();
  float l = 0.0f;
  float acc[HG][VPL][VEC];
#pragma unroll
  for (int g = 0; g < HG; ++g)
#pragma unroll
    for (int v = 0; v < VPL; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][v][e] = 0.0f;

#pragma unroll
  for (int t = 0; t < kAhead; ++t) fetch_ids(t, start + t * TILE);
#pragma unroll
  for (int t = 0; t < kAhead; ++t) issue(t, start + t * TILE);
#pragma unroll
  for (int t = kAhead; t < 2 * kAhead; ++t) fetch_ids(t % kStages, start + t * TILE);
  __syncthreads();  // q_s is read by every thread below

  for (int t_base = start; t_base < end; t_base += kStages * TILE) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      const int t0 = t_base + st * TILE;
      if (t0 >= end) break;  // the same for every thread of the CTA
      issue((st + kAhead) % kStages, t0 + kAhead * TILE);             // kAhead tiles in flight
      fetch_ids((st + 2 * kAhead) % kStages, t0 + 2 * kAhead * TILE);  // that slot's tile was issued last time
      cp_async_wait<kAhead>();                                        // this thread's copies of tile t0 landed

      // ---- Logits: x_g(j) = <scale·q_g, k_j> + alibi + bias; each lane group reduces its partial dot products.
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float kf[VPL][VEC];
#pragma unroll
        for (int v = 0; v < VPL; ++v) unpack<T>(*slot(st, 0, u, v), kf[v]);
#pragma unroll
        for (int g = 0; g < HG; ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int v = 0; v < VPL; ++v) {
            const int c = lg + v * LANES;
            if (c < NVEC) {
              const float4* q4 = reinterpret_cast<const float4*>(&q_s[g][c * VEC]);
#pragma unroll
              for (int e4 = 0; e4 < VEC / 4; ++e4) {
                const float4 q = q4[e4];
                dot += q.x * kf[v][4 * e4] + q.y * kf[v][4 * e4 + 1] + q.z * kf[v][4 * e4 + 2] +
                       q.w * kf[v][4 * e4 + 3];
              }
            }
          }
          dot = group_sum<LANES>(dot);
          if (lg == g % LANES) {
            // x = <scale·q, k> + alibi·(j − len + 1) + bias; −inf for a token that is no key.
            const int j = t0 + u * GROUPS + grp;
            float x = dot + alibi_r[g / LANES] * static_cast<float>(j - len + 1);
            if constexpr (Bias::enabled) x += to_float(bias_r[st][u][g / LANES]);
            x_s[st][g][u * GROUPS + grp] = ok_r[st][u] ? x : -inf();
          }
        }
      }
      __syncthreads();  // x_s[st] holds the whole tile's logits before the softmax reads them

      // ---- Online softmax, warp g for head g: m_new = max(m, max_j x), p = exp(x − m_new), l = l·α + Σ p.
      if (warp < HG) {
        float tile_max = -inf();
        for (int i = lane; i < TILE; i += kWarpSize) tile_max = fmaxf(tile_max, x_s[st][warp][i]);
        const float m_new = fmaxf(m, warp_max(tile_max));
        // While every key so far is masked (m_new = −inf) nothing accumulates: α = 1 and p = 0, never NaN.
        const bool empty = m_new == -inf();
        const float alpha = empty ? 1.0f : __expf(m - m_new);
        float sum = 0.0f;
        for (int i = lane; i < TILE; i += kWarpSize) {
          const float p = empty ? 0.0f : __expf(x_s[st][warp][i] - m_new);
          x_s[st][warp][i] = p;
          sum += p;
        }
        l = l * alpha + warp_sum(sum);
        m = m_new;
        if (lane == 0) alpha_s[st][warp] = alpha;
      }
      // x_s[st] now holds probabilities and alpha_s[st] the rescale factors. The next tile writes x_s and alpha_s
      // of another stage, so this barrier is the last one this tile needs.
      __syncthreads();

      // ---- Accumulate: acc_g = α_g·acc_g + Σ_j p_g(j)·v_j over the thread's tokens.
#pragma unroll
      for (int g = 0; g < HG; ++g) {
        const float a = alpha_s[st][g];
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][v][e] *= a;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float vf[VPL][VEC];
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
          if constexpr (Cache::kValueIsVector) {
            unpack<T>(*slot(st, 1, u, v), vf[v]);
          } else {
            unpack<T>(v_r[st][u][v], vf[v]);
          }
        }
#pragma unroll
        for (int g = 0; g < HG; ++g) {
          const float p = x_s[st][g][u * GROUPS + grp];  // 0 for a skipped token, whose values are zero-filled
#pragma unroll
          for (int v = 0; v < VPL; ++v)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][v][e] += p * vf[v][e];
        }
      }
    }
  }

  // ---- Epilogue: sum acc over the lane groups (shuffles within a warp, then shared memory across warps).
  cp_async_wait<0>();  // copies issued past the end still write zeros into the stages the epilogue reuses
  if (warp < HG && lane == 0) {
    m_s[warp] = m;
    l_s[warp] = l;
  }
  float(*red_s)[HEAD] = reinterpret_cast<float(*)[HEAD]>(stage_s);  // [kDecodeWarps][HEAD]
  __syncthreads();  // every thread is done with the stages before red_s overwrites them
#pragma unroll
  for (int g = 0; g < HG; ++g) {
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float x = acc[g][v][e];
#pragma unroll
        for (int o = LANES; o < kWarpSize; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
        const int c = lg + v * LANES;
        if (lane < LANES && c < NVEC) red_s[warp][c * VEC + e] = x;
      }
    }
    __syncthreads();  // red_s holds every warp's partial acc of head g (and m_s, l_s are written)
    if (g < nh && tid < HEAD) {
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) total += red_s[w][tid];
      const int h = head0 + g;
      if (num_parts == 1) {
        const float lsum = l_s[g];
        out[s * out_stride_s + h * out_stride_h + tid] = from_float<T>(lsum > 0.0f ? total / lsum : 0.0f);
      } else {
        const long long at = (static_cast<long long>(s) * (num_kv_heads * group_size) + h) * num_parts + part;
        part_acc[at * HEAD + tid] = total;
        if (tid == 0) {
          part_ml[at * 2] = m_s[g];
          part_ml[at * 2 + 1] = l_s[g];
        }
      }
    }
    __syncthreads();  // red_s is overwritten for the next head
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Split-K reduction: for each (sequence, head), combine the partitions that hold keys:
//   M = max_p m_p,  w_p = exp(m_p − M),  out = Σ_p w_p·acc_p / Σ_p w_p·l_p   (zeros when no key contributes).
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD>
__global__ void __launch_bounds__(kReduceThreads) paged_decode_reduce(
    T* __restrict__ out, long long out_stride_s, long long out_stride_h,
    const float* __restrict__ part_acc, const float* __restrict__ part_ml,
    const int* __restrict__ seq_lens, int max_len, int num_heads, int tokens_per_part, int num_parts) {
  const int s = blockIdx.x;
  const int h = blockIdx.y;
  const int len = clamped_len(seq_lens, s, max_len);
  const int used = min(num_parts, (len + tokens_per_part - 1) / tokens_per_part);
  const long long slot0 = (static_cast<long long>(s) * num_heads + h) * num_parts;

  float big_m = -inf();
  for (int p = 0; p < used; ++p) big_m = fmaxf(big_m, part_ml[(slot0 + p) * 2]);
  float big_l = 0.0f;
  for (int p = 0; p < used; ++p) {
    const float mp = part_ml[(slot0 + p) * 2];
    if (mp != -inf()) big_l += __expf(mp - big_m) * part_ml[(slot0 + p) * 2 + 1];
  }
  for (int d = threadIdx.x; d < HEAD; d += kReduceThreads) {
    float o = 0.0f;
    for (int p = 0; p < used; ++p) {
      const float mp = part_ml[(slot0 + p) * 2];
      if (mp != -inf()) o += __expf(mp - big_m) * part_acc[(slot0 + p) * HEAD + d];
    }
    out[s * out_stride_s + h * out_stride_h + d] = from_float<T>(big_l > 0.0f ? o / big_l : 0.0f);
  }
}

}  // namespace cpa
