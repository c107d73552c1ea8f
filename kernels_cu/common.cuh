// Device helpers shared by every kernel family of cupy-paged-attn: dtype conversion, 16-byte vector loads
// and stores, warp reductions, the paged caches' addressing, and the bias sources that the attention kernels add
// to their logits.
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
constexpr float kLog2e = 1.4426950408889634f;  // softmaxes run in base 2: e^x = 2^(x·log2 e)
constexpr float kRescaleSlack = 8.0f;  // base 2: how far a tile's max may pass a row's softmax reference (p <= 256)

// 2^x by the special-function unit alone (one MUFU.EX2; exp2f adds range fix-ups around it). Results below 2^-126
// flush to zero, which a softmax weight never misses; 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (sm_90 and later; no-ops before, and when the launch did not ask for it). An
// attention kernel lets its split-K reduction launch early; the reduction waits for the attention kernel's grid to
// complete, with its writes visible, before it reads them. A split attention kernel is itself launched as a
// dependent of the kernel before it (a reduction lets the next call's attention kernel launch at once): it waits
// at its very top, before reading anything, so whatever the kernel before it wrote is visible (decode.py).
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

// ---------------------------------------------------------------------------------------------------------------
// The paged KV caches, as every attention kernel reads them. A "vector" is VEC consecutive elements of head_size,
// at index c < HEAD / VEC.
// ---------------------------------------------------------------------------------------------------------------
enum class KvLayout : int {
  kNHD = 0,   // key, value: [num_blocks, block_size, num_kv_heads, head_size]
  kVLLM = 1,  // key: [num_blocks, num_kv_heads, head_size / VEC, block_size, VEC]; value: [.., head_size, block_size]
};

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

  // Offset in elements, within a page, of token off's key vector c of head kvh (NHD: of its value vector too).
  // 32-bit: a page holds fewer than 2**31 elements (checked on the host).
  __device__ __forceinline__ int page_offset(int off, int kvh, int c) const {
    if constexpr (LAYOUT == KvLayout::kNHD) {
      return (off * num_kv_heads + kvh) * HEAD + c * VEC;
    } else {
      return (((kvh * (HEAD / VEC) + c) << block_shift) + off) * VEC;
    }
  }
  // How page_offset grows per key vector c: page_offset(off, kvh, c) = page_offset(off, kvh, 0) + c·vector_stride().
  __device__ __forceinline__ int vector_stride() const {
    return LAYOUT == KvLayout::kNHD ? VEC : VEC << block_shift;
  }

  // Elements between consecutive tokens' vectors of one head within a page:
  // page_offset(off, kvh, c) = page_offset(0, kvh, c) + off·token_stride().
  __device__ __forceinline__ int token_stride() const {
    return LAYOUT == KvLayout::kNHD ? num_kv_heads * HEAD : VEC;
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

  // NHD only: the value vector is contiguous.
  __device__ __forceinline__ const T* value_vec(long long blk, int off, int kvh, int c) const {
    return value + blk * block_stride + page_offset(off, kvh, c);
  }

  // Element d of a token's value, either layout.
  __device__ __forceinline__ T value_elem(long long blk, int off, int kvh, int d) const {
    if constexpr (LAYOUT == KvLayout::kNHD) {
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
// Longest first (the decode kernels). The hardware starts a grid's CTAs in index order, so a grid of several waves
// over sequences of unequal length ends with CTAs of any length running while fewer and fewer others keep the
// memory busy. With longest_first, a decode kernel's CTA row r (the CTAs of one sequence) takes the sequence of
// rank r in decreasing length (ties by index): the longest start first and the last wave holds the shortest, which
// end together. Every CTA ranks the same clamped lengths, so the ranks are a permutation of the sequences.
// Each of the CTA's THREADS threads ranks kMaxLongestFirstSeqs / THREADS sequences (t, t + THREADS, ...): it counts
// the sequences before its own in broadcast reads of shared memory, and the one of rank `rank` writes *seq_out.
// ---------------------------------------------------------------------------------------------------------------
constexpr int kMaxLongestFirstSeqs = 256;

// Before the ranking, a CTA sends its first block ids on their way: num_ids (at most MAX_IDS) ids of the row's own
// sequence, row_ids[0 ... num_ids), are copied by cp.async to ids_s (MAX_IDS ints of shared memory, free until the
// caller's next barrier). The caller reads them when the ranked sequence is the row's own (a batch already longest
// first, equal lengths included), with no second round trip to L2 after the ranking. (Its own call, not part of
// seq_of_rank: issued before the caller works out seq_of_rank's arguments, the FP32 kernels' code stays as it was;
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
    // (Compared as a scalar: against the array element, NVVM made a branch of each ||, and the FP32 kernel's
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

// ---------------------------------------------------------------------------------------------------------------
// Bias sources: what the attention kernels add to a logit besides scale·<q, k> and ALiBi. Every kind is built from
// the same kernel arguments (BiasArgs), so decode and prefill share one signature and one device code path:
//
//   Bias::make(args)        the source, once per CTA
//   bias.seq(s)             its view of sequence s (a ragged bias reads the sequence's offsets here)
//   view.limit(len)         the keys the bias covers: len, or fewer when a ragged bias is too short
//   view.load(h, i, p, j)   the raw bias bits of query head h, query row i (0 in decode) at absolute position p,
//                           key position j; load early, convert late:
//   view.row(h, i, p)       the same for one (h, i, p) and many keys: row.load(j), with the row's address
//                           arithmetic done once (a kernel's inner loop then pays one multiply-add per key)
//   bias.value(raw)         the float the logit gets
//
// `enabled` is a compile-time constant, so a kernel built with NoBias contains no bias code at all (`if constexpr`).
// The element dtype (float32 / float16 / bfloat16) is a run-time argument: it costs one uniform branch per load,
// not a tripling of the specialisations.
// ---------------------------------------------------------------------------------------------------------------
enum BiasDtype : int { kBiasF32 = 0, kBiasF16 = 1, kBiasBF16 = 2 };

struct BiasArgs {
  const void* ptr;       // dense: the bias; ragged: its values; t5: the bias table
  const int* index;      // ragged: offsets [num_seqs + 1]; t5: bucket of each distance [max_distance + 1]
  long long stride[4];   // in elements. dense: (s, h, i, j); ragged: (token, h, -, -); t5: (bucket, h, *, -)
                         // (* t5: not a stride, the buckets of one side: num_buckets, or half when bidirectional)
  int dtype;             // BiasDtype of ptr's elements
  int n;                 // ragged: rows of values; t5: max_distance
  int m;                 // t5: bidirectional ? buckets per side : 0
};

// One element of a float32 / float16 / bfloat16 array as raw bits (16-bit types in the low half).
__device__ __forceinline__ unsigned load_bias_bits(const void* p, long long i, int dtype) {
  return dtype == kBiasF32 ? __ldg(static_cast<const unsigned*>(p) + i)
                           : static_cast<unsigned>(__ldg(static_cast<const unsigned short*>(p) + i));
}

// Selects, not branches: the kernels convert one bias value per logit in unrolled loops, where a branch per dtype
// would multiply the code (prefill's inner loop grew past the instruction cache that way).
__device__ __forceinline__ float bias_bits_to_float(unsigned bits, int dtype) {
  const float as_half = __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  const float as_wide = __uint_as_float(dtype == kBiasF32 ? bits : bits << 16);  // bfloat16: a float32's upper half
  return dtype == kBiasF16 ? as_half : as_wide;
}

// A row of an array in memory: key j's element at byte address row + j·step. Dense and ragged biases alike. The
// host keeps the step from one key to the next under 2**31 bytes (_checks.check_key_stride), so a key's address is
// one 32 x 32 -> 64-bit multiply-add onto the row's pointer: with 64-bit element indices the FP32 decode kernel's
// bias loads took 27 instructions per tile and warp (benchmarks/NOTES.md, session 13).
// load(j) for one key at a time; a caller stepping through keys at fixed distances (the tensor-core kernel's
// fragments) takes one address per row and tile, at(j), then adds multiples of step_bytes() and calls load_at.
struct StridedRow {
  const char* row;  // key 0 of the row
  int step;         // bytes from one key to the next
  bool wide;        // float32 elements, else 16-bit ones
  static __device__ __forceinline__ StridedRow make(const void* ptr, long long base, long long step, int dtype) {
    const int size = dtype == kBiasF32 ? 4 : 2;
    return {static_cast<const char*>(ptr) + base * size, static_cast<int>(step * size), dtype == kBiasF32};
  }
  __device__ __forceinline__ const char* at(int j) const { return row + static_cast<long long>(j) * step; }
  __device__ __forceinline__ int step_bytes() const { return step; }
  __device__ __forceinline__ unsigned load_at(const char* p) const {
    return wide ? __ldg(reinterpret_cast<const unsigned*>(p))
                : static_cast<unsigned>(__ldg(reinterpret_cast<const unsigned short*>(p)));
  }
  __device__ __forceinline__ unsigned load(int j) const { return load_at(at(j)); }
};

struct NoBias {
  static constexpr bool enabled = false;
  static constexpr bool kNearTable = false;
  using Raw = unsigned;
  struct Seq {
    struct Row {
      __device__ __forceinline__ Raw load(int) const { return 0u; }
    };
    __device__ __forceinline__ int limit(int len) const { return len; }
    __device__ __forceinline__ Raw load(int, int, int, int) const { return 0u; }
    __device__ __forceinline__ Row row(int, int, int) const { return {}; }
  };
  static __device__ __forceinline__ NoBias make(const BiasArgs&) { return {}; }
  __device__ __forceinline__ Seq seq(int) const { return {}; }
  __device__ __forceinline__ float value(Raw) const { return 0.0f; }
};

// A dense array, bias(s, h, i, j) = ptr[s·stride0 + h·stride1 + i·stride2 + j·stride3], any strides (0 broadcasts).
// Its length was checked on the host: the kernels' max_len never exceeds it.
struct DenseBias {
  static constexpr bool enabled = true;
  static constexpr bool kNearTable = false;
  using Raw = unsigned;
  BiasArgs a;
  struct Seq {
    BiasArgs a;  // a copy: registers, never a pointer into the CTA's locals
    long long base;
    __device__ __forceinline__ int limit(int len) const { return len; }
    using Row = StridedRow;
    __device__ __forceinline__ Raw load(int h, int i, int, int j) const {
      return load_bias_bits(a.ptr, base + h * a.stride[1] + i * a.stride[2] + j * a.stride[3], a.dtype);
    }
    __device__ __forceinline__ Row row(int h, int i, int) const {
      return Row::make(a.ptr, base + h * a.stride[1] + i * a.stride[2], a.stride[3], a.dtype);
    }
  };
  static __device__ __forceinline__ DenseBias make(const BiasArgs& args) { return {args}; }
  __device__ __forceinline__ Seq seq(int s) const { return {a, s * a.stride[0]}; }
  __device__ __forceinline__ float value(Raw r) const { return bias_bits_to_float(r, a.dtype); }
};

// A dense bias of 16-bit elements whose keys are adjacent (stride[3] == 1), rows anywhere: the tensor-core decode
// copies each tile's rows of it into shared memory by cp.async, beside the tile's K and V (paged_prefill.cu,
// stage_bias). The host picks it for such a bias (decode.py); DenseBias reads any other element by element.
struct DenseRowsBias : DenseBias {
  static __device__ __forceinline__ DenseRowsBias make(const BiasArgs& args) { return {{args}}; }
};

// A ragged bias: sequence s's keys are rows offsets[s] ... of values [n, num_heads]. Whatever the offsets hold, no
// row outside [0, n) is read: a sequence whose rows are missing is cut short (validate=True reports it).
struct RaggedBias {
  static constexpr bool enabled = true;
  static constexpr bool kNearTable = false;
  using Raw = unsigned;
  BiasArgs a;
  struct Seq {
    BiasArgs a;  // a copy: registers, never a pointer into the CTA's locals
    int first, rows;  // first row of the sequence, rows it may use
    __device__ __forceinline__ int limit(int len) const { return min(len, rows); }
    using Row = StridedRow;
    __device__ __forceinline__ Raw load(int h, int, int, int j) const {
      return load_bias_bits(a.ptr, static_cast<long long>(first + j) * a.stride[0] + h * a.stride[1], a.dtype);
    }
    __device__ __forceinline__ Row row(int h, int, int) const {
      return Row::make(a.ptr, static_cast<long long>(first) * a.stride[0] + h * a.stride[1], a.stride[0], a.dtype);
    }
  };
  static __device__ __forceinline__ RaggedBias make(const BiasArgs& args) { return {args}; }
  __device__ __forceinline__ Seq seq(int s) const {
    const int first = __ldg(a.index + s);
    const int next = __ldg(a.index + s + 1);
    const int rows = first < 0 || first > a.n ? 0 : max(0, min(next - first, a.n - first));
    return {a, max(first, 0), rows};
  }
  __device__ __forceinline__ float value(Raw r) const { return bias_bits_to_float(r, a.dtype); }
};

// A ragged bias of 16-bit elements whose heads are adjacent (stride[1] == 1) and whose step from one key to the next
// is a multiple of 16 bytes: the tensor-core decode copies each tile's keys' elements of its heads into shared memory
// by cp.async, beside the tile's K and V (paged_prefill.cu, stage_bias). The host picks it for such a bias
// (decode.py); RaggedBias reads any other element by element.
struct RaggedRowsBias : RaggedBias {
  static __device__ __forceinline__ RaggedRowsBias make(const BiasArgs& args) { return {{args}}; }
};

// T5's relative-position bias, computed per key: table[bucket(j − p), h] for the query at position p. The bucket of
// a distance comes from a small table (index, built on the host from the exact float32 definition, so host and
// device agree bit for bit); distances >= max_distance (n) share its last entry. Bidirectional (m > 0): keys after
// the query use the upper m buckets. Causal (m = 0): they all fall in bucket 0. Every bucket read from index is held
// inside the buckets of one side (stride[2]): a bucket array given to from_buckets whose values lie outside them
// (validate=True reports it) selects a wrong weight but never reads outside the table or the CTA's shared memory.
constexpr int kT5NearDistances = 128;  // T5's default max_distance: every near key of a standard T5 table

struct T5Bias {
  static constexpr bool enabled = true;
  static constexpr bool kNearTable = true;  // the FP32 decode kernel keeps a near-weight table (Seq::Row)
  using Raw = unsigned;
  BiasArgs a;
  // Most keys of a long sequence are far from the query: their bucket needs no table read, so the weight's load
  // never waits on another load. far: index's entry for every distance >= max_distance (on one side), as read.
  static __device__ __forceinline__ Raw load_at(const BiasArgs& a, int far, int h, int p, int j) {
    const int rel = j - p;
    const int distance = a.m > 0 ? abs(rel) : max(-rel, 0);
    const int bucket = (a.m > 0 && rel > 0 ? a.m : 0) + held(a, distance >= a.n ? far : __ldg(a.index + distance));
    return weight(a, bucket, h);
  }
  // An entry of index held inside [0, buckets of one side) (a negative one, as unsigned, is past the last). Applied
  // where the bucket is used, not where it is loaded: a thread waits for the load there.
  static __device__ __forceinline__ int held(int bucket, unsigned last) {
    return static_cast<int>(min(static_cast<unsigned>(bucket), last));
  }
  static __device__ __forceinline__ unsigned last_bucket(const BiasArgs& a) {
    return static_cast<unsigned>(a.stride[2]) - 1u;
  }
  static __device__ __forceinline__ int held(const BiasArgs& a, int bucket) { return held(bucket, last_bucket(a)); }
  // The table's entry for (bucket, head h), raw bits.
  static __device__ __forceinline__ Raw weight(const BiasArgs& a, int bucket, int h) {
    return load_bias_bits(a.ptr, bucket * a.stride[0] + h * a.stride[1], a.dtype);
  }
  struct Seq {
    BiasArgs a;  // a copy: registers, never a pointer into the CTA's locals
    int far;  // index's entry for distances >= max_distance, as read (held before use)
    // One query row of the FP32 decode kernel, whose keys are all at or before the query (j <= p). The weight of
    // the far keys is read once: a far key (most of a long sequence) costs a compare and no load. The weights of
    // the kT5NearDistances distances nearest the query come from a table in the CTA's shared memory (near, filled
    // by near_bucket / near_weight before the first key's bias is loaded): a near key costs a shared-memory load,
    // not a bucket load and a weight load behind seq_lens. Other keys (max_distance > kT5NearDistances) read both.
    struct Row {
      const void* ptr;
      const int* index;
      long long bucket_stride, head_at;  // the table's bucket stride, head h's offset
      int dtype, n, p;
      unsigned last;  // the last bucket of one side
      Raw far_bits;
      const Raw* near;  // shared memory: near[d] = the weight bits of distance d < kT5NearDistances
      __device__ __forceinline__ Raw load(int j) const {
        const int distance = p - j;
        if (distance >= n) return far_bits;
        if (distance < kT5NearDistances) return near[distance];
        return load_bias_bits(ptr, T5Bias::held(__ldg(index + distance), last) * bucket_stride + head_at, dtype);
      }
    };
    __device__ __forceinline__ int limit(int len) const { return len; }
    __device__ __forceinline__ Raw load(int h, int, int p, int j) const { return load_at(a, far, h, p, j); }
    __device__ __forceinline__ Row row(int h, int, int p, const Raw* near) const {
      return row(h, 0, p, near, weight(a, held(far), h));
    }
    // The same with the far keys' weight bits given.
    __device__ __forceinline__ Row row(int h, int, int p, const Raw* near, Raw far_bits) const {
      return {a.ptr, a.index, a.stride[0], h * a.stride[1], a.dtype, a.n, p, last_bucket(a), far_bits, near};
    }
    // Buckets on the side of keys at or before the query: [0, per_side()) (and far < per_side()).
    __device__ __forceinline__ int per_side() const { return static_cast<int>(a.stride[2]); }
    __device__ __forceinline__ int held(int bucket) const { return T5Bias::held(a, bucket); }
    // The bucket of a key at distance d (0 <= d) before the query, as read (held before use), and a bucket's weight
    // for head h: the near table's entries, in two steps so that a kernel issues the bucket loads first and the
    // weights later.
    __device__ __forceinline__ int near_bucket(int d) const { return __ldg(a.index + min(d, a.n)); }
    __device__ __forceinline__ Raw near_weight(int bucket, int h) const { return weight(a, bucket, h); }
  };
  static __device__ __forceinline__ T5Bias make(const BiasArgs& args) { return {args}; }
  __device__ __forceinline__ Seq seq(int) const { return {a, __ldg(a.index + a.n)}; }
  __device__ __forceinline__ float value(Raw r) const { return bias_bits_to_float(r, a.dtype); }
};

}  // namespace cpa
