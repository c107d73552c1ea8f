// Device helpers shared by every kernel family of cupy-paged-attn: constants, dtype conversion, 16-byte vector
// loads, asynchronous copies, warp reductions, programmatic dependent launch and thread block clusters.
//
// Headers are inlined into each kernel's source text by cupy_paged_attn/_compile.py (CuPy's disk cache keys on the
// source text, not on included files): they include only CUDA's own headers and each other, by "name".
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

// +infinity and a quiet NaN (NVRTC has no <cmath> INFINITY, NAN).
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float nan() { return __int_as_float(0x7fc00000); }

// An output element o / l, where l = Σ exp(x − m) of its row: zeros where no key contributed (l = 0: an empty
// sequence, every key masked), NaN where l is NaN (a poisoned row: out-of-contract device data, paged_cache.cuh).
// inv_sum gives the 1 / l that multiplies a row's elements, with the same two cases.
__device__ __forceinline__ float normalized(float o, float l) { return l == 0.0f ? 0.0f : o / l; }
__device__ __forceinline__ float inv_sum(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }
constexpr float kLog2e = 1.4426950408889634f;  // softmaxes run in base 2: e^x = 2^(x·log2 e)
constexpr float kRescaleSlack = 8.0f;  // base 2: how far a tile's max may pass a row's softmax reference (p <= 256)

// 2^x by the special-function unit alone (one MUFU.EX2; exp2f adds range fix-ups around it). Results below 2^-126
// flush to zero, which a softmax weight never misses; 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The sliding window a kernel receives when there is none (window_left: a query at position p attends keys p −
// window_left ... p). Large enough to mask nothing, small enough that p − kNoWindow stays within int32.
constexpr int kNoWindow = 1 << 30;

// Gemma 2's logit soft-cap, x -> cap·tanh(x / cap) on a natural-unit logit x, before the bias and ALiBi. It works in
// the units of its input: with y = x·log2(e) / mult (mult: the factor the caller still applies to y, scale·log2(e)
// for a raw <q, k>, 1 for a logit already in base 2), apply(y) = A·tanh(y / A), A = cap·log2(e) / mult, is the capped
// logit in y's units, so the caller's terms after it stay as they are. 16-bit kernels take A − 2A / (2^(y·k) + 1),
// k = 2·mult / cap: one MUFU.EX2 and one reciprocal, whose absolute error stays within a few units in the last place
// of A; float32 ones (EXACT) tanhf, as the float32 tolerance asks. A kernel makes it inside its `soft_cap > 0`
// branch, from its parameters, so that no register holds it where there is no cap.
struct SoftCap {
  float a, k;  // A, 2·mult / cap
  static __device__ __forceinline__ SoftCap make(float cap, float mult) {
    return {cap * kLog2e / mult, 2.0f * mult / cap};
  }
  template <bool EXACT>
  __device__ __forceinline__ float apply(float y) const {
    if constexpr (EXACT) return a * tanhf(y / a);
    return fmaf(-2.0f * a, __fdividef(1.0f, fast_exp2(y * k) + 1.0f), a);
  }
};

// Programmatic dependent launch (sm_90 and later; no-ops before, and when the launch did not ask for it). An
// attention kernel lets its split-K combine launch early; the combine waits for the attention kernel's grid to
// complete, with its writes visible, before it reads them. A split attention kernel is itself launched as a
// dependent of the kernel before it (a combine lets the next call's attention kernel launch at once): it waits
// at its very top, before reading anything, so whatever the kernel before it wrote is visible (planning.py).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread block clusters (sm_90 and later; the host launches a kernel that uses them only there, in clusters).
// cluster_sync: every thread of every CTA of the cluster arrives, its shared-memory writes released to the cluster,
// and waits for all the others (acquire): after it, any CTA may read what the others wrote, and every CTA has
// started. cluster_load: a float of CTA `rank`'s shared memory at the address that `p` has in this CTA's.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ float cluster_load(const float* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote));
  return v;
#else
  return rank == 0 ? *p : __int_as_float(0x7fffffff);  // no clusters before sm_90: NaN shows a misuse
#endif
}

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

// bfloat16 is the upper half of a float32: one shift or one mask per element, bit-exact (NaN and inf included).
// (__bfloat1622float2 compiles to about 1.5 instructions per element, a sixth of the decode kernel's inner loop.)
template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& raw, float* f) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// fp8 KV caches: one byte per element, OCP's float8 e4m3fn (max 448, no infinities) or e5m2 (max 57344). A cache
// element type of its own, so that a 16-byte vector holds 16 of them (vec_elems) and unpack() widens them.
// unpack<Fp8*> gives each value divided by kv_unit<Fp8*>(), which the kernels fold into their scales: the e4m3
// bits moved into a float16 read as value·2^-8 (exponent bias 7 against 15), where sm_89 and later convert exactly
// (cvt.rn.f16x2.e4m3x2). e5m2 is the upper byte of a float16: a byte permute, exact (NaN and infinity included).
// Without the conversion instruction, e4m3fn's NaN (0x7f, 0xff) reads as ±480 (reshape_and_cache never writes it).
// ---------------------------------------------------------------------------------------------------------------
struct Fp8E4M3 {
  unsigned char bits;
};
struct Fp8E5M2 {
  unsigned char bits;
};

// std::is_same without <type_traits> (NVRTC ships no standard library headers).
template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

template <typename T>
struct IsFp8 {
  static constexpr bool value = false;
};
template <>
struct IsFp8<Fp8E4M3> {
  static constexpr bool value = true;
};
template <>
struct IsFp8<Fp8E5M2> {
  static constexpr bool value = true;
};

// Bytes 0, 1 (lo) and 2, 3 (hi) of w into the upper bytes of two float16 each: an e5m2 pair as float16 pairs.
__device__ __forceinline__ void bytes_to_half_hi(unsigned w, unsigned& lo, unsigned& hi) {
  lo = __byte_perm(w, 0u, 0x1404);
  hi = __byte_perm(w, 0u, 0x3424);
}

// Four e4m3 values (the bytes of w) as two float16 pairs holding value·2^-8: sign kept, magnitude moved down one
// bit into the float16's exponent and mantissa (exact, subnormals included). Portable; unpack uses it before sm_89.
__device__ __forceinline__ void e4m3x4_to_scaled_half2x2(unsigned w, unsigned& lo, unsigned& hi) {
  unsigned p, q;
  bytes_to_half_hi(w, p, q);
  lo = (p & 0x80008000u) | ((p >> 1) & 0x3f803f80u);
  hi = (q & 0x80008000u) | ((q >> 1) & 0x3f803f80u);
}

// Four e4m3 values as two float16 pairs of value / kv_unit<Fp8E4M3>().
__device__ __forceinline__ void e4m3x4_to_half2x2(unsigned w, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;\n\t}"
      : "=r"(lo), "=r"(hi) : "r"(w));
#else
  e4m3x4_to_scaled_half2x2(w, lo, hi);
#endif
}

// What unpack<T> divides a cache value by (1 but for e4m3 without the conversion instruction).
template <typename T>
__host__ __device__ constexpr float kv_unit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  if constexpr (SameType<T, Fp8E4M3>::value) return 256.0f;
#endif
  return 1.0f;
}

__device__ __forceinline__ void half2x2_to_float4(unsigned lo, unsigned hi, float* f) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// Four values of fp8 format KV (the bytes of w) as two float16 pairs of value / kv_unit<KV>().
template <typename KV>
__device__ __forceinline__ void fp8x4_to_half2x2(unsigned w, unsigned& lo, unsigned& hi) {
  if constexpr (SameType<KV, Fp8E4M3>::value) {
    e4m3x4_to_half2x2(w, lo, hi);
  } else {
    bytes_to_half_hi(w, lo, hi);
  }
}

template <typename KV>
__device__ __forceinline__ void unpack_fp8(const uint4& raw, float* f) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned lo, hi;
    fp8x4_to_half2x2<KV>(w[i], lo, hi);
    half2x2_to_float4(lo, hi, f + 4 * i);
  }
}
template <>
__device__ __forceinline__ void unpack<Fp8E4M3>(const uint4& raw, float* f) { unpack_fp8<Fp8E4M3>(raw, f); }
template <>
__device__ __forceinline__ void unpack<Fp8E5M2>(const uint4& raw, float* f) { unpack_fp8<Fp8E5M2>(raw, f); }

// The scale of KV head h of an fp8 cache, times `unit` (kv_unit<KV>() where the read values are value / unit): the
// number times the array's entry (scales null: 1; stride 0: one entry for all heads). A kernel's scale parameters.
__device__ __forceinline__ float kv_scale(float scale, const float* scales, int stride, int h, float unit = 1.0f) {
  return scale * unit * (scales != nullptr ? scales[h * stride] : 1.0f);
}

// Sixteen fp8 values (one 16-byte vector) as sixteen of T (float16 or bfloat16, which hold every fp8 value exactly),
// each value / kv_unit<KV>(): elements 0-7 in lo, 8-15 in hi. The tensor-core decode converts its tiles with it.
template <typename T, typename KV>
__device__ __forceinline__ void fp8x16_to_16bit(const uint4& raw, uint4& lo, uint4& hi) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
  unsigned h[8];  // float16 pairs
#pragma unroll
  for (int i = 0; i < 4; ++i) fp8x4_to_half2x2<KV>(w[i], h[2 * i], h[2 * i + 1]);
  if constexpr (SameType<T, __nv_bfloat16>::value) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
      h[i] = *reinterpret_cast<const unsigned*>(&b);
    }
  }
  lo = make_uint4(h[0], h[1], h[2], h[3]);
  hi = make_uint4(h[4], h[5], h[6], h[7]);
}

// float -> fp8 bits, rounded to the nearest value (ties to even) and saturated to the format's largest finite value
// (infinities included; NaN stays NaN): what reshape_and_cache stores. Integer arithmetic on the float's bits, the
// same on every architecture. UNIT: the least normal value (2^-6, 2^-14); below it the steps are UNIT / 8 or / 4.
template <typename F>
__device__ __forceinline__ unsigned char fp8_from_float(float x) {
  constexpr bool kE4M3 = SameType<F, Fp8E4M3>::value;
  constexpr int kMantBits = kE4M3 ? 3 : 2;
  constexpr unsigned kBias = kE4M3 ? 7u : 15u;
  constexpr unsigned kMaxCode = kE4M3 ? 0x7eu : 0x7bu;  // 448, 57344
  constexpr float kMax = kE4M3 ? 448.0f : 57344.0f;
  constexpr float kLeastNormal = kE4M3 ? 0.015625f : 6.103515625e-05f;
  constexpr float kSubnormalSteps = kE4M3 ? 512.0f : 65536.0f;  // 1 / the subnormal step
  constexpr unsigned kNaN = kE4M3 ? 0x7fu : 0x7eu;  // e4m3fn's one NaN; e5m2's quiet NaN (float16's 0x7e00)
  const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
  float a = fabsf(x);
  if (a != a) return static_cast<unsigned char>(sign | kNaN);
  a = fminf(a, kMax);
  unsigned code;
  if (a < kLeastNormal) {
    code = static_cast<unsigned>(__float2int_rn(a * kSubnormalSteps));  // up to the least normal's code
  } else {
    constexpr int kDrop = 23 - kMantBits;
    const unsigned u = __float_as_uint(a);
    code = ((u + ((1u << (kDrop - 1)) - 1u) + ((u >> kDrop) & 1u)) >> kDrop) - ((127u - kBias) << kMantBits);
  }
  return static_cast<unsigned char>(sign | min(code, kMaxCode));
}

// ---------------------------------------------------------------------------------------------------------------
// Asynchronous copies global -> shared (sm_80+), 16 bytes each, cached in L2 only (or one int, cp_async4). A copy
// with src_bytes = 0 reads nothing and writes zeros. Copies are grouped by commit(); wait<N>() returns once at most
// N of this thread's groups are still in flight. Only the issuing thread may rely on its copies without a barrier.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async4(int* smem, const int* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem));
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


}  // namespace cpa
