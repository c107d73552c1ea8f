// Cache write (vLLM's reshape_and_cache): scatter new tokens' keys and values into their cache slots.
//
//   slot = slot_mapping[t] = block·block_size + offset;  key_cache[block, offset, kvh, :] = key[t, kvh, :]
//
// Negative slots are padding and are skipped; so is a slot past the cache (validate=True reports it). One CTA
// per token; its threads walk the token's num_kv_heads·head_size elements in 16-byte vectors of the input. An fp8
// cache (KV an fp8 format) stores each element as fp8_from_float(x / scale): rounded to the nearest, saturated.
#include "common.cuh"

namespace cpa {

constexpr int kCacheThreads = 128;

enum class CacheLayout : int { kNHD = 0, kVLLM = 1, kHND = 2 };  // as KvLayout in paged_cache.cuh

// One input vector (VEC elements of T) into the cache at dst: as it is, or with an fp8 cache as VEC bytes of x / scale.
template <typename T, typename KV>
__device__ __forceinline__ void store_vector(KV* dst, const uint4& raw, float scale) {
  constexpr int VEC = vec_elems<T>();
  if constexpr (IsFp8<KV>::value) {
    float f[VEC];
    unpack<T>(raw, f);
    unsigned char bytes[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) bytes[e] = fp8_from_float<KV>(f[e] / scale);
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(bytes);
    } else {
      *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(bytes);
    }
  } else {
    *reinterpret_cast<uint4*>(dst) = raw;
  }
}

template <typename T, typename KV, CacheLayout LAYOUT, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads) reshape_and_cache(
    const T* __restrict__ key, long long key_stride_t, long long key_stride_h,        // [num_tokens, Hkv, D]
    const T* __restrict__ value, long long value_stride_t, long long value_stride_h,  // [num_tokens, Hkv, D]
    KV* __restrict__ key_cache, KV* __restrict__ value_cache, long long cache_block_stride,
    const SlotT* __restrict__ slot_mapping, int num_kv_heads, int head_size, int block_size, int num_blocks,
    // fp8 caches: element x of head h is stored as x / (k_scale·k_scales[h·k_scale_stride]) (k_scales null: 1)
    const float* __restrict__ k_scales, const float* __restrict__ v_scales, int k_scale_stride, int v_scale_stride,
    float k_scale, float v_scale) {
  // The attention kernel after it (a split decode: a dependent launch) may launch now; it waits for this grid's
  // writes before reading anything. A decode step, H200: 7.2-7.4 -> 6.9 us without a bias (serving_step.py).
  launch_dependents();
  constexpr int VEC = vec_elems<T>();      // input elements per 16-byte load
  constexpr int KV_VEC = vec_elems<KV>();  // the vLLM key layout's x
  const int t = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[t]);
  if (slot < 0 || slot >= static_cast<long long>(num_blocks) * block_size) return;
  const long long blk = slot / block_size;
  const int off = static_cast<int>(slot % block_size);
  const int nvec = head_size / VEC;

  for (int i = threadIdx.x; i < num_kv_heads * nvec; i += kCacheThreads) {
    const int h = i / nvec;
    const int d = i % nvec * VEC;  // the vector's first element
    const uint4 k = load_raw(key + t * key_stride_t + h * key_stride_h + d);
    const uint4 v = load_raw(value + t * value_stride_t + h * value_stride_h + d);
    float ks = 1.0f, vs = 1.0f;
    if constexpr (IsFp8<KV>::value) {
      ks = kv_scale(k_scale, k_scales, k_scale_stride, h);
      vs = kv_scale(v_scale, v_scales, v_scale_stride, h);
    }
    KV* kc = key_cache + blk * cache_block_stride;
    KV* vc = value_cache + blk * cache_block_stride;
    if constexpr (LAYOUT == CacheLayout::kNHD) {
      const long long at = (static_cast<long long>(off) * num_kv_heads + h) * head_size + d;
      store_vector<T>(kc + at, k, ks);
      store_vector<T>(vc + at, v, vs);
    } else if constexpr (LAYOUT == CacheLayout::kHND) {
      const long long at = ((static_cast<long long>(h) * block_size) + off) * head_size + d;
      store_vector<T>(kc + at, k, ks);
      store_vector<T>(vc + at, v, vs);
    } else {
      // key [.., Hkv, D / KV_VEC, block_size, KV_VEC] (an input vector lies within one KV_VEC run: VEC divides it);
      // value [.., Hkv, D, block_size]
      store_vector<T>(kc + ((static_cast<long long>(h) * (head_size / KV_VEC) + d / KV_VEC) * block_size + off) *
                               KV_VEC + d % KV_VEC, k, ks);
      float f[VEC];
      unpack<T>(v, f);
      union {
        uint4 raw;
        T elem[VEC];
      } u;
      u.raw = v;
      KV* vp = vc + (static_cast<long long>(h) * head_size + d) * block_size + off;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if constexpr (IsFp8<KV>::value) {
          vp[e * block_size].bits = fp8_from_float<KV>(f[e] / vs);
        } else {
          vp[e * block_size] = u.elem[e];
        }
      }
    }
  }
}

}  // namespace cpa
