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
#pragma once

#include "common.cuh"

namespace cpa {

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
// one 32 x 32 -> 64-bit multiply-add onto the row's pointer: with 64-bit element indices the SIMT decode kernel's
// bias loads took 27 instructions per tile and warp.
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
// copies each tile's rows of it into shared memory by cp.async, beside the tile's K and V (decode_mma.cu,
// StagedBias). The host picks it for such a bias (planning.py); DenseBias reads any other element by element.
struct DenseRowsBias : DenseBias {
  static __device__ __forceinline__ DenseRowsBias make(const BiasArgs& args) { return {{args}}; }
};

// A ragged bias: sequence s's keys are rows offsets[s] ... of values [n, num_heads]. Whatever the offsets hold, no
// row outside [0, n) is read: a sequence whose rows are missing is cut short, which poisons its rows (NaN,
// paged_cache.cuh; validate=True reports it).
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
// by cp.async, beside the tile's K and V (decode_mma.cu, StagedBias). The host picks it for such a bias
// (planning.py); RaggedBias reads any other element by element.
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
  static constexpr bool kNearTable = true;  // the SIMT decode kernel keeps a near-weight table (Seq::Row)
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
    // One query row of the SIMT decode kernel, whose keys are all at or before the query (j <= p). The weight of
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
