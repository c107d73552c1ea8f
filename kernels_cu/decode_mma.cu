// Paged decode attention on the tensor cores (mma.sync): the decode tiling of the tensor-core tile (mma_tile.cuh),
// for float16 / bfloat16, head sizes up to 128. Grouped-query problems run here (a KV tile serves the group's query
// heads), and multi-head ones whose grid fills the GPU (planning.py).
//
// One CTA per (sequence, 8 or 16 query heads of a KV group, KV head, partition of the keys): its ROWS rows are the
// query heads of one KV head, one query token each. The 4 warps split each tile's keys, each with its own online
// softmax, and combine their (m, l, acc) once, at the end, as split-K partitions are. O is accumulated transposed,
// Oᵀ += Vᵀ·Pᵀ: the head size is the mma's M and the rows its N (8 per n tile), so a CTA of 8 rows holds half the
// accumulators (and issues half the mmas) of an m16 O; three CTAs per SM where registers allow, three K/V stages
// (TileLayout). Memory-bound: what lies on the path of the loads is what counts here.
//
// Besides the shared tile, this tiling has: the longest-first order of sequences (longest_first.cuh), a balanced
// split of ranked grids, a ring of bias values a few tiles ahead (dense and ragged biases read element by element), a
// bias copied into shared memory with its tile (StagedBias), T5's near table and far constants built from loads
// issued before the first copies, and the warps' combine. A split grid's partitions are combined by tile_combine
// (split_k.cuh).
#include "longest_first.cuh"
#include "mma_tile.cuh"
#include "split_k.cuh"

namespace cpa {

// Tiles of dense / ragged bias values in flight (register arrays, one per slot of the unrolled tile loop).
constexpr int kBiasRing = 3;
// T5: weights and bucket entries one thread loads at the CTA's start (see the kernel).
constexpr int kT5Slots = 2;

// ---------------------------------------------------------------------------------------------------------------
// A bias whose elements of a tile lie side by side travels with its tile: copied by cp.async into stage st of
// bias_stage in the tile's group of copies, as units of 16-byte vectors, each unit from its first element's address
// rounded down to 16 bytes (the bias may sit anywhere: that element is `shift` elements into the unit). Bytes no
// logit reads are zero-filled, never copied, so no copy reads past the bias (a unit starts at most 16 − size bytes
// before an element of it, inside the allocation, which starts on 16 bytes at least):
//  - DenseRowsBias (keys adjacent): a unit per row, its keys t0 ... t0 + TILE_N − 1; zeros from the partition's end
//    key on and for the rows without keys. One vector more than the keys need puts 8 rows' elements of one key in
//    8 bank groups (16-bit elements; float32 ones in 4, a two-way conflict).
//  - RaggedRowsBias (heads adjacent, a key's step a multiple of 16 bytes, so every key has the same shift): a unit
//    per key, the CTA's heads kvh·G + m0 ...; zeros past its last head and from the partition's end key on.
// The element size is the bias dtype's, a run-time argument (unit_vecs(2) or unit_vecs(4) vectors a unit): the
// stages have room for float32 elements where that room leaves the CTAs per SM as they are (kWide), else for 16-bit
// ones only, and planning stages a float32 bias only where kWide (_specs.decode_bias_fits, element_bytes=4).
// ---------------------------------------------------------------------------------------------------------------
template <typename L, typename Bias>
struct StagedBias {
  static constexpr bool kDense = SameType<Bias, DenseRowsBias>::value;
  static constexpr bool kRagged = SameType<Bias, RaggedRowsBias>::value;
  static constexpr bool enabled = kDense || kRagged;
  static constexpr int UNITS = kRagged ? L::TILE_N : L::ROWS;
  // 16-byte vectors of a unit of elements of `size` bytes
  static __host__ __device__ constexpr int unit_vecs(int size) {
    return kRagged ? (size * L::ROWS + kVecBytes - size + kVecBytes - 1) / kVecBytes : L::TILE_N * size / kVecBytes + 1;
  }
  static constexpr int WIDE_STAGE_VECS = UNITS * unit_vecs(4);
  static constexpr bool kWide =
      enabled && L::kCtasPerSm * (L::kSmemBytes + L::STAGES * WIDE_STAGE_VECS * kVecBytes + 1024) <= 227 * 1024;
  static constexpr int STAGE_VECS = kWide ? WIDE_STAGE_VECS : UNITS * unit_vecs(2);  // room of a stage
  static constexpr int SLOTS = (STAGE_VECS + L::THREADS - 1) / L::THREADS;  // vectors per thread
  static constexpr int SMEM_VECS = enabled ? L::STAGES * STAGE_VECS : 1;    // [stage][unit][unit vectors]
};

// This thread's bias bits of one tile from its stage: row hf's key 8nt + e past its first (key0 + 2qc) is element
// staged_at[hf] + (8nt + e)·key_step, an Element each (unsigned: float32, unsigned short: 16-bit).
template <typename L, typename Bias, typename Element>
__device__ __forceinline__ void read_staged(BiasFrag<L, Bias>& braw, const Element* stage,
                                            const int (&staged_at)[L::NR], int key_step) {
#pragma unroll
  for (int hf = 0; hf < L::NR; ++hf)
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) braw[hf / 2][nt][2 * (hf % 2) + e] = stage[staged_at[hf] + (nt * 8 + e) * key_step];
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel. Template parameters: T (__half / __nv_bfloat16), KV (T, or an fp8 format: Fp8Stages), HEAD, cache
// LAYOUT, Bias = NoBias, DenseBias,
// RaggedBias, T5Bias, DenseRowsBias or RaggedRowsBias (bias.cuh), ROWS = 8 or 16. Run-time: page size (block_shift),
// ALiBi, soft-cap, sliding window, bias dtype, split, longest first. The launch passes query_start_loc = tile_info =
// null (one query row per sequence: cta_rows), q_limit 1 and causal 0.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, typename KV, int HEAD, KvLayout LAYOUT, typename Bias, int ROWS, bool SCORES>
__global__ void __launch_bounds__(TileLayout<T, HEAD, ROWS, false, SCORES, IsFp8<KV>::value>::THREADS,
                                  TileLayout<T, HEAD, ROWS, false, SCORES, IsFp8<KV>::value>::kCtasPerSm)
decode_mma(
    T* __restrict__ out, long long out_stride_t, long long out_stride_h,  // [num_seqs, num_heads, HEAD]
    float* __restrict__ part_acc,  // [num_parts, num_seqs, num_heads, HEAD], used when num_parts > 1
    float* __restrict__ part_ml,   // [num_parts, num_seqs, num_heads, 2] = (m, l) in base 2
    const T* __restrict__ query, long long q_stride_t, long long q_stride_h, int q_vec,  // [num_seqs, num_heads, HEAD]
    const int* __restrict__ query_start_loc, int total_q,  // null, num_seqs
    const int2* __restrict__ tile_info,                    // null
    const KV* __restrict__ key_cache, const KV* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens, int max_len, int q_limit,
    const void* bias_ptr, const int* bias_index, long long bias_stride_0, long long bias_stride_1,
    long long bias_stride_2, long long bias_stride_3, int bias_dtype, int bias_n, int bias_m,  // BiasArgs
    const float* __restrict__ alibi_slopes,  // [num_heads] or null
    float scale, int group_size, int causal, int tokens_per_part, int num_parts,
    int longest_first,  // nonzero: the CTAs of row r take the r-th longest sequence (seq_of_rank)
    float soft_cap, int window_left,  // the score options (SCORES): soft_cap 0 none, window_left kNoWindow none
    // fp8 caches: a key element reads as stored·k_scale·k_scales[kvh·k_scale_stride] (k_scales null: 1), a value
    // likewise (the stride 0 for one scale of all heads)
    const float* __restrict__ k_scales, const float* __restrict__ v_scales, int k_scale_stride, int v_scale_stride,
    float k_scale, float v_scale) {
  constexpr bool kFp8 = IsFp8<KV>::value;
  using L = TileLayout<T, HEAD, ROWS, false, SCORES, kFp8>;
  using Cache = PagedCache<KV, HEAD, LAYOUT>;
  using Stages = typename CopyStages<L, KV>::type;
  using Staged = StagedBias<L, Bias>;
  using M = typename MmaElem<T, KV>::type;  // the mmas' elements: T, or float16 over fp8 caches
  constexpr int TILE_N = L::TILE_N, KSTEPS = L::KSTEPS, NT_S = L::NT_S, NR = L::NR, NH = L::NH, EL = L::EL;
  constexpr int STAGES = L::STAGES, AHEAD = L::AHEAD, KEY_WARPS = L::KEY_WARPS;
  constexpr bool kT5 = SameType<Bias, T5Bias>::value;
  // launch_dependents() only in the epilogue (below): at the top it measured 0.5-1 % slower (B1 H32/8 L65536 dense
  // 82.2 -> 82.9 us; B4 L32768 148.3 -> 149.3). A split grid's launch may precede the end of the kernel before it
  // (a programmatic dependent launch): nothing is read before this.
  wait_for_primary();

  extern __shared__ uint4 smem[];
  uint4* q_s = smem;                  // [ROWS][ROW]
  uint4* kv_s = q_s + ROWS * L::ROW;  // [stage][K, V][TILE_N][ROW] (fp8: one stage, then Fp8Stages' stages)
  uint4* f8_s = kv_s + 2 * TILE_N * L::ROW;  // (fp8 caches only)
  long long* page_s = reinterpret_cast<long long*>(kv_s + L::KV_VECS);  // [PAGE_BUFFERS][TILE_N]
  float* far_s = reinterpret_cast<float*>(page_s + L::PAGE_BUFFERS * TILE_N);            // [2][ROWS]

  CtaRows cta = cta_rows(tile_info, query_start_loc, total_q, group_size, num_kv_heads, ROWS);
  int part = blockIdx.z;
  // Where the first tiles' block ids are read (first_ids[i − first_base] is block id i): the block table, or with
  // longest_first and a sequence that is the row's own (a batch already longest first, equal lengths included) the
  // copy of the row's first ids that travelled to shared memory while the CTA ranked.
  const int* first_ids = nullptr;
  int first_base = 0;
  // A ranked split grid (longest_first, num_parts > 1) runs sequence by sequence: the CTA at place i of the issue
  // order (blockIdx.x fastest, then z) takes partition i / per % num_parts of the sequence of rank
  // i / (per · num_parts), per = tiles · num_kv_heads CTAs per partition, and cuts that sequence's own keys into
  // num_parts equal runs of whole tiles (not max_len's tokens_per_part). The work then starts longest first in
  // pieces of about equal size per sequence, where partition by partition each sequence's last pieces came in a
  // later pass than other sequences' first ones (H200, B64 H32/8 d128 L∈[128, 8192], no bias: 306.8 -> 293.4 us).
  bool balanced = false;
  int first_key = 0;
  if (longest_first) {  // the same for every thread of the CTA
    int row = cta.s;
    if (num_parts > 1) {
      const int tiles = (group_size + ROWS - 1) / ROWS;
      const int per = tiles * num_kv_heads;
      const int i = static_cast<int>(blockIdx.z * gridDim.x + blockIdx.x);
      const int in_part = i % per;
      cta.kvh = in_part % num_kv_heads;
      cta.tile = in_part / num_kv_heads;
      row = i / per / num_parts;
      part = i / per % num_parts;
      balanced = true;
    }
    // The ranking's lengths, then the row's first ids, live in the last K/V stage, which no copy writes before the
    // loop's first barrier (the prologue fills stages 0 ... AHEAD − 1).
    int* lens_s = reinterpret_cast<int*>(kv_s + L::LAST_STAGE);
    int* ids_s = lens_s + kMaxLongestFirstSeqs + 4;
    static_assert(STAGES == AHEAD + 1 && (kMaxLongestFirstSeqs + 4 + (AHEAD + 1) * TILE_N) * 4 <=
                                             2 * TILE_N * L::ROW * kVecBytes, "room to rank in the last stage");
    const int* row_ids = block_tables + row * block_table_stride;
    first_key = part * tokens_per_part;  // kstart (below) when the sequence is max_len long
    first_base = first_key >> block_shift;
    const int num_ids = ((min(first_key + (AHEAD + 1) * TILE_N, max_len) - 1) >> block_shift) - first_base + 1;
    copy_row_ids<L::THREADS, (AHEAD + 1) * TILE_N>(row_ids + first_base, num_ids, ids_s);
    cta.s = cta.q0 = seq_of_rank<L::THREADS>(seq_lens, total_q, max_len, row, lens_s, lens_s + kMaxLongestFirstSeqs);
    if (cta.s == row) first_ids = ids_s;
  }
  if (cta.s < 0) return;  // (uniform over the CTA: no barrier is skipped)
  TileCta<L> c;
  c.place(cta, cta.s, group_size);
  const int G = c.G, kvh = c.kvh, tid = c.tid;
  const Bias bias = Bias::make(BiasArgs{bias_ptr, bias_index, {bias_stride_0, bias_stride_1, bias_stride_2,
                                        bias_stride_3}, bias_dtype, bias_n, bias_m});
  const typename Bias::Seq seq_bias = bias.seq(c.s);
  c.keys(cta, seq_bias.limit(clamped_len(seq_lens, c.s, max_len)), part, tokens_per_part, num_parts,
         balanced, window_left);
  if (c.kstart != first_key) first_ids = nullptr;  // (the ids copied start at first_key)
  c.span(causal);
  const TileRows<NR> rows = tile_rows(c, q_limit, causal, window_left, RelTable{}, alibi_slopes);
  const int far_after = bias_m > 0 ? bias_n : 0;

  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const int* table = block_tables + c.s * block_table_stride;
  if (first_ids == nullptr) {  // (the ranked sequence is not the row's own, or no ranking)
    first_ids = table;
    first_base = 0;
  }
  const int block_mask = (1 << block_shift) - 1;

  // ---- T5: every global load before the first copies, none waiting on another. The bias of key j for a row of head
  // h at position p >= j (decode has no key after its query) is h's weight of bucket index[min(p − j, n)]. Each
  // thread loads up to kT5Slots weights of the CTA's heads' columns (entry e = tid + k·THREADS: bucket e % col_per of
  // head kvh·G + e / col_per) and up to kT5Slots entries of index at the start; they go to col_s and idx_s (the end
  // of the last K/V stage, free until the loop's first barrier) once the copies are issued, and after the prologue's
  // barrier the CTA builds near_s [head][distance 0 ... n − 1] (weights, base 2) and far_s from them: a near tile's
  // logit reads one shared float. A chain of two global loads per far constant (fill_far) waited behind the CTA's
  // first copies, and a near tile's chain per logit at the end of every CTA. near_s takes the shared memory that the
  // CTAs per SM leave over (up to 4 KB): at 3 of 4 CTAs of head size 64 the T5 kernel ran 6 % slower. Larger tables
  // (G·n past kNearTable, or n, G·col_per past kT5Slots·THREADS): fill_far and loads per logit.
  constexpr int kSmPerCta = L::kSmemBytes + 1024;  // (the runtime's 1 KB per CTA)
  constexpr int kNearLeft = (kSmemPerSm / (kSmemPerSm / kSmPerCta) - kSmPerCta) / 4 / 32 * 32;  // floats
  constexpr int kNearTable = kNearLeft < 1024 ? kNearLeft : 1024;
  __shared__ float near_s[kT5 && kNearTable > 0 ? kNearTable : 1];
  static_assert(!kT5 || kSmemPerSm / (kSmPerCta + sizeof(near_s)) == kSmemPerSm / kSmPerCta,
                "T5's table costs no CTA per SM");
  static_assert(!kT5 || (kMaxLongestFirstSeqs + 4 + (AHEAD + 1) * TILE_N + 2 * kT5Slots * L::THREADS) * 4 <=
                            2 * TILE_N * L::ROW * kVecBytes,
                "the ranking's lengths and ids and T5's column and index share the last K/V stage");
  const int col_per = kT5 ? (bias_m > 0 ? 2 : 1) * static_cast<int>(bias_stride_2) : 0;  // buckets used
  const bool t5_tables = kT5 && G * col_per <= kT5Slots * L::THREADS && bias_n < kT5Slots * L::THREADS &&
                         G * bias_n <= kNearTable;
  float* col_s = reinterpret_cast<float*>(kv_s + L::LAST_STAGE + 2 * TILE_N * L::ROW) - 2 * kT5Slots * L::THREADS;
  int* idx_s = reinterpret_cast<int*>(col_s + kT5Slots * L::THREADS);
  unsigned col_bits[kT5Slots];
  int near_idx[kT5Slots];
  if constexpr (kT5) {
    if (t5_tables) {
#pragma unroll
      for (int k = 0; k < kT5Slots; ++k) {
        const int e = tid + k * L::THREADS;
        col_bits[k] = e < G * col_per ? seq_bias.near_weight(e % col_per, kvh * G + e / col_per) : 0u;
        near_idx[k] = e <= bias_n ? seq_bias.near_bucket(e) : 0;
      }
    }
  }

  load_q_tile(q_s, query, q_stride_t, q_stride_h, q_vec, c);
  TilePages<L, Cache> pages{page_s, table, first_ids, first_base, tid, c.loop_end, block_shift, block_mask,
                            num_blocks, kvh, cache_block_stride, cache};
  TileCopies<L, Cache, Stages> copies{kFp8 ? f8_s : kv_s, page_s, nullptr, nullptr, cache, tid, kvh, block_mask,
                                      cache_block_stride};
  copies.point_at(key_cache, value_cache);

  // ---- The staged bias (StagedBias): this thread's vectors tid + k·THREADS of each stage, of elements of `size`
  // bytes (a float32 bias only where the stages have room: kWide), unit_vecs vectors a unit, stage_vecs a stage.
  // Ragged: the CTA's heads' elements of key 0 (its rows hold heads kvh·G + m0 ... of one query), the bytes from one
  // key to the next, and the elements of the first vector before them.
  __shared__ uint4 bias_stage[Staged::SMEM_VECS];
  static_assert(!Staged::enabled || L::kCtasPerSm * (L::kSmemBytes + sizeof(bias_stage) + 1024) <= 227 * 1024,
                "the CTAs per SM fit with their bias stages");
  const bool wide = Staged::kWide && bias_dtype == kBiasF32;
  const int size = wide ? 4 : 2;
  const int unit_vecs = Staged::unit_vecs(size);
  const int stage_vecs = Staged::UNITS * unit_vecs;
  const int row_step = Staged::kRagged ? 1 : unit_vecs * kVecBytes / size;  // elements between rows in a stage
  const int key_step = Staged::kRagged ? unit_vecs * kVecBytes / size : 1;  // and between keys
  const char* heads_at = static_cast<const char*>(bias_ptr);
  long long staged_step = size;  // bytes from one key to the next (dense: adjacent elements)
  if constexpr (Staged::kRagged) {
    const typename Bias::Seq::Row heads = seq_bias.row(kvh * G + c.m0, 0, 0);
    heads_at = heads.at(0);
    staged_step = heads.step_bytes();
  }
  const int heads_shift = static_cast<int>(reinterpret_cast<unsigned long long>(heads_at) & 15ull) / size;
  const char* staged_src[Staged::SLOTS];  // this thread's vector tid + k·THREADS of tile 0 ...
  int staged_left[Staged::SLOTS];         // ... dense: its row's bytes from there to the partition's end key;
                                          // ragged: the bytes of it to copy
  int staged_end[Staged::SLOTS];          // ragged: the first tile start t0 whose copy of it is all zeros
  if constexpr (Staged::enabled) {
#pragma unroll
    for (int k = 0; k < Staged::SLOTS; ++k) {
      const int idx = tid + k * L::THREADS;
      const int unit = idx / unit_vecs;
      const int vec = (idx % unit_vecs) * kVecBytes;
      staged_src[k] = static_cast<const char*>(bias_ptr);
      staged_left[k] = 0;
      staged_end[k] = c.kstart;
      if (idx < stage_vecs && Staged::kDense && c.m0 + unit < c.rows_total) {
        const int R = c.m0 + unit;
        const char* first = seq_bias.row(kvh * G + R % G, R / G, c.pos0 + R / G).at(0);
        staged_src[k] = reinterpret_cast<const char*>(reinterpret_cast<unsigned long long>(first) & ~15ull) + vec;
        staged_left[k] = static_cast<int>(first + static_cast<long long>(size) * c.kend - staged_src[k]);
      }
      if (idx < stage_vecs && Staged::kRagged) {
        const int heads_bytes = size * (heads_shift + min(ROWS, c.rows_total - c.m0));
        staged_src[k] = heads_at - size * heads_shift + unit * staged_step + vec;
        staged_left[k] = max(0, min(kVecBytes, heads_bytes - vec));
        staged_end[k] = c.kend - unit;
      }
    }
  }
  auto stage_bias = [&](int st, int t0) {  // tile t0's bias into stage st, in the tile's group of copies
    if constexpr (Staged::enabled) {
#pragma unroll
      for (int k = 0; k < Staged::SLOTS; ++k) {
        const int idx = tid + k * L::THREADS;
        if (idx < stage_vecs) {
          const int bytes = Staged::kDense ? max(0, min(kVecBytes, staged_left[k] - size * t0))
                                           : t0 < staged_end[k] ? staged_left[k] : 0;
          cp_async16(&bias_stage[st * Staged::STAGE_VECS + idx],
                     bytes > 0 ? staged_src[k] + t0 * staged_step : bias_ptr, bytes);
        }
      }
    }
  };

  // ---- Running state of this thread's rows: m (base 2), l (this thread's share), acc = Oᵀ: m tile dm (head
  // columns 16dm ...) and n tile nh (rows 8nh ...) at acc[0][dm·NH + nh], element e is column 16dm + qr + 8(e / 2) of
  // row 8nh + 2qc + (e & 1).
  float m[NR], l[NR];
  start_rows(m, l);
  constexpr int ACC_N = KSTEPS * NH;
  float acc[1][ACC_N][4];
  zero_fragments(acc);

  // ---- A dense or ragged bias read element by element: tiles are short and wait on memory, so the bits of a
  // tile's logits are loaded kBiasRing tiles ahead into a ring of kBiasRing register arrays (the tile loop is unrolled
  // by kBiasRing, so each slot is a compile-time array: no register waits on a load before its tile uses it). T5
  // reads in place (its loads hit L1). A staged bias: where this thread's rows read their keys key0 + 2qc + ... in a
  // stage, in elements (a row without keys takes its stand-in row's shift: any shift keeps its masked reads inside
  // its unit).
  constexpr bool kBiasAhead = Bias::enabled && !kT5 && !Staged::enabled;
  typename Bias::Seq::Row bias_rows[NR];
  if constexpr (kBiasAhead) {
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) bias_rows[hf] = seq_bias.row(rows.h[hf], rows.i[hf], rows.p[hf]);
  }
  int staged_at[NR];
  if constexpr (Staged::enabled) {
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) {
      int shift = heads_shift;
      if constexpr (Staged::kDense) {
        const char* first = seq_bias.row(rows.h[hf], rows.i[hf], rows.p[hf]).at(0);
        shift = static_cast<int>(reinterpret_cast<unsigned long long>(first) & 15ull) / size;
      }
      staged_at[hf] = c.row(hf) * row_step + shift + (c.key0 + 2 * c.qc) * key_step;
    }
  }
  constexpr int RING = kBiasAhead ? kBiasRing : 1;
  BiasFrag<L, Bias> ring[RING];
  if constexpr (kBiasAhead) {
#pragma unroll
    for (int u = 0; u < RING; ++u)
      load_bias_fragment<L, Bias>(ring[u], bias_rows, rows, c.kstart + u * TILE_N, c.key0, c.qc, c.kstart);
  }

  // ---- Prologue: the first tiles' pages and copies, then T5's tables.
  start_tiles(pages, copies, c.num_tiles, c.kstart, stage_bias);
  if constexpr (kT5) {
    if (t5_tables) {
#pragma unroll
      for (int k = 0; k < kT5Slots; ++k) {
        const int e = tid + k * L::THREADS;
        if (e < G * col_per) col_s[e] = bias.value(col_bits[k]) * kLog2e;
        if (e <= bias_n) idx_s[e] = seq_bias.held(near_idx[k]);
      }
    } else {
      fill_far<kT5>(c, rows, bias, seq_bias, far_s, bias_n, far_after);
    }
  }
  __syncthreads();  // Q_s, col_s and idx_s are complete before the warps read them
  if constexpr (kT5) {  // near_s and far_s: visible after the loop's first barrier
    if (t5_tables) {
      for (int e = tid; e < G * bias_n; e += L::THREADS) near_s[e] = col_s[(e / bias_n) * col_per + idx_s[e % bias_n]];
      if (c.qc == 0) {
        const int before = idx_s[bias_n];  // (index[n]: every distance >= n)
        const int after = bias_m > 0 ? bias_m + before : idx_s[0];
#pragma unroll
        for (int hf = 0; hf < NR; ++hf) {
          const float* col = col_s + (rows.h[hf] - kvh * G) * col_per;
          far_s[c.row(hf)] = col[before];
          far_s[ROWS + c.row(hf)] = col[after];
        }
      }
    }
  }

  // Q's A fragments, in registers (rows 8 ... 15 of the m tile are zeros with 8 rows: a1 = a3 = 0).
  unsigned qa[KSTEPS][4];
  if constexpr (ROWS == 8) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      unsigned two[2];
      ldmatrix_x2(two, &q_s[L::kSwizzledRows ? L::q_index(c.lane % 8, 2 * kk + (c.lane / 8) % 2)
                                             : (c.lane % 8) * L::ROW + 2 * kk + (c.lane / 8) % 2]);
      qa[kk][0] = two[0];
      qa[kk][2] = two[1];
      qa[kk][1] = qa[kk][3] = 0u;
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
      ldmatrix_x4(qa[kk], &q_s[L::kSwizzledRows
                                   ? L::q_index(c.row_warp * L::ROWS_W + c.lane % 16, 2 * kk + c.lane / 16)
                                   : (c.row_warp * L::ROWS_W + c.lane % 16) * L::ROW + 2 * kk + c.lane / 16]);
  }
  // With an fp8 cache the key's scale rides on the logits' scale, the value's on the accumulator (after the loop);
  // a bfloat16 query enters the float16 mmas scaled by 2^-e, and the logits' scale takes 2^e.
  float key_mult = 1.0f;
  if constexpr (kFp8) key_mult = kv_scale(k_scale, k_scales, k_scale_stride, kvh, kv_unit<KV>());
  if constexpr (!SameType<M, T>::value) {
    const int e = QToHalf::exponent<L>(q_s, c.lane);
    const float q_mult = QToHalf::pow2(-e);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) qa[kk][i] = QToHalf::convert(qa[kk][i], q_mult);
    key_mult *= QToHalf::pow2(e);
  }
  const float scale2 = scale * kLog2e * key_mult;
  const bool has_alibi = alibi_slopes != nullptr;

  for (int tile0 = 0; tile0 < c.num_tiles; tile0 += RING) {
#pragma unroll
    for (int slot = 0; slot < RING; ++slot) {  // each ring slot is a compile-time register array
      const int tile = tile0 + slot;
      if (tile >= c.num_tiles) break;  // the same for every thread of the CTA
      const int st = tile % STAGES;
      const int t0 = c.kstart + tile * TILE_N;
      cp_async_wait<AHEAD - 1>();  // this thread's copies of this tile have landed (the younger groups may not)
      // Every thread's copies of this tile (and its bias stage, T5's tables) are visible, and every thread is done
      // with the previous tile, whose stage the copies issued next overwrite. Also: are all keys of it in the cache?
      const bool tile_ok = __syncthreads_and(copies.tile_ok(tile));
      copies.issue_tile(tile + AHEAD, c.num_tiles, c.kstart, stage_bias);
      if (tile + AHEAD + 1 < c.num_tiles) pages.load_id(false, t0 + (AHEAD + 1) * TILE_N);
      int kv_st = st;  // the 16-bit stage the mmas read
      if constexpr (kFp8) {
        Fp8Stages<L, KV>::template convert<M>(f8_s, st, kv_s, tid);
        __syncthreads();  // the converted tile is complete before any warp reads it
        kv_st = 0;
      }

      if (t0 + c.key0 < rows.warp_end) {  // (uniform over the warp)
        const bool need_mask = !(tile_ok && tile_unmasked<L>(rows, t0));
        BiasFrag<L, Bias> braw;
        if constexpr (Staged::enabled) {
          const uint4* stage = bias_stage + st * Staged::STAGE_VECS;
          if (wide) {
            read_staged<L, Bias>(braw, reinterpret_cast<const unsigned*>(stage), staged_at, key_step);
          } else {
            read_staged<L, Bias>(braw, reinterpret_cast<const unsigned short*>(stage), staged_at, key_step);
          }
        } else if constexpr (kBiasAhead) {
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < EL; ++e) braw[0][nt][e] = ring[slot][0][nt][e];
          if (tile + RING < c.num_tiles)
            load_bias_fragment<L, Bias>(ring[slot], bias_rows, rows, t0 + RING * TILE_N, c.key0, c.qc, c.kstart);
        }

        // ---- S = Q·Kᵀ: ROWS rows (16 with the zero rows) x the warp's KEYS_W keys.
        float sacc[1][NT_S][4];
        zero_fragments(sacc);
        qk_mma<L, M>(sacc, qa, q_s, kv_s, kv_st, c.row_warp, c.key0, c.lane);

        if (L::kScores && soft_cap > 0.0f) cap_logits<L>(sacc, SoftCap::make(soft_cap, scale2));  // raw products
        if constexpr (!Bias::enabled) {
          scale_logits<L>(sacc, scale2);
        } else if (const int far = far_kind<kT5, TILE_N>(c, t0, bias_n, far_after); far != 0) {
          add_far_constants<L>(sacc, scale2, far_s, far, c);
        } else if (kT5 && t5_tables) {  // T5's near table (keys past the row's query are masked)
          const float* far_row = far_s + c.row(0);
          const float row_far[2] = {far_row[0], EL > 2 ? far_row[8] : 0.0f};
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < EL; ++e) {
              const int hf = e / 2;
              const int d = max(rows.p[hf] - (t0 + c.key0 + nt * 8 + 2 * c.qc + (e & 1)), 0);
              const float b = d < bias_n ? near_s[(rows.h[hf] - kvh * G) * bias_n + d] : row_far[e / 2];
              sacc[0][nt][e] = fmaf(sacc[0][nt][e], scale2, b);
            }
        } else {
          add_bias_bits<L>(sacc, scale2, bias, seq_bias, braw, rows, t0, c.key0, c.qc);
        }
        if (has_alibi) add_alibi<L>(sacc, rows, t0, c.key0, c.qc);
        if (need_mask) mask_logits<L>(sacc, rows, window_left, pages, tile, t0, c.key0, c.qc);
        float alpha[NR];
        const bool rescale = online_softmax<L>(sacc, m, l, alpha);
        // A tile that moves no row's reference (α = 1 exactly) leaves acc as it is. Oᵀ: row 8nh + 2qc + e's α is
        // held by the quad of lanes 4(2qc + e).
        if (__any_sync(0xffffffffu, rescale)) {
          float row_alpha[NH][2];
#pragma unroll
          for (int nh = 0; nh < NH; ++nh)
#pragma unroll
            for (int e = 0; e < 2; ++e) row_alpha[nh][e] = __shfl_sync(0xffffffffu, alpha[nh], 4 * (2 * c.qc + e));
#pragma unroll
          for (int n = 0; n < ACC_N; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[0][n][e] *= row_alpha[n % NH][e & 1];
        }

        // ---- Oᵀ += Vᵀ·Pᵀ: Pᵀ's B fragment of n tile nh (rows 8nh ...) and keys 16kk ... is (c0, c1) or (c2, c3) of
        // S's n tiles 2kk, 2kk + 1 as they are; Vᵀ's A fragments are the V tile read transposed, 16 head columns each.
#pragma unroll
        for (int kk = 0; kk < L::KEYS_W / 16; ++kk) {
          unsigned b[NH][2];
#pragma unroll
          for (int nh = 0; nh < NH; ++nh) {
            b[nh][0] = pack2<M>(sacc[0][2 * kk][2 * nh], sacc[0][2 * kk][2 * nh + 1]);
            b[nh][1] = pack2<M>(sacc[0][2 * kk + 1][2 * nh], sacc[0][2 * kk + 1][2 * nh + 1]);
          }
#pragma unroll
          for (int dm = 0; dm < KSTEPS; ++dm) {
            unsigned a[4];  // columns 16dm + (0..7 | 8..15) x keys 16kk + (0..7 | 8..15), transposed
            ldmatrix_x4_trans(a, L::v_vec(kv_s, kv_st, c.key0 + kk * 16 + (c.lane / 16) * 8 + c.lane % 8,
                                          2 * dm + (c.lane / 8) % 2));
#pragma unroll
            for (int nh = 0; nh < NH; ++nh) mma_16816<M>(acc[0][dm * NH + nh], a, b[nh][0], b[nh][1]);
          }
        }
      }
      // Tile + AHEAD + 1's page offsets (its block ids were loaded at the top of this tile); no one reads that
      // buffer now.
      if (tile + AHEAD + 1 < c.num_tiles) pages.store_page(tile + AHEAD + 1, t0 + (AHEAD + 1) * TILE_N);
    }
  }
  cp_async_wait<0>();  // no copy may still be writing shared memory when the CTA combines in it
  if constexpr (kFp8) {
    const float value_mult = kv_scale(v_scale, v_scales, v_scale_stride, kvh, kv_unit<KV>());
#pragma unroll
    for (int n = 0; n < ACC_N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][n][e] *= value_mult;
  }

  // ---- Epilogue. Every key is read: the split-K combine (a dependent launch) may be set up now, and its CTAs take
  // this grid's places as its CTAs exit, instead of being launched once the grid has ended (they wait for it in the
  // kernel). B1 H32/8 L65536 79.1-79.6 -> 78.1-78.4 us without a bias, 81.1-81.5 -> 80.7-80.8 dense (H200).
  quad_sums(l);
  launch_dependents();
  // The warps hold (m, l, acc) of the same rows over disjoint keys: combine them through the idle K/V stages as
  // split-K partitions are combined:  M = max_w m_w,  c_w = 2^(m_w − M),  L = Σ_w c_w·l_w,  o = Σ_w c_w·acc_w.
  // (Rows of acc_s are HEAD_P + 4 floats apart: a store of Oᵀ, rows 2qc + e x columns qr + ..., hits 32 banks.)
  constexpr int PITCH = L::HEAD_P + 4;
  float* acc_s = reinterpret_cast<float*>(kv_s);   // [KEY_WARPS][ROWS][PITCH]
  float* ml_s = acc_s + KEY_WARPS * ROWS * PITCH;  // [KEY_WARPS][ROWS][2]
  const int kw = c.warp % KEY_WARPS;
  // Every warp is done with the stages (the barrier of cta_poisoned).
  const bool poisoned = copies.cta_poisoned(seq_lens, c.s, c.len);
#pragma unroll
  for (int n = 0; n < ACC_N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 8 * (n % NH) + 2 * c.qc + (e & 1);
      const int d = 16 * (n / NH) + c.qr + 8 * (e / 2);
      acc_s[(kw * ROWS + r) * PITCH + d] = acc[0][n][e];
    }
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {
    const int r = c.row(hf);
    if (c.qc == 0) {
      ml_s[(kw * ROWS + r) * 2] = m[hf];
      ml_s[(kw * ROWS + r) * 2 + 1] = l[hf];
    }
  }
  __syncthreads();  // every warp's share is in shared memory
  const int rows_here = min(c.rows_total - c.m0, ROWS);
  for (int idx = tid; idx < rows_here * HEAD; idx += L::THREADS) {
    const int r = idx / HEAD;
    const int d = idx % HEAD;
    float big_m = -inf();
#pragma unroll
    for (int w = 0; w < KEY_WARPS; ++w) big_m = fmaxf(big_m, ml_s[(w * ROWS + r) * 2]);
    float big_l = 0.0f, o = 0.0f;
    if (big_m != -inf()) {
#pragma unroll
      for (int w = 0; w < KEY_WARPS; ++w) {
        const float cw = fast_exp2(ml_s[(w * ROWS + r) * 2] - big_m);  // 0 for a warp that saw no key
        big_l += cw * ml_s[(w * ROWS + r) * 2 + 1];
        o += cw * acc_s[(w * ROWS + r) * PITCH + d];
      }
    }
    big_l = poisoned_sum(big_l, poisoned);
    const int R = c.m0 + r;
    const long long q_row = c.q0 + R / G;
    const int h = kvh * G + R % G;
    if (num_parts == 1) {
      out[q_row * out_stride_t + h * out_stride_h + d] = from_float<T>(normalized(o, big_l));
    } else {
      const long long at = (static_cast<long long>(part) * total_q + q_row) * (num_kv_heads * G) + h;
      part_acc[at * HEAD + d] = o;
      if (d == 0) {
        part_ml[at * 2] = big_m;
        part_ml[at * 2 + 1] = big_l;
      }
    }
  }
}

}  // namespace cpa
