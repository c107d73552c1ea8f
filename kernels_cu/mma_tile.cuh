// The tensor-core attention tile: the pieces that the three tilings of the tensor-core kernels share (prefill's
// mma.sync tiling in prefill.cu, the decode tiling in decode_mma.cu, the Hopper tiling in prefill_wgmma.cu).
//
// Sequence s owns query rows query_start_loc[s] ... query_start_loc[s + 1] − 1 (q_len of them); they are the last
// q_len of its len = seq_lens[s] keys, so query row i sits at absolute position p_i = len − q_len + i. For query
// head h (KV head h / G) and key position j < len (j <= p_i when causal; j >= p_i − window with a sliding window,
// window = kNoWindow when there is none):
//
//   x(i, h, j) = scale·<q_ih, k_j> + alibi_h·(j − p_i) + bias(s, h, i, p_i, j)
//                (with a soft-cap c, the first term is c·tanh(scale·<q_ih, k_j> / c))
//   out_ih     = Σ_j softmax_j(x)·v_j                                     (float32 softmax and accumulation)
//
// One CTA per (M tile, KV head, partition of the keys). The M dimension of the matrix products packs (query token,
// query head of the KV group) pairs, FlashInfer-style: packed row R = i·G + g is token i, head kvh·G + g, so a CTA
// of 128 rows serves e.g. 128 tokens of one head (G = 1), 16 tokens of 8 heads, or, in decode with GQA (8 or 16
// rows), the G heads of one token. Every row carries its own position and key range, so all of these are the same
// code.
//
// Per CTA, 16-bit dtypes (mma.sync m16n8k16 with float32 accumulators, mma.cuh; Hopper: wgmma, wgmma.cuh):
//   S = Q·Kᵀ      A = Q (ldmatrix from shared memory), B = the K tile (ldmatrix)
//   online softmax on S in registers (base 2): m = row reference (the running max, moved lazily), l = Σ 2^(x − m)
//   O += P·V      A = P (the S accumulators, rounded to 16 bits), B = the V tile (ldmatrix.trans)
// K and V tiles of TILE_N keys travel global -> shared by cp.async, STAGES deep, one barrier per tile; the byte
// offset of each key's page row is computed once per key (TilePages) so that a copy costs a shared load and two
// adds. Per tile, each term of the logits is its own loop under a warp-uniform branch (ALiBi, the bias, the mask),
// so the inner loop stays small: a version with a branch per logit and per bias dtype outgrew the instruction cache
// and ran 2.3x slower. T5 tiles that lie max_distance or more from every row of the CTA add one constant per row
// (far_s); the others read a table built once per CTA (prefill: rel_s by relative position; decode: near_s by
// distance).
//
// Tiles: a host-sized grid of M tiles over all sequences, mapped to (sequence, tile of that sequence) by
// prefill_plan (prefill_plan.cuh: the host never reads query_start_loc). With several partitions (split-K, when the
// grid is small) each CTA writes (acc, m, l) and tile_combine (split_k.cuh) combines them.
#pragma once

#include "bias.cuh"
#include "mma.cuh"
#include "paged_cache.cuh"
#include "tile_rows.cuh"
#include "wgmma.cuh"

namespace cpa {

// ---------------------------------------------------------------------------------------------------------------
// Constants (host mirrors: cupy_paged_attn/_specs.py)
// ---------------------------------------------------------------------------------------------------------------
constexpr int kTileThreads = 128;  // 4 warps (mma.sync tilings)
constexpr int kRowsPerMma = 16;    // the M of one mma
constexpr int kTileWarps = kTileThreads / kWarpSize;
constexpr int kPrefillStages = 2;  // K/V tiles in shared memory: one computing, one landing
constexpr int kRelTableMax = 2048;  // floats of a CTA's relative-bias table (T5)
constexpr int kSmemPerSm = 228 * 1024;  // shared memory of an H100 / H200 SM (each CTA takes 1 KB more than it asks)
// The Hopper tiling (wgmma, sm_90a; TileLayout with WG = true): two warpgroups of 64 rows each.
constexpr int kWgmmaThreads = 256;
constexpr int kWgmmaRows = 128;
constexpr int kWgmmaTileKeys = 64;
constexpr int kWarpgroupThreads = 128;
// Whether the Hopper tiling defers each tile's P·V into the next iteration (three stages; see prefill_wgmma.cu): at
// head size 64. At 128, two CTAs per SM (each SM's 16 warps hide each other's latency; with one CTA and three stages
// the no-bias case ran 3.48 ms against 2.69) leave shared memory for two stages only: a tile's P·V is waited for in
// its tile.
__host__ __device__ constexpr bool wgmma_deferred(int head) { return head <= 64; }

// ---------------------------------------------------------------------------------------------------------------
// Layout of one tensor-core specialisation (16-bit T). KEY_WARPS (DECODE_ROWS 0: 1, else 4) says how the 4 warps
// share a tile:
//   1 (prefill): each warp owns MT·16 packed rows of the CTA's and computes them against every key of the tile.
//                MT = 2 (FlashAttention-2's 32 rows per warp) up to head size 128: each K or V fragment read from
//                shared memory then feeds two mmas, which halves the shared-memory traffic per mma (at 16 rows it
//                was the limit: 2.5 wavefronts per mma) and gives each warp two independent mma chains. Larger
//                heads have no registers for it: MT = 1.
//   4 (decode):  the CTA has DECODE_ROWS = 8 or 16 rows (the query heads of one KV head, one query token each)
//                and each warp computes them against its quarter of the tile's keys, with its own online softmax;
//                the warps' (m, l, acc) are combined once, at the end, as split-K partitions are. S = Q·Kᵀ is an
//                m16 mma whose rows past DECODE_ROWS are zeros, but O is accumulated transposed, Oᵀ += Vᵀ·Pᵀ: the
//                head size is the mma's M and the rows its N (8 per n tile), so a CTA of 8 rows holds half the
//                accumulators (and issues half the mmas) of an m16 O. Pᵀ's B fragments are S's C fragments as
//                they stand (mma.cuh). Memory-bound, so its pipeline is deeper.
// The Hopper tiling (WG = true): 8 warps as two warpgroups of 64 rows (128 rows per CTA), one m tile per warp.
// Host mirror: _specs.py (rows_per_cta, tile_keys, tile_smem_bytes, decode_ctas_per_sm, decode_stages).
// ---------------------------------------------------------------------------------------------------------------
constexpr int kDecodeKeyWarps = 4;
__host__ __device__ constexpr int prefill_m_tiles(int head, int decode_rows) {
  return decode_rows == 0 && head <= 128 ? 2 : 1;
}
__host__ __device__ constexpr int rows_per_cta(int head, int decode_rows) {
  return decode_rows > 0 ? decode_rows : kRowsPerMma * prefill_m_tiles(head, 0) * kTileWarps;
}
// Shared memory of a CTA, in bytes (TileLayout::kSmemBytes): Q_s [rows][row] and the K/V stages
// [stages][K, V][tile][row] (16-byte vectors), page_s [page_buffers][tile] long longs, rel_s [rel_table] and
// far_s [2][rows] floats, then align (Hopper: Q_s and the stages start on the swizzle's period).
__host__ __device__ constexpr int tiling_smem_bytes(int rows, int row, int tile, int stages, int page_buffers,
                                                    int rel_table, int align) {
  return (rows + stages * 2 * tile) * row * kVecBytes + page_buffers * tile * 8 + (rel_table + 2 * rows) * 4 + align;
}
// Decode tiling: CTAs per SM (three where a CTA's registers allow: head sizes up to 64, or 8 rows, whose
// accumulators are half), and K/V stages (three, or two where three CTAs of three stages, with their four page
// buffers, overflow the SM's 227 KB).
constexpr int kDecodeTileKeys = 64;
__host__ __device__ constexpr int decode_ctas_per_sm(int head_p, int rows) { return head_p <= 64 || rows == 8 ? 3 : 2; }
__host__ __device__ constexpr int decode_stages(int head_p, int rows) {
  return decode_ctas_per_sm(head_p, rows) * (tiling_smem_bytes(rows, head_p / 8 + 1, kDecodeTileKeys, 3, 4, 0, 0) +
                                             1024) <= 227 * 1024 ? 3 : 2;
}

// Vector position of (row r, vector c) in rows of `row` vectors (a multiple of 8) whose 8-vector groups are
// XOR-swizzled by the row: the 8 rows that one ldmatrix matrix reads at one column, and the 8 vectors of a row that a
// quarter warp copies, fall in 8 different bank groups.
__host__ __device__ constexpr int swizzled_row_vector(int row, int r, int c) {
  return r * row + ((c & ~7) | ((c ^ r) & 7));
}

// FP8 (decode only): the caches hold fp8, whose tiles travel into STAGES stages of half the size and are converted,
// a tile at a time, into one 16-bit stage that the mmas read (Fp8Stages).
template <typename T, int HEAD, int DECODE_ROWS, bool WG = false, bool SCORES = false, bool FP8 = false>
struct TileLayout {
  // The score options (logit soft-cap, sliding window) compiled in: without them a kernel never reads soft_cap and
  // window_left, and its code is that of a kernel without the options (they cost the head size 128 tilings spills).
  static constexpr bool kScores = SCORES;
  static constexpr bool kFp8 = FP8;
  static constexpr bool kDecode = DECODE_ROWS > 0;
  static constexpr int KEY_WARPS = kDecode ? kDecodeKeyWarps : 1;  // warps that split a tile's keys
  static constexpr bool kWgmma = WG;  // the Hopper tiling (prefill_wgmma.cu)
  static constexpr int THREADS = WG ? kWgmmaThreads : kTileThreads;
  static constexpr int WARPS = THREADS / kWarpSize;
  static constexpr int MT = WG ? 1 : prefill_m_tiles(HEAD, DECODE_ROWS);  // m tiles (16 rows each) per warp
  static constexpr int ROWS_W = MT * kRowsPerMma;          // rows of one warp's S (decode: past ROWS, zeros)
  static constexpr int ROWS = WG ? kWgmmaRows : rows_per_cta(HEAD, DECODE_ROWS);  // packed (token, head) rows per CTA
  // Fragment rows of a thread that hold packed rows (qr + 8·hf of each m tile; decode: ROWS / 8), and decode's n
  // tiles of Oᵀ (8 rows each).
  static constexpr int NR = kDecode ? ROWS / 8 : 2 * MT;
  static constexpr int NH = kDecode ? ROWS / 8 : 0;
  static constexpr int EL = kDecode ? 2 * NR : 4;  // elements of an m tile of S that hold rows (decode, 8 rows: 2)
  static constexpr int VEC = vec_elems<T>();               // 8 elements per 16-byte vector
  static constexpr int HEAD_P = (HEAD + 15) / 16 * 16;     // head size padded to the mma's k (120 -> 128)
  static constexpr int NV = HEAD_P / VEC;                  // vectors per padded row (even)
  static constexpr int NV_REAL = HEAD / VEC;               // of those, vectors that hold data (the rest are zeros)
  // Row pitch in vectors. Prefill's rows: odd (padded by one vector), so ldmatrix is conflict-free. The decode
  // tiling's rows of whole 128-byte lines (head sizes 64 and 128: NV % 8 == 0) are unpadded, their 8-vector groups
  // XOR-swizzled by the row instead (swizzled_row_vector): a cp.async copy lands in shared memory row by row, and
  // into padded rows, whose 128-byte lines straddle the copy's, the hardware read half of the 32-byte sectors twice
  // from L2 (ncu, B32 H32/8 d128: 50.4 M sectors for 33.6 M of K and V, 8 % of the time). The Hopper tiling's rows
  // are unpadded and swizzled in blocks (wgmma.cuh).
  static constexpr bool kSwizzledRows = !WG && kDecode && NV % 8 == 0;
  static constexpr int ROW = WG || kSwizzledRows ? NV : NV + 1;
  // Keys per tile: 64, or 32 where two m tiles of a larger head would not fit their registers otherwise (so
  // FlashAttention-2 tiles head size 128: 128 rows x 32 keys), and past head size 128. Hopper: kWgmmaTileKeys.
  static constexpr int TILE_N = WG ? kWgmmaTileKeys : HEAD > 128 || (MT == 2 && HEAD_P > 64) ? 32 : 64;
  static constexpr int KEYS_W = TILE_N / KEY_WARPS;        // keys of a tile that one warp computes
  static constexpr int KSTEPS = HEAD_P / 16;               // k steps of S = Q·Kᵀ
  static constexpr int NT_S = KEYS_W / 8;                  // n tiles of a warp's S
  static constexpr int NT_O = HEAD_P / 8;                  // n tiles of O
  static constexpr int COPIES = (TILE_N * NV + THREADS - 1) / THREADS;  // K, V vectors per thread
  static constexpr bool kCopiesEven = TILE_N * NV % THREADS == 0;  // else the last slot is some threads'
  // CTAs per SM. Prefill: two, Q's A fragments re-read from shared memory each tile where the warp has two m tiles
  // (their accumulators take the registers), else held in registers. Decode: decode_ctas_per_sm, each with
  // STAGES − 1 tiles in flight while it computes one (decode_stages), Q in registers. Hopper: two (128 registers;
  // see wgmma_deferred).
  static constexpr int kCtasPerSm = kDecode ? decode_ctas_per_sm(HEAD_P, ROWS) : 2;
  static constexpr bool kQInRegs = !WG && MT == 1 && HEAD <= 192;
  static constexpr int STAGES = kDecode ? decode_stages(HEAD_P, ROWS)
                                        : WG && wgmma_deferred(HEAD_P) ? 3 : kPrefillStages;  // K/V tiles
  // Tiles whose copies are in flight while one computes: all stages but that one; Hopper: one, its third stage
  // holding the previous tile's V for the P·V still running (the warpgroup's pipeline, prefill_wgmma.cu).
  static constexpr int AHEAD = WG ? 1 : STAGES - 1;
  static constexpr bool kPvDefer = WG && STAGES == 3;
  static constexpr int PAGE_BUFFERS = AHEAD + 2;  // tiles whose page offsets are in shared memory (TilePages)
  // Decode has one query position per CTA: its T5 table is per distance (near_s, decode_mma.cu), not this one.
  static constexpr int REL_TABLE = kDecode ? 0 : kRelTableMax;
  // Shared memory, in bytes (tiling_smem_bytes; Hopper: 1024 more, to align Q_s and KV_s on the swizzle's period).
  // With FP8 the K/V region is one 16-bit stage, then STAGES fp8 stages of 16-element vectors (Fp8Stages).
  static constexpr int FP8_STAGE_VECS = 2 * TILE_N * (HEAD_P / 16);
  static constexpr int KV_VECS = FP8 ? 2 * TILE_N * ROW + STAGES * FP8_STAGE_VECS : STAGES * 2 * TILE_N * ROW;
  static constexpr int kKVBytes = KV_VECS * kVecBytes;
  static constexpr int kSmemBytes =
      FP8 ? tiling_smem_bytes(ROWS, ROW, TILE_N, 1, PAGE_BUFFERS, REL_TABLE, 0) + STAGES * FP8_STAGE_VECS * kVecBytes
          : tiling_smem_bytes(ROWS, ROW, TILE_N, STAGES, PAGE_BUFFERS, REL_TABLE, WG ? 1024 : 0);
  // The last 16-bit stage ([2][TILE_N][ROW] vectors, from kv_s + LAST_STAGE): no copy writes it before the loop's
  // first barrier (the prologue fills stages 0 ... AHEAD − 1; with FP8 the conversions write it from the first tile
  // on), so the prologue may keep what it needs until then there.
  static constexpr int LAST_STAGE = FP8 ? 0 : (STAGES - 1) * 2 * TILE_N * ROW;
  static_assert(sizeof(T) == 2, "the tensor-core kernels take float16 / bfloat16");
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 227 * 1024, "the CTAs per SM fit in an H100/H200 SM");
  static_assert(!WG || (!kDecode && HEAD % 64 == 0 && (NT_S == 8 || NT_S == 16) && (NT_O == 8 || NT_O == 16) &&
                        ROWS == WARPS * kRowsPerMma),
                "Hopper tiling: prefill, head size 64 or 128, 64 or 128 keys per tile, 16 rows per warp");
  static_assert(HEAD % VEC == 0 && NV % 2 == 0, "whole vectors, pairs of 8-column matrices");
  static_assert(KEYS_W % 16 == 0, "P·V takes keys 16 at a time");
  static_assert(!kDecode || KEY_WARPS * ROWS * (HEAD_P + 6) * 4 <= kKVBytes, "the warps combine in the K/V stages");
  static_assert(!kDecode || (MT == 1 && (ROWS == 8 || ROWS == 16) && TILE_N == kDecodeTileKeys),
                "decode: one m tile, kDecodeTileKeys keys");
  static_assert(!FP8 || (kDecode && HEAD % 16 == 0), "fp8 caches: the decode tiling, whole 16-byte fp8 vectors");

  // Vector c of key t of K (V) in stage st of kv_s: padded rows, the decode tiling's swizzled rows, or the Hopper
  // tiling's swizzled blocks (wgmma.cuh); Q_s's row r, vector c likewise (q_index). (The padded index is written as
  // it always was: ptxas's schedule of the mma.sync tiling, 11 % of its time at head size 128, changed with its
  // association.)
  static __device__ __forceinline__ uint4* k_vec(uint4* kv_s, int st, int t, int c) {
    if constexpr (kWgmma) return &kv_s[st * 2 * TILE_N * ROW + swizzled_vector(TILE_N, t, c)];
    else if constexpr (kSwizzledRows) return &kv_s[st * 2 * TILE_N * ROW + swizzled_row_vector(ROW, t, c)];
    else return &kv_s[((st * 2) * TILE_N + t) * ROW + c];
  }
  static __device__ __forceinline__ uint4* v_vec(uint4* kv_s, int st, int t, int c) {
    if constexpr (kWgmma) return &kv_s[(st * 2 + 1) * TILE_N * ROW + swizzled_vector(TILE_N, t, c)];
    else if constexpr (kSwizzledRows) return &kv_s[(st * 2 + 1) * TILE_N * ROW + swizzled_row_vector(ROW, t, c)];
    else return &kv_s[((st * 2 + 1) * TILE_N + t) * ROW + c];
  }
  static __device__ __forceinline__ int q_index(int r, int c) {
    if constexpr (kWgmma) return swizzled_vector(ROWS, r, c);
    else if constexpr (kSwizzledRows) return swizzled_row_vector(ROW, r, c);
    else return r * ROW + c;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// The CTA's rows and keys: sequence s, packed rows m0 ... m0 + ROWS − 1 of its q_len·G, KV head kvh, keys
// [kstart, kend) of its partition (loop_end: the last one any row sees), and this thread's place in the tile.
// ---------------------------------------------------------------------------------------------------------------
template <typename L>
struct TileCta {
  int s, m0, kvh, G;
  int tid, warp, lane;
  int row_warp;  // this warp's rows: ROWS_W·row_warp ... of the CTA's
  int key0;      // and its keys: key0 ... key0 + KEYS_W − 1 of each tile
  int qr;        // fragment row (and row + 8)
  int qc;        // fragment column pair
  int q0, q_len, len, pos0, rows_total, kstart, kend;
  int p_first, p_last;  // positions of the CTA's first and last rows
  int loop_end, num_tiles;

  // The threads' places; s is the CTA's sequence (not a spare tile's −1).
  __device__ __forceinline__ void place(const CtaRows& cta, int s_, int group_size) {
    s = s_;
    m0 = cta.tile * L::ROWS;
    kvh = cta.kvh;
    G = group_size;
    tid = threadIdx.x;
    warp = tid / kWarpSize;
    lane = tid % kWarpSize;
    row_warp = warp / L::KEY_WARPS;
    key0 = (warp % L::KEY_WARPS) * L::KEYS_W;
    qr = lane / 4;
    qc = lane % 4;
  }
  // The keys of partition part of a sequence of len keys: tokens_per_part each, or with `balanced` the sequence's
  // own keys cut into num_parts runs of whole tiles (decode_mma.cu). With the score options the keys start at the
  // tile holding the first key of the CTA's first row's window (position − window; 0 without a window): pages wholly
  // before every row's window are never read. The last partition then takes every key left: the host sizes the
  // partitions for a window's keys, so they need not cover max_len.
  __device__ __forceinline__ void keys(const CtaRows& cta, int len_, int part, int tokens_per_part, int num_parts,
                                       bool balanced, int window) {
    q0 = cta.q0;
    q_len = cta.q_len;
    len = len_;
    pos0 = len - q_len;  // absolute position of query row 0
    rows_total = q_len * G;
    constexpr int TILE_N = L::TILE_N;
    const int first = L::kScores ? max(0, pos0 + m0 / G - window) / TILE_N * TILE_N : 0;
    const int keys_ = len - first;
    const int part_keys = balanced ? max(TILE_N, ((keys_ + num_parts - 1) / num_parts + TILE_N - 1) / TILE_N * TILE_N)
                                   : tokens_per_part;
    kstart = first + part * part_keys;
    kend = min(L::kScores && part == num_parts - 1 ? len : kstart + part_keys, len);
  }
  // The position span of the CTA's rows, for the causal key range (and T5's table).
  __device__ __forceinline__ void span(int causal) {
    const int last_row = min(rows_total, m0 + L::ROWS) - 1;
    const int i_first = m0 / G;
    const int i_last = last_row / G;
    p_first = pos0 + i_first;
    p_last = pos0 + i_last;
    loop_end = causal ? min(kend, p_last + 1) : kend;
    num_tiles = loop_end > kstart ? (loop_end - kstart + L::TILE_N - 1) / L::TILE_N : 0;
  }
  // CTA row of this thread's fragment row r = 2·mt + hf: row qr + 8·hf of the warp's m tile mt (accumulator
  // elements 2hf, 2hf + 1 of that tile's fragments).
  __device__ __forceinline__ int row(int r) const {
    return row_warp * L::ROWS_W + (r / 2) * kRowsPerMma + qr + 8 * (r % 2);
  }
};

// Prefill's T5 table (rel_s): T5's bias depends on (head, j − p) only, and is the same for every |j − p| >= max_distance
// (bias_n) on a side, so one table in shared memory serves the whole CTA. Entry (g, w) is head kvh·G + g's bias at
// relative position w − half, base 2, for w < w_len = 2·half + 1. Every (row, key) pair of a near tile (far_kind 0)
// lies within ±half, so a row reads its entries of a tile at fixed offsets from one address (add_rel_table). Built
// once, before the first tile; not used (a load chain per logit instead) where it would pass REL_TABLE floats
// (large groups or max_distance). Decode has none (RelTable{}).
struct RelTable {
  int half = 0, w_len = 0;
  bool used = false;
};

template <bool kT5, typename L>
__device__ __forceinline__ RelTable rel_table(const TileCta<L>& c, int bias_n) {
  const int G = c.G, p_first = c.p_first, p_last = c.p_last;
  const int half = min(bias_n, L::REL_TABLE) + L::TILE_N + p_last - p_first;
  const int w_len = 2 * half + 1;
  return {half, w_len, kT5 && bias_n <= L::REL_TABLE && G * w_len <= L::REL_TABLE};
}

// This thread's fragment rows: per row, its query token i, head h, position p, key range end, T5 table offset (rel_s
// entry of relative position −p), whether it is written, and its ALiBi slope (base 2); over the warp, the greatest
// first key of a written row's window and the least end (tiles between them need no mask), and the greatest end
// (keys from it on are keys of no row: skipped). A row's window starts at p − window, computed where it is used
// (mask_logits): a register per row would cost the head size 128 tilings spills.
template <int NR>
struct TileRows {
  int i[NR], h[NR], p[NR], end[NR], off[NR];
  bool written[NR];
  float slope2[NR];
  int warp_min_end, warp_max_begin, warp_end;
};

// Every key of the tile t0 ... t0 + TILE_N − 1 is in the range of every row of the warp (the window's first key is
// looked at only with the score options).
template <typename L>
__device__ __forceinline__ bool tile_unmasked(const TileRows<L::NR>& rows, int t0) {
  return t0 + L::TILE_N <= rows.warp_min_end && (!L::kScores || t0 >= rows.warp_max_begin);
}

template <typename L>
__device__ __forceinline__ TileRows<L::NR> tile_rows(const TileCta<L>& c, int q_limit, int causal, int window,
                                                     RelTable rel, const float* __restrict__ alibi_slopes) {
  TileRows<L::NR> r;
  r.warp_min_end = 1 << 30;
  r.warp_max_begin = -(1 << 30);
  r.warp_end = c.kstart;
#pragma unroll
  for (int hf = 0; hf < L::NR; ++hf) {
    const int R = c.m0 + c.row(hf);
    const int i = R / c.G;
    const int g = R % c.G;
    r.written[hf] = R < c.rows_total;
    const bool keys = r.written[hf] && i < q_limit;
    r.i[hf] = keys ? i : 0;
    r.h[hf] = c.kvh * c.G + g;
    r.p[hf] = keys ? c.pos0 + i : c.p_last;
    r.end[hf] = keys ? (causal ? min(c.kend, c.pos0 + i + 1) : c.kend) : c.kstart;
    r.off[hf] = g * rel.w_len + rel.half - r.p[hf];
    r.slope2[hf] = alibi_slopes != nullptr && r.written[hf] ? alibi_slopes[r.h[hf]] * kLog2e : 0.0f;
    if (r.written[hf]) {
      r.warp_min_end = min(r.warp_min_end, r.end[hf]);
      if constexpr (L::kScores) r.warp_max_begin = max(r.warp_max_begin, r.p[hf] - window);
      r.warp_end = max(r.warp_end, r.end[hf]);
    }
  }
#pragma unroll
  for (int o = 1; o < kWarpSize; o *= 2) {
    r.warp_min_end = min(r.warp_min_end, __shfl_xor_sync(0xffffffffu, r.warp_min_end, o));
    if constexpr (L::kScores) {
      r.warp_max_begin = max(r.warp_max_begin, __shfl_xor_sync(0xffffffffu, r.warp_max_begin, o));
    }
    r.warp_end = max(r.warp_end, __shfl_xor_sync(0xffffffffu, r.warp_end, o));
  }
  return r;
}

// ---------------------------------------------------------------------------------------------------------------
// T5's far tiles: its bias is one value per direction for keys at least max_distance (bias_n) before the query, and
// for keys at least far_after after it (max_distance when bidirectional; 0 otherwise: one bucket for all later
// keys). A tile whose keys are all that far from every row of the CTA adds a per-row constant: no table, no fill.
// Most tiles of a long sequence are far.
// ---------------------------------------------------------------------------------------------------------------
template <bool kT5, int TILE_N, typename L>
__device__ __forceinline__ int far_kind(const TileCta<L>& c, int t0, int bias_n, int far_after) {
  if (!kT5) return 0;  // 0: near, 1: every key far before, 2: every key far after
  if (t0 + TILE_N - 1 - c.p_first <= -bias_n) return 1;
  return t0 - c.p_last >= far_after ? 2 : 0;
}

// far_s[kind][row]: the two constants of each row, base 2 (shared memory: registers are all taken). Written by the
// row's own thread (qc == 0) and read by its quad: visible after the barrier before the first tile. Each waits on two
// dependent loads (bucket, weight).
template <bool kT5, typename L, typename Bias>
__device__ __forceinline__ void fill_far(const TileCta<L>& c, const TileRows<L::NR>& rows, const Bias& bias,
                                         const typename Bias::Seq& seq_bias, float* far_s, int bias_n, int far_after) {
  if (kT5 && c.qc == 0) {
#pragma unroll
    for (int hf = 0; hf < L::NR; ++hf) {
      const int r = c.row(hf);
      far_s[r] = bias.value(seq_bias.load(rows.h[hf], 0, 0, -bias_n)) * kLog2e;
      far_s[L::ROWS + r] = bias.value(seq_bias.load(rows.h[hf], 0, 0, far_after)) * kLog2e;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The Q tile -> shared memory (zeros for rows past the sequence and for padding). q_vec: the query's rows may be read
// in 16-byte vectors (else element by element).
// ---------------------------------------------------------------------------------------------------------------
template <typename L, typename T>
__device__ __forceinline__ void load_q_tile(uint4* q_s, const T* __restrict__ query, long long q_stride_t,
                                            long long q_stride_h, int q_vec, const TileCta<L>& c) {
  for (int idx = c.tid; idx < L::ROWS * L::NV; idx += L::THREADS) {
    const int r = idx / L::NV;
    const int col = idx % L::NV;
    const int R = c.m0 + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (R < c.rows_total && col < L::NV_REAL) {
      const T* src = query + static_cast<long long>(c.q0 + R / c.G) * q_stride_t +
                     static_cast<long long>(c.kvh * c.G + R % c.G) * q_stride_h + col * L::VEC;
      if (q_vec) {
        v = load_raw(src);
      } else {
        union {
          uint4 raw;
          T elem[L::VEC];
        } u;
#pragma unroll
        for (int e = 0; e < L::VEC; ++e) u.elem[e] = src[e];
        v = u.raw;
      }
    }
    q_s[L::q_index(r, col)] = v;
  }
}

// Prefill's T5 table rel_s [G][w_len] (RelTable). Visible after the barrier before the first tile.
template <typename L, typename Bias>
__device__ __forceinline__ void fill_rel_table(float* rel_s, const Bias& bias, const typename Bias::Seq& seq_bias,
                                               const TileCta<L>& c, RelTable rel) {
#pragma unroll 4
  for (int e = c.tid; e < c.G * rel.w_len; e += L::THREADS) {
    const int g = e / rel.w_len;
    const int w = e % rel.w_len;
    rel_s[e] = bias.value(seq_bias.load(c.kvh * c.G + g, 0, 0, w - rel.half)) * kLog2e;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Pages. page_s[u % PAGE_BUFFERS][t] is the byte offset, in the key cache, of vector 0 of key t of tile u (head kvh):
// its page's plus its token's. −1 when its block id lies outside the cache (never dereferenced: the key is masked;
// validate=True reports it), −2 for keys past loop_end. Thread t < TILE_N loads key t's block id one tile early
// (load_id, into a register) and stores the offset at the end of that tile (store_page): tile u's offsets are written
// in iteration u − AHEAD − 1, read by its copies in iteration u − AHEAD and by its masks in iteration u, so AHEAD + 2
// buffers never collide. Each copy is then one shared load and two 64-bit adds. The prologue's tiles (`first`) read
// their ids from first_ids (id i at first_ids[i − first_base]: the block table, or decode's copy in shared memory),
// the others from the block table.
// ---------------------------------------------------------------------------------------------------------------
template <typename L, typename Cache>
struct TilePages {
  long long* page_s;
  const int* table;
  const int* first_ids;
  int first_base;
  int tid, loop_end, block_shift, block_mask, num_blocks, kvh;
  long long cache_block_stride;
  Cache cache;
  int pending_blk = 0;
  bool pending_in = false;

  __device__ __forceinline__ void load_id(bool first, int t0) {
    if (tid < L::TILE_N) {
      const int j = t0 + tid;
      pending_in = j < loop_end;
      pending_blk = pending_in ? (first ? first_ids[(j >> block_shift) - first_base] : table[j >> block_shift]) : 0;
    }
  }
  __device__ __forceinline__ void store_page(int u, int t0) {
    using T = typename Cache::Elem;
    if (tid < L::TILE_N) {
      const bool blk_ok = pending_blk >= 0 && pending_blk < num_blocks;
      const long long at = static_cast<long long>(pending_blk) * cache_block_stride +
                           cache.page_offset((t0 + tid) & block_mask, kvh, 0);
      page_s[(u % L::PAGE_BUFFERS) * L::TILE_N + tid] =
          !pending_in ? -2 : blk_ok ? at * static_cast<long long>(sizeof(T)) : -1;
    }
  }
  // Whether key kl of tile u's buffer lies in the cache (its mask reads this).
  __device__ __forceinline__ bool missing(int u, int kl) const {
    return page_s[(u % L::PAGE_BUFFERS) * L::TILE_N + kl] == -1;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Copies of tile u (keys from t0) into stage st: K/V vectors by cp.async (vLLM values gathered), zeros where a key is
// missing. Slot k of this thread is vector c of tile row t (idx = tid + k·threads: coalesced). When the threads cover
// whole rows (NV divides them), c is the same in every slot and its byte offset is folded into this thread's cache
// pointers once. issue() returns whether every key that this thread copied lies in the cache; issue_tile clears bit
// u % 32 of ok_bits when not (u's copies are issued AHEAD < 32 tiles before u is computed). A cleared bit stays
// cleared: the tiles u + 32, u + 64 ... are then masked key by key (their rows are poisoned anyway), and ok_bits
// tells at the end whether any key was missing (missed_any) at no register's cost.
// ---------------------------------------------------------------------------------------------------------------
template <typename L, typename Cache, typename G = L>  // G: where the copies go (L's stages, or Fp8Stages<L>)
struct TileCopies {
  using T = typename Cache::Elem;
  static constexpr int THREADS = L::THREADS;
  static constexpr bool kColFixed = THREADS % G::NV == 0;
  uint4* kv_s;
  const long long* page_s;
  const char* key_bytes;
  const char* value_bytes;
  Cache cache;
  int tid, kvh, block_mask;
  long long cache_block_stride;
  unsigned ok_bits = ~0u;

  __device__ __forceinline__ bool slot_used(int k) const {
    return G::kCopiesEven || k < G::COPIES - 1 || tid + k * THREADS < L::TILE_N * G::NV;
  }
  __device__ __forceinline__ int slot_col(int k) const {
    return kColFixed ? tid % G::NV : (tid + k * THREADS) % G::NV;
  }
  __device__ __forceinline__ int slot_row(int k) const {
    return kColFixed ? tid / G::NV + k * (THREADS / G::NV) : (tid + k * THREADS) / G::NV;
  }
  __device__ __forceinline__ void point_at(const T* key_cache, const T* value_cache) {
    const long long col_bytes =
        kColFixed ? static_cast<long long>(slot_col(0)) * cache.vector_stride() * sizeof(T) : 0;
    key_bytes = reinterpret_cast<const char*>(key_cache) + col_bytes;
    value_bytes = reinterpret_cast<const char*>(value_cache) + col_bytes;
  }
  __device__ __forceinline__ bool issue(int st, int u, int t0) {
    const long long* pages = page_s + (u % L::PAGE_BUFFERS) * L::TILE_N;
    bool all_ok = true;
#pragma unroll
    for (int k = 0; k < G::COPIES; ++k) {
      if (!slot_used(k)) continue;
      const int t = slot_row(k);
      const int c = slot_col(k);
      const long long page = pages[t];
      const bool copy = page >= 0 && c < G::NV_REAL;
      all_ok = all_ok && page != -1;
      const long long col = kColFixed ? 0 : static_cast<long long>(c) * cache.vector_stride() * sizeof(T);
      const long long at = copy ? page + col : 0;
      cp_async16(G::k_vec(kv_s, st, t, c), key_bytes + at, copy ? kVecBytes : 0);
      if constexpr (Cache::kValueIsVector) {
        cp_async16(G::v_vec(kv_s, st, t, c), value_bytes + at, copy ? kVecBytes : 0);
      } else {
        const int off = (t0 + t) & block_mask;
        const long long blk =
            copy ? (page / static_cast<long long>(sizeof(T)) - cache.page_offset(off, kvh, 0)) / cache_block_stride : 0;
        *G::v_vec(kv_s, st, t, c) = copy ? cache.gather_value(blk, off, kvh, c) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    cp_async_commit();
    return all_ok;
  }
  // Tile u's copies (after `extra(st, t0)`'s, in the same group), or an empty group past the last tile (the count of
  // groups in flight per tile stays).
  template <typename Extra>
  __device__ __forceinline__ void issue_tile(int u, int num_tiles, int kstart, Extra&& extra) {
    if (u < num_tiles) {
      const unsigned bit = 1u << (u % 32);
      const int st = u % L::STAGES;
      const int t0 = kstart + u * L::TILE_N;
      extra(st, t0);
      if (!issue(st, u, t0)) ok_bits &= ~bit;
    } else {
      cp_async_commit();
    }
  }
  // Bit u % 32 of ok_bits: whether this thread's copies of tile u all lay in the cache.
  __device__ __forceinline__ unsigned tile_ok(int u) const { return (ok_bits >> (u % 32)) & 1u; }
  // Whether any of this thread's copies so far missed its page.
  __device__ __forceinline__ bool missed_any() const { return ok_bits != ~0u; }
  // Whether the CTA's rows of sequence s are poisoned (paged_cache.cuh): a copy of any of its threads missed its
  // page, or the keys it used (len) are not seq_lens[s]. A barrier: every thread of the CTA calls it.
  __device__ __forceinline__ bool cta_poisoned(const int* seq_lens, int s, int len) const {
    return __syncthreads_or(missed_any()) != 0 || out_of_contract(seq_lens, s, len);
  }
};

// fp8 caches in the decode tiling (TileLayout FP8): tile u's K and V travel into stage u % STAGES of f8_s,
// [STAGES][K, V][TILE_N][NV] vectors of 16 fp8 values (the copies' G), and the whole CTA converts a tile once, after
// the barrier that makes its copies visible, into the one 16-bit stage of kv_s that the mmas read (then a second
// barrier): each value is read from global memory once, at half the bytes, and converted once for all the CTA's
// query heads.
template <typename L, typename KV>
struct Fp8Stages {
  static constexpr int NV = L::HEAD_P / 16;   // 16-byte vectors of a key's fp8 row
  static constexpr int NV_REAL = L::NV_REAL / 2;  // (fp8 head sizes are multiples of 16)
  static constexpr int COPIES = (L::TILE_N * NV + L::THREADS - 1) / L::THREADS;
  static constexpr bool kCopiesEven = L::TILE_N * NV % L::THREADS == 0;
  static constexpr int STAGE_VECS = L::FP8_STAGE_VECS;
  static_assert(STAGE_VECS == 2 * L::TILE_N * NV, "the layout's fp8 stage");
  static __device__ __forceinline__ uint4* k_vec(uint4* f8_s, int st, int t, int c) {
    return &f8_s[(st * 2 * L::TILE_N + t) * NV + c];
  }
  static __device__ __forceinline__ uint4* v_vec(uint4* f8_s, int st, int t, int c) {
    return &f8_s[((st * 2 + 1) * L::TILE_N + t) * NV + c];
  }
  // Stage st's tile as T into stage 0 of kv_s (value / kv_unit<KV>()): fp8 vector c is 16-bit vectors 2c, 2c + 1.
  template <typename T>
  static __device__ __forceinline__ void convert(const uint4* f8_s, int st, uint4* kv_s, int tid) {
#pragma unroll
    for (int idx = tid; idx < STAGE_VECS; idx += L::THREADS) {
      const int half = L::TILE_N * NV;
      const int t = idx % half / NV;
      const int c = idx % NV;
      uint4 lo, hi;
      fp8x16_to_16bit<T, KV>(f8_s[st * STAGE_VECS + idx], lo, hi);
      if (idx < half) {
        *L::k_vec(kv_s, 0, t, 2 * c) = lo;
        *L::k_vec(kv_s, 0, t, 2 * c + 1) = hi;
      } else {
        *L::v_vec(kv_s, 0, t, 2 * c) = lo;
        *L::v_vec(kv_s, 0, t, 2 * c + 1) = hi;
      }
    }
  }
};

// The element type of the decode's mmas: the query's, but float16 over fp8 caches. Every fp8 value (divided by
// kv_unit) and every probability (p <= 2^kRescaleSlack) is a float16, and a tile converts to float16 in one
// instruction per pair of values, where bfloat16 took three (fp8x16_to_16bit); a bfloat16 query enters as float16
// through QToHalf.
template <typename T, typename KV, bool FP8 = IsFp8<KV>::value>
struct MmaElem {
  using type = T;
};
template <typename T, typename KV>
struct MmaElem<T, KV, true> {
  using type = __half;
};

// A bfloat16 Q tile as float16 A fragments: every element times 2^-e, one power of two for the tile, chosen so that
// its largest |element| lands in [2^14, 2^15) (float16's largest binade ends at 65504). Each element keeps its 8
// significant bits (float16 has 11) unless it is below 2^-28 of the largest, where float16's subnormals round it; the
// logits' scale takes 2^e back. (A row of the tile may be far smaller than another: its logits are then as small.)
struct QToHalf {
  // e from the tile in shared memory, every warp reading all of it (no barrier): the largest magnitude's bfloat16
  // exponent, clamped so that 2^e and 2^-e are normal floats (an infinite or NaN element stays one).
  template <typename L>
  static __device__ __forceinline__ int exponent(const uint4* q_s, int lane) {
    unsigned big = 0u;  // bfloat16 magnitudes (sign bits cleared) order as their bits
    for (int idx = lane; idx < L::ROWS * L::NV; idx += kWarpSize) {
      const uint4 v = q_s[L::q_index(idx / L::NV, idx % L::NV)];
      const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) big = max(big, max(w[i] & 0x7fffu, (w[i] >> 16) & 0x7fffu));
    }
    big = __reduce_max_sync(0xffffffffu, big);
    const int biased = static_cast<int>(big >> 7);  // 0: all zeros (or subnormal)
    return biased == 0 ? 0 : min(max(biased - 127 - 14, -126), 126);
  }
  static __device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }
  // One register of a bfloat16 pair as the float16 pair of its values times `mult` (2^-e).
  static __device__ __forceinline__ unsigned convert(unsigned bf16x2, float mult) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bf16x2));
    const __half2 h = __floats2half2_rn(f.x * mult, f.y * mult);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

// The copies' destination of a tiling: its own stages, or with fp8 caches Fp8Stages.
template <typename L, typename KV, bool FP8 = L::kFp8>
struct CopyStages {
  using type = L;
};
template <typename L, typename KV>
struct CopyStages<L, KV, true> {
  using type = Fp8Stages<L, KV>;
};

// The pipeline's start: the page offsets of tiles 0 ... AHEAD, then the copies of tiles 0 ... AHEAD − 1 (each after
// extra(st, t0)'s, as issue_tile). Uniform over the CTA (num_tiles is): every thread reaches the barrier or none.
template <typename L, typename Cache, typename G, typename Extra>
__device__ __forceinline__ void start_tiles(TilePages<L, Cache>& pages, TileCopies<L, Cache, G>& copies, int num_tiles,
                                            int kstart, Extra&& extra) {
  if (num_tiles > 0) {
#pragma unroll
    for (int u = 0; u <= L::AHEAD; ++u) {
      pages.load_id(true, kstart + u * L::TILE_N);
      pages.store_page(u, kstart + u * L::TILE_N);
    }
    __syncthreads();  // the first tiles' page offsets are visible to every thread's copies
#pragma unroll
    for (int u = 0; u < L::AHEAD; ++u) copies.issue_tile(u, num_tiles, kstart, extra);
  }
}

// The running state of this thread's rows before any key: m = −inf (base 2), l = 0.
template <int NR>
__device__ __forceinline__ void start_rows(float (&m)[NR], float (&l)[NR]) {
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {
    m[hf] = -inf();
    l[hf] = 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Bias bits of a tile's logits for this thread's fragment (rows qr, qr + 8; keys key0 + 8nt + 2qc + {0, 1}) of a
// dense or ragged bias, read element by element: one address per row and tile, then fixed byte offsets where every
// key of the fragment is in the row (`whole`, decode; prefill, with 4x the keys per thread, would hold the offsets in
// registers it has not got). A key past a row's end reads the row's last key instead (its logit is masked); rows
// without keys read nothing.
// ---------------------------------------------------------------------------------------------------------------
template <typename L, typename Bias>
using BiasFrag = typename Bias::Raw[L::MT][L::NT_S][4];

template <typename L, typename Bias>
__device__ __forceinline__ void load_bias_fragment(BiasFrag<L, Bias>& raw,
                                                   const typename Bias::Seq::Row (&bias_rows)[L::NR],
                                                   const TileRows<L::NR>& rows, int t0, int key0, int qc, int kstart) {
  const int j0 = t0 + key0 + 2 * qc;
#pragma unroll
  for (int hf = 0; hf < L::NR; ++hf) {
    const bool whole = L::kDecode && j0 + (L::NT_S - 1) * 8 + 1 < rows.end[hf];  // every key of it is in the row
    const char* p = bias_rows[hf].at(j0);
    const long long step = bias_rows[hf].step_bytes();  // widened: (8·nt + c)·step may pass 2**31
    if (rows.end[hf] > kstart) {  // one branch per row, not per key
#pragma unroll
      for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const char* at = whole ? p + (nt * 8 + c) * step : bias_rows[hf].at(min(j0 + nt * 8 + c, rows.end[hf] - 1));
          raw[hf / 2][nt][2 * (hf % 2) + c] = bias_rows[hf].load_at(at);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < L::NT_S; ++nt) raw[hf / 2][nt][2 * (hf % 2)] = raw[hf / 2][nt][2 * (hf % 2) + 1] = 0u;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// S = Q·Kᵀ on mma.sync: ROWS_W rows x KEYS_W keys per warp; each K fragment feeds the MT m tiles. Q's A fragments
// come from qa (kQInRegs) or are read from shared memory each tile.
// ---------------------------------------------------------------------------------------------------------------
template <typename L, typename T>
__device__ __forceinline__ void qk_mma(float (&sacc)[L::MT][L::NT_S][4],
                                       const unsigned (&qa)[L::kQInRegs ? L::KSTEPS : 1][4], uint4* q_s, uint4* kv_s,
                                       int st, int row_warp, int key0, int lane) {
#pragma unroll
  for (int kk = 0; kk < L::KSTEPS; ++kk) {
    unsigned a[L::MT][4];
#pragma unroll
    for (int mt = 0; mt < L::MT; ++mt) {
      if constexpr (L::kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[mt][e] = qa[kk][e];
      } else {
        ldmatrix_x4(a[mt], &q_s[(row_warp * L::ROWS_W + mt * kRowsPerMma + lane % 16) * L::ROW + 2 * kk + lane / 16]);
      }
    }
#pragma unroll
    for (int np = 0; np < L::NT_S / 2; ++np) {
      unsigned b[4];  // keys 16np + (0..7 | 8..15) x columns 16kk + (0..7 | 8..15)
      ldmatrix_x4(b, L::k_vec(kv_s, st, key0 + np * 16 + (lane / 16) * 8 + lane % 8, 2 * kk + (lane / 8) % 2));
#pragma unroll
      for (int mt = 0; mt < L::MT; ++mt) {
        mma_16816<T>(sacc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(sacc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Logits in base 2: x = (scale·s + alibi·(j − p) + bias)·log2(e); −inf for keys a row may not see. One loop per term,
// each under a branch that is uniform over the warp: no term costs a branch per logit. The scale rides on the bias's
// add (one FFMA). Row of element e of m tile mt: hf = 2·mt + e / 2.
// ---------------------------------------------------------------------------------------------------------------
template <typename L>
using SFrag = float[L::MT][L::NT_S][4];

// The soft-cap on the raw products (SoftCap made with mult = scale2, so the scaling after it stays).
template <typename L>
__device__ __forceinline__ void cap_logits(SFrag<L>& sacc, const SoftCap& cap) {
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e) sacc[mt][nt][e] = cap.apply<false>(sacc[mt][nt][e]);
}

template <typename L>
__device__ __forceinline__ void scale_logits(SFrag<L>& sacc, float scale2) {
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e) sacc[mt][nt][e] *= scale2;
}

// A far tile (far_kind 1 or 2): one constant per row, far_s[kind − 1][row].
template <typename L>
__device__ __forceinline__ void add_far_constants(SFrag<L>& sacc, float scale2, const float* far_s, int far,
                                                  const TileCta<L>& c) {
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt) {
    const float* far_row = far_s + (far - 1) * L::ROWS + c.row(2 * mt);
    const float row_bias[2] = {far_row[0], L::EL > 2 ? far_row[8] : 0.0f};
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e) sacc[mt][nt][e] = fmaf(sacc[mt][nt][e], scale2, row_bias[e / 2]);
  }
}

// Prefill's T5 table: a row reads its entries of a tile at fixed offsets from one address (row_off + t0 + key).
template <typename L>
__device__ __forceinline__ void add_rel_table(SFrag<L>& sacc, float scale2, const float* rel_s,
                                              const TileRows<L::NR>& rows, int t0, int key0, int qc) {
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt) {
    const float* rel_row[2] = {rel_s + rows.off[2 * mt] + t0, rel_s + rows.off[min(2 * mt + 1, L::NR - 1)] + t0};
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e)
        sacc[mt][nt][e] = fmaf(sacc[mt][nt][e], scale2, rel_row[e / 2][key0 + nt * 8 + 2 * qc + (e & 1)]);
  }
}

// Any bias, a logit at a time: T5 computed per key (loads), dense and ragged from their loaded bits (braw).
template <typename L, typename Bias>
__device__ __forceinline__ void add_bias_bits(SFrag<L>& sacc, float scale2, const Bias& bias,
                                              const typename Bias::Seq& seq_bias, const BiasFrag<L, Bias>& braw,
                                              const TileRows<L::NR>& rows, int t0, int key0, int qc) {
  constexpr bool kT5 = SameType<Bias, T5Bias>::value;
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e) {
        const int hf = 2 * mt + e / 2;
        const int j = t0 + key0 + nt * 8 + 2 * qc + (e & 1);
        const typename Bias::Raw raw = kT5 ? seq_bias.load(rows.h[hf], rows.i[hf], rows.p[hf], j) : braw[mt][nt][e];
        sacc[mt][nt][e] = fmaf(sacc[mt][nt][e], scale2, bias.value(raw) * kLog2e);
      }
}

template <typename L>
__device__ __forceinline__ void add_alibi(SFrag<L>& sacc, const TileRows<L::NR>& rows, int t0, int key0, int qc) {
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e) {
        const int hf = 2 * mt + e / 2;
        sacc[mt][nt][e] += rows.slope2[hf] * static_cast<float>(t0 + key0 + nt * 8 + 2 * qc + (e & 1) - rows.p[hf]);
      }
}

// −inf for keys outside a row's [p − window, end) and keys whose page lies outside the cache.
template <typename L, typename Pages>
__device__ __forceinline__ void mask_logits(SFrag<L>& sacc, const TileRows<L::NR>& rows, int window,
                                            const Pages& pages, int tile, int t0, int key0, int qc) {
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < L::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e) {
        const int kl = key0 + nt * 8 + 2 * qc + (e & 1);
        const int hf = 2 * mt + e / 2;
        if (t0 + kl >= rows.end[hf] || (L::kScores && t0 + kl < rows.p[hf] - window) || pages.missing(tile, kl)) {
          sacc[mt][nt][e] = -inf();
        }
      }
}

// ---------------------------------------------------------------------------------------------------------------
// Online softmax per row against a reference m (at least the max seen, less kRescaleSlack):
//   α = 2^(m − m_ref), p = 2^(x − m_ref), l = α·l + Σ p.
// While a row has seen no key (m_ref = −inf) its reference is 0: α = 0·(nothing) and p = 0, never NaN. Leaves p in
// sacc and α per row; returns whether any row of this thread must rescale its acc (its reference moved from a finite
// value).
// ---------------------------------------------------------------------------------------------------------------
template <typename L>
__device__ __forceinline__ bool online_softmax(SFrag<L>& sacc, float (&m)[L::NR], float (&l)[L::NR],
                                               float (&alpha)[L::NR]) {
  constexpr int NR = L::NR, NT_S = L::NT_S;
  float m_use[NR];
  bool grow[NR];
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {
    const int mt = hf / 2, c0 = 2 * (hf % 2);
    // The row max of this thread's logits as a balanced tree (a short dependency chain), then over the quad.
    float tree[NT_S];
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) tree[nt] = fmaxf(sacc[mt][nt][c0], sacc[mt][nt][c0 + 1]);
#pragma unroll
    for (int w = NT_S / 2; w > 0; w /= 2)
#pragma unroll
      for (int i = 0; i < w; ++i) tree[i] = fmaxf(tree[i], tree[i + w]);
    float mx = tree[0];
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 lanes of a quad share the row
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // The reference moves only when the tile's max passes it by more than kRescaleSlack (lazy rescaling, as in
    // FlashAttention-4): p <= 2^kRescaleSlack then, exact in float32 and in the 16-bit P, and l and acc share the
    // reference, so out = acc / l is unchanged. Most tiles then leave every row's reference alone, and the rescale
    // of acc is skipped.
    const bool moves = mx > m[hf] + kRescaleSlack;  // (m = −inf: any key moves it)
    const float m_ref = moves ? mx : m[hf];
    m_use[hf] = m_ref == -inf() ? 0.0f : m_ref;
    alpha[hf] = moves ? fast_exp2(m[hf] - m_use[hf]) : 1.0f;
    grow[hf] = moves && m[hf] != -inf();  // (from −inf, acc and l are still 0: nothing to rescale)
    m[hf] = m_ref;
  }
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < L::EL; ++e) sacc[mt][nt][e] = fast_exp2(sacc[mt][nt][e] - m_use[2 * mt + e / 2]);
  bool rescale = false;
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {  // l = α·l + Σ p, the sum as a balanced tree
    const int mt = hf / 2, c0 = 2 * (hf % 2);
    float tree[NT_S];
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) tree[nt] = sacc[mt][nt][c0] + sacc[mt][nt][c0 + 1];
#pragma unroll
    for (int w = NT_S / 2; w > 0; w /= 2)
#pragma unroll
      for (int i = 0; i < w; ++i) tree[i] += tree[i + w];
    l[hf] = fmaf(l[hf], alpha[hf], tree[0]);
    rescale = rescale || grow[hf];
  }
  return rescale;
}

// acc (rows x head columns) times each row's α.
template <typename L>
__device__ __forceinline__ void rescale_rows(float (&acc)[L::MT][L::NT_O][4], const float (&alpha)[L::NR]) {
#pragma unroll
  for (int mt = 0; mt < L::MT; ++mt)
#pragma unroll
    for (int n = 0; n < L::NT_O; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][n][e] *= alpha[2 * mt + e / 2];
}

// The S accumulators of n tiles 2kk, 2kk + 1 of m tile mt as P's A fragment of keys 16kk ... 16kk + 15.
template <typename L, typename T>
__device__ __forceinline__ void p_fragment(unsigned (&a)[4], const SFrag<L>& sacc, int mt, int kk) {
  a[0] = pack2<T>(sacc[mt][2 * kk][0], sacc[mt][2 * kk][1]);
  a[1] = pack2<T>(sacc[mt][2 * kk][2], sacc[mt][2 * kk][3]);
  a[2] = pack2<T>(sacc[mt][2 * kk + 1][0], sacc[mt][2 * kk + 1][1]);
  a[3] = pack2<T>(sacc[mt][2 * kk + 1][2], sacc[mt][2 * kk + 1][3]);
}

// O += P·V on mma.sync: P from the S accumulators (of the warp's keys), each V fragment (the V tile read transposed)
// feeding the MT m tiles.
template <typename L, typename T>
__device__ __forceinline__ void pv_mma(float (&acc)[L::MT][L::NT_O][4], const SFrag<L>& sacc, uint4* kv_s, int st,
                                       int key0, int lane) {
#pragma unroll
  for (int kk = 0; kk < L::KEYS_W / 16; ++kk) {
    unsigned a[L::MT][4];
#pragma unroll
    for (int mt = 0; mt < L::MT; ++mt) p_fragment<L, T>(a[mt], sacc, mt, kk);
#pragma unroll
    for (int np = 0; np < L::NT_O / 2; ++np) {
      unsigned b[4];  // keys 16kk + (0..7 | 8..15) x columns 16np + (0..7 | 8..15), transposed
      ldmatrix_x4_trans(b, L::v_vec(kv_s, st, key0 + kk * 16 + ((lane / 8) % 2) * 8 + lane % 8, 2 * np + lane / 16));
#pragma unroll
      for (int mt = 0; mt < L::MT; ++mt) {
        mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Epilogue of the prefill tilings: l over the quad (the 4 lanes of a row), then out = acc / l, or (acc, m, l) for the
// split-K combine: part_acc [num_parts, total_q, num_heads, HEAD], part_ml [.., 2] = (m, l) in base 2. A poisoned
// CTA (out-of-contract data, paged_cache.cuh) writes l = NaN.
// ---------------------------------------------------------------------------------------------------------------
template <int NR>
__device__ __forceinline__ void quad_sums(float (&l)[NR]) {
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {
    l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 1);
    l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 2);
  }
}

template <typename L, typename T, int HEAD>
__device__ __forceinline__ void write_rows(T* __restrict__ out, long long out_stride_t, long long out_stride_h,
                                           float* __restrict__ part_acc, float* __restrict__ part_ml,
                                           const float (&acc)[L::MT][L::NT_O][4], const float (&m)[L::NR],
                                           const float (&l_rows)[L::NR], const TileRows<L::NR>& rows,
                                           const TileCta<L>& c, int part, int total_q, int num_kv_heads, int num_parts,
                                           bool poisoned) {
#pragma unroll
  for (int hf = 0; hf < L::NR; ++hf) {
    if (!rows.written[hf]) continue;
    const float l = poisoned_sum(l_rows[hf], poisoned);
    const int R = c.m0 + c.row(hf);
    const float(&row_acc)[L::NT_O][4] = acc[hf / 2];
    const int c0 = 2 * (hf % 2);
    const long long q_row = c.q0 + R / c.G;
    const int h = rows.h[hf];
    if (num_parts == 1) {
      const float inv = inv_sum(l);
      T* o = out + q_row * out_stride_t + h * out_stride_h;
#pragma unroll
      for (int n = 0; n < L::NT_O; ++n) {
        const int d = n * 8 + 2 * c.qc;
        if (d < HEAD) {
          o[d] = from_float<T>(row_acc[n][c0] * inv);
          o[d + 1] = from_float<T>(row_acc[n][c0 + 1] * inv);
        }
      }
    } else {
      const long long at = (static_cast<long long>(part) * total_q + q_row) * (num_kv_heads * c.G) + h;
#pragma unroll
      for (int n = 0; n < L::NT_O; ++n) {
        const int d = n * 8 + 2 * c.qc;
        if (d < HEAD) {
          part_acc[at * HEAD + d] = row_acc[n][c0];
          part_acc[at * HEAD + d + 1] = row_acc[n][c0 + 1];
        }
      }
      if (c.qc == 0) {
        part_ml[at * 2] = m[hf];
        part_ml[at * 2 + 1] = l;
      }
    }
  }
}

}  // namespace cpa
