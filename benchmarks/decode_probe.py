"""Probes of where decode time goes, each timed like bench_decode.py (L2 flushed before every repetition, CUDA
graphs over ``--sets`` input sets, median of ``--reps``), each printing a table:

``floor``
    The latency case (B1 H16/16 d64 L1024, bf16, block 16) against kernels that do nothing but what any decode
    kernel must: read ``seq_lens`` and the block table, read every key and value vector through it (4.2 MB), write
    a result. ``probe-empty`` is a launch of the same grid that reads nothing; ``probe-read PxT`` reads the case's
    K and V with P CTAs per head of T threads, every load issued at once (two dependent round trips to memory:
    table, then K/V), and writes one float per thread; ``+ reduce`` adds a second kernel of 16 CTAs that combines
    the partitions' results, as a split-K decode must; ``+ last-CTA combine`` combines them in the same kernel
    instead (the last CTA of each head to finish, told by an atomic counter); ``probe-read unsplit`` is one CTA of
    1024 threads per head with all of the head's keys and values in flight at once (needing no combine). What they
    take is the floor of this harness for the case: launch, round trips, bytes, and no arithmetic. Beside them our
    ``DecodePlan.run`` with and without its split-K reduction (the partials then stay uncombined: timing only).
``bias-layout``
    Our kernels with a dense bias laid out ``[B, Hq, L]`` (keys fastest, as bench_decode) and ``[B, L, Hq]``
    (heads fastest, passed as the strided view ``[B, Hq, L]``), a RaggedBias and T5, beside no bias.
``split``
    The ragged-length MHA case (B64 H16/16 d64 L 1024-2048) and the B64 L2048 case with the keys split into 1-4
    partitions (``decode._CTAS_PER_SM_TARGET``) and split grids capped at 3 or 4 CTAs per SM.
``gqa-split``
    The grouped-query cases of the tensor-core kernel (B32 H32/8 d128 L8192, B16 H32/8 d128 L16384 fp16, B1 H32/8
    d128 L65536 in 24 to 147 partitions, the two widely spread ones, two of equal lengths in more than one wave, and
    six of less than one wave that the one-wave rule leaves unsplit) with their keys forced into a given number of
    partitions (``decode.split_keys`` replaced):
    B32's 256 CTAs run unsplit, two per SM on most SMs where three fit; B64 H32/8 d128 L4096's 512 CTAs make 1.3
    waves of the 396 that an H200 holds.
``read-floor``
    The read floor of whole cases (``--floor-cases``; by default the grouped-query ones and, to calibrate, the MHA
    ones whose kernels are memory-bound): ``probe_stream`` reads exactly the bytes bench_decode counts for a case (its
    K and V rows through the block table, with the dense bias the group's bias rows, q and out aside) and nothing
    else, with 1 to 64 partitions per (sequence, KV head) of 256 threads, 8 loads of 16 bytes in flight per thread.
    Its fastest partitioning is what a kernel doing no arithmetic achieves; beside it, ours, and ours over it.
``cluster``
    Split grids of the FP32 kernel in at most 8 partitions (the latency case and others of 64 to 512 CTAs), their
    partitions combined by the reduction kernel or in thread block clusters, a grid of clusters allowed at most 1
    or 2 CTAs per SM.
``cp-async``
    The same reads without a bias (head size 128, ``--floor-cases``, 1 and 2 partitions) by cp.async into shared
    memory in five forms (``probe_async16_*``: with and without the src-size operand, ``.ca``, and into rows padded to
    17 vectors or XOR-swizzled rows of 16, the tensor-core decode's old and new layouts). Under ``ncu``, the padded
    rows request 1.5x the L2 sectors of the bytes copied.

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/decode_probe.py [floor] [bias-layout] [split] [gqa-split]
[read-floor] [cp-async] [cluster]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import bench_decode as bd

PROBE_SOURCE = r"""
// probe_read: CTA (head h = blockIdx.x, partition blockIdx.y) reads the K and V vectors of its tokens_per_cta
// keys (16 bytes each; a token's nvec vectors are adjacent in an NHD page) through the block table, every load
// issued before any is used, and writes one float per thread (the XOR of what it read, so nothing is elided; its
// top exponent bit cleared, so it is never NaN: bench_decode's capture check poisons outputs with NaN).
template <int VPT>
__device__ void probe_read_body(const uint4* __restrict__ key, const uint4* __restrict__ value,
                                const int* __restrict__ table, const int* __restrict__ seq_lens,
                                float* __restrict__ out, int num_kv_heads, int nvec, int tokens_per_cta,
                                long long page_vecs) {
  const int h = blockIdx.x;
  const int start = blockIdx.y * tokens_per_cta;
  const int len = seq_lens[0];
  int blk[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    const int t = start + idx / nvec;
    blk[i] = idx < tokens_per_cta * nvec ? table[t >> 4] : -1;
  }
  uint4 k[VPT], v[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    const int t = start + idx / nvec;
    const int c = idx % nvec;
    k[i] = v[i] = make_uint4(0u, 0u, 0u, 0u);
    if (blk[i] >= 0 && t < len) {
      const long long at = blk[i] * page_vecs + ((t & 15) * num_kv_heads + h) * nvec + c;
      k[i] = __ldg(key + at);
      v[i] = __ldg(value + at);
    }
  }
  unsigned x = 0u;
#pragma unroll
  for (int i = 0; i < VPT; ++i) x ^= k[i].x ^ k[i].y ^ k[i].z ^ k[i].w ^ v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  out[(static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] =
      __uint_as_float(x & 0xbfffffffu);
}

extern "C" __global__ void probe_read2(const uint4* key, const uint4* value, const int* table, const int* seq_lens,
                                       float* out, int num_kv_heads, int nvec, int tokens_per_cta,
                                       long long page_vecs) {
  probe_read_body<2>(key, value, table, seq_lens, out, num_kv_heads, nvec, tokens_per_cta, page_vecs);
}

extern "C" __global__ void probe_read4(const uint4* key, const uint4* value, const int* table, const int* seq_lens,
                                       float* out, int num_kv_heads, int nvec, int tokens_per_cta,
                                       long long page_vecs) {
  probe_read_body<4>(key, value, table, seq_lens, out, num_kv_heads, nvec, tokens_per_cta, page_vecs);
}

// probe_read_combine: probe_read4, then the last CTA of each head to finish (a ticket from an atomic counter, zero
// before the launch and reset by that CTA) sums the first head_size floats of its parts partitions and writes them:
// a split-K combine without a second kernel.
extern "C" __global__ void probe_read_combine(const uint4* key, const uint4* value, const int* table,
                                              const int* seq_lens, float* part, float* out, int* counters,
                                              int num_kv_heads, int nvec, int tokens_per_cta, long long page_vecs,
                                              int head_size) {
  probe_read_body<4>(key, value, table, seq_lens, part, num_kv_heads, nvec, tokens_per_cta, page_vecs);
  __shared__ bool last;
  __threadfence();  // this CTA's partials are visible to the CTA that combines them
  __syncthreads();  // every thread's partials are written and fenced
  if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
  __syncthreads();  // the ticket is known to every thread
  if (!last) return;
  const int d = threadIdx.x;
  if (d < head_size) {
    float s = 0.0f;
    for (int p = 0; p < static_cast<int>(gridDim.y); ++p)
      s += __ldcg(part + (static_cast<long long>(p) * gridDim.x + blockIdx.x) * blockDim.x + d);
    out[blockIdx.x * head_size + d] = s;
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch
}

// probe_read_unsplit: one CTA of 1024 threads per head reads all of the head's tokens keys at once, the keys by
// cp.async into shared memory (tokens·nvec vectors), the values into registers (8 vectors a thread), and writes one
// float per thread: the best case of a decode kernel that does not split the keys (and so needs no combine), whose
// CTA must hold a head's whole K and V in flight.
extern "C" __global__ void __launch_bounds__(1024, 1) probe_read_unsplit(
    const uint4* __restrict__ key, const uint4* __restrict__ value, const int* __restrict__ table,
    const int* __restrict__ seq_lens, float* __restrict__ out, int num_kv_heads, int nvec, int tokens,
    long long page_vecs) {
  constexpr int VPT = 8;
  extern __shared__ uint4 k_s[];
  const int h = blockIdx.x;
  const int len = seq_lens[0];
  int blk[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    blk[i] = idx < tokens * nvec ? table[(idx / nvec) >> 4] : -1;
  }
  uint4 v[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    const int t = idx / nvec;
    v[i] = make_uint4(0u, 0u, 0u, 0u);
    if (blk[i] >= 0 && t < len) {
      const long long at = blk[i] * page_vecs + ((t & 15) * num_kv_heads + h) * nvec + idx % nvec;
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(k_s + idx));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(key + at));
      v[i] = __ldg(value + at);
    } else if (idx < tokens * nvec) {
      k_s[idx] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // this thread's copies have landed (it reads only those)
  unsigned x = 0u;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    const uint4 k = idx < tokens * nvec ? k_s[idx] : make_uint4(0u, 0u, 0u, 0u);
    x ^= k.x ^ k.y ^ k.z ^ k.w ^ v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  }
  out[static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x] = __uint_as_float(x & 0xbfffffffu);
}

// probe_empty: the same grid, no loads: one float per thread.
extern "C" __global__ void probe_empty(float* out) {
  out[(static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = 1.0f;
}

// probe_reduce: CTA h sums the first head_size floats of each of its parts partitions' CTAs (what a split-K
// reduction reads) and writes head_size floats.
extern "C" __global__ void probe_reduce(const float* __restrict__ part, float* __restrict__ out, int parts,
                                        int threads_per_part, int head_size) {
  const int h = blockIdx.x;
  const int d = threadIdx.x;
  if (d >= head_size) return;
  float s = 0.0f;
  for (int p = 0; p < parts; ++p) s += part[(static_cast<long long>(p) * gridDim.x + h) * threads_per_part + d];
  out[h * head_size + d] = s;
}
// The keys of a streaming probe's CTA (KV heads fastest, as our grids): sequence s, KV head kvh, keys [start, end)
// of partition blockIdx.x / num_kv_heads % parts, whose page ids (first = start's page) it loads into ids: one round
// trip, and a barrier after which every thread may use them.
constexpr int kStreamMaxIds = 2048;
struct StreamKeys {
  int s, kvh, start, end, first;
};
__device__ StreamKeys stream_keys(const int* __restrict__ table, const int* __restrict__ seq_lens, int* ids,
                                  int num_kv_heads, int blocks_per_seq, int chunk, int parts) {
  StreamKeys q;
  q.kvh = blockIdx.x % num_kv_heads;
  q.s = blockIdx.x / num_kv_heads / parts;
  q.start = blockIdx.x / num_kv_heads % parts * chunk;
  q.end = min(seq_lens[q.s], q.start + chunk);
  q.first = q.start >> 4;
  const int count = q.start < q.end ? min(((q.end - 1) >> 4) - q.first + 1, kStreamMaxIds) : 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) ids[i] = table[q.s * blocks_per_seq + q.first + i];
  __syncthreads();  // every page id of the partition is in shared memory before any thread uses one
  return q;
}

// probe_stream: the fewest bytes of a whole decode grid, read as fast as this layout allows (the read floor of any
// case, as the probes above are the latency case's). CTA (s, p, kvh) = blockIdx.x, KV heads fastest (as our grids):
// the keys [p·chunk, min(len_s, (p + 1)·chunk)) of sequence s. Its page ids first, into shared memory (one round
// trip), then every K and V vector of those keys (NVEC of 16 bytes per token row of head kvh in an NHD page), U of
// each per thread in flight per step with no dependence between steps but the XOR, then, when bias_row_vecs > 0,
// the 16-byte vectors of the group's bias rows [B, Hq, L] over the same keys (rounded up to whole vectors; L·2
// bytes a multiple of 16). Writes one float per thread, as probe_read.
template <int NVEC>
__device__ void probe_stream_body(const uint4* __restrict__ key, const uint4* __restrict__ value,
                                  const int* __restrict__ table, const int* __restrict__ seq_lens,
                                  const uint4* __restrict__ bias, float* __restrict__ out, int num_kv_heads,
                                  int group, int blocks_per_seq, int chunk, int parts, long long page_vecs,
                                  int bias_row_vecs) {
  constexpr int U = 4;
  __shared__ int ids[kStreamMaxIds];
  const auto [s, kvh, start, end, first] = stream_keys(table, seq_lens, ids, num_kv_heads, blocks_per_seq, chunk,
                                                       parts);
  unsigned x = 0u;
  if (start < end) {
    const int items = (end - start) * NVEC;
    for (int base = 0; base < items; base += U * static_cast<int>(blockDim.x)) {
      uint4 k[U], v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * blockDim.x + threadIdx.x;
        k[u] = v[u] = make_uint4(0u, 0u, 0u, 0u);
        if (idx < items) {
          const int t = start + idx / NVEC;
          const long long at = ids[(t >> 4) - first] * page_vecs + ((t & 15) * num_kv_heads + kvh) * NVEC + idx % NVEC;
          k[u] = __ldg(key + at);
          v[u] = __ldg(value + at);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) x ^= k[u].x ^ k[u].y ^ k[u].z ^ k[u].w ^ v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (bias_row_vecs > 0) {
      const int row_vecs = (end - start + 7) / 8;  // 16-bit entries, 8 a vector
      const int bias_items = group * row_vecs;
      const long long row0 = (static_cast<long long>(s) * num_kv_heads + kvh) * group;
      for (int base = 0; base < bias_items; base += U * static_cast<int>(blockDim.x)) {
        uint4 b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int idx = base + u * blockDim.x + threadIdx.x;
          b[u] = make_uint4(0u, 0u, 0u, 0u);
          if (idx < bias_items)
            b[u] = __ldg(bias + (row0 + idx / row_vecs) * bias_row_vecs + start / 8 + idx % row_vecs);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) x ^= b[u].x ^ b[u].y ^ b[u].z ^ b[u].w;
      }
    }
  }
  out[static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x] = __uint_as_float(x & 0xbfffffffu);
}

extern "C" __global__ void __launch_bounds__(256) probe_stream8(
    const uint4* key, const uint4* value, const int* table, const int* seq_lens, const uint4* bias, float* out,
    int num_kv_heads, int group, int blocks_per_seq, int chunk, int parts, long long page_vecs, int bias_row_vecs) {
  probe_stream_body<8>(key, value, table, seq_lens, bias, out, num_kv_heads, group, blocks_per_seq, chunk, parts,
                       page_vecs, bias_row_vecs);
}

extern "C" __global__ void __launch_bounds__(256) probe_stream16(
    const uint4* key, const uint4* value, const int* table, const int* seq_lens, const uint4* bias, float* out,
    int num_kv_heads, int group, int blocks_per_seq, int chunk, int parts, long long page_vecs, int bias_row_vecs) {
  probe_stream_body<16>(key, value, table, seq_lens, bias, out, num_kv_heads, group, blocks_per_seq, chunk, parts,
                        page_vecs, bias_row_vecs);
}
// probe_async: probe_stream's K/V reads (same keys, same lanes: a token row's vectors on consecutive lanes) by
// cp.async into shared memory, as the decode kernels copy, in one of three forms (MODE): 0 cp.async.cg with a
// src-size operand (zero-fill; the decode kernels' form), 1 cp.async.cg without it, 2 cp.async.ca without it; 3 and
// 4 the form of 0 into the tensor-core kernel's layouts of a tile: 3 rows of 17 vectors (one of padding), 4 rows of
// 16 vectors whose 8-vector halves are XOR-swizzled by the row (vector c at (c & 8) | ((c ^ r) & 7)). Each step's U
// vectors of K and of V land in the thread's own slots, are waited for, and XORed. To compare the forms' L2 traffic
// (ncu: lts__t_sectors_srcunit_tex_op_read.sum) and time. No bias.
template <int NVEC, int MODE>
__device__ void probe_async_body(const uint4* __restrict__ key, const uint4* __restrict__ value,
                                 const int* __restrict__ table, const int* __restrict__ seq_lens,
                                 float* __restrict__ out, int num_kv_heads, int blocks_per_seq, int chunk, int parts,
                                 long long page_vecs) {
  constexpr int U = 4;
  __shared__ int ids[kStreamMaxIds];
  constexpr int kSlot = MODE == 3 ? 272 : 256;  // vectors per slot: 256 threads' vectors, 16 rows of 16 (or 17)
  __shared__ uint4 slots[2 * U * kSlot];
  const int r = threadIdx.x / 16, c = threadIdx.x % 16;
  const int mine = MODE == 3 ? r * 17 + c : MODE == 4 ? r * 16 + ((c & 8) | ((c ^ r) & 7)) : threadIdx.x;
  const auto [s, kvh, start, end, first] = stream_keys(table, seq_lens, ids, num_kv_heads, blocks_per_seq, chunk,
                                                       parts);
  unsigned x = 0u;
  if (start < end) {
    const int items = (end - start) * NVEC;
    for (int base = 0; base < items; base += U * static_cast<int>(blockDim.x)) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * blockDim.x + threadIdx.x;
        const bool in = idx < items;
        const int t = start + (in ? idx : 0) / NVEC;
        const long long at = ids[(t >> 4) - first] * page_vecs + ((t & 15) * num_kv_heads + kvh) * NVEC + idx % NVEC;
        const unsigned dk = static_cast<unsigned>(__cvta_generic_to_shared(slots + (2 * u) * kSlot + mine));
        const unsigned dv = static_cast<unsigned>(__cvta_generic_to_shared(slots + (2 * u + 1) * kSlot + mine));
        if constexpr (MODE == 0 || MODE >= 3) {
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dk), "l"(key + at), "r"(in ? 16 : 0));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dv), "l"(value + at), "r"(in ? 16 : 0));
        } else if (in) {
          if constexpr (MODE == 1) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dk), "l"(key + at));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dv), "l"(value + at));
          } else {
            asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dk), "l"(key + at));
            asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dv), "l"(value + at));
          }
        }
      }
      asm volatile("cp.async.commit_group;\n" ::);
      asm volatile("cp.async.wait_all;\n" ::: "memory");  // this thread's copies have landed (it reads only those)
#pragma unroll
      for (int u = 0; u < 2 * U; ++u) {
        const uint4 v = slots[u * kSlot + mine];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    }
  }
  out[static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x] = __uint_as_float(x & 0xbfffffffu);
}

#define PROBE_ASYNC(MODE)                                                                                         \
  extern "C" __global__ void __launch_bounds__(256) probe_async16_##MODE(                                        \
      const uint4* key, const uint4* value, const int* table, const int* seq_lens, float* out, int num_kv_heads, \
      int blocks_per_seq, int chunk, int parts, long long page_vecs) {                                           \
    probe_async_body<16, MODE>(key, value, table, seq_lens, out, num_kv_heads, blocks_per_seq, chunk, parts,     \
                               page_vecs);                                                                       \
  }
PROBE_ASYNC(0)
PROBE_ASYNC(1)
PROBE_ASYNC(2)
PROBE_ASYNC(3)
PROBE_ASYNC(4)
"""

LATENCY_CASE = 4  # bench_decode.CASES[4]: B1 H16/16 d64 L1024
BIAS_CASES = (0, 1, 3, 8)
SPLIT_CASES = (0, 1)


@contextlib.contextmanager
def cupy_on_torch_stream() -> Iterator[None]:
    """CuPy's current stream is torch's current one (a capture stream inside ``torch.cuda.graph``)."""
    import cupy
    import torch

    with cupy.cuda.Stream.from_external(torch.cuda.current_stream()):
        yield


def time_sets(timer: bd.Timer, calls: Sequence[Callable[[], Any]], outputs: Sequence[Any]) -> float:
    """µs per call of ``calls`` (one per input set) replayed as one CUDA graph, L2 flushed before each replay."""
    def body() -> list[Any]:
        for call in calls:
            call()
        return list(outputs)

    graph, error = bd.capture_graph(body)
    if graph is None:
        raise RuntimeError(error)
    return 1e3 * timer.median_ms(graph.replay) / len(calls)


def probe_rows(timer: bd.Timer, sets: list[bd.InputSet], case: bd.Case) -> list[tuple[str, float]]:
    """The floor probes of the latency case: (row, µs per call)."""
    import cupy

    module = cupy.RawModule(code=PROBE_SOURCE, options=("-std=c++17",))
    rows = []
    for parts, threads in ((8, 256), (16, 256), (16, 128)):
        rows += probe_grid(timer, module, sets, case, parts, threads, with_empty=parts == 8)
    return [*rows, probe_unsplit(timer, module, sets, case)]


def probe_unsplit(timer: bd.Timer, module: Any, sets: list[bd.InputSet], case: bd.Case) -> tuple[str, float]:
    """probe_read_unsplit: one CTA of 1024 threads per head, all of its keys and values in flight at once."""
    import cupy
    import torch

    heads, nvec, tokens, threads = case.num_kv_heads, case.head_size * case.itemsize // 16, case.max_len, 1024
    if tokens * nvec != 8 * threads:
        raise ValueError(f"probe_read_unsplit holds 8 vectors a thread; {case.name} has {tokens * nvec}")
    smem = tokens * nvec * 16
    kernel = module.get_function("probe_read_unsplit")
    kernel.max_dynamic_shared_size_bytes = smem
    partials = [torch.empty(heads * threads, device="cuda") for _ in sets]
    ptr = cupy.uint64

    def read(i: int) -> None:
        s = sets[i]
        with cupy_on_torch_stream():
            kernel((heads,), (threads,), (
                ptr(s.key_cache.data_ptr()), ptr(s.value_cache.data_ptr()), ptr(s.block_tables.data_ptr()),
                ptr(s.seq_lens.data_ptr()), ptr(partials[i].data_ptr()), cupy.int32(heads), cupy.int32(nvec),
                cupy.int32(tokens), cupy.int64(bd.BLOCK_SIZE * heads * nvec)), shared_mem=smem)

    calls = [functools.partial(read, i) for i in range(len(sets))]
    return f"probe-read unsplit 1x{threads} ({smem // 1024} KB of K in shared memory)", time_sets(timer, calls,
                                                                                                  partials)


def probe_grid(timer: bd.Timer, module: Any, sets: list[bd.InputSet], case: bd.Case, parts: int, threads: int,
               with_empty: bool) -> list[tuple[str, float]]:
    """probe-read (and probe-empty) with ``parts`` CTAs of ``threads`` threads per head, alone and with the reduce."""
    import cupy
    import torch

    heads, nvec = case.num_kv_heads, case.head_size * case.itemsize // 16
    tokens = case.max_len // parts
    kernel = module.get_function(f"probe_read{tokens * nvec // threads}")
    empty, reduce = module.get_function("probe_empty"), module.get_function("probe_reduce")
    partials = [torch.empty(parts * heads * threads, device="cuda") for _ in sets]
    reduced = [torch.empty(heads * case.head_size, device="cuda") for _ in sets]
    ptr = cupy.uint64

    def read(i: int) -> None:
        s = sets[i]
        with cupy_on_torch_stream():
            kernel((heads, parts), (threads,), (
                ptr(s.key_cache.data_ptr()), ptr(s.value_cache.data_ptr()), ptr(s.block_tables.data_ptr()),
                ptr(s.seq_lens.data_ptr()), ptr(partials[i].data_ptr()), cupy.int32(heads), cupy.int32(nvec),
                cupy.int32(tokens), cupy.int64(bd.BLOCK_SIZE * heads * nvec)))

    def read_reduce(i: int) -> None:
        read(i)
        with cupy_on_torch_stream():
            reduce((heads,), (128,), (ptr(partials[i].data_ptr()), ptr(reduced[i].data_ptr()), cupy.int32(parts),
                                      cupy.int32(threads), cupy.int32(case.head_size)))

    def nothing(i: int) -> None:
        with cupy_on_torch_stream():
            empty((heads, parts), (threads,), (ptr(partials[i].data_ptr()),))

    label = f"{parts}x{threads}"
    indices = range(len(sets))
    rows = [(f"probe-empty {label}", time_sets(timer, [functools.partial(nothing, i) for i in indices], partials))
            ] if with_empty else []
    rows.append((f"probe-read {label}", time_sets(timer, [functools.partial(read, i) for i in indices], partials)))
    rows.append((f"probe-read {label} + reduce",
                 time_sets(timer, [functools.partial(read_reduce, i) for i in indices], reduced)))
    if tokens * nvec // threads == 4:
        combine = module.get_function("probe_read_combine")
        counters = [torch.zeros(heads, dtype=torch.int32, device="cuda") for _ in sets]

        def read_combine(i: int) -> None:
            s = sets[i]
            with cupy_on_torch_stream():
                combine((heads, parts), (threads,), (
                    ptr(s.key_cache.data_ptr()), ptr(s.value_cache.data_ptr()), ptr(s.block_tables.data_ptr()),
                    ptr(s.seq_lens.data_ptr()), ptr(partials[i].data_ptr()), ptr(reduced[i].data_ptr()),
                    ptr(counters[i].data_ptr()), cupy.int32(heads), cupy.int32(nvec), cupy.int32(tokens),
                    cupy.int64(bd.BLOCK_SIZE * heads * nvec), cupy.int32(case.head_size)))

        rows.append((f"probe-read {label} + last-CTA combine",
                     time_sets(timer, [functools.partial(read_combine, i) for i in indices], reduced)))
    return rows


def ours_rows(timer: bd.Timer, case: bd.Case, sets: list[bd.InputSet],
              biases: dict[str, Callable[[bd.InputSet], Any]]) -> list[tuple[str, float]]:
    """Our decode on each set, per bias variant: (row, µs per call); each output checked against the first row's
    with the same bias values (the dense bias's, for every variant but none and T5)."""
    import torch

    rows = []
    reference = None  # ours with the dense bias on the first set, computed once
    for name, bias_of in biases.items():
        args = [bias_of(s) for s in sets]
        calls = [lambda s=s, a=a: bd.ours(s, a, s.out) for s, a in zip(sets, args, strict=True)]
        rows.append((name, time_sets(timer, calls, [s.out for s in sets])))
        if name not in ("none", "t5"):
            if reference is None:
                reference = bd.ours(sets[0], sets[0].bias)
            got = bd.ours(sets[0], args[0])
            diff = float((got.float() - reference.float()).abs().max())
            if diff > bd.TOLERANCE[case.dtype]:
                raise AssertionError(f"{name}: max |diff| against the dense bias {diff:.3g}")
        torch.cuda.synchronize()
    return rows


def heads_inner(bias: Any) -> Any:
    """The same values as ``bias`` ``[B, Hq, L]``, stored heads fastest (``[B, L, Hq]``), as a strided view."""
    return bias.transpose(1, 2).contiguous().transpose(1, 2)


def build(index: int, args: argparse.Namespace, case: bd.Case | None = None) -> tuple[bd.Case, list[bd.InputSet]]:
    """bench_decode's inputs of case ``index`` (its seed and set count); with ``case``, that case's inputs, drawn
    with the seed of ``index``."""
    case = bd.CASES[index] if case is None else case
    seq_lens = bd.draw_seq_lens(case, args.seed + index)
    sets, _ = bd.build_inputs(case, seq_lens, case.num_sets(args.sets), args.seed + index)
    for s in sets:
        s.make_bias_object("ragged")
        s.make_bias_object("t5")
    return case, sets


def attention_only_rows(timer: bd.Timer, sets: list[bd.InputSet]) -> list[tuple[str, float]]:
    """``DecodePlan.run`` without a bias, with and without its split-K reduction (the partials are then never
    combined: timing only, the output is the workspace); the plans combine through the reduction kernel, not in
    clusters."""
    import cupy_paged_attn as cpa
    from cupy_paged_attn import decode

    def operands(s: bd.InputSet) -> tuple[Any, ...]:
        return s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens

    rows = []
    for name, reduce in (("plan.run", True), ("plan.run, attention kernel only", False)):
        saved, decode.CLUSTER_COMBINE = decode.CLUSTER_COMBINE, False
        try:
            plan = cpa.DecodePlan(*operands(sets[0]))
        finally:
            decode.CLUSTER_COMBINE = saved
        if not plan.launch.reduces:
            raise RuntimeError("the latency case is expected to split its keys")
        if not reduce:
            plan._reduce_launch = NoLaunch()
            plan._reduce_args = NoLaunch()
        outputs = [plan._workspace] if not reduce else [s.out for s in sets]
        calls = [functools.partial(plan.run, *operands(s), out=s.out) for s in sets]
        rows.append((f"{name} ({plan.launch.num_parts} parts)", time_sets(timer, calls, outputs)))
    return rows


class NoLaunch:
    """Stands in for a plan's reduction launch (attention_only_rows)."""

    def launch(self, *args: Any) -> None:
        pass

    def set_pointer(self, *args: Any) -> None:
        pass

    def set(self, *args: Any) -> None:
        pass


def floor(args: argparse.Namespace, timer: bd.Timer) -> list[tuple[str, str, float]]:
    case, sets = build(LATENCY_CASE, args)
    rows = ours_rows(timer, case, sets, {"none": lambda s: None, "dense": lambda s: s.bias})
    rows += attention_only_rows(timer, sets)
    rows += probe_rows(timer, sets, case)
    return [(case.name, name, us) for name, us in rows]


def bias_layout(args: argparse.Namespace, timer: bd.Timer) -> list[tuple[str, str, float]]:
    table = []
    for index in args.bias_cases:
        case, sets = build(index, args)
        inner = {id(s): heads_inner(s.bias) for s in sets}
        rows = ours_rows(timer, case, sets, {
            "none": lambda s: None, "dense [B,H,L]": lambda s: s.bias,
            "dense [B,L,H]": lambda s, inner=inner: inner[id(s)], "ragged": lambda s: s.ragged_bias,
            "t5": lambda s: s.t5_bias})
        table += [(case.name, name, us) for name, us in rows]
    return table


def split(args: argparse.Namespace, timer: bd.Timer) -> list[tuple[str, str, float]]:
    from cupy_paged_attn import decode

    saved = (decode._SPLIT_BELOW_CTAS_PER_SM, decode._CTAS_PER_SM_TARGET, decode._SPLIT_CTAS_PER_SM)
    table = []
    try:
        for index in SPLIT_CASES:
            case, sets = build(index, args)
            for target, cap in ((0, 3), (8, 3), (16, 3), (24, 3), (8, 4), (16, 4), (24, 4)):
                if target:
                    decode._SPLIT_BELOW_CTAS_PER_SM, decode._CTAS_PER_SM_TARGET = 10**6, target
                else:
                    decode._SPLIT_BELOW_CTAS_PER_SM, decode._CTAS_PER_SM_TARGET = saved[0], saved[1]
                decode._SPLIT_CTAS_PER_SM = cap
                decode._PLANS.__dict__.pop("plans", None)  # plans are keyed by shapes, not by these knobs
                rows = ours_rows(timer, case, sets, {"none": lambda s: None, "dense": lambda s: s.bias})
                parts = max(plan.launch.num_parts for plan in decode._PLANS.plans.values())
                label = f"{parts} parts, at most {cap} CTAs/SM" if parts > 1 else "unsplit"
                table += [(case.name, f"{name:5s} {label}", us) for name, us in rows]
            del sets
    finally:
        decode._SPLIT_BELOW_CTAS_PER_SM, decode._CTAS_PER_SM_TARGET, decode._SPLIT_CTAS_PER_SM = saved
        decode._PLANS.__dict__.pop("plans", None)
    return table


GQA_SPLIT_CASES = {3: (1, 2, 3, 4, 6), 5: (3, 6, 9), 6: (24, 33, 41, 45, 55, 66, 98, 147), 11: (2, 3, 4, 6),
                   12: (2, 3)}  # case -> partitions
#: Grids of more than one wave with equal lengths (the H200 holds 396 CTAs of these): probe-only cases, their seeds
#: those of indices past bench_decode's.
GQA_WAVE_CASES = ((bd.Case(64, 32, 8, 128, 4096), (2, 3, 4)), (bd.Case(128, 32, 8, 128, 2048), (2, 3)))
#: Grids of less than one wave that the one-wave rule leaves unsplit, one or two CTAs on each SM where three fit (224
#: to 352 CTAs of 8 rows), at equal lengths and shorter ones (where a split's reduction weighs more): probe-only cases
#: too, indexed after GQA_WAVE_CASES.
GQA_SUBWAVE_CASES = (*((bd.Case(b, 32, 8, 128, 8192), (2, 3, 4, 6)) for b in (28, 36, 40, 44)),
                     (bd.Case(32, 32, 8, 128, 2048), (2, 3, 4)), (bd.Case(32, 32, 8, 128, 4096), (2, 3, 4)))


def gqa_split(args: argparse.Namespace, timer: bd.Timer) -> list[tuple[str, str, float]]:
    from cupy_paged_attn import decode

    saved = decode.split_keys

    def forced(parts: int) -> Callable[..., tuple[int, int]]:
        def split_keys(ctas: int, max_len: int, num_sms: int, tile: int,
                       resident: int | None = None) -> tuple[int, int]:
            return decode.partitions(max_len, parts, tile)
        return split_keys

    table = []
    try:
        extra = {len(bd.CASES) + i: case_parts for i, case_parts in enumerate(GQA_WAVE_CASES + GQA_SUBWAVE_CASES)}
        todo = [(i, None, parts) for i, parts in GQA_SPLIT_CASES.items()]
        todo += [(i, case, parts) for i, (case, parts) in extra.items()]
        for index, extra_case, part_counts in todo:
            if args.gqa_cases is not None and index not in args.gqa_cases:
                continue
            case, sets = build(index, args, extra_case)
            for parts in (0, *part_counts):
                decode.split_keys = saved if parts == 0 else forced(parts)
                decode._PLANS.__dict__.pop("plans", None)  # plans are keyed by shapes, not by the split
                rows = ours_rows(timer, case, sets, {"none": lambda s: None, "dense": lambda s: s.bias})
                plan = next(iter(decode._PLANS.plans.values()))
                label = (f"{plan.launch.num_parts} parts, {plan.launch.grid[0] * plan.launch.grid[2]} CTAs"
                         + (" (the plan's own)" if parts == 0 else ""))
                table += [(case.name, f"{name:5s} {label}", us) for name, us in rows]
            del sets
    finally:
        decode.split_keys = saved
        decode._PLANS.__dict__.pop("plans", None)
    return table


#: read-floor's cases (bench_decode's indices): the grouped-query ones of the FlexAttention target, and MHA ones whose
#: kernels are memory-bound, to calibrate how near a decode kernel comes to the read floor.
READ_FLOOR_CASES = (0, 1, 3, 5, 6, 7, 11, 12)
READ_FLOOR_PARTS = (1, 2, 4, 8, 16, 32, 64)  # partitions of each (sequence, KV head) tried; the fastest is the floor
STREAM_THREADS = 256
STREAM_MAX_CHUNK = 32768  # keys of one partition whose page ids fit probe_stream's shared memory


def stream_rows(timer: bd.Timer, module: Any, case: bd.Case, sets: list[bd.InputSet]) -> list[tuple[str, str, float]]:
    """probe_stream over ``case`` with each partition count of :data:`READ_FLOOR_PARTS`, without and with the dense
    bias's rows: (bias kind, row, µs per call)."""
    import cupy
    import torch

    if case.itemsize != 2:
        raise ValueError(f"probe_stream reads 16-bit caches and biases; {case.name} is {case.dtype}")
    nvec = case.head_size * case.itemsize // 16
    kernel = module.get_function(f"probe_stream{nvec}")
    ptr = cupy.uint64
    rows = []
    for parts in READ_FLOOR_PARTS:
        keys = -(-case.max_len // parts)
        chunk = -(-keys // bd.BLOCK_SIZE) * bd.BLOCK_SIZE  # whole pages
        if chunk > STREAM_MAX_CHUNK or (parts > 1 and chunk < 256):
            continue
        ctas = case.batch * parts * case.num_kv_heads
        partials = [torch.empty(ctas * STREAM_THREADS, device="cuda") for _ in sets]
        for kind in ("none", "dense"):
            row_vecs = case.max_len * case.itemsize // 16 if kind == "dense" else 0

            def read(i: int, row_vecs: int = row_vecs, chunk: int = chunk, parts: int = parts,
                     ctas: int = ctas, partials: list[Any] = partials) -> None:
                s = sets[i]
                with cupy_on_torch_stream():
                    kernel((ctas,), (STREAM_THREADS,), (
                        ptr(s.key_cache.data_ptr()), ptr(s.value_cache.data_ptr()), ptr(s.block_tables.data_ptr()),
                        ptr(s.seq_lens.data_ptr()), ptr(s.bias.data_ptr()), ptr(partials[i].data_ptr()),
                        cupy.int32(case.num_kv_heads), cupy.int32(case.num_heads // case.num_kv_heads),
                        cupy.int32(case.blocks_per_seq), cupy.int32(chunk), cupy.int32(parts),
                        cupy.int64(bd.BLOCK_SIZE * case.num_kv_heads * nvec), cupy.int32(row_vecs)))

            calls = [functools.partial(read, i) for i in range(len(sets))]
            rows.append((kind, f"stream {kind} {parts} parts, {ctas} CTAs", time_sets(timer, calls, partials)))
    return rows


def bandwidth_label(case: bd.Case, seq_lens: list[int], copy_bps: float, name: str, kind: str, us: float) -> str:
    """``name`` with the floor bytes of ``case`` with bias ``kind`` over ``us``: in TB/s and in % of the copy."""
    bps = bd.floor_bytes(case, seq_lens, kind) / (us * 1e-6)
    return f"{name} ({bps / 1e12:.2f} TB/s, {100 * bps / copy_bps:.1f} % of copy)"


def read_floor(args: argparse.Namespace, timer: bd.Timer) -> list[tuple[str, str, float]]:
    """Each case's read floor (probe_stream's fastest partitioning) beside our decode, without and with the dense
    bias; each row's label gives its bandwidth (bench_decode's floor bytes over its time) and its share of the copy
    bandwidth measured first; the last rows per case give ours over the floor."""
    import cupy

    copy_bps = bd.measure_copy_bandwidth(timer)["bytes_per_s"]
    print(f"read-floor   copy bandwidth {copy_bps / 1e12:.3f} TB/s", flush=True)
    module = cupy.RawModule(code=PROBE_SOURCE, options=("-std=c++17",))
    table = []
    for index in args.floor_cases:
        case, sets = build(index, args)
        seq_lens = sets[0].seq_lens.tolist()
        ours = ours_rows(timer, case, sets, {"none": lambda s: None, "dense": lambda s: s.bias})
        streams = stream_rows(timer, module, case, sets)
        floor_us = {kind: min(us for k, _, us in streams if k == kind) for kind, _ in ours}
        rate = functools.partial(bandwidth_label, case, seq_lens, copy_bps)
        table += [(case.name, rate(name, kind, us), us) for kind, name, us in streams]
        table += [(case.name, rate(f"ours {kind}", kind, us) + f" {us / floor_us[kind]:.3f}x floor", us)
                  for kind, us in ours]
        del sets
    return table


def launch_async(kernel: Any, case: bd.Case, s: bd.InputSet, out: Any, chunk: int, parts: int, ctas: int) -> None:
    """One probe_async16 launch over input set ``s``, on torch's current stream."""
    import cupy

    ptr = cupy.uint64
    with cupy_on_torch_stream():
        kernel((ctas,), (STREAM_THREADS,), (
            ptr(s.key_cache.data_ptr()), ptr(s.value_cache.data_ptr()), ptr(s.block_tables.data_ptr()),
            ptr(s.seq_lens.data_ptr()), ptr(out.data_ptr()), cupy.int32(case.num_kv_heads),
            cupy.int32(case.blocks_per_seq), cupy.int32(chunk), cupy.int32(parts),
            cupy.int64(bd.BLOCK_SIZE * case.num_kv_heads * 16)))


ASYNC_FORMS = {0: "cp.async.cg, src-size", 1: "cp.async.cg", 2: "cp.async.ca", 3: "as 0, rows of 17 vectors",
               4: "as 0, swizzled rows of 16"}


def cp_async(args: argparse.Namespace, timer: bd.Timer) -> list[tuple[str, str, float]]:
    """probe_stream's K/V reads without a bias (16-byte loads, head size 128) beside probe_async's three forms of
    the same reads by cp.async, with 1 and 2 partitions per (sequence, KV head)."""
    import cupy
    import torch

    module = cupy.RawModule(code=PROBE_SOURCE, options=("-std=c++17",))
    table = []
    for index in args.floor_cases:
        case, sets = build(index, args)
        if case.head_size * case.itemsize != 256:
            raise ValueError(f"probe_async16 reads rows of 16 vectors; {case.name} has other rows")
        table += [(case.name, name, us) for kind, name, us in stream_rows(timer, module, case, sets)
                  if kind == "none" and int(name.split()[2]) <= 2]
        for parts in (1, 2):
            chunk = -(-case.max_len // parts // bd.BLOCK_SIZE) * bd.BLOCK_SIZE
            ctas = case.batch * parts * case.num_kv_heads
            partials = [torch.empty(ctas * STREAM_THREADS, device="cuda") for _ in sets]
            for mode, form in ASYNC_FORMS.items():
                kernel = module.get_function(f"probe_async16_{mode}")
                calls = [functools.partial(launch_async, kernel, case, s, out, chunk, parts, ctas)
                         for s, out in zip(sets, partials, strict=True)]
                us = time_sets(timer, calls, partials)
                table.append((case.name, f"async {form} {parts} parts, {ctas} CTAs", us))
        del sets
    return table


#: cluster's cases: split grids of the FP32 kernel in at most 8 partitions, 64 to 512 CTAs (probe-only, their seeds
#: past bench_decode's).
CLUSTER_CASES = (bd.Case(1, 16, 16, 64, 1024), bd.Case(1, 16, 16, 64, 512), bd.Case(1, 16, 16, 128, 1024),
                 bd.Case(1, 32, 32, 64, 1024), bd.Case(2, 16, 16, 64, 1024), bd.Case(3, 16, 16, 64, 1024),
                 bd.Case(4, 16, 16, 64, 1024))


def max_active_clusters(plan: Any) -> int:
    """``cuOccupancyMaxActiveClusters`` of a cluster-combined plan's attention launch (a negative driver status on
    failure)."""
    import ctypes

    count = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters(
        ctypes.byref(count), ctypes.c_void_p(plan._function), ctypes.byref(plan._attention_launch._config))
    return count.value if status == 0 else -status


def cluster(args: argparse.Namespace, timer: bd.Timer) -> list[tuple[str, str, float]]:
    """CLUSTER_CASES with their partitions combined by the reduction kernel and in clusters, the cluster rule's
    CTAs per SM (``decode._CLUSTER_CTAS_PER_SM``) at 1 and 2."""
    from cupy_paged_attn import decode

    saved = decode.CLUSTER_COMBINE, decode._CLUSTER_CTAS_PER_SM
    table = []
    try:
        for i, extra_case in enumerate(CLUSTER_CASES):
            case, sets = build(100 + i, args, extra_case)
            for combine, per_sm in ((False, 1), (True, 1), (True, 2)):
                decode.CLUSTER_COMBINE, decode._CLUSTER_CTAS_PER_SM = combine, per_sm
                decode._PLANS.__dict__.pop("plans", None)  # plans are keyed by shapes, not by these knobs
                rows = ours_rows(timer, case, sets, {"none": lambda s: None, "dense": lambda s: s.bias,
                                                     "t5": lambda s: s.t5_bias})
                plan = next(iter(decode._PLANS.plans.values()))
                launch = plan.launch
                if launch.cluster and per_sm == 1:
                    print(f"cluster      {case.name}: {max_active_clusters(plan)} clusters of {launch.num_parts} CTAs "
                          f"fit the GPU at once ({launch.grid[0]} in the grid)", flush=True)
                label = (f"{launch.num_parts} parts, {launch.grid[0] * launch.num_parts} CTAs, "
                         + (f"clusters (rule: {per_sm}/SM)" if launch.cluster else f"reduction (rule: {per_sm}/SM)"))
                table += [(case.name, f"{name:5s} {label}", us) for name, us in rows]
            del sets
    finally:
        decode.CLUSTER_COMBINE, decode._CLUSTER_CTAS_PER_SM = saved
        decode._PLANS.__dict__.pop("plans", None)
    return table


PROBES = {"floor": floor, "bias-layout": bias_layout, "split": split, "gqa-split": gqa_split, "read-floor": read_floor,
          "cp-async": cp_async, "cluster": cluster}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probes", nargs="*", default=list(PROBES), choices=list(PROBES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sets", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bias-cases", type=bd.parse_case_indices, default=list(BIAS_CASES))
    parser.add_argument("--floor-cases", type=bd.parse_case_indices, default=list(READ_FLOOR_CASES),
                        help="read-floor: the cases to run, by bench_decode's index")
    parser.add_argument("--gqa-cases", type=lambda text: [int(i) for i in text.split(",")], default=None,
                        help="gqa-split: the cases to run, by index (bench_decode's, then GQA_WAVE_CASES and "
                             "GQA_SUBWAVE_CASES after them)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("decode_probe: no CUDA device; these probes need a GPU", file=sys.stderr)
        return 2
    timer = bd.Timer("auto", args.reps, 10)
    table = []
    for name in args.probes:
        rows = PROBES[name](args, timer)
        table += [(name, *row) for row in rows]
        for row in rows:
            print(f"{name:12s} {row[0]:28s} {row[1]:72s} {row[2]:9.2f} us", flush=True)
    print(f"\n{'probe':12s} {'case':28s} {'row':72s} {'us':>9s}")
    for probe, case, row, us in table:
        print(f"{probe:12s} {case:28s} {row:72s} {us:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
