// Paged prefill / chunked-prefill attention with an additive bias: many query tokens per sequence, keys and values
// read through a block table.
//
// Sequence s owns query rows query_start_loc[s] ... query_start_loc[s + 1] − 1 (q_len of them); they are the last
// q_len of its len = seq_lens[s] keys, so query row i sits at absolute position p_i = len − q_len + i. For query
// head h (KV head h / G) and key position j < len (j <= p_i when causal):
//
//   x(i, h, j) = scale·<q_ih, k_j> + alibi_h·(j − p_i) + bias(s, h, i, p_i, j)
//   out_ih     = Σ_j softmax_j(x)·v_j                                     (float32 softmax and accumulation)
//
// One CTA per (M tile, KV head, partition of the keys). The M dimension of the matrix products packs (query token,
// query head of the KV group) pairs, FlashInfer-style: packed row R = i·G + g is token i, head kvh·G + g, so a CTA
// of 128 rows serves e.g. 128 tokens of one head (G = 1), 16 tokens of 8 heads, or, in decode with GQA (8 or 16
// rows), the G heads of one token. Every row carries its own position and key range, so all of these are the same code.
//
// 16-bit dtypes run on the tensor cores (mma.sync m16n8k16, float32 accumulators); float32 runs a plain SIMT kernel
// (paged_prefill_simt: correct, not fast; no TF32, whose rounding would miss the 2e-5 tolerance).
//
// Tensor-core kernel, per CTA: 4 warps, warp w owns packed rows 32w ... 32w + 31 (prefill; 16 rows for head sizes
// over 128), or all 4 warps own the same 8 or 16 rows and split each tile's keys (decode: DECODE_ROWS, see
// PrefillLayout; decode accumulates Oᵀ += Vᵀ·Pᵀ instead of the O += P·V below).
//   S = Q·Kᵀ      A = Q via ldmatrix (each tile with two m tiles per warp; else once, into registers),
//                 B = K tile via ldmatrix
//   online softmax on S in registers (base 2): m = row reference (the running max, moved lazily), l = Σ 2^(x − m)
//   O += P·V      A = P (the S accumulators, rounded to 16 bits), B = V tile via ldmatrix.trans
// K and V tiles of TILE_N keys travel global -> shared by cp.async, STAGES deep, one barrier per tile; the byte
// offset of each key's page row is computed once per key (page_s) so that a copy costs a shared load and two adds.
// Rows of shared memory are padded by one 16-byte vector (an odd number of vectors per row), so the 8 rows that one
// ldmatrix matrix reads fall in 8 different bank groups; the decode tiling's rows of whole 128-byte lines are
// unpadded and XOR-swizzled instead (swizzled_row_vector: cp.async into padded rows cost L2 traffic, see ROW). Two
// CTAs per SM in prefill (see PrefillLayout).
// Per tile, each term of the logits is its own loop under a warp-uniform branch (ALiBi, the bias, the mask), so the
// inner loop stays small: an earlier version with a branch per logit and per bias dtype outgrew the instruction
// cache and ran 2.3x slower. T5 tiles that lie max_distance or more from every row of the CTA add one constant
// per row (far_s); the others read a table built once per CTA (prefill: rel_s by relative position; decode: near_s
// by distance).
//
// Hopper tiling (WG = true; sm_90a, float16 / bfloat16, head sizes 64 and 128, prefill): 8 warps as two warpgroups of
// 64 rows (128 rows per CTA, as above), wgmma (wgmma.cuh) instead of mma.sync: S = Q·Kᵀ with Q and the K tile read
// by the tensor cores from shared memory (128-byte swizzled tiles instead of padded rows), O += P·V with P from
// registers; the logits, masks, bias and softmax are the code above, on the same fragment layout. Two CTAs per SM
// (128 registers), one tile of copies ahead. At head size 64 a tile's P·V is issued with the next tile's S and runs
// during that tile's softmax (three K/V stages); at 128 it is waited for in its tile (two stages: see
// wgmma_deferred). T5 only through the CTA's table (kT5TableOnly); a dense bias runs on the mma.sync tiling.
//
// Tiles: a host-sized grid of M tiles over all sequences, mapped to (sequence, tile of that sequence) by
// paged_prefill_plan (device side: the host never reads query_start_loc). With several partitions (split-K, when
// the grid is small) each CTA writes (acc, m, l) and paged_prefill_reduce combines them.
#include "common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace cpa {

// ---------------------------------------------------------------------------------------------------------------
// Constants
// ---------------------------------------------------------------------------------------------------------------
constexpr int kPrefillThreads = 128;  // 4 warps
constexpr int kRowsPerMma = 16;       // the M of one mma
constexpr int kPrefillWarps = kPrefillThreads / kWarpSize;
constexpr int kSimtRowsPerCta = 64;   // packed (token, head) rows of a SIMT (float32) CTA
constexpr int kPrefillStages = 2;     // K/V tiles in shared memory: one computing, one landing
constexpr int kRelTableMax = 2048;    // floats of a CTA's relative-bias table (T5)
constexpr int kSmemPerSm = 228 * 1024;  // shared memory of an H100 / H200 SM (each CTA takes 1 KB more than it asks)
constexpr int kPlanThreads = 1024;
constexpr int kPrefillReduceThreads = 128;
constexpr int kReduceBatch = 8;  // partitions whose partials paged_prefill_reduce loads at once
// The Hopper tiling (wgmma, sm_90a; PrefillLayout with WG = true): two warpgroups of 64 rows each.
constexpr int kWgmmaThreads = 256;
constexpr int kWgmmaRows = 128;
constexpr int kWgmmaTileKeys = 64;
// Whether the Hopper tiling defers each tile's P·V into the next iteration (three stages; see pv_pending): at head
// size 64. At 128, two CTAs per SM (each SM's 16 warps hide each other's latency; with one CTA and three stages the
// no-bias case ran 3.48 ms against 2.69) leave shared memory for two stages only: a tile's P·V is waited for in its
// tile.
__host__ __device__ constexpr bool wgmma_deferred(int head) { return head <= 64; }
constexpr int kWarpgroupThreads = 128;
#ifndef CPA_BIAS_RING
#define CPA_BIAS_RING 3
#endif
constexpr int kBiasRing = CPA_BIAS_RING;  // decode: tiles of dense / ragged bias values in flight (register arrays)

// std::is_same without <type_traits> (NVRTC ships no standard library headers).
template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// The query rows of sequence s, clamped into [0, total_q] whatever query_start_loc holds (the plan and the kernels
// agree on them, so every tile the plan made exists for the kernels).
__device__ __forceinline__ int2 query_rows(const int* query_start_loc, int s, int total_q) {
  const int q0 = min(max(query_start_loc[s], 0), total_q);
  const int q1 = min(max(query_start_loc[s + 1], q0), total_q);
  return make_int2(q0, q1 - q0);
}

// The rows of this CTA: sequence s (−1 for a spare tile of the host-sized grid), its M tile, the sequence's first
// query row q0 and q_len, and the KV head. Prefill: blockIdx.x is a tile of the plan's tile_info (last first),
// blockIdx.y the KV head. Decode passes no query_start_loc: one query row per sequence (row s), ceil(G / rows) M tiles per
// sequence, and blockIdx.x = (s·tiles + tile)·num_kv_heads + kvh, so that the CTAs of one sequence run side by
// side (a RaggedBias row holds every head of a key: each sector is then fetched once, not once per KV head). With
// longest_first the kernel then takes the sequence of rank s instead (seq_of_rank, common.cuh).
struct CtaRows {
  int s, tile, q0, q_len, kvh;
};
__device__ __forceinline__ CtaRows cta_rows(const int2* tile_info, const int* query_start_loc, int total_q, int G,
                                            int num_kv_heads, int rows) {
  if (query_start_loc == nullptr) {
    const int tiles = (G + rows - 1) / rows;
    const int kvh = static_cast<int>(blockIdx.x) % num_kv_heads;
    const int st = static_cast<int>(blockIdx.x) / num_kv_heads;
    return {st / tiles, st % tiles, st / tiles, 1, kvh};
  }
  // Last entry first: a sequence's later tiles come first, which under a causal mask are its longest (more keys
  // than the tiles before them), so the GPU's last wave is of short ones. (The spare tiles, last in tile_info,
  // exit at once.)
  const int2 info = tile_info[gridDim.x - 1 - blockIdx.x];
  if (info.x < 0) return {-1, 0, 0, 0, 0};
  const int2 q = query_rows(query_start_loc, info.x, total_q);
  return {info.x, info.y, q.x, q.y, static_cast<int>(blockIdx.y)};
}

// ---------------------------------------------------------------------------------------------------------------
// The plan: tile_info[t] = (sequence, M tile within it) for t < Σ_s ceil(q_len_s·G / rows), (−1, 0) for the
// rest of the host-sized grid (num_tiles >= that sum for any valid query_start_loc; extra tiles are dropped).
// One CTA, sequences in chunks of kPlanThreads with an exclusive scan of their tile counts.
// ---------------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kPlanThreads) paged_prefill_plan(const int* __restrict__ query_start_loc,
                                                                   int num_seqs, int total_q, int group_size,
                                                                   int rows_per_tile, int2* __restrict__ tile_info,
                                                                   int num_tiles) {
  __shared__ int scan_s[kPlanThreads];
  const int tid = threadIdx.x;
  for (int t = tid; t < num_tiles; t += kPlanThreads) tile_info[t] = make_int2(-1, 0);
  // Every (−1, 0) is written before any tile is assigned (the writes below may land on the same entries).
  __syncthreads();
  int carry = 0;
  for (int base = 0; base < num_seqs; base += kPlanThreads) {
    const int s = base + tid;
    int n = 0;
    if (s < num_seqs) {
      const long long rows = static_cast<long long>(query_rows(query_start_loc, s, total_q).y) * group_size;
      n = static_cast<int>(min((rows + rows_per_tile - 1) / rows_per_tile, static_cast<long long>(num_tiles)));
    }
    scan_s[tid] = n;
    __syncthreads();  // every count is in before the scan reads its neighbours
    // Hillis-Steele inclusive scan; each step reads, syncs, then writes.
    for (int o = 1; o < kPlanThreads; o *= 2) {
      const int add = tid >= o ? scan_s[tid - o] : 0;
      __syncthreads();  // all reads of this step are done before anyone writes
      scan_s[tid] += add;
      __syncthreads();  // all writes of this step are done before the next step reads
    }
    const long long first = static_cast<long long>(carry) + scan_s[tid] - n;
    for (int k = 0; k < n && first + k < num_tiles; ++k) tile_info[first + k] = make_int2(s, k);
    carry = static_cast<int>(min(static_cast<long long>(carry) + scan_s[kPlanThreads - 1],
                                 static_cast<long long>(num_tiles)));
    __syncthreads();  // scan_s is rewritten by the next chunk
  }
}

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
// Host mirror: _compile.py (rows_per_cta, prefill_tile_keys, prefill_smem_bytes, decode_ctas_per_sm, decode_stages).
// ---------------------------------------------------------------------------------------------------------------
constexpr int kDecodeKeyWarps = 4;
__host__ __device__ constexpr int prefill_m_tiles(int head, int decode_rows) {
  return decode_rows == 0 && head <= 128 ? 2 : 1;
}
__host__ __device__ constexpr int rows_per_cta(int head, int decode_rows) {
  return decode_rows > 0 ? decode_rows : kRowsPerMma * prefill_m_tiles(head, 0) * kPrefillWarps;
}
// Shared memory of a CTA, in bytes (PrefillLayout::kSmemBytes): Q_s [rows][row] and the K/V stages
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

template <typename T, int HEAD, int DECODE_ROWS, bool WG = false>
struct PrefillLayout {
  static constexpr bool kDecode = DECODE_ROWS > 0;
  static constexpr int KEY_WARPS = kDecode ? kDecodeKeyWarps : 1;  // warps that split a tile's keys
  static constexpr bool kWgmma = WG;  // the Hopper tiling (see the file's header and wgmma_deferred)
  static constexpr int THREADS = WG ? kWgmmaThreads : kPrefillThreads;
  static constexpr int WARPS = THREADS / kWarpSize;
  static constexpr int MT = WG ? 1 : prefill_m_tiles(HEAD, DECODE_ROWS);  // m tiles (16 rows each) per warp
  static constexpr int ROWS_W = MT * kRowsPerMma;          // rows of one warp's S (decode: past ROWS, zeros)
  static constexpr int ROWS = WG ? kWgmmaRows : rows_per_cta(HEAD, DECODE_ROWS);  // packed (token, head) rows per CTA
  // Fragment rows of a thread that hold packed rows (qr + 8·hf of each m tile; decode: ROWS / 8), and decode's n
  // tiles of Oᵀ (8 rows each).
  static constexpr int NR = kDecode ? ROWS / 8 : 2 * MT;
  static constexpr int NH = kDecode ? ROWS / 8 : 0;
  static constexpr int VEC = vec_elems<T>();               // 8 elements per 16-byte vector
  static constexpr int HEAD_P = (HEAD + 15) / 16 * 16;     // head size padded to the mma's k (120 -> 128)
  static constexpr int NV = HEAD_P / VEC;                  // vectors per padded row (even)
  static constexpr int NV_REAL = HEAD / VEC;               // of those, vectors that hold data (the rest are zeros)
  // Row pitch in vectors. Prefill's rows: odd (padded by one vector), so ldmatrix is conflict-free. The decode
  // tiling's rows of whole 128-byte lines (head sizes 64 and 128: NV % 8 == 0) are unpadded, their 8-vector groups
  // XOR-swizzled by the row instead (swizzled_row_vector): a cp.async copy lands in shared memory row by row, and
  // into padded rows, whose 128-byte lines straddle the copy's, the hardware read half of the 32-byte sectors twice
  // from L2 (ncu, B32 H32/8 d128: 50.4 M sectors for 33.6 M of K and V, 8 % of the time; decode_probe.py cp-async).
  // The Hopper tiling's rows are unpadded and swizzled in blocks (wgmma.cuh).
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
  // holding the previous tile's V for the P·V still running (the warpgroup's pipeline, see pv_pending).
  static constexpr int AHEAD = WG ? 1 : STAGES - 1;
  static constexpr bool kPvDefer = WG && STAGES == 3;
  static constexpr int PAGE_BUFFERS = AHEAD + 2;  // tiles whose page offsets are in shared memory (see page_s)
  // Decode has one query position per CTA: its T5 table is per distance (near_s, in the kernel), not this one.
  static constexpr int REL_TABLE = kDecode ? 0 : kRelTableMax;
  // Shared memory, in bytes (tiling_smem_bytes; Hopper: 1024 more, to align Q_s and KV_s on the swizzle's period).
  static constexpr int kKVBytes = STAGES * 2 * TILE_N * ROW * kVecBytes;
  static constexpr int kSmemBytes =
      tiling_smem_bytes(ROWS, ROW, TILE_N, STAGES, PAGE_BUFFERS, REL_TABLE, WG ? 1024 : 0);
  static_assert(sizeof(T) == 2, "the tensor-core kernel takes float16 / bfloat16");
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 227 * 1024, "the CTAs per SM fit in an H100/H200 SM");
  static_assert(!WG || (!kDecode && HEAD % 64 == 0 && (NT_S == 8 || NT_S == 16) && (NT_O == 8 || NT_O == 16) &&
                        ROWS == WARPS * kRowsPerMma),
                "Hopper tiling: prefill, head size 64 or 128, 64 or 128 keys per tile, 16 rows per warp");
  static_assert(HEAD % VEC == 0 && NV % 2 == 0, "whole vectors, pairs of 8-column matrices");
  static_assert(KEYS_W % 16 == 0, "P·V takes keys 16 at a time");
  static_assert(!kDecode || KEY_WARPS * ROWS * (HEAD_P + 6) * 4 <= kKVBytes, "the warps combine in the K/V stages");
  static_assert(!kDecode || (MT == 1 && (ROWS == 8 || ROWS == 16) && TILE_N == kDecodeTileKeys),
                "decode: one m tile, kDecodeTileKeys keys");
};

// ---------------------------------------------------------------------------------------------------------------
// The tensor-core kernel. Template parameters: T (__half / __nv_bfloat16), HEAD, cache LAYOUT, Bias = NoBias,
// DenseBias, RaggedBias (decode) or T5Bias (common.cuh), DECODE_ROWS (0: prefill; see PrefillLayout). Run-time:
// page size (block_shift), causal, ALiBi, bias dtype, split. Decode passes query_start_loc = tile_info = null
// (cta_rows).
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD, KvLayout LAYOUT, typename Bias, int DECODE_ROWS, bool WG>
__global__ void __launch_bounds__(PrefillLayout<T, HEAD, DECODE_ROWS, WG>::THREADS,
                                  PrefillLayout<T, HEAD, DECODE_ROWS, WG>::kCtasPerSm) paged_prefill(
    T* __restrict__ out, long long out_stride_t, long long out_stride_h,  // [total_q, num_heads, HEAD]
    float* __restrict__ part_acc,  // [num_parts, total_q, num_heads, HEAD], used when num_parts > 1
    float* __restrict__ part_ml,   // [num_parts, total_q, num_heads, 2] = (m, l) in base 2
    const T* __restrict__ query, long long q_stride_t, long long q_stride_h, int q_vec,  // [total_q, num_heads, HEAD]
    const int* __restrict__ query_start_loc, int total_q,  // [num_seqs + 1]
    const int2* __restrict__ tile_info,                    // [gridDim.x], from paged_prefill_plan
    const T* __restrict__ key_cache, const T* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens, int max_len, int q_limit,           // q_limit: rows a dense bias holds
    const void* bias_ptr, const int* bias_index, long long bias_stride_0, long long bias_stride_1,
    long long bias_stride_2, long long bias_stride_3, int bias_dtype, int bias_n, int bias_m,  // BiasArgs
    const float* __restrict__ alibi_slopes,  // [num_heads] or null
    float scale, int group_size, int causal, int tokens_per_part, int num_parts,
    int longest_first) {  // decode: nonzero, the CTAs of row r take the r-th longest sequence (seq_of_rank)
  using L = PrefillLayout<T, HEAD, DECODE_ROWS, WG>;
  using Cache = PagedCache<T, HEAD, LAYOUT>;
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!WG, "the Hopper tiling (wgmma) compiles for sm_90a only");
#endif
  constexpr int NV = L::NV, NV_REAL = L::NV_REAL, ROW = L::ROW, TILE_N = L::TILE_N, KSTEPS = L::KSTEPS;
  constexpr int NT_S = L::NT_S, NT_O = L::NT_O, COPIES = L::COPIES, MT = L::MT, NR = L::NR, NH = L::NH;
  constexpr int KEY_WARPS = L::KEY_WARPS;
  // Elements of an m tile of S that hold rows (decode with 8 rows: c0, c1; the rest are the zero rows' logits).
  constexpr int EL = L::kDecode ? 2 * NR : 4;
  constexpr int ROWS = L::ROWS, STAGES = L::STAGES, PAGE_BUFFERS = L::PAGE_BUFFERS, REL_TABLE = L::REL_TABLE;
  constexpr int AHEAD = L::AHEAD;
  constexpr bool kT5 = SameType<Bias, T5Bias>::value;
  // launch_dependents() only in the decode tiling's epilogue (below). At the top it changed prefill's whole schedule
  // (prefill d128 ~5 % slower), and in the decode tiling alone it measured 0.5-1 % slower (B1 H32/8 L65536 dense
  // 82.2 -> 82.9 us; B4 L32768 148.3 -> 149.3).
  // A split decode grid's launch may precede the end of the kernel before it (decode.py): nothing is read before.
  if constexpr (L::kDecode) wait_for_primary();

  extern __shared__ uint4 smem[];
  // (Hopper: Q_s and the stages start on the 128-byte swizzle's period, 1024 bytes.)
  uint4* q_s = L::kWgmma ? smem + ((1024u - (smem_addr(smem) & 1023u)) & 1023u) / kVecBytes : smem;  // [ROWS][ROW]
  uint4* kv_s = q_s + ROWS * ROW;                      // [stage][K, V][TILE_N][ROW]
  long long* page_s = reinterpret_cast<long long*>(kv_s + STAGES * 2 * TILE_N * ROW);  // [PAGE_BUFFERS][TILE_N]
  float* rel_s = reinterpret_cast<float*>(page_s + PAGE_BUFFERS * TILE_N);            // [REL_TABLE]
  float* far_s = rel_s + REL_TABLE;                                                   // [2][ROWS]

  CtaRows cta = cta_rows(tile_info, query_start_loc, total_q, group_size, num_kv_heads, ROWS);
  int part = blockIdx.z;
  // Decode: where the first tiles' block ids are read (load_id before the loop: first_ids[i − first_base] is block
  // id i): the block table, or with longest_first and a sequence that is the row's own (a batch already longest
  // first, equal lengths included) the copy of the row's first ids that travelled to shared memory while the CTA
  // ranked. (Prefill reads the block table only: its code stays as it was, and so do its compile time and registers.)
  const int* first_ids = nullptr;
  int first_base = 0;
  // A ranked split grid (longest_first, num_parts > 1) runs sequence by sequence: the CTA at place i of the issue
  // order (blockIdx.x fastest, then z) takes partition i / per % num_parts of the sequence of rank
  // i / (per · num_parts), per = tiles · num_kv_heads CTAs per partition, and cuts that sequence's own keys into
  // num_parts equal runs of whole tiles (not max_len's tokens_per_part). The work then starts longest first in
  // pieces of about equal size per sequence, where partition by partition each sequence's last pieces came in a
  // later pass than other sequences' first ones (H200, B64 H32/8 d128 L∈[128, 8192], no bias: 306.8 -> 293.4 us;
  // benchmarks/NOTES.md, session 23).
  bool balanced = false;
  int first_key = 0;
  if constexpr (L::kDecode) {
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
      // The ranking's lengths, then the row's first ids, live in the last K/V stage, which no copy writes before
      // the loop's first barrier (the prologue fills stages 0 ... AHEAD − 1).
      int* lens_s = reinterpret_cast<int*>(kv_s + (STAGES - 1) * 2 * TILE_N * ROW);
      int* ids_s = lens_s + kMaxLongestFirstSeqs + 4;
      static_assert(STAGES == AHEAD + 1 && (kMaxLongestFirstSeqs + 4 + (AHEAD + 1) * TILE_N) * 4 <=
                                               2 * TILE_N * ROW * kVecBytes, "room to rank in the last stage");
      const int* row_ids = block_tables + row * block_table_stride;
      first_key = part * tokens_per_part;  // kstart (below) when the sequence is max_len long
      first_base = first_key >> block_shift;
      const int num_ids = ((min(first_key + (AHEAD + 1) * TILE_N, max_len) - 1) >> block_shift) - first_base + 1;
      copy_row_ids<L::THREADS, (AHEAD + 1) * TILE_N>(row_ids + first_base, num_ids, ids_s);
      cta.s = cta.q0 = seq_of_rank<L::THREADS>(seq_lens, total_q, max_len, row, lens_s, lens_s + kMaxLongestFirstSeqs);
      if (cta.s == row) first_ids = ids_s;
    }
  }
  const int s = cta.s;
  if (s < 0) return;  // a spare tile of the host-sized grid (uniform over the CTA: no barrier is skipped)
  const int m0 = cta.tile * ROWS;  // first packed row of this CTA
  const int kvh = cta.kvh;
  const int G = group_size;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int row_warp = warp / KEY_WARPS;         // this warp's rows: ROWS_W·row_warp ... of the CTA's
  const int key0 = (warp % KEY_WARPS) * L::KEYS_W;  // and its keys: key0 ... key0 + KEYS_W − 1 of each tile
  const int qr = lane / 4;  // fragment row (and row + 8)
  const int qc = lane % 4;  // fragment column pair

  const Bias bias = Bias::make(BiasArgs{bias_ptr, bias_index, {bias_stride_0, bias_stride_1, bias_stride_2,
                                        bias_stride_3}, bias_dtype, bias_n, bias_m});
  const typename Bias::Seq seq_bias = bias.seq(s);
  const int q0 = cta.q0, q_len = cta.q_len;
  const int len = seq_bias.limit(clamped_len(seq_lens, s, max_len));
  const int pos0 = len - q_len;  // absolute position of query row 0
  const int rows_total = q_len * G;
  const int part_keys = balanced ? max(TILE_N, ((len + num_parts - 1) / num_parts + TILE_N - 1) / TILE_N * TILE_N)
                                 : tokens_per_part;
  const int kstart = part * part_keys;
  const int kend = min(kstart + part_keys, len);
  if constexpr (L::kDecode) {
    if (kstart != first_key) first_ids = nullptr;  // (the ids copied start at first_key)
  }

  // Rows of the whole CTA: the last one written, and the position span (for the causal key range, T5's table).
  const int last_row = min(rows_total, m0 + ROWS) - 1;
  const int i_first = m0 / G;
  const int i_last = last_row / G;
  const int p_first = pos0 + i_first;
  const int p_last = pos0 + i_last;
  const int loop_end = causal ? min(kend, p_last + 1) : kend;
  const int num_tiles = loop_end > kstart ? (loop_end - kstart + TILE_N - 1) / TILE_N : 0;

  // T5 through one table in shared memory for the whole CTA: the bias depends on (head, j − p) only, and is the
  // same for every |j − p| >= max_distance (bias_n) on a side. Entry (g, w) of rel_s: head kvh·G + g at relative
  // position w − rel_half, base 2. Every (row, key) pair of a near tile (far_kind 0, below) lies within ±rel_half,
  // so a row reads its entries of a tile at fixed offsets from one address (row_off + t0 + key). Built once, before
  // the first tile. A table past REL_TABLE (large groups or max_distance): one load chain per logit.
  const int rel_half = min(bias_n, REL_TABLE) + TILE_N + p_last - p_first;
  const int rel_w = 2 * rel_half + 1;
  const bool use_rel = kT5 && REL_TABLE > 0 && bias_n <= REL_TABLE && G * rel_w <= REL_TABLE;
  // The Hopper tiling has no per-logit T5 path (its registers cost the 128-register budget of head size 128 some
  // 200 bytes of spills): the host gives it only problems whose table fits (prefill.py, _t5_table_fits).
  constexpr bool kT5TableOnly = L::kWgmma && kT5;
  if (kT5TableOnly && !use_rel) __trap();  // (unreachable)

  // ---- This thread's fragment rows: r = 2·mt + hf is row qr + 8·hf of the warp's m tile mt (accumulator
  // elements 2hf, 2hf + 1 of that tile's fragments). Per row: token, head, position, key range.
  auto cta_row = [&](int r) { return row_warp * L::ROWS_W + (r / 2) * kRowsPerMma + qr + 8 * (r % 2); };
  int row_i[NR], row_h[NR], row_p[NR], row_end[NR], row_off[NR];
  bool row_written[NR];
  float slope2[NR];
  int warp_min_end = 1 << 30;
  int warp_end = kstart;
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {
    const int R = m0 + cta_row(hf);
    const int i = R / G;
    const int g = R % G;
    row_written[hf] = R < rows_total;
    const bool keys = row_written[hf] && i < q_limit;
    row_i[hf] = keys ? i : 0;
    row_h[hf] = kvh * G + g;
    row_p[hf] = keys ? pos0 + i : p_last;
    row_end[hf] = keys ? (causal ? min(kend, pos0 + i + 1) : kend) : kstart;
    row_off[hf] = g * rel_w + rel_half - row_p[hf];  // T5: rel_s entry of relative position −row_p
    slope2[hf] = alibi_slopes != nullptr && row_written[hf] ? alibi_slopes[row_h[hf]] * kLog2e : 0.0f;
    if (row_written[hf]) {
      warp_min_end = min(warp_min_end, row_end[hf]);
      warp_end = max(warp_end, row_end[hf]);
    }
  }
  // Keys before warp_min_end are keys of every written row of the warp: tiles below it need no mask. Keys from
  // warp_end on are keys of none: the warp skips them (under a causal mask, the last tiles of the CTA's diagonal
  // for its first warps; every tile for a warp without rows).
#pragma unroll
  for (int o = 1; o < kWarpSize; o *= 2) {
    warp_min_end = min(warp_min_end, __shfl_xor_sync(0xffffffffu, warp_min_end, o));
    warp_end = max(warp_end, __shfl_xor_sync(0xffffffffu, warp_end, o));
  }

  // Far tiles: T5's bias is one value per direction for keys at least max_distance (bias_n) before the query, and
  // for keys at least far_after after it (max_distance when bidirectional; 0 otherwise: one bucket for all later
  // keys). A tile whose keys are all that far from every row of the CTA adds a per-row constant: no table, no
  // fill. Most tiles of a long sequence are far.
  const int far_after = bias_m > 0 ? bias_n : 0;
  auto far_kind = [&](int t0) -> int {  // 0: near, 1: every key far before, 2: every key far after
    if (!kT5) return 0;
    if (t0 + TILE_N - 1 - p_first <= -bias_n) return 1;
    return t0 - p_last >= far_after ? 2 : 0;
  };
  // far_s[kind][row]: the two constants of each row, base 2 (shared memory: registers are all taken). Written by
  // the row's own thread (qc == 0) and read by its quad: visible after the barrier before the first tile. Prefill
  // writes them here. Decode takes them from its T5 tables (below), or where those do not fit calls this once its
  // first tiles' copies are issued: each waits on two dependent loads (bucket, weight), which here delayed those
  // copies, the start of every CTA (H200, B64 H16/16 d64 L2048 and L∈[1024, 2048] on the tensor cores, T5: 134.5 ->
  // 134.2, 102.8 -> 102.4 us; benchmarks/NOTES.md, session 25).
  auto fill_far = [&]() {
    if (kT5 && qc == 0) {
#pragma unroll
      for (int hf = 0; hf < NR; ++hf) {
        const int r = cta_row(hf);
        far_s[r] = bias.value(seq_bias.load(row_h[hf], 0, 0, -bias_n)) * kLog2e;
        far_s[ROWS + r] = bias.value(seq_bias.load(row_h[hf], 0, 0, far_after)) * kLog2e;
      }
    }
  };
  if constexpr (!L::kDecode) fill_far();

  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const int* table = block_tables + s * block_table_stride;
  if (first_ids == nullptr) {  // (decode: the ranked sequence is not the row's own, or no ranking)
    first_ids = table;
    first_base = 0;
  }
  const int block_mask = (1 << block_shift) - 1;

  // Vector c of key t of stage st: padded rows, the decode tiling's swizzled rows, or the Hopper tiling's swizzled
  // blocks (wgmma.cuh). (The padded index is written as it always was: ptxas's schedule of the mma.sync tiling, 11 %
  // of its time at head size 128, changed with its association; so is Q_s's below.) Q_s's row r, vector c likewise
  // (q_vector).
  auto k_s = [&](int st, int t, int c) -> uint4* {
    if constexpr (L::kWgmma) return &kv_s[st * 2 * TILE_N * ROW + swizzled_vector(TILE_N, t, c)];
    else if constexpr (L::kSwizzledRows) return &kv_s[st * 2 * TILE_N * ROW + swizzled_row_vector(ROW, t, c)];
    else return &kv_s[((st * 2) * TILE_N + t) * ROW + c];
  };
  auto v_s = [&](int st, int t, int c) -> uint4* {
    if constexpr (L::kWgmma) return &kv_s[(st * 2 + 1) * TILE_N * ROW + swizzled_vector(TILE_N, t, c)];
    else if constexpr (L::kSwizzledRows) return &kv_s[(st * 2 + 1) * TILE_N * ROW + swizzled_row_vector(ROW, t, c)];
    else return &kv_s[((st * 2 + 1) * TILE_N + t) * ROW + c];
  };
  auto q_vector = [&](int r, int c) {
    if constexpr (L::kWgmma) return swizzled_vector(ROWS, r, c);
    else if constexpr (L::kSwizzledRows) return swizzled_row_vector(ROW, r, c);
    else return r * ROW + c;
  };

  // ---- Decode, T5: every global load before the first copies, none waiting on another. The bias of key j for a
  // row of head h at position p >= j (decode has no key after its query) is h's weight of bucket index[min(p − j,
  // n)]. Each thread loads up to kSlots weights of the CTA's heads' columns (entry e = tid + k·THREADS: bucket
  // e % col_per of head kvh·G + e / col_per) and up to kSlots entries of index at the start; they go to col_s and
  // idx_s (the end of the last K/V stage, free until the loop's first barrier) once the copies are issued, and after
  // the prologue's barrier the CTA builds near_s [head][distance 0 ... n − 1] (weights, base 2) and far_s from
  // them: a near tile's logit reads one shared float. fill_far's chain of two global loads per constant waited
  // behind the CTA's first copies, and a near tile's chain per logit at the end of every CTA (benchmarks/NOTES.md,
  // session 26). near_s takes the shared memory that the CTAs per SM leave over (up to 4 KB): at 3 of 4 CTAs of
  // head size 64 the T5 kernel ran 6 % slower. Larger tables (G·n past kNearTable, or n, G·col_per past
  // kSlots·THREADS): fill_far and loads per logit.
  constexpr bool kT5Tables = kT5 && L::kDecode;
  constexpr int kSlots = 2;
  constexpr int kSmPerCta = L::kSmemBytes + 1024;  // (the runtime's 1 KB per CTA)
  constexpr int kNearLeft = (kSmemPerSm / (kSmemPerSm / kSmPerCta) - kSmPerCta) / 4 / 32 * 32;  // floats
  constexpr int kNearTable = kNearLeft < 1024 ? kNearLeft : 1024;
  __shared__ float near_s[kT5Tables && kNearTable > 0 ? kNearTable : 1];
  static_assert(!kT5Tables || kSmemPerSm / (kSmPerCta + sizeof(near_s)) == kSmemPerSm / kSmPerCta,
                "T5's table costs no CTA per SM");
  static_assert(!kT5Tables || (kMaxLongestFirstSeqs + 4 + (AHEAD + 1) * TILE_N + 2 * kSlots * L::THREADS) * 4 <=
                                  2 * TILE_N * ROW * kVecBytes,
                "the ranking's lengths and ids and T5's column and index share the last K/V stage");
  const int col_per = kT5Tables ? (bias_m > 0 ? 2 : 1) * static_cast<int>(bias_stride_2) : 0;  // buckets used
  const bool t5_tables = kT5Tables && G * col_per <= kSlots * L::THREADS && bias_n < kSlots * L::THREADS &&
                         G * bias_n <= kNearTable;
  float* col_s = reinterpret_cast<float*>(kv_s + STAGES * 2 * TILE_N * ROW) - 2 * kSlots * L::THREADS;
  int* idx_s = reinterpret_cast<int*>(col_s + kSlots * L::THREADS);
  unsigned col_bits[kSlots];
  int near_idx[kSlots];
  if constexpr (kT5Tables) {
    if (t5_tables) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int e = tid + k * L::THREADS;
        col_bits[k] = e < G * col_per ? seq_bias.near_weight(e % col_per, kvh * G + e / col_per) : 0u;
        near_idx[k] = e <= bias_n ? seq_bias.near_bucket(e) : 0;
      }
    }
  }

  // ---- Q tile -> shared memory (zeros for rows past the sequence and for padding), then A fragments.
  for (int idx = tid; idx < ROWS * NV; idx += L::THREADS) {
    const int r = idx / NV;
    const int c = idx % NV;
    const int R = m0 + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (R < rows_total && c < NV_REAL) {
      const T* src = query + static_cast<long long>(q0 + R / G) * q_stride_t +
                     static_cast<long long>(kvh * G + R % G) * q_stride_h + c * L::VEC;
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
    q_s[q_vector(r, c)] = v;
  }

  // The T5 table (see rel_half); visible after the barrier before the first tile.
  if (use_rel) {
#pragma unroll 4
    for (int e = tid; e < G * rel_w; e += L::THREADS) {
      const int g = e / rel_w;
      const int w = e % rel_w;
      rel_s[e] = bias.value(seq_bias.load(kvh * G + g, 0, 0, w - rel_half)) * kLog2e;
    }
  }

  // ---- Pages. page_s[u % PAGE_BUFFERS][t] is the byte offset, in the key cache, of vector 0 of key t of tile u
  // (head kvh): its page's plus its token's. −1 when its block id lies outside the cache (never dereferenced: the
  // key is masked; validate=True reports it), −2 for keys past loop_end. Thread t < TILE_N loads key t's block id
  // one tile early (load_id, into a register) and stores the offset at the end of that tile (store_page): tile u's
  // offsets are written in iteration u − AHEAD − 1, read by its copies in iteration u − AHEAD and by its masks in
  // iteration u, so AHEAD + 2 buffers never collide. Each copy is then one shared load and two 64-bit adds.
  int pending_blk = 0;
  bool pending_in = false;
  auto load_id = [&](bool first, int t0) {  // first: a tile of the prologue
    if (tid < TILE_N) {
      const int j = t0 + tid;
      pending_in = j < loop_end;
      if constexpr (L::kDecode) {
        pending_blk = pending_in ? (first ? first_ids[(j >> block_shift) - first_base] : table[j >> block_shift]) : 0;
      } else {
        pending_blk = pending_in ? table[j >> block_shift] : 0;
      }
    }
  };
  auto store_page = [&](int u, int t0) {
    if (tid < TILE_N) {
      const bool blk_ok = pending_blk >= 0 && pending_blk < num_blocks;
      const long long at = static_cast<long long>(pending_blk) * cache_block_stride +
                           cache.page_offset((t0 + tid) & block_mask, kvh, 0);
      page_s[(u % PAGE_BUFFERS) * TILE_N + tid] =
          !pending_in ? -2 : blk_ok ? at * static_cast<long long>(sizeof(T)) : -1;
    }
  };

  // ---- Copies of tile u (keys from t0) into stage st: K/V vectors by cp.async (vLLM values gathered), zeros where
  // a key is missing. Slot k of this thread is vector c of tile row t (idx = tid + k·threads: coalesced). When the
  // threads cover whole rows (NV divides them), c is the same in every slot and its byte offset is folded into this
  // thread's cache pointers once. Returns whether every key that this thread copied lies in the cache.
  constexpr int THREADS = L::THREADS;
  constexpr bool kColFixed = THREADS % NV == 0;
  auto slot_used = [&](int k) { return L::kCopiesEven || k < COPIES - 1 || tid + k * THREADS < TILE_N * NV; };
  auto slot_col = [&](int k) { return kColFixed ? tid % NV : (tid + k * THREADS) % NV; };
  auto slot_row = [&](int k) { return kColFixed ? tid / NV + k * (THREADS / NV) : (tid + k * THREADS) / NV; };
  const long long col_bytes = kColFixed ? static_cast<long long>(slot_col(0)) * cache.vector_stride() * sizeof(T) : 0;
  const char* key_bytes = reinterpret_cast<const char*>(key_cache) + col_bytes;
  const char* value_bytes = reinterpret_cast<const char*>(value_cache) + col_bytes;
  // ---- A 16-bit bias whose elements of a tile lie side by side travels with its tile (decode): copied by cp.async
  // into stage st of bias_stage in the tile's group of copies, as units of UNIT_VECS 16-byte vectors, each unit from
  // its first element's address rounded down to 16 bytes (the bias may sit anywhere: that element is `shift` elements
  // into the unit). Bytes no logit reads are zero-filled, never copied, so no copy reads past the bias (a unit starts
  // at most 14 bytes before an element of it, inside the allocation, which starts on 16 bytes at least):
  //  - DenseRowsBias (keys adjacent): a unit per row, its keys t0 ... t0 + TILE_N − 1; zeros from the partition's
  //    end key on and for the rows without keys. 144-byte units put 8 rows' elements of one key in 8 bank groups.
  //  - RaggedRowsBias (heads adjacent, a key's step a multiple of 16 bytes, so every key has the same shift): a unit
  //    per key, the CTA's heads kvh·G + m0 ...; zeros past its last head and from the partition's end key on.
  constexpr bool kDenseStaged = L::kDecode && SameType<Bias, DenseRowsBias>::value;
  constexpr bool kRaggedStaged = L::kDecode && SameType<Bias, RaggedRowsBias>::value;
  constexpr bool kBiasStaged = kDenseStaged || kRaggedStaged;
  constexpr int UNITS = kRaggedStaged ? TILE_N : ROWS;
  constexpr int UNIT_VECS = kRaggedStaged ? (2 * ROWS + 14 + kVecBytes - 1) / kVecBytes : TILE_N * 2 / kVecBytes + 1;
  constexpr int STAGE_VECS = UNITS * UNIT_VECS;
  constexpr int ROW_STEP = kRaggedStaged ? 1 : UNIT_VECS * kVecBytes / 2;  // elements between rows in a stage
  constexpr int KEY_STEP = kRaggedStaged ? UNIT_VECS * kVecBytes / 2 : 1;  // and between keys
  constexpr int STAGED_SLOTS = (STAGE_VECS + L::THREADS - 1) / L::THREADS;  // vectors per thread
  __shared__ uint4 bias_stage[kBiasStaged ? STAGES * STAGE_VECS : 1];  // [stage][unit][UNIT_VECS]
  static_assert(!kBiasStaged || L::kCtasPerSm * (L::kSmemBytes + sizeof(bias_stage) + 1024) <= 227 * 1024,
                "the CTAs per SM fit with their bias stages");
  // Ragged: the CTA's heads' elements of key 0 (its rows hold heads kvh·G + m0 ... of one query), the bytes from one
  // key to the next, and the elements of the first vector before them.
  const char* heads_at = static_cast<const char*>(bias_ptr);
  long long staged_step = 2;  // bytes from one key to the next (dense: adjacent 16-bit elements)
  if constexpr (kRaggedStaged) {
    const typename Bias::Seq::Row heads = seq_bias.row(kvh * G + m0, 0, 0);
    heads_at = heads.at(0);
    staged_step = heads.step_bytes();
  }
  const int heads_shift = static_cast<int>(reinterpret_cast<unsigned long long>(heads_at) & 15ull) / 2;
  const char* staged_src[STAGED_SLOTS];  // this thread's vector tid + k·THREADS of tile 0 ...
  int staged_left[STAGED_SLOTS];         // ... dense: its row's bytes from there to the partition's end key;
                                         // ragged: the bytes of it to copy
  int staged_end[STAGED_SLOTS];          // ragged: the first tile start t0 whose copy of it is all zeros
  if constexpr (kBiasStaged) {
#pragma unroll
    for (int k = 0; k < STAGED_SLOTS; ++k) {
      const int idx = tid + k * L::THREADS;
      const int unit = idx / UNIT_VECS;
      const int vec = (idx % UNIT_VECS) * kVecBytes;
      staged_src[k] = static_cast<const char*>(bias_ptr);
      staged_left[k] = 0;
      staged_end[k] = kstart;
      if (idx < STAGE_VECS && kDenseStaged && m0 + unit < rows_total) {
        const int R = m0 + unit;
        const char* first = seq_bias.row(kvh * G + R % G, R / G, pos0 + R / G).at(0);
        staged_src[k] = reinterpret_cast<const char*>(reinterpret_cast<unsigned long long>(first) & ~15ull) + vec;
        staged_left[k] = static_cast<int>(first + 2ll * kend - staged_src[k]);
      }
      if (idx < STAGE_VECS && kRaggedStaged) {
        const int heads_bytes = 2 * (heads_shift + min(ROWS, rows_total - m0));
        staged_src[k] = heads_at - 2 * heads_shift + unit * staged_step + vec;
        staged_left[k] = max(0, min(kVecBytes, heads_bytes - vec));
        staged_end[k] = kend - unit;
      }
    }
  }
  auto stage_bias = [&](int st, int t0) {
    if constexpr (kBiasStaged) {
#pragma unroll
      for (int k = 0; k < STAGED_SLOTS; ++k) {
        const int idx = tid + k * L::THREADS;
        if (STAGE_VECS % L::THREADS == 0 || idx < STAGE_VECS) {
          const int bytes = kDenseStaged ? max(0, min(kVecBytes, staged_left[k] - 2 * t0))
                                         : t0 < staged_end[k] ? staged_left[k] : 0;
          cp_async16(&bias_stage[st * STAGE_VECS + idx], bytes > 0 ? staged_src[k] + t0 * staged_step : bias_ptr,
                     bytes);
        }
      }
    }
  };
  auto issue = [&](int st, int u, int t0) -> bool {
    const long long* pages = page_s + (u % PAGE_BUFFERS) * TILE_N;
    bool all_ok = true;
    stage_bias(st, t0);
#pragma unroll
    for (int k = 0; k < COPIES; ++k) {
      if (!slot_used(k)) continue;
      const int t = slot_row(k);
      const int c = slot_col(k);
      const long long page = pages[t];
      const bool copy = page >= 0 && c < NV_REAL;
      all_ok = all_ok && page != -1;
      const long long col = kColFixed ? 0 : static_cast<long long>(c) * cache.vector_stride() * sizeof(T);
      const long long at = copy ? page + col : 0;
      cp_async16(k_s(st, t, c), key_bytes + at, copy ? kVecBytes : 0);
      if constexpr (Cache::kValueIsVector) {
        cp_async16(v_s(st, t, c), value_bytes + at, copy ? kVecBytes : 0);
      } else {
        const int off = (t0 + t) & block_mask;
        const long long blk =
            copy ? (page / static_cast<long long>(sizeof(T)) - cache.page_offset(off, kvh, 0)) / cache_block_stride : 0;
        *v_s(st, t, c) = copy ? cache.gather_value(blk, off, kvh, c) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    cp_async_commit();
    return all_ok;
  };

  // ---- Running state of this thread's rows: m (base 2), l (this thread's share), acc = O.
  float m[NR], l[NR];
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {
    m[hf] = -inf();
    l[hf] = 0.0f;
  }
  // O: MT x NT_O C fragments (rows x head columns). Decode: Oᵀ, m tile dm (head columns 16dm ...) and n tile nh
  // (rows 8nh ...) at acc[0][dm·NH + nh]: element e is column 16dm + qr + 8(e / 2) of row 8nh + 2qc + (e & 1).
  constexpr int ACC_N = L::kDecode ? KSTEPS * NH : NT_O;
  float acc[MT][ACC_N][4];
  zero_fragments(acc);

  // Bias bits of a tile's logits for this thread's fragment (rows qr, qr + 8; keys key0 + 8nt + 2qc + {0, 1}).
  // Prefill loads them as a tile starts, to travel during its S = Q·Kᵀ. Decode, whose tiles are short and wait on
  // memory, loads them kBiasRing tiles ahead into a ring of kBiasRing register arrays (the tile loop is unrolled by
  // kBiasRing, so each slot is a compile-time array: no register waits on a load before its tile uses it). (T5 reads
  // in place, below: its loads hit L1.)
  // The thread's keys of a tile are j0 + {0, 1, 8, 9, ...}: decode takes one address per row and tile, then fixed
  // byte offsets (prefill, with 4x the keys per thread, would hold the offsets in registers it has not got). A key
  // past a row's end reads the row's last key instead (its logit is masked); rows without keys read nothing.
  constexpr bool kBiasLoads = Bias::enabled && !kT5 && !kBiasStaged;  // (dense and ragged: strided rows)
  constexpr bool kBiasAhead = kBiasLoads && L::kDecode;
  using BiasFrag = typename Bias::Raw[MT][NT_S][4];
  typename Bias::Seq::Row bias_rows[NR];
  if constexpr (kBiasLoads) {
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) bias_rows[hf] = seq_bias.row(row_h[hf], row_i[hf], row_p[hf]);
  }
  // A staged bias: where this thread's rows read their keys key0 + 2qc + ... in a stage, in elements. (A row without
  // keys takes its stand-in row's shift: any shift keeps its masked reads inside its unit.)
  int staged_at[NR];
  if constexpr (kBiasStaged) {
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) {
      int shift = heads_shift;
      if constexpr (kDenseStaged) {
        const char* first = seq_bias.row(row_h[hf], row_i[hf], row_p[hf]).at(0);
        shift = static_cast<int>(reinterpret_cast<unsigned long long>(first) & 15ull) / 2;
      }
      staged_at[hf] = cta_row(hf) * ROW_STEP + shift + (key0 + 2 * qc) * KEY_STEP;
    }
  }
  auto load_bias = [&](BiasFrag& raw, int t0) {
    if constexpr (kBiasLoads) {
      const int j0 = t0 + key0 + 2 * qc;
#pragma unroll
      for (int hf = 0; hf < NR; ++hf) {
        const bool whole = L::kDecode && j0 + (NT_S - 1) * 8 + 1 < row_end[hf];  // every key of it is in the row
        const char* p = bias_rows[hf].at(j0);
        const long long step = bias_rows[hf].step_bytes();  // widened: (8·nt + c)·step may pass 2**31
        if (row_end[hf] > kstart) {  // one branch per row, not per key
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const char* at = whole ? p + (nt * 8 + c) * step
                                     : bias_rows[hf].at(min(j0 + nt * 8 + c, row_end[hf] - 1));
              raw[hf / 2][nt][2 * (hf % 2) + c] = bias_rows[hf].load_at(at);
            }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt) raw[hf / 2][nt][2 * (hf % 2)] = raw[hf / 2][nt][2 * (hf % 2) + 1] = 0u;
        }
      }
    }
  };
  constexpr int RING = kBiasAhead ? kBiasRing : 1;
  BiasFrag ring[RING];
  if constexpr (kBiasAhead) {
#pragma unroll
    for (int u = 0; u < RING; ++u) load_bias(ring[u], kstart + u * TILE_N);
  }

  // Whether every key this thread copied for tile u lies in the cache: bit u % 32 (u's copies are issued
  // AHEAD < 32 tiles before u is computed).
  unsigned ok_bits = ~0u;
  auto issue_tile = [&](int u) {
    if (u < num_tiles) {
      const unsigned bit = 1u << (u % 32);
      ok_bits = issue(u % STAGES, u, kstart + u * TILE_N) ? ok_bits | bit : ok_bits & ~bit;
    } else {
      cp_async_commit();  // an empty group keeps the count of groups in flight per tile
    }
  };
  if (num_tiles > 0) {  // (uniform over the CTA)
#pragma unroll
    for (int u = 0; u <= AHEAD; ++u) {
      load_id(true, kstart + u * TILE_N);
      store_page(u, kstart + u * TILE_N);
    }
    __syncthreads();  // the first tiles' page offsets are visible to every thread's copies
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) issue_tile(u);
  }
  if constexpr (kT5Tables) {  // (decode has no rel_s, REL_TABLE)
    if (t5_tables) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int e = tid + k * L::THREADS;
        if (e < G * col_per) col_s[e] = bias.value(col_bits[k]) * kLog2e;
        if (e <= bias_n) idx_s[e] = seq_bias.held(near_idx[k]);
      }
    } else {
      fill_far();
    }
  }
  if constexpr (L::kWgmma) fence_proxy_async();  // Q_s (ordinary stores) is read by wgmma, the async proxy
  __syncthreads();  // Q_s (and prefill's far_s, rel_s; decode's col_s, idx_s) are complete before the warps read them
  if constexpr (kT5Tables) {  // decode's near_s and far_s: visible after the loop's first barrier
    if (t5_tables) {
      for (int e = tid; e < G * bias_n; e += L::THREADS)
        near_s[e] = col_s[(e / bias_n) * col_per + idx_s[e % bias_n]];
      if (qc == 0) {
        const int before = idx_s[bias_n];  // (index[n]: every distance >= n)
        const int after = bias_m > 0 ? bias_m + before : idx_s[0];
#pragma unroll
        for (int hf = 0; hf < NR; ++hf) {
          const float* col = col_s + (row_h[hf] - kvh * G) * col_per;
          far_s[cta_row(hf)] = col[before];
          far_s[ROWS + cta_row(hf)] = col[after];
        }
      }
    }
  }
  const int group = warp / (kWarpgroupThreads / kWarpSize);  // Hopper: this thread's warpgroup

  unsigned qa[L::kQInRegs ? KSTEPS : 1][4];
  if constexpr (L::kQInRegs && ROWS == 8) {  // (decode) rows 8 ... 15 of the m tile are zeros: a1 = a3 = 0
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      unsigned two[2];
      ldmatrix_x2(two, &q_s[L::kSwizzledRows ? q_vector(lane % 8, 2 * kk + (lane / 8) % 2)
                                             : (lane % 8) * ROW + 2 * kk + (lane / 8) % 2]);
      qa[kk][0] = two[0];
      qa[kk][2] = two[1];
      qa[kk][1] = qa[kk][3] = 0u;
    }
  } else if constexpr (L::kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
      ldmatrix_x4(qa[kk], &q_s[L::kSwizzledRows ? q_vector(row_warp * L::ROWS_W + lane % 16, 2 * kk + lane / 16)
                                                : (row_warp * L::ROWS_W + lane % 16) * ROW + 2 * kk + lane / 16]);
  }
  const float scale2 = scale * kLog2e;
  const bool has_alibi = alibi_slopes != nullptr;

  // Hopper: the warpgroup's pipeline (FlashAttention-3's). A tile's P·V is issued with the next tile's S = Q·Kᵀ
  // and runs while that tile's softmax computes: P (pa, 16-bit A fragments), the stage of its V (pv_stage) and its
  // rescale of acc (pv_alpha, when pv_rescale) wait in pv_pending for one iteration. acc is waited for, rescaled
  // and handed to the next P·V at the top of an iteration, after the barrier: a wait placed after the softmax's
  // exponentials was hoisted above them by ptxas.
  constexpr int PV_STEPS = L::kWgmma ? TILE_N / 16 : 1;
  unsigned pa[PV_STEPS][4];
  bool pv_pending = false, pv_rescale = false;  // (uniform over the warpgroup; over the warp)
  int pv_stage = 0;
  float pv_alpha[NR];
  auto rescale_pending = [&]() {  // acc (complete) times the pending tile's α, when a row's reference moved
    if constexpr (L::kWgmma) {
      wgmma_wait<0>();
      wgmma_pin(acc[0]);
      if (pv_rescale) {
#pragma unroll
        for (int n = 0; n < NT_O; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[0][n][e] *= pv_alpha[e / 2];
      }
    }
  };
  auto issue_pv = [&]() {  // O += P·V: V MN-major; keys 16kk ... are 16 rows of 128 bytes (128 vectors) further
    if constexpr (L::kWgmma) {
      const uint4* v_tile = v_s(pv_stage, 0, 0);
#pragma unroll
      for (int kk = 0; kk < PV_STEPS; ++kk) wgmma_rs<T>(acc[0], pa[kk], wgmma_desc(v_tile + kk * 16 * 8, TILE_N * 128));
    }
  };
  auto run_pv = [&]() {  // the pending P·V (its rescale first), issued and waited for
    if constexpr (L::kWgmma) {
      rescale_pending();
      wgmma_pin(acc[0]);
      wgmma_fence();
      issue_pv();
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_pin(acc[0]);
    }
  };

  for (int tile0 = 0; tile0 < num_tiles; tile0 += RING) {
#pragma unroll
    for (int slot = 0; slot < RING; ++slot) {  // (decode: each ring slot is a compile-time register array)
      const int tile = tile0 + slot;
      if (tile >= num_tiles) break;  // the same for every thread of the CTA
      const int st = tile % STAGES;
      const int t0 = kstart + tile * TILE_N;
      cp_async_wait<AHEAD - 1>();  // this thread's copies of this tile have landed (the younger groups may not)
      if constexpr (L::kWgmma) fence_proxy_async();  // ... and are visible to wgmma (the async proxy)
      // Every thread's copies of this tile (and its T5 table, its key flags) are visible, and every thread is done
      // with the previous tile, whose stage the copies issued next overwrite. Also: are all keys of it in the cache?
      const bool tile_ok = __syncthreads_and((ok_bits >> (tile % 32)) & 1u);
      issue_tile(tile + AHEAD);
      if (tile + AHEAD + 1 < num_tiles) load_id(false, t0 + (AHEAD + 1) * TILE_N);

      // Hopper: every warpgroup computes every tile (its wgmmas are collective, and ptxas serialises them when it
      // cannot prove a branch around them uniform); keys past a row's end are masked.
      if (L::kWgmma || t0 + key0 < warp_end) {  // (uniform over the warp)
        const bool need_mask = !(tile_ok && t0 + TILE_N <= warp_min_end);
        BiasFrag braw;
        if constexpr (kBiasStaged) {
          const unsigned short* stage = reinterpret_cast<const unsigned short*>(bias_stage + st * STAGE_VECS);
#pragma unroll
          for (int hf = 0; hf < NR; ++hf)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int c = 0; c < 2; ++c)
                braw[hf / 2][nt][2 * (hf % 2) + c] = stage[staged_at[hf] + (nt * 8 + c) * KEY_STEP];
        } else if constexpr (kBiasAhead) {
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < EL; ++e) braw[0][nt][e] = ring[slot][0][nt][e];
          if (tile + RING < num_tiles) load_bias(ring[slot], t0 + RING * TILE_N);
        } else if constexpr (kBiasLoads) {
          load_bias(braw, t0);
        }

        // ---- S = Q·Kᵀ: ROWS_W rows x KEYS_W keys per warp; each K fragment feeds the MT m tiles. Hopper: the
        // warpgroup's 64 rows x TILE_N keys, KSTEPS wgmmas from shared memory (Q and K K-major, see wgmma.cuh).
        float sacc[MT][NT_S][4];
        zero_fragments(sacc);
        if constexpr (L::kWgmma) {
          const uint4* q_group = q_s + group * 64 * 8;  // row 64·group of each 64-column block
          const uint4* k_tile = k_s(st, 0, 0);
          if constexpr (L::kPvDefer) rescale_pending();  // (the P·V issued last iteration has landed)
          wgmma_pin(sacc[0]);
          wgmma_pin(acc[0]);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < KSTEPS; ++kk) {
            const int block = kk / 4, step = (kk % 4) * 2;  // 64-column block, 32-byte step (2 vectors) inside it
            wgmma_ss<T>(sacc[0], wgmma_desc(q_group + block * ROWS * 8 + step, 0),
                        wgmma_desc(k_tile + block * TILE_N * 8 + step, 0), kk > 0);
          }
          wgmma_commit();
          if (pv_pending) issue_pv();  // the previous tile's P·V behind it
          wgmma_commit();              // (an empty group when none)
          wgmma_wait<1>();             // S only: groups complete in order
          wgmma_pin(sacc[0]);
        } else {
#pragma unroll
          for (int kk = 0; kk < KSTEPS; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              if constexpr (L::kQInRegs) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[mt][e] = qa[kk][e];
              } else {
                ldmatrix_x4(a[mt],
                            &q_s[(row_warp * L::ROWS_W + mt * kRowsPerMma + lane % 16) * ROW + 2 * kk + lane / 16]);
              }
            }
#pragma unroll
            for (int np = 0; np < NT_S / 2; ++np) {
              unsigned b[4];  // keys 16np + (0..7 | 8..15) x columns 16kk + (0..7 | 8..15)
              ldmatrix_x4(b, k_s(st, key0 + np * 16 + (lane / 16) * 8 + lane % 8, 2 * kk + (lane / 8) % 2));
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(sacc[mt][2 * np], a[mt], b[0], b[1]);
                mma_16816<T>(sacc[mt][2 * np + 1], a[mt], b[2], b[3]);
              }
            }
          }
        }

        // ---- Logits in base 2: x = (scale·s + alibi·(j − p) + bias)·log2(e); −inf for keys a row may not see.
        // One loop per term, each under a branch that is uniform over the warp: no term costs a branch per logit.
        // The scale rides on the bias's add (one FFMA). Row of element e of m tile mt: hf = 2·mt + e / 2.
        if constexpr (!Bias::enabled) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int e = 0; e < EL; ++e) sacc[mt][nt][e] *= scale2;
        } else if (const int far = far_kind(t0); far != 0) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const float* far_row = far_s + (far - 1) * ROWS + cta_row(2 * mt);
            const float row_bias[2] = {far_row[0], EL > 2 ? far_row[8] : 0.0f};
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int e = 0; e < EL; ++e) sacc[mt][nt][e] = fmaf(sacc[mt][nt][e], scale2, row_bias[e / 2]);
          }
        } else if (kT5TableOnly || use_rel) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const float* rel_row[2] = {rel_s + row_off[2 * mt] + t0, rel_s + row_off[min(2 * mt + 1, NR - 1)] + t0};
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int e = 0; e < EL; ++e)
                sacc[mt][nt][e] = fmaf(sacc[mt][nt][e], scale2, rel_row[e / 2][key0 + nt * 8 + 2 * qc + (e & 1)]);
          }
        } else if (kT5Tables && t5_tables) {  // (decode: keys past the row's query are masked)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const float* far_row = far_s + cta_row(2 * mt);
            const float row_far[2] = {far_row[0], EL > 2 ? far_row[8] : 0.0f};
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int e = 0; e < EL; ++e) {
                const int hf = 2 * mt + e / 2;
                const int d = max(row_p[hf] - (t0 + key0 + nt * 8 + 2 * qc + (e & 1)), 0);
                const float b = d < bias_n ? near_s[(row_h[hf] - kvh * G) * bias_n + d] : row_far[e / 2];
                sacc[mt][nt][e] = fmaf(sacc[mt][nt][e], scale2, b);
              }
          }
        } else {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int e = 0; e < EL; ++e) {
                const int hf = 2 * mt + e / 2;
                const int j = t0 + key0 + nt * 8 + 2 * qc + (e & 1);
                const typename Bias::Raw raw =
                    kT5 ? seq_bias.load(row_h[hf], row_i[hf], row_p[hf], j) : braw[mt][nt][e];
                sacc[mt][nt][e] = fmaf(sacc[mt][nt][e], scale2, bias.value(raw) * kLog2e);
              }
        }
        if (has_alibi) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int e = 0; e < EL; ++e) {
                const int hf = 2 * mt + e / 2;
                sacc[mt][nt][e] += slope2[hf] * static_cast<float>(t0 + key0 + nt * 8 + 2 * qc + (e & 1) - row_p[hf]);
              }
        }
        if (need_mask) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
              for (int e = 0; e < EL; ++e) {
                const int kl = key0 + nt * 8 + 2 * qc + (e & 1);
                if (t0 + kl >= row_end[2 * mt + e / 2] || page_s[(tile % PAGE_BUFFERS) * TILE_N + kl] == -1)
                  sacc[mt][nt][e] = -inf();
              }
        }

        // ---- Online softmax per row against a reference m (at least the max seen, less kRescaleSlack):
        // α = 2^(m − m_ref), p = 2^(x − m_ref), l = α·l + Σ p.
        // While a row has seen no key (m_ref = −inf) its reference is 0: α = 0·(nothing) and p = 0, never NaN.
        float alpha[NR], m_use[NR];
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
          // The reference moves only when the tile's max passes it by more than kRescaleSlack (lazy rescaling, as
          // in FlashAttention-4): p <= 2^kRescaleSlack then, exact in float32 and in the 16-bit P, and l and acc
          // share the reference, so out = acc / l is unchanged. Most tiles then leave every row's reference alone,
          // and the rescale of acc below is skipped.
          const bool moves = mx > m[hf] + kRescaleSlack;  // (m = −inf: any key moves it)
          const float m_ref = moves ? mx : m[hf];
          m_use[hf] = m_ref == -inf() ? 0.0f : m_ref;
          alpha[hf] = moves ? fast_exp2(m[hf] - m_use[hf]) : 1.0f;
          grow[hf] = moves && m[hf] != -inf();  // (from −inf, acc and l are still 0: nothing to rescale)
          m[hf] = m_ref;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < EL; ++e) sacc[mt][nt][e] = fast_exp2(sacc[mt][nt][e] - m_use[2 * mt + e / 2]);
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
        // A tile that moves no row's reference (α = 1 exactly) leaves acc as it is: one vote replaces the MT·NT_O·4
        // multiplications of the rescale. (Hopper: done with the tile's P·V, next iteration: rescale_pending.)
        if constexpr (L::kWgmma) {
          pv_rescale = __any_sync(0xffffffffu, rescale);
#pragma unroll
          for (int hf = 0; hf < NR; ++hf) pv_alpha[hf] = alpha[hf];
        } else if (__any_sync(0xffffffffu, rescale)) {
          if constexpr (L::kDecode) {  // Oᵀ: row 8nh + 2qc + c's α is held by the quad of lanes 4(2qc + c)
            float row_alpha[NH][2];
#pragma unroll
            for (int nh = 0; nh < NH; ++nh)
#pragma unroll
              for (int c = 0; c < 2; ++c) row_alpha[nh][c] = __shfl_sync(0xffffffffu, alpha[nh], 4 * (2 * qc + c));
#pragma unroll
            for (int n = 0; n < ACC_N; ++n)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[0][n][e] *= row_alpha[n % NH][e & 1];
          } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
              for (int n = 0; n < NT_O; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][n][e] *= alpha[2 * mt + e / 2];
          }
        }

        // ---- O += P·V: the S accumulators of n tiles 2kk, 2kk + 1 are the A fragment of keys 16kk ... 16kk + 15
        // (of the warp's keys); each V fragment feeds the MT m tiles. Hopper: P from registers, V from shared
        // memory MN-major, TILE_N / 16 wgmmas of 64 rows x HEAD columns, issued one iteration later (pv_pending).
        if constexpr (L::kWgmma) {  // issued with the next tile's S (kPvDefer), else here, by run_pv
#pragma unroll
          for (int kk = 0; kk < PV_STEPS; ++kk) {
            pa[kk][0] = pack2<T>(sacc[0][2 * kk][0], sacc[0][2 * kk][1]);
            pa[kk][1] = pack2<T>(sacc[0][2 * kk][2], sacc[0][2 * kk][3]);
            pa[kk][2] = pack2<T>(sacc[0][2 * kk + 1][0], sacc[0][2 * kk + 1][1]);
            pa[kk][3] = pack2<T>(sacc[0][2 * kk + 1][2], sacc[0][2 * kk + 1][3]);
          }
          pv_stage = st;
          if constexpr (L::kPvDefer) {
            pv_pending = true;
          } else {
            run_pv();
          }
        } else if constexpr (L::kDecode) {
          // Oᵀ += Vᵀ·Pᵀ: Pᵀ's B fragment of n tile nh (rows 8nh ...) and keys 16kk ... is (c0, c1) or (c2, c3) of S's
          // n tiles 2kk, 2kk + 1 as they are; Vᵀ's A fragments are the V tile read transposed, 16 head columns each.
#pragma unroll
          for (int kk = 0; kk < L::KEYS_W / 16; ++kk) {
            unsigned b[NH][2];
#pragma unroll
            for (int nh = 0; nh < NH; ++nh) {
              b[nh][0] = pack2<T>(sacc[0][2 * kk][2 * nh], sacc[0][2 * kk][2 * nh + 1]);
              b[nh][1] = pack2<T>(sacc[0][2 * kk + 1][2 * nh], sacc[0][2 * kk + 1][2 * nh + 1]);
            }
#pragma unroll
            for (int dm = 0; dm < KSTEPS; ++dm) {
              unsigned a[4];  // columns 16dm + (0..7 | 8..15) x keys 16kk + (0..7 | 8..15), transposed
              ldmatrix_x4_trans(a, v_s(st, key0 + kk * 16 + (lane / 16) * 8 + lane % 8, 2 * dm + (lane / 8) % 2));
#pragma unroll
              for (int nh = 0; nh < NH; ++nh) mma_16816<T>(acc[0][dm * NH + nh], a, b[nh][0], b[nh][1]);
            }
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < L::KEYS_W / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              a[mt][0] = pack2<T>(sacc[mt][2 * kk][0], sacc[mt][2 * kk][1]);
              a[mt][1] = pack2<T>(sacc[mt][2 * kk][2], sacc[mt][2 * kk][3]);
              a[mt][2] = pack2<T>(sacc[mt][2 * kk + 1][0], sacc[mt][2 * kk + 1][1]);
              a[mt][3] = pack2<T>(sacc[mt][2 * kk + 1][2], sacc[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int np = 0; np < NT_O / 2; ++np) {
              unsigned b[4];  // keys 16kk + (0..7 | 8..15) x columns 16np + (0..7 | 8..15), transposed
              ldmatrix_x4_trans(b, v_s(st, key0 + kk * 16 + ((lane / 8) % 2) * 8 + lane % 8, 2 * np + lane / 16));
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
              }
            }
          }
        }
      }
      // Tile + AHEAD + 1's page offsets (its block ids were loaded at the top of this tile); no one reads that buffer
      // now.
      if (tile + AHEAD + 1 < num_tiles) store_page(tile + AHEAD + 1, t0 + (AHEAD + 1) * TILE_N);
    }
  }
  if (pv_pending) run_pv();  // (Hopper) the last tile's P·V
  cp_async_wait<0>();  // no copy may still be writing shared memory when the CTA exits (or combines in it)

  // ---- Epilogue: l over the quad; out = acc / l, or (acc, m, l) for the split-K reduction.
#pragma unroll
  for (int hf = 0; hf < NR; ++hf) {
    l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 1);
    l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 2);
  }
  if constexpr (L::kDecode) {
    // Every key is read: the split-K reduction (a dependent launch) may be set up now, and its CTAs take this
    // grid's places as its CTAs exit, instead of being launched once the grid has ended (they wait for it in the
    // kernel). B1 H32/8 L65536 79.1-79.6 -> 78.1-78.4 us without a bias, 81.1-81.5 -> 80.7-80.8 dense (H200).
    launch_dependents();
    // The warps hold (m, l, acc) of the same rows over disjoint keys: combine them through the idle K/V stages as
    // split-K partitions are combined:  M = max_w m_w,  c_w = 2^(m_w − M),  L = Σ_w c_w·l_w,  o = Σ_w c_w·acc_w.
    // (Rows of acc_s are HEAD_P + 4 floats apart: a store of Oᵀ, rows 2qc + c x columns qr + ..., hits 32 banks.)
    constexpr int PITCH = L::HEAD_P + 4;
    float* acc_s = reinterpret_cast<float*>(kv_s);   // [KEY_WARPS][ROWS][PITCH]
    float* ml_s = acc_s + KEY_WARPS * ROWS * PITCH;  // [KEY_WARPS][ROWS][2]
    const int kw = warp % KEY_WARPS;
    __syncthreads();  // every warp is done with the stages
#pragma unroll
    for (int n = 0; n < ACC_N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 8 * (n % NH) + 2 * qc + (e & 1);
        const int d = 16 * (n / NH) + qr + 8 * (e / 2);
        acc_s[(kw * ROWS + r) * PITCH + d] = acc[0][n][e];
      }
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) {
      const int r = cta_row(hf);
      if (qc == 0) {
        ml_s[(kw * ROWS + r) * 2] = m[hf];
        ml_s[(kw * ROWS + r) * 2 + 1] = l[hf];
      }
    }
    __syncthreads();  // every warp's share is in shared memory
    const int rows = min(rows_total - m0, ROWS);
    for (int idx = tid; idx < rows * HEAD; idx += kPrefillThreads) {
      const int r = idx / HEAD;
      const int d = idx % HEAD;
      float big_m = -inf();
#pragma unroll
      for (int w = 0; w < KEY_WARPS; ++w) big_m = fmaxf(big_m, ml_s[(w * ROWS + r) * 2]);
      float big_l = 0.0f, o = 0.0f;
      if (big_m != -inf()) {
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) {
          const float c = fast_exp2(ml_s[(w * ROWS + r) * 2] - big_m);  // 0 for a warp that saw no key
          big_l += c * ml_s[(w * ROWS + r) * 2 + 1];
          o += c * acc_s[(w * ROWS + r) * PITCH + d];
        }
      }
      const int R = m0 + r;
      const long long q_row = q0 + R / G;
      const int h = kvh * G + R % G;
      if (num_parts == 1) {
        out[q_row * out_stride_t + h * out_stride_h + d] = from_float<T>(big_l > 0.0f ? o / big_l : 0.0f);
      } else {
        const long long at = (static_cast<long long>(part) * total_q + q_row) * (num_kv_heads * G) + h;
        part_acc[at * HEAD + d] = o;
        if (d == 0) {
          part_ml[at * 2] = big_m;
          part_ml[at * 2 + 1] = big_l;
        }
      }
    }
  } else {
#pragma unroll
    for (int hf = 0; hf < NR; ++hf) {
      if (!row_written[hf]) continue;
      const int R = m0 + cta_row(hf);
      const float(&row_acc)[NT_O][4] = acc[hf / 2];
      const int c0 = 2 * (hf % 2);
      const long long q_row = q0 + R / G;
      const int h = row_h[hf];
      if (num_parts == 1) {
        const float inv = l[hf] > 0.0f ? 1.0f / l[hf] : 0.0f;
        T* o = out + q_row * out_stride_t + h * out_stride_h;
#pragma unroll
        for (int n = 0; n < NT_O; ++n) {
          const int d = n * 8 + 2 * qc;
          if (d < HEAD) {
            o[d] = from_float<T>(row_acc[n][c0] * inv);
            o[d + 1] = from_float<T>(row_acc[n][c0 + 1] * inv);
          }
        }
      } else {
        const long long at = (static_cast<long long>(part) * total_q + q_row) * (num_kv_heads * G) + h;
#pragma unroll
        for (int n = 0; n < NT_O; ++n) {
          const int d = n * 8 + 2 * qc;
          if (d < HEAD) {
            part_acc[at * HEAD + d] = row_acc[n][c0];
            part_acc[at * HEAD + d + 1] = row_acc[n][c0 + 1];
          }
        }
        if (qc == 0) {
          part_ml[at * 2] = m[hf];
          part_ml[at * 2 + 1] = l[hf];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The SIMT kernel (float32, or any T): the same grid, rows and outputs as paged_prefill, computed with FMAs. Each
// warp takes packed rows warp, warp + 4, ...; per row, keys 32 at a time (lane = key) for the logits, then lanes
// over head_size for P·V. Reads K/V straight from the cache (L1/L2), once per row: a correctness path.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, int HEAD, KvLayout LAYOUT, typename Bias>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_simt(
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
    int longest_first) {  // (the tensor-core kernel's parameter list; prefill passes 0, and so this kernel ignores it)
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
  const int kstart = part * tokens_per_part;
  const int kend = min(kstart + tokens_per_part, len);
  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const int* table = block_tables + s * block_table_stride;
  const int block_mask = (1 << block_shift) - 1;

  for (int r = warp; r < kSimtRowsPerCta; r += kPrefillThreads / kWarpSize) {
    const int R = m0 + r;
    if (R >= q_len * G) break;
    const int i = R / G;
    const int h = kvh * G + R % G;
    const int p = pos0 + i;
    const int row_end = i >= q_limit ? kstart : causal ? min(kend, p + 1) : kend;
    const float slope = alibi_slopes != nullptr ? alibi_slopes[h] : 0.0f;
    const T* qp = query + static_cast<long long>(q0 + i) * q_stride_t + static_cast<long long>(h) * q_stride_h;
    float q[DPL];
#pragma unroll
    for (int k = 0; k < DPL; ++k) q[k] = lane + k * kWarpSize < HEAD ? scale * to_float(qp[lane + k * kWarpSize]) : 0.0f;

    // m = running max, l = running Σ exp(x − m), acc = running Σ exp(x − m)·v (lane holds columns lane + 32k).
    float m = -inf(), l = 0.0f;
    float acc[DPL];
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] = 0.0f;
    for (int j0 = kstart; j0 < row_end; j0 += kWarpSize) {
      // Logit of key j0 + lane, its dot product computed by the whole warp for each key in turn.
      float my_x = -inf();
      long long my_blk = -1;
      for (int t = 0; t < kWarpSize && j0 + t < row_end; ++t) {
        const int j = j0 + t;
        const long long blk = table[j >> block_shift];
        if (blk < 0 || blk >= num_blocks) continue;  // the same for every lane: masked key
        const int off = j & block_mask;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const int d = lane + k * kWarpSize;
          if (d < HEAD) dot += q[k] * to_float(cache.key_vec(blk, off, kvh, d / VEC)[d % VEC]);
        }
        dot = group_sum<kWarpSize>(dot);
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
    if (num_parts == 1) {
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      T* o = out + static_cast<long long>(q0 + i) * out_stride_t + h * out_stride_h;
#pragma unroll
      for (int k = 0; k < DPL; ++k)
        if (lane + k * kWarpSize < HEAD) o[lane + k * kWarpSize] = from_float<T>(acc[k] * inv);
    } else {
      // Stored in base 2 like the tensor-core kernel's, for the shared reduction.
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

// ---------------------------------------------------------------------------------------------------------------
// Split-K reduction, per (M tile, KV head) as the attention CTAs (same blockIdx.x, y):
//   M = max_p m_p,  w_p = 2^(m_p − M),  out = Σ_p w_p·acc_p / Σ_p w_p·l_p   (zeros when no key contributes).
// With few CTAs (a long sequence split into many partitions) this kernel is a chain of memory latencies, not
// bandwidth: each thread loads kReduceBatch partitions' partials at once, and past kReduceBatch partitions the
// partitions are spread over groups of threads (reduce_groups: the warps of a CTA in 1, 2, 4 or 8 groups), each an
// online combine of its own, merged in shared memory; a CTA takes kPrefillReduceThreads / groups output elements.
// With one group (at most kReduceBatch partitions) a thread takes 4 adjacent elements of one row instead (one
// (m, l) and one 16-byte acc load per partition), a CTA 4 · kPrefillReduceThreads, and a decode grid covers only
// the rows that hold heads: a quarter of the CTAs or fewer, which a grid of many tiles and few partitions needs
// (H200, B64 H32/8 d128 L∈[1024, 2048], 3 partitions: 112.8 -> 108.6 us; B64 L∈[128, 8192] 287.7 -> 283.9). A
// first version that did the same with several groups made B1 H32/8 L65536 (49 partitions) and B4 L32768 (12)
// 0.7-1.0 us slower, the cause not separated: that path and its grid are as they were (benchmarks/NOTES.md,
// session 23). The host's grid.z covers every element: reduce_chunks in _compile.py.
// ---------------------------------------------------------------------------------------------------------------
__host__ __device__ constexpr int reduce_groups(int num_parts) {
  return num_parts <= kReduceBatch ? 1 : num_parts <= 2 * kReduceBatch ? 2 : num_parts <= 4 * kReduceBatch ? 4 : 8;
}
__host__ __device__ constexpr int reduce_vec(int num_parts) { return reduce_groups(num_parts) == 1 ? 4 : 1; }

// (m, l, acc) of VEC adjacent elements: an online combine of partials.
template <int VEC>
struct ReducePartial {
  float m, l, o[VEC];
  __device__ __forceinline__ void add(float m_p, float l_p, const float (&acc)[VEC]) {
    // A partial that saw no key of this row (m = −inf, l = 0, acc = 0) weighs nothing.
    const float m_new = fmaxf(m, m_p);
    const float alpha = m == -inf() ? 0.0f : fast_exp2(m - m_new);
    const float w = m_p == -inf() ? 0.0f : fast_exp2(m_p - m_new);
    l = l * alpha + w * l_p;
#pragma unroll
    for (int v = 0; v < VEC; ++v) o[v] = o[v] * alpha + w * acc[v];
    m = m_new;
  }
};

// One group of threads (num_parts <= kReduceBatch), each thread VEC adjacent elements of one row.
template <typename T, int HEAD, int ROWS, int VEC>
__device__ __forceinline__ void reduce_tile(T* __restrict__ out, long long out_stride_t, long long out_stride_h,
                                            const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                            const CtaRows& cta, int total_q, int num_kv_heads, int G, int num_parts) {
  static_assert(HEAD % VEC == 0 && VEC == 4, "a thread's elements lie in one row, one 16-byte load");
  const int m0 = cta.tile * ROWS;
  const int rows = min(cta.q_len * G - m0, ROWS);
  const int num_heads = num_kv_heads * G;
  const long long part_stride = static_cast<long long>(total_q) * num_heads;
  const float2* ml2 = reinterpret_cast<const float2*>(part_ml);
  const int elems = rows * HEAD;
  for (int base = blockIdx.z * kPrefillReduceThreads * VEC; base < elems;
       base += gridDim.z * kPrefillReduceThreads * VEC) {  // (uniform over the CTA)
    const int idx = min(base + threadIdx.x * VEC, elems - VEC);  // (past the end: the last elements again)
    const int R = m0 + idx / HEAD;
    const int d = idx % HEAD;
    const long long q_row = cta.q0 + R / G;
    const int h = cta.kvh * G + R % G;
    const long long at = q_row * num_heads + h;
    float2 ml[kReduceBatch];
    float a[kReduceBatch][VEC];
#pragma unroll
    for (int i = 0; i < kReduceBatch; ++i) {  // unpredicated loads (past the last partition: the last again)
      const long long slot = min(i, num_parts - 1) * part_stride + at;
      ml[i] = ml2[slot];
      const float4 v = *reinterpret_cast<const float4*>(part_acc + slot * HEAD + d);  // (16 bytes: d % 4 == 0)
      a[i][0] = v.x, a[i][1] = v.y, a[i][2] = v.z, a[i][3] = v.w;
    }
    ReducePartial<VEC> r{-inf(), 0.0f, {}};
#pragma unroll
    for (int i = 0; i < kReduceBatch; ++i)  // one past the last partition counts as one that saw no key
      r.add(i < num_parts ? ml[i].x : -inf(), ml[i].y, a[i]);
    if (base + threadIdx.x * VEC < elems) {
      T* dst = out + q_row * out_stride_t + h * out_stride_h + d;
#pragma unroll
      for (int v = 0; v < VEC; ++v) dst[v] = from_float<T>(r.l > 0.0f ? r.o[v] / r.l : 0.0f);
    }
  }
}

template <typename T, int HEAD, int DECODE_ROWS>
__global__ void __launch_bounds__(kPrefillReduceThreads) paged_prefill_reduce(
    T* __restrict__ out, long long out_stride_t, long long out_stride_h,
    const float* __restrict__ part_acc, const float* __restrict__ part_ml,
    const int* __restrict__ query_start_loc, int total_q, const int2* __restrict__ tile_info,
    int num_kv_heads, int group_size, int num_parts) {
  constexpr int ROWS = sizeof(T) == 4 ? kSimtRowsPerCta : rows_per_cta(HEAD, DECODE_ROWS);  // the M tile's
  __shared__ float3 merge_s[kPrefillReduceThreads];  // (m, l, o) of each thread, when groups > 1
  const CtaRows cta = cta_rows(tile_info, query_start_loc, total_q, group_size, num_kv_heads, ROWS);
  if (cta.s < 0) return;
  launch_dependents();  // the next decode call's attention kernel may start (it waits for this grid before reading)
  wait_for_primary();   // decode launches this reduction early: the attention kernel's partials are now complete
  if (reduce_vec(num_parts) == 4) {  // (uniform over the grid)
    reduce_tile<T, HEAD, ROWS, 4>(out, out_stride_t, out_stride_h, part_acc, part_ml, cta, total_q, num_kv_heads,
                                  group_size, num_parts);
  } else {  // several groups, one element a thread (the code as it was before session 23)
    const int G = group_size;
    const int m0 = cta.tile * ROWS;
    const int rows = min(cta.q_len * G - m0, ROWS);
    const int num_heads = num_kv_heads * G;
    const int groups = reduce_groups(num_parts);
    const int elems = kPrefillReduceThreads / groups;  // output elements per CTA
    const int e = threadIdx.x % elems;
    const int group = threadIdx.x / elems;  // this thread's partitions: group, group + groups, ...
    const long long part_stride = static_cast<long long>(total_q) * num_heads;
    const float2* ml2 = reinterpret_cast<const float2*>(part_ml);
    for (int base = blockIdx.z * elems; base < rows * HEAD; base += gridDim.z * elems) {  // (uniform over the CTA)
      const int idx = min(base + e, rows * HEAD - 1);  // (a thread past the end computes the last element again)
      const int R = m0 + idx / HEAD;
      const int d = idx % HEAD;
      const long long q_row = cta.q0 + R / G;
      const int h = cta.kvh * G + R % G;
      const long long at = q_row * num_heads + h;
      // One online pass over this group's partitions, kReduceBatch at a time: their (m, l) and acc are loaded
      // together, then combined (a pass for the max and a second for the sums, each waiting on a load per partition,
      // took 10 us for 32 partitions at B1 H32/8 L65536: the long-context decode's tail).
      float big_m = -inf(), big_l = 0.0f, o = 0.0f;
      for (int p0 = group; p0 < num_parts; p0 += kReduceBatch * groups) {
        float2 ml[kReduceBatch];
        float a[kReduceBatch];
#pragma unroll
        for (int i = 0; i < kReduceBatch; ++i) {  // unpredicated loads (past the last partition: the last again)
          const long long slot = min(p0 + i * groups, num_parts - 1) * part_stride + at;
          ml[i] = ml2[slot];
          a[i] = part_acc[slot * HEAD + d];
        }
#pragma unroll
        for (int i = 0; i < kReduceBatch; ++i) {
          // A partition that saw no key of this row (m = −inf, l = 0, acc = 0) weighs nothing; one past the last
          // counts as such.
          if (p0 + i * groups >= num_parts) ml[i].x = -inf();
          const float m_new = fmaxf(big_m, ml[i].x);
          const float alpha = big_m == -inf() ? 0.0f : fast_exp2(big_m - m_new);
          const float w = ml[i].x == -inf() ? 0.0f : fast_exp2(ml[i].x - m_new);
          big_l = big_l * alpha + w * ml[i].y;
          o = o * alpha + w * a[i];
          big_m = m_new;
        }
      }
      if (groups > 1) {  // group 0 merges the groups' (m, l, o) of its element, as the partitions were merged
        merge_s[threadIdx.x] = make_float3(big_m, big_l, o);
        __syncthreads();  // every group's (m, l, o) of this element is in merge_s before group 0 reads them
        if (group == 0) {
          for (int g = 1; g < groups; ++g) {
            const float3 v = merge_s[g * elems + e];
            const float m_new = fmaxf(big_m, v.x);
            const float alpha = big_m == -inf() ? 0.0f : fast_exp2(big_m - m_new);
            const float w = v.x == -inf() ? 0.0f : fast_exp2(v.x - m_new);
            big_l = big_l * alpha + w * v.y;
            o = o * alpha + w * v.z;
            big_m = m_new;
          }
        }
        __syncthreads();  // merge_s is free for the next element
      }
      if (group == 0 && base + e < rows * HEAD)
        out[q_row * out_stride_t + h * out_stride_h + d] = from_float<T>(big_l > 0.0f ? o / big_l : 0.0f);
    }
  }
}

}  // namespace cpa
