// The paged KV caches, as every attention kernel reads them (NHD, HND and vLLM layouts), and the sequence length as the
// kernels see it. A "vector" is VEC consecutive elements of head_size, at index c < HEAD / VEC.
#pragma once

#include "common.cuh"

namespace cpa {

enum class KvLayout : int {
  kNHD = 0,   // key, value: [num_blocks, block_size, num_kv_heads, head_size]
  kVLLM = 1,  // key: [num_blocks, num_kv_heads, head_size / VEC, block_size, VEC]; value: [.., head_size, block_size]
  kHND = 2,   // key, value: [num_blocks, num_kv_heads, block_size, head_size]
};

template <typename T, int HEAD, KvLayout LAYOUT>
struct PagedCache {
  using Elem = T;
  static constexpr int VEC = vec_elems<T>();
  // vLLM's value pages are head_size-major: a token's VEC elements are block_size apart, too scattered for one copy.
  static constexpr bool kValueIsVector = LAYOUT != KvLayout::kVLLM;
  const T* key;
  const T* value;
  long long block_stride;  // elements between consecutive pages (the caches may be views of a larger array)
  int num_kv_heads;
  int block_shift;  // log2(block_size): pages hold a power of two of tokens

  // Offset in elements, within a page, of token off's key vector c of head kvh (NHD, HND: of its value vector too).
  // 32-bit: a page holds fewer than 2**31 elements (checked on the host).
  __device__ __forceinline__ int page_offset(int off, int kvh, int c) const {
    if constexpr (LAYOUT == KvLayout::kNHD) {
      return (off * num_kv_heads + kvh) * HEAD + c * VEC;
    } else if constexpr (LAYOUT == KvLayout::kHND) {
      return ((kvh << block_shift) + off) * HEAD + c * VEC;
    } else {
      return (((kvh * (HEAD / VEC) + c) << block_shift) + off) * VEC;
    }
  }
  // How page_offset grows per key vector c: page_offset(off, kvh, c) = page_offset(off, kvh, 0) + c·vector_stride().
  __device__ __forceinline__ int vector_stride() const {
    return LAYOUT == KvLayout::kVLLM ? VEC << block_shift : VEC;
  }

  // Elements between consecutive tokens' vectors of one head within a page:
  // page_offset(off, kvh, c) = page_offset(0, kvh, c) + off·token_stride().
  __device__ __forceinline__ int token_stride() const {
    return LAYOUT == KvLayout::kNHD ? num_kv_heads * HEAD : LAYOUT == KvLayout::kHND ? HEAD : VEC;
  }
  // Offset in elements, from the start of either cache, of the element at in-page offset `at` (a page_offset) of
  // page blk. blk must be a valid page index (0 <= blk < num_blocks): its product with the 64-bit stride is then an
  // unsigned 32 x 64-bit multiply, without the sign extension.
  __device__ __forceinline__ long long element_offset(int blk, int at) const {
    return static_cast<long long>(static_cast<unsigned>(blk)) * block_stride + at;
  }

  __device__ __forceinline__ const T* key_vec(long long blk, int off, int kvh, int c) const {
    return key + blk * block_stride + page_offset(off, kvh, c);
  }

  // NHD and HND: the value vector is contiguous.
  __device__ __forceinline__ const T* value_vec(long long blk, int off, int kvh, int c) const {
    return value + blk * block_stride + page_offset(off, kvh, c);
  }

  // Element d of a token's value, either layout.
  __device__ __forceinline__ T value_elem(long long blk, int off, int kvh, int d) const {
    if constexpr (kValueIsVector) {
      return value_vec(blk, off, kvh, 0)[d];
    } else {
      return value[blk * block_stride + ((static_cast<long long>(kvh) * HEAD + d) << block_shift) + off];
    }
  }

  // vLLM only: gather the value vector element by element (one address, then block_size apart).
  __device__ __forceinline__ uint4 gather_value(long long blk, int off, int kvh, int c) const {
    const T* p = value + blk * block_stride + ((static_cast<long long>(kvh) * HEAD + c * VEC) << block_shift) + off;
    union {
      uint4 raw;
      T elem[VEC];
    } u;
#pragma unroll
    for (int e = 0; e < VEC; ++e) u.elem[e] = p[e << block_shift];
    return u.raw;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Sequence length as the kernels see it: seq_lens[s] clamped to [0, max_len], where max_len is the most keys the
// block table (and a dense bias) can hold. Whatever seq_lens holds, no index leaves its array.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ int clamped_len(const int* seq_lens, int s, int max_len) {
  return min(max(seq_lens[s], 0), max_len);
}

// ---------------------------------------------------------------------------------------------------------------
// Out-of-contract device data, made loud: a sequence whose seq_lens[s] is negative, past what its block table (or a
// dense bias) holds, or past a ragged bias's rows (len, the keys the kernel uses, then differs from it), and rows that
// reach a key in a page outside the cache, are poisoned: their l becomes NaN, so every output element o / l of them is
// NaN (normalized, common.cuh) and a split-K combine carries the NaN through (0·NaN is NaN). Nothing outside the
// arrays is read either way; a length of 0 is in contract (zeros). validate=True names the offending argument instead.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool out_of_contract(const int* seq_lens, int s, int len) { return seq_lens[s] != len; }
__device__ __forceinline__ float poisoned_sum(float l, bool poisoned) { return poisoned ? nan() : l; }

}  // namespace cpa
