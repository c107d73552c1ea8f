// Device helpers shared by every kernel family of cupy-paged-attn: dtype conversion, 16-byte vector loads
// and stores, warp reductions, and the bias sources that the attention kernels add to their logits.
//
// This header is inlined into each kernel's source text by cupy_paged_attn/_compile.py (CuPy's disk cache keys
// on the source text, not on included files), so it must not include anything but CUDA's own headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cpa {

// ---------------------------------------------------------------------------------------------------------------
// Constants
// ---------------------------------------------------------------------------------------------------------------
constexpr int kWarpSize = 32;
constexpr int kVecBytes = 16;  // one 128-bit load or store

// Elements of T in one 16-byte vector.
template <typename T>
__host__ __device__ constexpr int vec_elems() {
  return kVecBytes / static_cast<int>(sizeof(T));
}

__host__ __device__ constexpr int pow2_ceil(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

__host__ __device__ constexpr int pow2_floor(int n) {
  int p = 1;
  while (2 * p <= n) p *= 2;
  return p;
}

// +infinity (NVRTC has no <cmath> INFINITY).
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

// ---------------------------------------------------------------------------------------------------------------
// Scalar conversion: storage dtype <-> float32 (all arithmetic is float32)
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---------------------------------------------------------------------------------------------------------------
// 16-byte vectors. `raw` is the register image of one load; unpack() widens it to vec_elems<T>() floats.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint4 load_raw(const void* p) {
  // Read-only path: the caches are never written by the attention kernels.
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float* f);

template <>
__device__ __forceinline__ void unpack<float>(const uint4& raw, float* f) {
  f[0] = __uint_as_float(raw.x);
  f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z);
  f[3] = __uint_as_float(raw.w);
}

template <>
__device__ __forceinline__ void unpack<__half>(const uint4& raw, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& raw, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Asynchronous copies global -> shared (sm_80+), 16 bytes each, cached in L2 only. A copy with src_bytes = 0 reads
// nothing and writes zeros. Copies are grouped by commit(); wait<N>() returns once at most N of this thread's
// groups are still in flight. Only the issuing thread may rely on its copies without a barrier.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------------------------
// Sum over aligned groups of LANES consecutive lanes (LANES a power of two <= 32); every lane gets its group's sum.
// Every lane of the warp must call it (it shuffles with a full mask).
// ---------------------------------------------------------------------------------------------------------------
template <int LANES>
__device__ __forceinline__ float group_sum(float x) {
  static_assert(LANES >= 1 && LANES <= kWarpSize && (LANES & (LANES - 1)) == 0, "a power of two up to a warp");
#pragma unroll
  for (int o = LANES / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// ---------------------------------------------------------------------------------------------------------------
// Sequence length as the kernels see it: seq_lens[s] clamped to [0, max_len], where max_len is the most keys the
// block table (and a dense bias) can hold. Whatever seq_lens holds, no index leaves its array.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ int clamped_len(const int* seq_lens, int s, int max_len) {
  return min(max(seq_lens[s], 0), max_len);
}

// ---------------------------------------------------------------------------------------------------------------
// Bias sources. Each attention kernel is templated on one of these; `enabled` is a compile-time constant, so a
// kernel built with NoBias contains no bias code at all (`if constexpr`).
//   value(s, h, j) = the additive bias of sequence s, query head h, key position j (0 <= j < seq_len).
// ---------------------------------------------------------------------------------------------------------------
//   make(ptr, stride_s, stride_h, stride_j) builds the source from the kernel's generic bias arguments.
struct NoBias {
  static constexpr bool enabled = false;
  using Raw = float;
  static __device__ __forceinline__ NoBias make(const void*, long long, long long, long long) { return {}; }
  __device__ __forceinline__ Raw load(int, int, int) const { return 0.0f; }
};

// A dense [num_seqs, num_heads, L] array with arbitrary strides in elements (0 broadcasts).
template <typename B>
struct DenseBias {
  static constexpr bool enabled = true;
  const B* ptr;
  long long stride_s, stride_h, stride_j;
  static __device__ __forceinline__ DenseBias make(const void* p, long long ss, long long sh, long long sj) {
    return {static_cast<const B*>(p), ss, sh, sj};
  }
  using Raw = B;
  __device__ __forceinline__ Raw load(int s, int h, int j) const { return ptr[s * stride_s + h * stride_h + j * stride_j]; }
};

}  // namespace cpa
