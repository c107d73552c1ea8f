// Paged prefill on Hopper (sm_90a: H100, H200), float16 / bfloat16, head sizes 64 and 128, no bias or T5's: the
// Hopper tiling of the tensor-core tile (mma_tile.cuh), with wgmma (wgmma.cuh) instead of mma.sync.
//
// 8 warps as two warpgroups of 64 rows (128 rows per CTA). S = Q·Kᵀ with Q and the K tile read by the tensor cores
// from shared memory (128-byte swizzled tiles instead of padded rows), O += P·V with P from registers; the logits,
// masks, bias and softmax are mma_tile.cuh's, on the same fragment layout. Two CTAs per SM (128 registers), one tile
// of copies ahead. At head size 64 a tile's P·V is issued with the next tile's S and runs during that tile's softmax
// (three K/V stages); at 128 it is waited for in its tile (two stages: wgmma_deferred). T5 only through the CTA's
// table (the host sends other T5 problems, and a dense bias, to prefill.cu's mma.sync tiling, which measured faster
// with a dense bias: its bias fragments overflow this tiling's 128 registers).
#include "mma_tile.cuh"
#include "prefill_plan.cuh"
#include "split_k.cuh"

namespace cpa {

template <typename T, int HEAD, KvLayout LAYOUT, typename Bias, bool SCORES>
__global__ void __launch_bounds__(TileLayout<T, HEAD, 0, true, SCORES>::THREADS,
                                  TileLayout<T, HEAD, 0, true, SCORES>::kCtasPerSm)
prefill_wgmma(
    T* __restrict__ out, long long out_stride_t, long long out_stride_h,  // [total_q, num_heads, HEAD]
    float* __restrict__ part_acc,  // [num_parts, total_q, num_heads, HEAD], used when num_parts > 1
    float* __restrict__ part_ml,   // [num_parts, total_q, num_heads, 2] = (m, l) in base 2
    const T* __restrict__ query, long long q_stride_t, long long q_stride_h, int q_vec,  // [total_q, num_heads, HEAD]
    const int* __restrict__ query_start_loc, int total_q,  // [num_seqs + 1]
    const int2* __restrict__ tile_info,                    // [gridDim.x], from prefill_plan
    const T* __restrict__ key_cache, const T* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens, int max_len, int q_limit,
    const void* bias_ptr, const int* bias_index, long long bias_stride_0, long long bias_stride_1,
    long long bias_stride_2, long long bias_stride_3, int bias_dtype, int bias_n, int bias_m,  // BiasArgs
    const float* __restrict__ alibi_slopes,  // [num_heads] or null
    float scale, int group_size, int causal, int tokens_per_part, int num_parts,
    float soft_cap, int window_left) {  // the score options (SCORES): soft_cap 0 none, window_left kNoWindow none
  using L = TileLayout<T, HEAD, 0, true, SCORES>;
  using Cache = PagedCache<T, HEAD, LAYOUT>;
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 0, "the Hopper tiling (wgmma) compiles for sm_90a only");
#endif
  constexpr int TILE_N = L::TILE_N, NR = L::NR, NT_O = L::NT_O, ROWS = L::ROWS, AHEAD = L::AHEAD;
  constexpr int REL_TABLE = L::REL_TABLE;
  constexpr bool kT5 = SameType<Bias, T5Bias>::value;
  static_assert(!Bias::enabled || kT5, "the Hopper tiling takes no bias or T5's");

  extern __shared__ uint4 smem[];
  // Q_s and the stages start on the 128-byte swizzle's period, 1024 bytes.
  uint4* q_s = smem + ((1024u - (smem_addr(smem) & 1023u)) & 1023u) / kVecBytes;  // [ROWS][ROW], swizzled
  uint4* kv_s = q_s + ROWS * L::ROW;                                               // [stage][K, V][TILE_N][ROW]
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

  // T5's table (RelTable): this tiling has no per-logit path (its registers would cost head size 128's budget some
  // 200 bytes of spills), so the host sends it only problems whose table fits (planning.py, t5_table_fits).
  const RelTable rel = rel_table<kT5>(c, bias_n);
  if (kT5 && !rel.used) __trap();  // (unreachable)
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

  // Running state of this thread's rows: m (base 2), l (this thread's share), acc = O (one m tile per warp).
  float m[NR], l[NR];
  start_rows(m, l);
  float acc[1][NT_O][4];
  zero_fragments(acc);

  auto no_extra = [](int, int) {};
  start_tiles(pages, copies, c.num_tiles, c.kstart, no_extra);
  fence_proxy_async();  // Q_s (ordinary stores) is read by wgmma, the async proxy
  __syncthreads();      // Q_s, far_s and rel_s are complete before the warps read them
  const int group = c.warp / (kWarpgroupThreads / kWarpSize);  // this thread's warpgroup
  const float scale2 = scale * kLog2e;
  const bool has_alibi = alibi_slopes != nullptr;

  // The warpgroup's pipeline (FlashAttention-3's). A tile's P·V is issued with the next tile's S = Q·Kᵀ and runs
  // while that tile's softmax computes: P (pa, 16-bit A fragments), the stage of its V (pv_stage) and its rescale of
  // acc (pv_alpha, when pv_rescale) wait in pv_pending for one iteration. acc is waited for, rescaled and handed to
  // the next P·V at the top of an iteration, after the barrier: a wait placed after the softmax's exponentials was
  // hoisted above them by ptxas.
  constexpr int PV_STEPS = TILE_N / 16;
  unsigned pa[PV_STEPS][4];
  bool pv_pending = false, pv_rescale = false;  // (uniform over the warpgroup; over the warp)
  int pv_stage = 0;
  float pv_alpha[NR];
  auto rescale_pending = [&]() {  // acc (complete) times the pending tile's α, when a row's reference moved
    wgmma_wait<0>();
    wgmma_pin(acc[0]);
    if (pv_rescale) {
#pragma unroll
      for (int n = 0; n < NT_O; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][n][e] *= pv_alpha[e / 2];
    }
  };
  auto issue_pv = [&]() {  // O += P·V: V MN-major; keys 16kk ... are 16 rows of 128 bytes (128 vectors) further
    const uint4* v_tile = L::v_vec(kv_s, pv_stage, 0, 0);
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) wgmma_rs<T>(acc[0], pa[kk], wgmma_desc(v_tile + kk * 16 * 8, TILE_N * 128));
  };
  auto run_pv = [&]() {  // the pending P·V (its rescale first), issued and waited for
    rescale_pending();
    wgmma_pin(acc[0]);
    wgmma_fence();
    issue_pv();
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(acc[0]);
  };

  for (int tile = 0; tile < c.num_tiles; ++tile) {
    const int st = tile % L::STAGES;
    const int t0 = c.kstart + tile * TILE_N;
    cp_async_wait<AHEAD - 1>();  // this thread's copies of this tile have landed (the younger groups may not)
    fence_proxy_async();         // ... and are visible to wgmma (the async proxy)
    // Every thread's copies of this tile are visible, and every thread is done with the previous tile, whose stage
    // the copies issued next overwrite. Also: are all keys of it in the cache?
    const bool tile_ok = __syncthreads_and(copies.tile_ok(tile));
    copies.issue_tile(tile + AHEAD, c.num_tiles, c.kstart, no_extra);
    if (tile + AHEAD + 1 < c.num_tiles) pages.load_id(false, t0 + (AHEAD + 1) * TILE_N);

    // Every warpgroup computes every tile (its wgmmas are collective, and ptxas serialises them when it cannot prove
    // a branch around them uniform); keys past a row's end are masked.
    const bool need_mask = !(tile_ok && tile_unmasked<L>(rows, t0));
    // ---- S = Q·Kᵀ: the warpgroup's 64 rows x TILE_N keys, KSTEPS wgmmas from shared memory (Q and K K-major).
    float sacc[1][L::NT_S][4];
    zero_fragments(sacc);
    const uint4* q_group = q_s + group * 64 * 8;  // row 64·group of each 64-column block
    const uint4* k_tile = L::k_vec(kv_s, st, 0, 0);
    if constexpr (L::kPvDefer) rescale_pending();  // (the P·V issued last iteration has landed)
    wgmma_pin(sacc[0]);
    wgmma_pin(acc[0]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < L::KSTEPS; ++kk) {
      const int block = kk / 4, step = (kk % 4) * 2;  // 64-column block, 32-byte step (2 vectors) inside it
      wgmma_ss<T>(sacc[0], wgmma_desc(q_group + block * ROWS * 8 + step, 0),
                  wgmma_desc(k_tile + block * TILE_N * 8 + step, 0), kk > 0);
    }
    wgmma_commit();
    if (pv_pending) issue_pv();  // the previous tile's P·V behind it
    wgmma_commit();              // (an empty group when none)
    wgmma_wait<1>();             // S only: groups complete in order
    wgmma_pin(sacc[0]);

    if (L::kScores && soft_cap > 0.0f) cap_logits<L>(sacc, SoftCap::make(soft_cap, scale2));  // raw products
    if constexpr (!Bias::enabled) {
      scale_logits<L>(sacc, scale2);
    } else if (const int far = far_kind<kT5, TILE_N>(c, t0, bias_n, far_after); far != 0) {
      add_far_constants<L>(sacc, scale2, far_s, far, c);
    } else {
      add_rel_table<L>(sacc, scale2, rel_s, rows, t0, c.key0, c.qc);
    }
    if (has_alibi) add_alibi<L>(sacc, rows, t0, c.key0, c.qc);
    if (need_mask) mask_logits<L>(sacc, rows, window_left, pages, tile, t0, c.key0, c.qc);
    float alpha[NR];
    const bool rescale = online_softmax<L>(sacc, m, l, alpha);
    // A tile that moves no row's reference (α = 1 exactly) leaves acc as it is; done with the tile's P·V.
    pv_rescale = __any_sync(0xffffffffu, rescale);
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) pv_alpha[hf] = alpha[hf];

    // ---- O += P·V: P from registers, V from shared memory MN-major, TILE_N / 16 wgmmas of 64 rows x HEAD columns,
    // issued with the next tile's S (kPvDefer), else here.
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) p_fragment<L, T>(pa[kk], sacc, 0, kk);
    pv_stage = st;
    if constexpr (L::kPvDefer) {
      pv_pending = true;
    } else {
      run_pv();
    }
    // Tile + AHEAD + 1's page offsets (its block ids were loaded at the top of this tile); no one reads that buffer
    // now.
    if (tile + AHEAD + 1 < c.num_tiles) pages.store_page(tile + AHEAD + 1, t0 + (AHEAD + 1) * TILE_N);
  }
  if (pv_pending) run_pv();  // the last tile's P·V
  cp_async_wait<0>();  // no copy may still be writing shared memory when the CTA exits

  quad_sums(l);
  const bool poisoned = copies.cta_poisoned(seq_lens, c.s, c.len);
  write_rows<L, T, HEAD>(out, out_stride_t, out_stride_h, part_acc, part_ml, acc, m, l, rows, c, part, total_q,
                         num_kv_heads, num_parts, poisoned);
}

}  // namespace cpa
