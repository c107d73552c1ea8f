// Hopper warpgroup matrix multiply (wgmma.mma_async, sm_90a only), for float16 and bfloat16 operands with float32
// accumulators: the Hopper tiling of prefill (prefill_wgmma.cu; TileLayout with WG = true).
//
// A warpgroup (4 consecutive warps, 128 threads) computes D (64 x N) += A (64 x 16) · B (16 x N) per instruction.
// Warp w of the group holds rows 16w ... 16w + 15 of D and of a register A, in mma.sync's m16n8k16 fragment layouts
// (mma.cuh): D n tile nt (columns 8nt ...) is d[nt][0..3], so the S accumulator of one tile converts to P's A
// fragments exactly as with mma.sync. Operands in shared memory are named by 64-bit descriptors (PTX ISA, "Matrix
// Descriptor Format"): start address, leading and stride byte offsets (each >> 4, 14 bits), swizzle mode.
//
// Shared-memory layout used here: 128-byte swizzle. A matrix of R rows x C 16-bit columns (C a multiple of 64) is
// stored as C / 64 blocks of [R][64] elements; in a block, row r's 16-byte vector c sits at vector position c ^ (r % 8)
// of the row's 128 bytes (swizzled_vector). Every block starts on a 1024-byte boundary (the swizzle's period, so the
// descriptors' base offset is 0). The same tile then serves as
//   K-major operand (Q as A, K as B of S = Q·Kᵀ): rows = M or N, columns = K; stride byte offset = 1024 (8 rows),
//     leading byte offset unused; the k step of 16 columns inside a block is +32 bytes of start address, the next
//     block is +R·128 bytes;
//   MN-major operand (V as B of O = P·V, "transposed"): rows = K (keys), columns = N (head); stride byte offset =
//     1024 (8 keys), leading byte offset = R·128 (the next 64 columns); the k step of 16 keys is +2048 bytes.
//
// Issue order (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): wgmma_fence() before the first
// wgmma that reads registers written since (the accumulators, A), the wgmmas, wgmma_commit(), wgmma_wait<0>()
// before the accumulators are touched again; wgmma_pin() keeps the compiler from moving accumulator registers across
// those points. Shared memory written by ordinary stores or cp.async is read by wgmma through the async proxy:
// fence_proxy_async() after the writes, before the barrier that publishes them.
//
// Inlined into a kernel's source text by cupy_paged_attn/_compile.py, like every header: CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cpa {

// Vector (16 bytes) position of (row r, vector c) in a 128-byte-swizzled tile of `rows` rows (see above).
__host__ __device__ constexpr int swizzled_vector(int rows, int r, int c) {
  return (c / 8) * rows * 8 + r * 8 + ((c % 8) ^ (r % 8));
}

// Descriptor of a 128-byte-swizzled operand at `p` (shared memory): leading byte offset `lead_bytes`, stride 1024.
__device__ __forceinline__ unsigned long long wgmma_desc(const void* p, unsigned lead_bytes) {
  const unsigned long long start = (static_cast<unsigned>(__cvta_generic_to_shared(p)) & 0x3FFFFu) >> 4;
  const unsigned long long lead = (lead_bytes & 0x3FFFFu) >> 4;
  const unsigned long long stride = 1024u >> 4;
  return start | lead << 16 | stride << 32 | 1ull << 62;  // bits 62-63 = 1: 128-byte swizzle
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int NT>
__device__ __forceinline__ void wgmma_pin(float (&d)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[nt][e])::"memory");
}

template <typename T>
constexpr bool kIsBf16 = false;
template <>
constexpr bool kIsBf16<__nv_bfloat16> = true;

// The accumulator operand lists: N = 64 (8 n tiles, 32 registers) and N = 128 (16 n tiles, 64 registers).
#define CPA_WG_D4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define CPA_WG_OUT64 \
  CPA_WG_D4(0), CPA_WG_D4(1), CPA_WG_D4(2), CPA_WG_D4(3), CPA_WG_D4(4), CPA_WG_D4(5), CPA_WG_D4(6), CPA_WG_D4(7)
#define CPA_WG_OUT128                                                                                              \
  CPA_WG_OUT64, CPA_WG_D4(8), CPA_WG_D4(9), CPA_WG_D4(10), CPA_WG_D4(11), CPA_WG_D4(12), CPA_WG_D4(13),           \
      CPA_WG_D4(14), CPA_WG_D4(15)
#define CPA_WG_REGS64                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define CPA_WG_REGS128                                                                                             \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D = A·B (+ D when accumulate): A and B in shared memory, both K-major (Q and K of S = Q·Kᵀ). NT = N / 8.
// D += A·B: A in registers (P, mma.sync's A fragment of this warp's 16 rows), B in shared memory MN-major (V).
#define CPA_WGMMA_SS(N, TY, REGS, OUTS, A, B, ACC)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ACC ", 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", %" A ", %" B ", p, 1, 1, " \
               "0, 0;\n}\n"                                                                                        \
               : OUTS                                                                                              \
               : "l"(a), "l"(b), "r"(accumulate))
#define CPA_WGMMA_RS(N, TY, REGS, OUTS, A0, A1, A2, A3, B, ACC)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ACC ", 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", {%" A0 ", %" A1 ", %" A2    \
               ", %" A3 "}, %" B ", p, 1, 1, 1;\n}\n"                                                               \
               : OUTS                                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))

template <typename T, int NT>
__device__ __forceinline__ void wgmma_ss(float (&d)[NT][4], unsigned long long a, unsigned long long b,
                                         int accumulate) {
  static_assert(NT == 8 || NT == 16, "N = 64 or 128");
  constexpr bool kHalf = !kIsBf16<T>;
  if constexpr (NT == 8) {
    if constexpr (kHalf) CPA_WGMMA_SS(64, "f16", CPA_WG_REGS64, CPA_WG_OUT64, "32", "33", "34");
    else CPA_WGMMA_SS(64, "bf16", CPA_WG_REGS64, CPA_WG_OUT64, "32", "33", "34");
  } else {
    if constexpr (kHalf) CPA_WGMMA_SS(128, "f16", CPA_WG_REGS128, CPA_WG_OUT128, "64", "65", "66");
    else CPA_WGMMA_SS(128, "bf16", CPA_WG_REGS128, CPA_WG_OUT128, "64", "65", "66");
  }
}

template <typename T, int NT>
__device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const unsigned (&a)[4], unsigned long long b) {
  static_assert(NT == 8 || NT == 16, "N = 64 or 128");
  constexpr bool kHalf = !kIsBf16<T>;
  if constexpr (NT == 8) {
    if constexpr (kHalf) CPA_WGMMA_RS(64, "f16", CPA_WG_REGS64, CPA_WG_OUT64, "32", "33", "34", "35", "36", "37");
    else CPA_WGMMA_RS(64, "bf16", CPA_WG_REGS64, CPA_WG_OUT64, "32", "33", "34", "35", "36", "37");
  } else {
    if constexpr (kHalf) CPA_WGMMA_RS(128, "f16", CPA_WG_REGS128, CPA_WG_OUT128, "64", "65", "66", "67", "68", "69");
    else CPA_WGMMA_RS(128, "bf16", CPA_WG_REGS128, CPA_WG_OUT128, "64", "65", "66", "67", "68", "69");
  }
}

#undef CPA_WGMMA_SS
#undef CPA_WGMMA_RS
#undef CPA_WG_REGS64
#undef CPA_WG_REGS128
#undef CPA_WG_OUT64
#undef CPA_WG_OUT128
#undef CPA_WG_D4

}  // namespace cpa
