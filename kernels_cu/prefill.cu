// Paged prefill / chunked-prefill attention with an additive bias, on every GPU from sm_80: many query tokens per
// sequence, keys and values read through a block table (the math and the tile's pipeline: mma_tile.cuh).
//
//   prefill_mma    float16 / bfloat16 on the tensor cores (mma.sync m16n8k16, float32 accumulators): 4 warps, warp w
//                  owning packed rows 32w ... 32w + 31 (16 rows for head sizes over 128), two CTAs per SM, two K/V
//                  stages. On an H100 / H200 the Hopper tiling (prefill_wgmma.cu) takes head sizes 64 and 128.
//   prefill_simt   float32 (or any T) with FMAs: correct, not fast (no TF32, whose rounding would miss the 2e-5
//                  tolerance).
// Both take their tiles from prefill_plan (prefill_plan.cuh); a split grid's partitions are combined by tile_combine
// (split_k.cuh).
#include "mma_tile.cuh"
#include "prefill_plan.cuh"
#include "split_k.cuh"

namespace cpa {

constexpr int kSimtThreads = 128;   // 4 warps
constexpr int kSimtRowsPerCta = 64;  // packed (token, head) rows of a SIMT (float32) CTA

// ---------------------------------------------------------------------------------------------------------------
// The mma.sync tiling. Template parameters: T (__half / __nv_bfloat16), HEAD, cache LAYOUT, Bias = NoBias, DenseBias
// or T5Bias (bias.cuh). Run-time: page size (block_shift), causal, sliding window, soft-cap, ALiBi, bias dtype, split.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD, KvLayout LAYOUT, typename Bias, bool SCORES>
__global__ void __launch_bounds__(TileLayout<T, HEAD, 0, false, SCORES>::THREADS,
                                  TileLayout<T, HEAD, 0, false, SCORES>::kCtasPerSm) prefill_mma(
    T* __restrict__ out, long long out_stride_t, long long out_stride_h,  // [total_q, num_heads, HEAD]
    float* __restrict__ part_acc,  // [num_parts, total_q, num_heads, HEAD], used when num_parts > 1
    float* __restrict__ part_ml,   // [num_parts, total_q, num_heads, 2] = (m, l) in base 2
    const T* __restrict__ query, long long q_stride_t, long long q_stride_h, int q_vec,  // [total_q, num_heads, HEAD]
    const int* __restrict__ query_start_loc, int total_q,  // [num_seqs + 1]
    const int2* __restrict__ tile_info,                    // [gridDim.x], from prefill_plan
    const T* __restrict__ key_cache, const T* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens, int max_len, int q_limit,           // q_limit: rows a dense bias holds
    const void* bias_ptr, const int* bias_index, long long bias_stride_0, long long bias_stride_1,
    long long bias_stride_2, long long bias_stride_3, int bias_dtype, int bias_n, int bias_m,  // BiasArgs
    const float* __restrict__ alibi_slopes,  // [num_heads] or null
    float scale, int group_size, int causal, int tokens_per_part, int num_parts,
    float soft_cap, int window_left) {  // the score options (SCORES): soft_cap 0 none, window_left kNoWindow none
  using L = TileLayout<T, HEAD, 0, false, SCORES>;
  using Cache = PagedCache<T, HEAD, LAYOUT>;
  constexpr int TILE_N = L::TILE_N, MT = L::MT, NR = L::NR, ROWS = L::ROWS, AHEAD = L::AHEAD;
  constexpr int REL_TABLE = L::REL_TABLE;
  constexpr bool kT5 = SameType<Bias, T5Bias>::value;
  constexpr bool kBiasLoads = Bias::enabled && !kT5;  // dense: strided rows, loaded as each tile starts

  extern __shared__ uint4 smem[];
  uint4* q_s = smem;                                    // [ROWS][ROW]
  uint4* kv_s = q_s + ROWS * L::ROW;                    // [stage][K, V][TILE_N][ROW]
  long long* page_s = reinterpret_cast<long long*>(kv_s + L::STAGES * 2 * TILE_N * L::ROW);  // [PAGE_BUFFERS][TILE_N]
  float* rel_s = reinterpret_cast<float*>(page_s + L::PAGE_BUFFERS * TILE_N);              // [REL_TABLE]
  float* far_s = rel_s + REL_TABLE;                                                        // [2][ROWS]

  const CtaRows cta = cta_rows(tile_info, query_start_loc, total_q, group_size, num_kv_heads, ROWS);
  const int part = blockIdx.z;
  if (cta.s < 0) return;  // a spare tile of the host-sized grid (uniform over the CTA: no barrier is skipped)
  TileCta<L> c;
  c.place(cta, cta.s, group_size);
  const Bias bias = Bias::make(BiasArgs{bias_ptr, bias_index, {bias_stride_0, bias_stride_1, bias_stride_2,
                                        bias_stride_3}, bias_dtype, bias_n, bias_m});
  const typename Bias::Seq seq_bias = bias.seq(c.s);
  c.keys(cta, seq_bias.limit(clamped_len(seq_lens, c.s, max_len)), part, tokens_per_part, num_parts,
         false, window_left);
  c.span(causal);

  const RelTable rel = rel_table<kT5>(c, bias_n);  // T5 through one table for the whole CTA, where it fits
  const TileRows<NR> rows = tile_rows(c, q_limit, causal, window_left, rel, alibi_slopes);
  const int far_after = bias_m > 0 ? bias_n : 0;
  fill_far<kT5>(c, rows, bias, seq_bias, far_s, bias_n, far_after);

  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const int* table = block_tables + c.s * block_table_stride;
  const int block_mask = (1 << block_shift) - 1;
  load_q_tile(q_s, query, q_stride_t, q_stride_h, q_vec, c);
  if (rel.used) fill_rel_table<L>(rel_s, bias, seq_bias, c, rel);
  TilePages<L, Cache> pages{page_s, table, table, 0, c.tid, c.loop_end, block_shift, block_mask, num_blocks,
                            c.kvh, cache_block_stride, cache};
  TileCopies<L, Cache> copies{kv_s, page_s, nullptr, nullptr, cache, c.tid, c.kvh, block_mask, cache_block_stride};
  copies.point_at(key_cache, value_cache);

  // Running state of this thread's rows: m (base 2), l (this thread's share), acc = O (MT x NT_O C fragments).
  float m[NR], l[NR];
  start_rows(m, l);
  float acc[MT][L::NT_O][4];
  zero_fragments(acc);
  // A dense bias: its bits of a tile's logits are loaded as the tile starts, to travel during its S = Q·Kᵀ.
  typename Bias::Seq::Row bias_rows[NR];
  if constexpr (kBiasLoads) {
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) bias_rows[hf] = seq_bias.row(rows.h[hf], rows.i[hf], rows.p[hf]);
  }

  auto no_extra = [](int, int) {};
  start_tiles(pages, copies, c.num_tiles, c.kstart, no_extra);
  __syncthreads();  // Q_s, far_s and rel_s are complete before the warps read them

  unsigned qa[L::kQInRegs ? L::KSTEPS : 1][4];  // Q's A fragments, where they stay in registers
  if constexpr (L::kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < L::KSTEPS; ++kk)
      ldmatrix_x4(qa[kk], &q_s[(c.row_warp * L::ROWS_W + c.lane % 16) * L::ROW + 2 * kk + c.lane / 16]);
  }
  const float scale2 = scale * kLog2e;
  const bool has_alibi = alibi_slopes != nullptr;

  for (int tile = 0; tile < c.num_tiles; ++tile) {
    const int st = tile % L::STAGES;
    const int t0 = c.kstart + tile * TILE_N;
    cp_async_wait<AHEAD - 1>();  // this thread's copies of this tile have landed (the younger groups may not)
    // Every thread's copies of this tile are visible, and every thread is done with the previous tile, whose stage
    // the copies issued next overwrite. Also: are all keys of it in the cache?
    const bool tile_ok = __syncthreads_and(copies.tile_ok(tile));
    copies.issue_tile(tile + AHEAD, c.num_tiles, c.kstart, no_extra);
    if (tile + AHEAD + 1 < c.num_tiles) pages.load_id(false, t0 + (AHEAD + 1) * TILE_N);

    if (t0 + c.key0 < rows.warp_end) {  // (uniform over the warp: under a causal mask the last tiles of the CTA's
                                        // diagonal hold no key of its first warps)
      const bool need_mask = !(tile_ok && tile_unmasked<L>(rows, t0));
      BiasFrag<L, Bias> braw;
      if constexpr (kBiasLoads) load_bias_fragment<L, Bias>(braw, bias_rows, rows, t0, c.key0, c.qc, c.kstart);
      float sacc[MT][L::NT_S][4];
      zero_fragments(sacc);
      qk_mma<L, T>(sacc, qa, q_s, kv_s, st, c.row_warp, c.key0, c.lane);
      if (L::kScores && soft_cap > 0.0f) cap_logits<L>(sacc, SoftCap::make(soft_cap, scale2));  // raw products
      if constexpr (!Bias::enabled) {
        scale_logits<L>(sacc, scale2);
      } else if (const int far = far_kind<kT5, TILE_N>(c, t0, bias_n, far_after); far != 0) {
        add_far_constants<L>(sacc, scale2, far_s, far, c);
      } else if (rel.used) {
        add_rel_table<L>(sacc, scale2, rel_s, rows, t0, c.key0, c.qc);
      } else {
        add_bias_bits<L>(sacc, scale2, bias, seq_bias, braw, rows, t0, c.key0, c.qc);
      }
      if (has_alibi) add_alibi<L>(sacc, rows, t0, c.key0, c.qc);
      if (need_mask) mask_logits<L>(sacc, rows, window_left, pages, tile, t0, c.key0, c.qc);
      float alpha[NR];
      const bool rescale = online_softmax<L>(sacc, m, l, alpha);
      // A tile that moves no row's reference (α = 1 exactly) leaves acc as it is: one vote replaces the MT·NT_O·4
      // multiplications of the rescale.
      if (__any_sync(0xffffffffu, rescale)) rescale_rows<L>(acc, alpha);
      pv_mma<L, T>(acc, sacc, kv_s, st, c.key0, c.lane);
    }
    // Tile + AHEAD + 1's page offsets (its block ids were loaded at the top of this tile); no one reads that buffer
    // now.
    if (tile + AHEAD + 1 < c.num_tiles) pages.store_page(tile + AHEAD + 1, t0 + (AHEAD + 1) * TILE_N);
  }
  cp_async_wait<0>();  // no copy may still be writing shared memory when the CTA exits

  quad_sums(l);
  const bool poisoned = copies.cta_poisoned(seq_lens, c.s, c.len);
  write_rows<L, T, HEAD>(out, out_stride_t, out_stride_h, part_acc, part_ml, acc, m, l, rows, c, part, total_q,
                         num_kv_heads, num_parts, poisoned);
}

// ---------------------------------------------------------------------------------------------------------------
// The SIMT kernel (float32, or any T): the same grid, rows and outputs as prefill_mma, computed with FMAs. Each
// warp takes packed rows warp, warp + 4, ...; per row, keys 32 at a time (lane = key) for the logits, then lanes
// over head_size for P·V. Reads K/V straight from the cache (L1/L2), once per row: a correctness path.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD, KvLayout LAYOUT, typename Bias, bool SCORES>
__global__ void __launch_bounds__(kSimtThreads) prefill_simt(
    T* __restrict__ out, long long out_stride_t, long long out_stride_h,
    float* __restrict__ part_acc, float* __restrict__ part_ml,
    const T* __restrict__ query, long long q_stride_t, long long q_stride_h, int q_vec,
    const int* __restrict__ query_start_loc, int total_q, const int2* __restrict__ tile_info,
    const T* __restrict__ key_cache, const T* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride,
    const int* __restrict__ seq_lens, int max_len, int q_limit,
    const void* bias_ptr, const int* bias_index, long long bias_stride_0, long long bias_stride_1,
    long long bias_stride_2, long long bias_stride_3, int bias_dtype, int bias_n, int bias_m,
    const float* __restrict__ alibi_slopes,
    float scale, int group_size, int causal, int tokens_per_part, int num_parts,
    float soft_cap, int window_left) {  // the score options (SCORES): soft_cap 0 none, window_left kNoWindow none
  using Cache = PagedCache<T, HEAD, LAYOUT>;
  constexpr int DPL = (HEAD + kWarpSize - 1) / kWarpSize;  // head_size elements per lane
  constexpr int VEC = Cache::VEC;

  const CtaRows cta = cta_rows(tile_info, query_start_loc, total_q, group_size, num_kv_heads, kSimtRowsPerCta);
  const int s = cta.s;
  if (s < 0) return;
  const int m0 = cta.tile * kSimtRowsPerCta;
  const int kvh = cta.kvh;
  const int part = blockIdx.z;
  const int G = group_size;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  const Bias bias = Bias::make(BiasArgs{bias_ptr, bias_index, {bias_stride_0, bias_stride_1, bias_stride_2,
                                        bias_stride_3}, bias_dtype, bias_n, bias_m});
  const typename Bias::Seq seq_bias = bias.seq(s);
  const int q0 = cta.q0, q_len = cta.q_len;
  const int len = seq_bias.limit(clamped_len(seq_lens, s, max_len));
  const int pos0 = len - q_len;
  // With a sliding window, the keys from the first key of the CTA's first row on (as TileCta::keys).
  const int first = SCORES ? max(0, pos0 + m0 / G - window_left) : 0;
  const int kstart = first + part * tokens_per_part;
  const int kend = min(SCORES && part == num_parts - 1 ? len : kstart + tokens_per_part, len);
  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const int* table = block_tables + s * block_table_stride;
  const int block_mask = (1 << block_shift) - 1;
  const bool broken = out_of_contract(seq_lens, s, len);  // (paged_cache.cuh: the rows are then NaN)

  for (int r = warp; r < kSimtRowsPerCta; r += kSimtThreads / kWarpSize) {
    const int R = m0 + r;
    if (R >= q_len * G) break;
    const int i = R / G;
    const int h = kvh * G + R % G;
    const int p = pos0 + i;
    const int row_end = i >= q_limit ? kstart : causal ? min(kend, p + 1) : kend;
    const int row_begin = SCORES ? max(kstart, p - window_left) : kstart;
    const float slope = alibi_slopes != nullptr ? alibi_slopes[h] : 0.0f;
    const T* qp = query + static_cast<long long>(q0 + i) * q_stride_t + static_cast<long long>(h) * q_stride_h;
    float q[DPL];
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      q[k] = lane + k * kWarpSize < HEAD ? scale * to_float(qp[lane + k * kWarpSize]) : 0.0f;
    }

    // m = running max, l = running Σ exp(x − m), acc = running Σ exp(x − m)·v (lane holds columns lane + 32k).
    float m = -inf(), l = 0.0f;
    bool missing = false;  // a key of the row lies in a page outside the cache
    float acc[DPL];
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] = 0.0f;
    for (int j0 = row_begin; j0 < row_end; j0 += kWarpSize) {
      // Logit of key j0 + lane, its dot product computed by the whole warp for each key in turn.
      float my_x = -inf();
      long long my_blk = -1;
      for (int t = 0; t < kWarpSize && j0 + t < row_end; ++t) {
        const int j = j0 + t;
        const long long blk = table[j >> block_shift];
        if (blk < 0 || blk >= num_blocks) {  // the same for every lane: left out, and the row poisoned
          missing = true;
          continue;
        }
        const int off = j & block_mask;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const int d = lane + k * kWarpSize;
          if (d < HEAD) dot += q[k] * to_float(cache.key_vec(blk, off, kvh, d / VEC)[d % VEC]);
        }
        dot = group_sum<kWarpSize>(dot);
        if (SCORES && soft_cap > 0.0f) dot = soft_cap * tanhf(dot / soft_cap);  // natural units here
        if (lane == t) {
          my_blk = blk;
          my_x = dot + slope * static_cast<float>(j - p);
          if constexpr (Bias::enabled) my_x += bias.value(seq_bias.load(h, i, p, j));
        }
      }
      float mx = my_x;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m, mx);
      const float m_use = m_new == -inf() ? 0.0f : m_new;
      const float alpha = __expf(m - m_use);
      const float my_p = __expf(my_x - m_use);
      m = m_new;
      l = l * alpha + group_sum<kWarpSize>(my_p);
#pragma unroll
      for (int k = 0; k < DPL; ++k) acc[k] *= alpha;
      for (int t = 0; t < kWarpSize && j0 + t < row_end; ++t) {
        const float pt = __shfl_sync(0xffffffffu, my_p, t);
        const long long blk = __shfl_sync(0xffffffffu, my_blk, t);
        if (pt == 0.0f || blk < 0) continue;  // the same for every lane
        const int off = (j0 + t) & block_mask;
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const int d = lane + k * kWarpSize;
          if (d < HEAD) acc[k] += pt * to_float(cache.value_elem(blk, off, kvh, d));
        }
      }
    }
    l = poisoned_sum(l, broken || missing);
    if (num_parts == 1) {
      const float inv = inv_sum(l);
      T* o = out + static_cast<long long>(q0 + i) * out_stride_t + h * out_stride_h;
#pragma unroll
      for (int k = 0; k < DPL; ++k)
        if (lane + k * kWarpSize < HEAD) o[lane + k * kWarpSize] = from_float<T>(acc[k] * inv);
    } else {
      // Stored in base 2 like the tensor-core kernels', for the shared combine (tile_combine).
      const long long at = (static_cast<long long>(part) * total_q + q0 + i) * (num_kv_heads * G) + h;
#pragma unroll
      for (int k = 0; k < DPL; ++k)
        if (lane + k * kWarpSize < HEAD) part_acc[at * HEAD + lane + k * kWarpSize] = acc[k];
      if (lane == 0) {
        part_ml[at * 2] = m * kLog2e;
        part_ml[at * 2 + 1] = l;
      }
    }
  }
}

}  // namespace cpa
