// Tensor-core helpers (sm_80+, inline PTX): ldmatrix from shared memory and mma.sync m16n8k16 with float32
// accumulators, for float16 and bfloat16 operands.
//
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col (PTX ISA, "Matrix fragments for mma.m16n8k16"), for lane
// l, with r = l / 4 and c = l % 4:
//   A (16 x 16, row-major), 4 registers of 2 elements: a0 = (r, 2c..2c+1), a1 = (r + 8, 2c..), a2 = (r, 2c + 8..),
//                                                       a3 = (r + 8, 2c + 8..)
//   B (16 x 8, "col": k pairs),  2 registers:            b0 = (k 2c..2c+1, n r), b1 = (k 2c + 8.., n r)
//   C (16 x 8, float32),         4 registers:            c0, c1 = (r, 2c..2c+1), c2, c3 = (r + 8, 2c..2c+1)
//
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit elements; lane l gives the shared-memory address of row l % 8 of
// matrix l / 8 (16 bytes each, 16-byte aligned). Without .trans lane l receives row r, elements 2c, 2c + 1 of each
// matrix; with .trans it receives column r, rows 2c, 2c + 1.
//
// Inlined into a kernel's source text by cupy_paged_attn/_compile.py, like every header: CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cpa {

// Zero accumulators of MT x NT mma tiles (4 float32 of C each).
template <int MT, int NT>
__device__ __forceinline__ void zero_fragments(float (&c)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[mt][nt][e] = 0.0f;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// ldmatrix.x2: matrices 0 and 1, addressed by lanes 0 ... 15 (the others' addresses are not read).
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// d = a · b + d: A 16 x 16, B 16 x 8, C and D float32 16 x 8.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one register of two 16-bit elements (x in the low half), rounded to nearest.
template <typename T>
__device__ __forceinline__ unsigned pack2(float x, float y);

template <>
__device__ __forceinline__ unsigned pack2<__half>(float x, float y) {
  const __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<const unsigned*>(&h);
}

template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float x, float y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const unsigned*>(&h);
}

}  // namespace cpa
