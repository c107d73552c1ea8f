// The pages of fp8 caches that a call reads, dequantized into caches of the query's dtype: how prefill reads fp8
// caches (its tensor-core tilings take 16-bit K and V; the conversion of each page once costs a fraction of the
// attention over it).
//
//   page p = s·max_blocks + i (entry i of sequence s's block table, if it holds keys below seq_lens[s]):
//   key_out[p, off, kvh, :] = key_cache[block_tables[s, i], off, kvh, :]·k_scale(kvh), values alike
//   table_out[s, i] = p, or −1 for an entry past the sequence or outside the cache (the attention kernels skip it)
//
// The output is in the NHD layout whatever the input's. One CTA per page; its threads walk the page's
// block_size·num_kv_heads·HEAD elements in 16-byte vectors of the fp8 input (16 elements).
#include "paged_cache.cuh"

namespace cpa {

constexpr int kDequantizeThreads = 128;

template <typename T, typename KV, int HEAD, KvLayout LAYOUT>
__global__ void __launch_bounds__(kDequantizeThreads) dequantize_pages(
    T* __restrict__ key_out, T* __restrict__ value_out,  // NHD pages, [num_seqs·max_blocks][block_size][Hkv][HEAD]
    int* __restrict__ table_out,                         // [num_seqs][max_blocks]
    const KV* __restrict__ key_cache, const KV* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride, const int* __restrict__ seq_lens,
    int max_blocks,
    // element x of head h reads as x·k_scale·k_scales[h·k_scale_stride] (k_scales null: 1), values alike
    const float* __restrict__ k_scales, const float* __restrict__ v_scales, int k_scale_stride, int v_scale_stride,
    float k_scale, float v_scale) {
  using Cache = PagedCache<KV, HEAD, LAYOUT>;
  constexpr int VEC = vec_elems<KV>();
  constexpr int NVEC = HEAD / VEC;
  constexpr int OUT_VEC = vec_elems<T>();
  static_assert(IsFp8<KV>::value && HEAD % VEC == 0 && VEC % OUT_VEC == 0, "fp8 vectors into whole output vectors");
  const int page = blockIdx.x;
  const int s = page / max_blocks;
  const int i = page % max_blocks;
  const int block_size = 1 << block_shift;
  const int len = clamped_len(seq_lens, s, max_blocks << block_shift);
  const int blk = i * block_size < len ? block_tables[s * block_table_stride + i] : -1;
  const bool used = static_cast<unsigned>(blk) < static_cast<unsigned>(num_blocks);
  if (threadIdx.x == 0) table_out[page] = used ? page : -1;
  if (!used) return;

  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const long long out_page = static_cast<long long>(page) * block_size * num_kv_heads * HEAD;
  for (int idx = threadIdx.x; idx < block_size * num_kv_heads * NVEC; idx += kDequantizeThreads) {
    const int c = idx % NVEC;
    const int h = idx / NVEC % num_kv_heads;
    const int off = idx / (NVEC * num_kv_heads);
    const float ks = kv_scale(k_scale, k_scales, k_scale_stride, h, kv_unit<KV>());
    const float vs = kv_scale(v_scale, v_scales, v_scale_stride, h, kv_unit<KV>());
    float k[VEC], v[VEC];
    unpack<KV>(load_raw(cache.key_vec(blk, off, h, c)), k);
    if constexpr (Cache::kValueIsVector) {
      unpack<KV>(load_raw(cache.value_vec(blk, off, h, c)), v);
    } else {
      unpack<KV>(cache.gather_value(blk, off, h, c), v);
    }
    const long long at = out_page + (static_cast<long long>(off) * num_kv_heads + h) * HEAD + c * VEC;
#pragma unroll
    for (int o = 0; o < VEC / OUT_VEC; ++o) {
      union {
        uint4 raw;
        T elem[OUT_VEC];
      } uk, uv;
#pragma unroll
      for (int e = 0; e < OUT_VEC; ++e) {
        uk.elem[e] = from_float<T>(k[o * OUT_VEC + e] * ks);
        uv.elem[e] = from_float<T>(v[o * OUT_VEC + e] * vs);
      }
      *reinterpret_cast<uint4*>(key_out + at + o * OUT_VEC) = uk.raw;
      *reinterpret_cast<uint4*>(value_out + at + o * OUT_VEC) = uv.raw;
    }
  }
}

}  // namespace cpa
