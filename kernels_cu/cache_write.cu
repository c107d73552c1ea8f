// Cache write (vLLM's reshape_and_cache): scatter new tokens' keys and values into their cache slots.
//
//   slot = slot_mapping[t] = block·block_size + offset;  key_cache[block, offset, kvh, :] = key[t, kvh, :]
//
// Negative slots are padding and are skipped; so is a slot past the cache (validate=True reports it). One CTA
// per token; its threads walk the token's num_kv_heads·head_size elements in 16-byte vectors.
#include "common.cuh"

namespace cpa {

constexpr int kCacheThreads = 128;

enum class CacheLayout : int { kNHD = 0, kVLLM = 1, kHND = 2 };  // as KvLayout in paged_cache.cuh

template <typename T, CacheLayout LAYOUT, typename SlotT>
__global__ void __launch_bounds__(kCacheThreads) reshape_and_cache(
    const T* __restrict__ key, long long key_stride_t, long long key_stride_h,        // [num_tokens, Hkv, D]
    const T* __restrict__ value, long long value_stride_t, long long value_stride_h,  // [num_tokens, Hkv, D]
    T* __restrict__ key_cache, T* __restrict__ value_cache, long long cache_block_stride,
    const SlotT* __restrict__ slot_mapping, int num_kv_heads, int head_size, int block_size, int num_blocks) {
  // The attention kernel after it (a split decode: a dependent launch) may launch now; it waits for this grid's
  // writes before reading anything. A decode step, H200: 7.2-7.4 -> 6.9 us without a bias (serving_step.py).
  launch_dependents();
  constexpr int VEC = vec_elems<T>();
  const int t = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[t]);
  if (slot < 0 || slot >= static_cast<long long>(num_blocks) * block_size) return;
  const long long blk = slot / block_size;
  const int off = static_cast<int>(slot % block_size);
  const int nvec = head_size / VEC;

  for (int i = threadIdx.x; i < num_kv_heads * nvec; i += kCacheThreads) {
    const int h = i / nvec;
    const int c = i % nvec;
    const uint4 k = load_raw(key + t * key_stride_t + h * key_stride_h + c * VEC);
    const uint4 v = load_raw(value + t * value_stride_t + h * value_stride_h + c * VEC);
    T* kc = key_cache + blk * cache_block_stride;
    T* vc = value_cache + blk * cache_block_stride;
    if constexpr (LAYOUT == CacheLayout::kNHD) {
      const long long at = (static_cast<long long>(off) * num_kv_heads + h) * head_size + c * VEC;
      *reinterpret_cast<uint4*>(kc + at) = k;
      *reinterpret_cast<uint4*>(vc + at) = v;
    } else if constexpr (LAYOUT == CacheLayout::kHND) {
      const long long at = ((static_cast<long long>(h) * block_size) + off) * head_size + c * VEC;
      *reinterpret_cast<uint4*>(kc + at) = k;
      *reinterpret_cast<uint4*>(vc + at) = v;
    } else {
      // key [.., Hkv, D / VEC, block_size, VEC]; value [.., Hkv, D, block_size]
      *reinterpret_cast<uint4*>(kc + ((static_cast<long long>(h) * nvec + c) * block_size + off) * VEC) = k;
      union {
        uint4 raw;
        T elem[VEC];
      } u;
      u.raw = v;
      T* vp = vc + (static_cast<long long>(h) * head_size + c * VEC) * block_size + off;
#pragma unroll
      for (int e = 0; e < VEC; ++e) vp[e * block_size] = u.elem[e];
    }
  }
}

}  // namespace cpa
