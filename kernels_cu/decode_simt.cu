// Paged decode attention with an additive bias: one query token per sequence, keys and values read through a
// block table.
//
//   x_h(j)   = scale·<q_h, k_j> + alibi_h·(j − len + 1) + bias(s, h, j)        for key positions j < len
//              (j >= len − 1 − window_left with a sliding window; with a soft-cap c the first term is
//              c·tanh(scale·<q_h, k_j> / c))
//   out_h    = Σ_j softmax_j(x_h)·v_j                                          (float32 math, any storage dtype)
// The kernels hold x·log2(e) and take powers of 2 (one MUFU.EX2 each), so m below is in those units.
//
// One CTA per (sequence, KV head, chunk of up to HG query heads of that KV head's group, partition of the keys):
// blockIdx.x = (row·num_kv_heads + kvh)·chunks + chunk, so that the CTAs of one sequence run side by side (a
// RaggedBias row holds every head of a key: each of its sectors is then fetched once, not once per head), and
// blockIdx.z = partition. Row r is sequence r, or with longest_first the r-th longest (seq_of_rank).
// The CTA reads each key/value page of its partition once for all its query heads, in tiles of TILE tokens
// pipelined through shared memory, with an online softmax across tiles:
//   m = a reference for x (at most kRescaleSlack below the running max), l = Σ 2^(x − m), acc = Σ 2^(x − m)·v.
// With one partition the CTA writes out = acc / l. With several (split-K, for long contexts or few CTAs) each
// writes (acc, m, l) to a workspace and decode_simt_combine (split_k.cuh) combines the partitions; or, with
// CLUSTER, the partitions of one (sequence, KV head, chunk) are the CTAs of a thread block cluster (1, 1,
// num_parts), which keep their (acc, m, l) in shared memory and combine them there: no workspace and no second
// launch.
#include "bias.cuh"
#include "longest_first.cuh"
#include "paged_cache.cuh"
#include "split_k.cuh"

namespace cpa {

// ---------------------------------------------------------------------------------------------------------------
// Constants
// ---------------------------------------------------------------------------------------------------------------
constexpr int kDecodeThreads = 256;
constexpr int kVecsPerThread = 2;  // 16-byte key (and as many value) vectors each thread copies per tile
constexpr int kStages = 3;         // shared-memory pipeline depth: kStages − 1 tiles in flight while one computes
constexpr int kMaxDecodeTile = 128;  // tokens of the largest tile (16-bit head size 32)
constexpr int kMaxClusterParts = 8;  // partitions of a cluster-combined grid: a cluster of 8 CTAs is portable
// CTAs per SM the register budget of a cluster-combined kernel allows: the host launches one only where its grid
// holds at most one CTA per SM (planning.py, plan_decode), so registers never limit it.
constexpr int kClusterMinCtas = 2;

// ---------------------------------------------------------------------------------------------------------------
// Layout of one specialisation.
// Compute: thread (tx, ty, tz), tid = (tz·HG + ty)·TX + tx. TX lanes span head_size (VPL vectors each), ty is the
// query head, tz a token slot. The TX lanes of (ty, tz) form a group that scores and accumulates head ty over
// tokens tz, tz + TZ, ... of each tile with its own online softmax, query and accumulator all in registers; the
// groups are combined once, at the end. Lanes of a warp that differ only in ty read the same key and value
// vectors from shared memory: one broadcast serves all the heads of a group.
// Copies: a tile is TILE tokens, at most kVecsPerThread·kDecodeThreads 16-byte vectors of K and as many of V
// (16 KB per tile, whatever the shape); vector idx = tid + k·kDecodeThreads is token idx / NVEC, vector idx % NVEC.
// KV is the caches' element type: the query's, or an fp8 format (16 elements a vector, up to kMaxDecodeTile tokens
// a tile).
// ---------------------------------------------------------------------------------------------------------------
template <typename KV, int HEAD, int HG>
struct DecodeLayout {
  static constexpr int VEC = vec_elems<KV>();
  static constexpr int NVEC = HEAD / VEC;
  static constexpr int TILE = pow2_floor(kVecsPerThread * kDecodeThreads / NVEC) < kMaxDecodeTile
                                  ? pow2_floor(kVecsPerThread * kDecodeThreads / NVEC) : kMaxDecodeTile;
  // Lanes per token: enough to cover head_size in one or two vectors each (two halves the shuffles of the dot
  // product), while every thread still gets at least one token of a tile. Two vectors of fp8 would be 32 elements
  // of query and accumulator per lane: one.
  static constexpr int TX_ONE = pow2_ceil(NVEC) < kWarpSize ? pow2_ceil(NVEC) : kWarpSize;
  static constexpr int TX =
      TX_ONE >= 8 && VEC <= 8 && TILE * TX_ONE * HG >= 2 * kDecodeThreads ? TX_ONE / 2 : TX_ONE;
  static constexpr int VPL = (NVEC + TX - 1) / TX;
  static constexpr int TZ = kDecodeThreads / (TX * HG);
  static constexpr int TPT = TILE / TZ;            // tokens per thread per tile
  static constexpr int KPL = (TPT + TX - 1) / TX;  // of those, tokens whose bias this lane adds
  static constexpr int kStageVecs = kVecsPerThread * kDecodeThreads;  // per tensor: K_s and V_s are [TILE][NVEC]
  // CTAs per SM the register budget allows: four (64 registers) with one query head per CTA, whose state fits
  // them without spills; three (80) with more heads, whose bias rings and epilogue need the room. Four CTAs of
  // ~50 KB of shared memory fit an H100 / H200 SM (228 KB); elsewhere the occupancy is what shared memory allows.
  static constexpr int kMinCtas = HG == 1 ? 4 : 3;
  static constexpr int kStageBytes = kStages * 2 * kStageVecs * kVecBytes;
  // After the stages, one byte per token and stage: the token is a key (set by the thread that copies its first
  // vector, read by the lane that adds its bias). Sized for the largest tile, so every specialisation asks the same.
  // Then each warp's out-of-contract flag, in 16 bytes.
  static constexpr int kFlagsOffset = kStageBytes + kStages * kMaxDecodeTile;
  static constexpr int kSmemBytes = kFlagsOffset + 16;
  // With a T5 bias, then the near-weight table of each head, [HG][kT5NearDistances] raw bits (T5Bias::Seq::Row),
  // the column of the bias table it is gathered from, [HG][kT5NearDistances] (buckets of the keys' side), and the
  // CTA's sequence when ranked longest first (an int, in 16 bytes).
  static constexpr int kNearBytes = 2 * HG * kT5NearDistances * 4 + 16;
  static_assert(HEAD % VEC == 0, "head size must be a whole number of 16-byte vectors");
  static_assert(TX * HG <= kDecodeThreads && TPT >= 1 && TILE % TZ == 0, "every thread owns whole tokens");
  static_assert(TILE * NVEC <= kStageVecs, "a tile fits its stage");
  static_assert(TILE <= kMaxDecodeTile, "a tile's key flags fit theirs");
  static_assert(kFlagsOffset % 8 == 0 && kDecodeThreads / kWarpSize == 8, "the warps' flags are one 8-byte word");
  static_assert((TZ * HG * HEAD + 2 * TZ * HG) * 4 <= kStageBytes, "the epilogue reuses the stage buffers");
  // A cluster-combined CTA's (acc, m, l) of each head, [HG][HEAD] then [HG][2], past the epilogue's buffers.
  static_assert(((TZ + 1) * HG * HEAD + 2 * (TZ + 1) * HG) * 4 <= kStageBytes, "the cluster's partials fit too");
};

// ---------------------------------------------------------------------------------------------------------------
// The attention kernel. Template parameters: storage dtype T (query, output), cache element type KV (T, or an fp8
// format read as value·k_scale and value·v_scale), head size HEAD, cache LAYOUT, HG = query heads per
// CTA (1, 2, 4 or 8), Bias = NoBias, DenseBias, RaggedBias or T5Bias (common.cuh), CLUSTER = the partitions are
// combined in a thread block cluster (sm_90 and later; launched in clusters (1, 1, num_parts), num_parts at most
// kMaxClusterParts). The page size is a run-time power of two (block_shift).
//
// Pipeline: tile i's K and V travel by cp.async into stage i % kStages of shared memory while the CTA computes
// tile i − kAhead (kAhead = kStages − 1 tiles, 16 KB each, always in flight). Block ids are fetched 2·kAhead tiles
// ahead and bias values kAhead tiles ahead into small register rings indexed by the stage (a compile-time
// constant in the unrolled stage loop), so no thread waits on a load before it needs the value. One barrier per
// tile hands the stage over; the softmax needs none.
// ---------------------------------------------------------------------------------------------------------------
template <typename T, typename KV, int HEAD, KvLayout LAYOUT, int HG, typename Bias, bool CLUSTER, bool SCORES>
__global__ void __launch_bounds__(kDecodeThreads, CLUSTER ? kClusterMinCtas : DecodeLayout<KV, HEAD, HG>::kMinCtas)
decode_simt(
    T* __restrict__ out, long long out_stride_s, long long out_stride_h,  // [num_seqs, num_heads, HEAD]
    float* __restrict__ part_acc,  // [num_seqs, num_heads, num_parts, HEAD], used when num_parts > 1 (no CLUSTER)
    float* __restrict__ part_ml,   // [num_seqs, num_heads, num_parts, 2] = (m, l), likewise
    const T* __restrict__ query, long long q_stride_s, long long q_stride_h,  // [num_seqs, num_heads, HEAD]
    const KV* __restrict__ key_cache, const KV* __restrict__ value_cache, long long cache_block_stride,
    int num_blocks, int block_shift, int num_kv_heads,
    const int* __restrict__ block_tables, long long block_table_stride,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens, int max_len,                        // [num_seqs]
    const void* bias_ptr, const int* bias_index, long long bias_stride_0, long long bias_stride_1,
    long long bias_stride_2, long long bias_stride_3, int bias_dtype, int bias_n, int bias_m,  // BiasArgs
    const float* __restrict__ alibi_slopes,  // [num_heads] or null
    float scale, int group_size, int tokens_per_part, int num_parts,
    int longest_first,  // nonzero: CTA rows take the sequences longest first (seq_of_rank; unsplit grids only)
    float soft_cap, int window_left,  // the score options (SCORES): soft_cap 0 none, window_left kNoWindow none
    // fp8 caches: a key element reads as stored·k_scale·k_scales[kvh·k_scale_stride] (k_scales null: 1), a value
    // likewise (the stride 0 for one scale of all heads)
    const float* __restrict__ k_scales, const float* __restrict__ v_scales, int k_scale_stride, int v_scale_stride,
    float k_scale, float v_scale) {
  using L = DecodeLayout<KV, HEAD, HG>;
  using Cache = PagedCache<KV, HEAD, LAYOUT>;
  constexpr int VEC = L::VEC, NVEC = L::NVEC, TX = L::TX, VPL = L::VPL, TZ = L::TZ, TILE = L::TILE;
  constexpr int TPT = L::TPT, KPL = L::KPL, kAhead = kStages - 1;
  launch_dependents();  // the combine, or the next call's kernel, may start (it waits for this grid before reading)
  wait_for_primary();   // a split grid's launch may precede the end of the kernel before it: nothing is read before

  extern __shared__ uint4 stage_s[];  // [kStages][K, V][TILE][NVEC]; then the epilogue's [TZW][HG][HEAD + 2]
  // [kStages][TILE]: token t of the tile in stage st is a key (in the sequence, and its block id in the cache).
  unsigned char* key_s = reinterpret_cast<unsigned char*>(stage_s) + L::kStageBytes;
  // Each warp's out-of-contract flag (set before the loop, read in the epilogue): a nonzero byte poisons the rows.
  auto bad_flags = [&]() -> unsigned char* { return reinterpret_cast<unsigned char*>(stage_s) + L::kFlagsOffset; };
  // T5 only, [HG][kT5NearDistances]: head g's weight bits of the keys at distance d < kT5NearDistances before the
  // query; then [HG][kT5NearDistances]: head g's weight bits of bucket b (b below the buckets of the keys' side);
  // then the CTA's sequence when ranked (seq_late, below).
  auto* near_s = reinterpret_cast<typename Bias::Raw*>(reinterpret_cast<unsigned char*>(stage_s) + L::kSmemBytes);
  auto* column_s = near_s + HG * kT5NearDistances;
  volatile int* seq_s = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(stage_s) + L::kSmemBytes +
                                               L::kNearBytes - 16);

  const int num_chunks = (group_size + HG - 1) / HG;
  const int row = static_cast<int>(blockIdx.x) / (num_kv_heads * num_chunks);
  const int y = static_cast<int>(blockIdx.x) % (num_kv_heads * num_chunks);  // (KV head, chunk)
  const int kvh = y / num_chunks;
  const int head0 = kvh * group_size + (y % num_chunks) * HG;  // first query head of this CTA
  const int nh = min(HG, group_size - (y % num_chunks) * HG);  // query heads in use
  const int part = blockIdx.z;

  const int tid = threadIdx.x;
  const int tx = tid % TX;
  const int ty = (tid / TX) % HG;
  const int tz = tid / (TX * HG);

  int start = part * tokens_per_part;
  // The keys whose block ids are fetched: the partition's, within the table (max_len), whatever seq_lens[s] says (an
  // id is used only for a key below end). The loads then need not wait for seq_lens[s], and fewer values stay live
  // across the loop: the bias specialisations stopped spilling.
  int fetch_end = min(start + tokens_per_part, max_len);
  const int block_mask = (1 << block_shift) - 1;

  // The sequence, and where the first tiles' block ids are read: the block table, or with longest_first and a
  // sequence that is the row's own (a batch already longest first, equal lengths included) the copy of the row's
  // first ids that travelled to shared memory while the CTA ranked (no second round trip to L2 after the ranking).
  int s = row;
  const int* first_ids = block_tables + row * block_table_stride;  // entry i: block id i + first_base
  int first_base = 0;
  if (longest_first) {  // the same for every thread of the CTA
    // The ranking's lengths, then the row's first block ids, live in the last stage, which no copy writes before
    // the loop's first barrier.
    int* lens_s = reinterpret_cast<int*>(stage_s + (kStages - 1) * 2 * L::kStageVecs);
    int* ids_s = lens_s + kMaxLongestFirstSeqs + 4;
    static_assert(kStages >= 2 && (kMaxLongestFirstSeqs + 4 + kAhead * kMaxDecodeTile) * 4 <=
                                      2 * L::kStageVecs * kVecBytes, "room to rank");
    first_base = start >> block_shift;
    const int num_ids = ((min(start + kAhead * TILE, max_len) - 1) >> block_shift) - first_base + 1;
    copy_row_ids<kDecodeThreads, kAhead * kMaxDecodeTile>(first_ids + first_base, num_ids, ids_s);
    s = seq_of_rank<kDecodeThreads>(seq_lens, static_cast<int>(gridDim.x) / (num_kv_heads * num_chunks), max_len,
                                    row, lens_s, Bias::kNearTable ? seq_s : lens_s + kMaxLongestFirstSeqs);
    if (s == row) {
      first_ids = ids_s;
    } else {
      first_ids = block_tables + s * block_table_stride;
      first_base = 0;
    }
  }

  const Bias bias = Bias::make(BiasArgs{bias_ptr, bias_index, {bias_stride_0, bias_stride_1, bias_stride_2,
                                        bias_stride_3}, bias_dtype, bias_n, bias_m});
  const typename Bias::Seq seq_bias = bias.seq(s);
  // Keys of this sequence: seq_lens[s] within the block table (and a dense bias), and within a ragged bias's rows.
  const int len = seq_bias.limit(clamped_len(seq_lens, s, max_len));
  int end = min(start + tokens_per_part, len);
  // With a sliding window (the score options) the keys from lo = len − 1 − window_left on are keys: the partitions cut
  // them from the tile holding lo (pages wholly before it are never read), and the last one takes every key left (the
  // host sizes the partitions for the window's keys). The fetches then wait for seq_lens[s].
  int lo = 0;
  if (SCORES && window_left < kNoWindow) {
    lo = len - 1 - window_left;
    start += max(lo, 0) / TILE * TILE;
    const int part_end = part == num_parts - 1 ? max_len : start + tokens_per_part;
    fetch_end = min(part_end, max_len);
    end = min(part_end, len);
    first_ids = block_tables + s * block_table_stride;  // (the ids copied while ranking start before the window)
    first_base = 0;
  }

  // The sequence where the loop and the epilogue need it: s, but in the T5 kernels reread from shared memory when
  // ranked (as blockIdx is when not). Their one-head forms sit at the 64 registers of four CTAs per SM, and a
  // sequence kept across the loop spilled 8 bytes there (+2 us on B64 H16 d64 L2048 even unranked).
  auto seq_late = [&]() -> int {
    if constexpr (Bias::kNearTable) return longest_first ? *seq_s : row;
    return s;
  };
  const Cache cache{key_cache, value_cache, cache_block_stride, num_kv_heads, block_shift};
  const int* table = block_tables + s * block_table_stride;  // (the T5 kernels' loop rebuilds it: seq_late)
  const bool head_used = ty < nh;
  const int h = head0 + ty;

  // This thread's head: scale·log2(e)·q and the alibi slope, in registers for the whole CTA. With an fp8 cache the
  // key's scale is folded into q, the value's into the accumulator at the epilogue.
  float key_mult = 1.0f;
  if constexpr (IsFp8<KV>::value) {
    key_mult = kv_scale(k_scale, k_scales, k_scale_stride, kvh, kv_unit<KV>());
  }
  const float scale2 = scale * kLog2e * key_mult;
  float q[VPL][VEC];
#pragma unroll
  for (int v = 0; v < VPL; ++v)
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int c = tx + v * TX;
      q[v][e] = head_used && c < NVEC ? scale2 * to_float(query[s * q_stride_s + h * q_stride_h + c * VEC + e]) : 0.0f;
    }
  const float slope = alibi_slopes != nullptr && head_used ? alibi_slopes[h] : 0.0f;
  constexpr bool kExactCap = sizeof(T) == 4;
  typename Bias::Seq::Row bias_row;  // this thread's head's bias, set once the first copies are issued

  // ---- Prefetch rings, one slot per stage (a tile's slot is its index mod kStages).
  int cblk_r[kStages][kVecsPerThread];      // block id of each vector this thread copies
  typename Bias::Raw bias_r[kStages][KPL];  // bias for head ty, raw bits, of each token whose bias this lane adds

  auto k_s = [&](int st, int t, int c) -> uint4* { return &stage_s[(st * 2 * TILE + t) * NVEC + c]; };
  auto v_s = [&](int st, int t, int c) -> uint4* { return &stage_s[((st * 2 + 1) * TILE + t) * NVEC + c]; };
  // A block id outside the cache is never dereferenced: the key is skipped, and the CTA's rows poisoned (below;
  // validate=True reports it).
  auto in_cache = [&](int blk) -> bool { return static_cast<unsigned>(blk) < static_cast<unsigned>(num_blocks); };
  auto is_key = [&](int j, int blk) -> bool { return j < end && (!SCORES || j >= lo) && in_cache(blk); };
  // Where this thread's copies go within a page: vector idx = tid + k·kDecodeThreads of a tile is token
  // idx / NVEC, vector c = idx % NVEC, at page_offset(0, kvh, c) + (token's offset in its page)·token_stride.
  // Kept from here so that a copy's address is one multiply-add and the page's 64-bit offset.
  const int token_stride = cache.token_stride();
  int copy_at[kVecsPerThread];
#pragma unroll
  for (int k = 0; k < kVecsPerThread; ++k) copy_at[k] = cache.page_offset(0, kvh, (tid + k * kDecodeThreads) % NVEC);

  // Block ids of tile t0's copies into ring slot st, from ids (block id i at ids[i - base]).
  auto fetch_ids_from = [&](const int* ids, int base, int st, int t0) {
#pragma unroll
    for (int k = 0; k < kVecsPerThread; ++k) {
      const int idx = tid + k * kDecodeThreads;
      cblk_r[st][k] = -1;
      if (idx < TILE * NVEC && t0 + idx / NVEC < fetch_end)
        cblk_r[st][k] = ids[((t0 + idx / NVEC) >> block_shift) - base];
    }
  };
  auto fetch_ids = [&](int st, int t0) {
    if constexpr (Bias::kNearTable) {
      fetch_ids_from(block_tables + seq_late() * block_table_stride, 0, st, t0);
    } else {
      fetch_ids_from(table, 0, st, t0);
    }
  };
  // Tile t0 into slot st: its keys and values into shared memory (one cp.async group), and its key flags (read
  // after the barrier of tile t0's turn, kAhead barriers later).
  auto issue = [&](int st, int t0) {
#pragma unroll
    for (int k = 0; k < kVecsPerThread; ++k) {
      const int idx = tid + k * kDecodeThreads;
      if (idx < TILE * NVEC) {
        const int t = idx / NVEC;
        const int c = idx % NVEC;
        const int j = t0 + t;
        const int blk = cblk_r[st][k];
        const bool copy = is_key(j, blk);
        const int off = j & block_mask;
        // The page's offset, the same in both caches (0 for a token that is no key: its copy reads nothing).
        const long long at = copy ? cache.element_offset(blk, off * token_stride + copy_at[k]) : 0;
        cp_async16(k_s(st, t, c), key_cache + at, copy ? kVecBytes : 0);
        if (c == 0) key_s[st * TILE + t] = copy;
        if constexpr (Cache::kValueIsVector) {
          cp_async16(v_s(st, t, c), value_cache + at, copy ? kVecBytes : 0);
        } else {
          *v_s(st, t, c) = copy ? cache.gather_value(blk, off, kvh, c) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    cp_async_commit();
  };
  // Tile t0's bias into slot st. Apart from issue so that the prologue issues every copy before any bias: a T5
  // far key's bias is a register copy of the far weight, which waits for that load.
  auto issue_bias = [&](int st, int t0) {
    if constexpr (Bias::enabled) {
#pragma unroll
      for (int i = 0; i < KPL; ++i) {
        const int k = tx + i * TX;
        const int j = t0 + tz + k * TZ;
        bias_r[st][i] = typename Bias::Raw{};
        if (k < TPT && j < end && head_used) bias_r[st][i] = bias_row.load(j);
      }
    }
  };

  // The group's running max m, sum l = Σ exp(x − m) and acc = Σ exp(x − m)·v over the tokens it has seen.
  float m = -inf();
  float l = 0.0f;
  float acc[VPL][VEC];
#pragma unroll
  for (int v = 0; v < VPL; ++v)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[v][e] = 0.0f;

  // Prologue. Every load that waits on no other goes first (block ids; T5's near buckets and, when the buckets of
  // the keys' side fit the column, the table's column of each head); a load whose address is a load (T5's weights
  // otherwise) only once the first tiles' copies are out; a register copy of a pending load (the bias ring: T5's
  // far weight) last, since the thread waits there (no register renaming on a GPU).
  static_assert(kT5NearDistances <= kDecodeThreads, "a thread per near distance");
  int near_bucket = 0;
  [[maybe_unused]] typename Bias::Raw column[HG];  // T5: the weight bits of bucket tid for head head0 + g
  [[maybe_unused]] bool whole_column = false;
  if constexpr (Bias::kNearTable) {
    whole_column = seq_bias.per_side() <= kT5NearDistances;
    if (tid < kT5NearDistances) {
      near_bucket = seq_bias.near_bucket(tid);
#pragma unroll
      for (int g = 0; g < HG; ++g) {
        column[g] = {};
        if (whole_column && g < nh && tid < seq_bias.per_side()) column[g] = seq_bias.near_weight(tid, head0 + g);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kAhead; ++t) fetch_ids_from(first_ids, first_base, t, start + t * TILE);
#pragma unroll
  for (int t = 0; t < kAhead; ++t) issue(t, start + t * TILE);
#pragma unroll
  for (int t = kAhead; t < 2 * kAhead; ++t) fetch_ids(t % kStages, start + t * TILE);
  // ---- Out-of-contract data poisons the CTA's rows (NaN, paged_cache.cuh): a length the kernel cannot use as it is,
  // or a page of the partition's keys outside the cache. Checked once, while the first copies are in flight, from
  // the block ids again (L2-resident), each warp's verdict in its own flag (written once: no initialisation, no
  // barrier), read in the epilogue. The loop runs as for valid data (a flag carried through it costs registers in the
  // 80-register kernels). The flags sit in the dynamic shared memory, after the key flags: static shared memory in
  // this kernel has slowed its unchanged loop (docs/performance.md, "Open questions"); a 1-byte static flag with the
  // key flags carrying a missing page into the loop ran +15 % on B64 H16/16 d64 L2048 with a ragged bias (H200).
  {
    bool bad = tid == 0 && out_of_contract(seq_lens, s, len);
    const int last = (end - 1) >> block_shift;  // (end <= start: no page)
    for (int i = ((SCORES ? max(start, lo) : start) >> block_shift) + tid; i <= last && end > start;
         i += kDecodeThreads) {
      bad = bad || !in_cache(table[i]);
    }
    const bool warp_bad = __any_sync(0xffffffffu, bad);
    if (tid % kWarpSize == 0) {
      bad_flags()[tid / kWarpSize] = warp_bad;
    }
  }

  if constexpr (Bias::kNearTable) {
    if (whole_column) {  // the near table gathered from the column in shared memory: one round trip to the table
      if (tid < kT5NearDistances) {
#pragma unroll
        for (int g = 0; g < HG; ++g) column_s[g * kT5NearDistances + tid] = column[g];
      }
      __syncthreads();  // the columns are complete before any thread gathers from them
      if (tid < kT5NearDistances) {
#pragma unroll
        for (int g = 0; g < HG; ++g) {
          near_s[g * kT5NearDistances + tid] = column_s[g * kT5NearDistances + seq_bias.held(near_bucket)];
        }
      }
      bias_row = seq_bias.row(h, 0, len - 1, near_s + ty * kT5NearDistances,
                              column_s[ty * kT5NearDistances + seq_bias.held(seq_bias.far)]);
    } else {  // the near buckets' weights read from the table (a load behind a load)
      bias_row = seq_bias.row(h, 0, len - 1, near_s + ty * kT5NearDistances);
      if (tid < kT5NearDistances) {
#pragma unroll
        for (int g = 0; g < HG; ++g) {
          if (g < nh) near_s[g * kT5NearDistances + tid] = seq_bias.near_weight(seq_bias.held(near_bucket), head0 + g);
        }
      }
    }
    __syncthreads();  // the table is complete before any thread loads a bias from it
  } else {
    bias_row = seq_bias.row(h, 0, len - 1);
  }
#pragma unroll
  for (int t = 0; t < kStages; ++t) issue_bias(t, start + t * TILE);

  for (int t_base = start; t_base < end; t_base += kStages * TILE) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      const int t0 = t_base + st * TILE;
      if (t0 >= end) break;  // the same for every thread of the CTA
      cp_async_wait<kAhead - 1>();  // this thread's copies of tile t0 have landed (kAhead − 1 younger groups)
      // Every thread's copies of tile t0 are visible, and every thread is done with tile t0 − 1, whose stage
      // the copies issued next overwrite.
      __syncthreads();
      issue((st + kAhead) % kStages, t0 + kAhead * TILE);
      fetch_ids((st + 2 * kAhead) % kStages, t0 + 2 * kAhead * TILE);

      // ---- Logits x_k = <scale·q, k_j> + alibi·(j − len + 1) + bias(j) (−inf for a token that is no key). The
      // lane that owns token k adds its extra term to its partial dot product; the group sum gives x_k to all.
      float x[TPT];
#pragma unroll
      for (int k = 0; k < TPT; ++k) {
        const int t = tz + k * TZ;
        float dot = 0.0f;
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
          const int c = tx + v * TX;
          if (c < NVEC) {
            float kf[VEC];
            unpack<KV>(*k_s(st, t, c), kf);
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot += q[v][e] * kf[e];
          }
        }
        if (SCORES && soft_cap > 0.0f) {  // the cap on the whole product (x = <scale·log2(e)·q, k>, base 2),
                                          // then the owner lane's extra term, passed to its group
          const float capped = SoftCap::make(soft_cap, 1.0f).apply<kExactCap>(group_sum<TX>(dot));
          float own = capped;
          if (tx == k % TX) {
            float extra = slope * static_cast<float>(t0 + t - len + 1);
            if constexpr (Bias::enabled) extra += bias.value(bias_r[st][k / TX]);
            own = key_s[st * TILE + t] ? fmaf(extra, kLog2e, capped) : -inf();
          }
          x[k] = __shfl_sync(0xffffffffu, own, k % TX, TX);
        } else {
          if (tx == k % TX) {
            float extra = slope * static_cast<float>(t0 + t - len + 1);
            if constexpr (Bias::enabled) extra += bias.value(bias_r[st][k / TX]);
            dot = key_s[st * TILE + t] ? fmaf(extra, kLog2e, dot) : -inf();
          }
          x[k] = group_sum<TX>(dot);
        }
      }
      // Tile t0's bias is in its logits: its ring slot takes the bias of the tile kStages ahead, a whole ring of
      // tiles before its turn (one tile more than the copies).
      issue_bias(st, t0 + kStages * TILE);

      // ---- Online softmax: when max_k x_k exceeds m by more than kRescaleSlack, m moves to it and l and acc are
      // rescaled by α = 2^(m − m_new) (0 at the first key, while m = −inf); then p_k = 2^(x_k − m) ≤ 2^kRescaleSlack.
      // Most tiles skip the rescale (FlashAttention-4's conditional rescaling); acc / l is the same softmax
      // whatever reference m was used.
      float m_new = m;
#pragma unroll
      for (int k = 0; k < TPT; ++k) m_new = fmaxf(m_new, x[k]);
      if (m_new > m + kRescaleSlack) {
        const float alpha = fast_exp2(m - m_new);
        m = m_new;
        l *= alpha;
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[v][e] *= alpha;
      }
      // While every key so far is masked (m = −inf) nothing accumulates: p = 0, never NaN.
      const bool empty = m == -inf();

      // ---- Accumulate: l += Σ p_k, acc += Σ p_k·v_k.
#pragma unroll
      for (int k = 0; k < TPT; ++k) {
        const int t = tz + k * TZ;
        const float p = empty ? 0.0f : fast_exp2(x[k] - m);  // 0 for a token that is no key
        l += p;
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
          const int c = tx + v * TX;
          if (c < NVEC) {
            float vf[VEC];
            unpack<KV>(*v_s(st, t, c), vf);  // zero-filled for a token that is no key
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[v][e] += p * vf[e];
          }
        }
      }
    }
  }

  // ---- Epilogue: combine the TZ token slots of each head, as the split-K combine merges partitions:
  //   M = max_z m_z,  w_z = 2^(m_z − M),  L = Σ_z w_z·l_z,  o = Σ_z w_z·acc_z.
  // First across the slots of a warp by shuffles (the lane bits above TX·HG are tz), then across the warps'
  // TZW partial results in shared memory: a few dependent steps, not a loop over the TZ slots (which was most of
  // the CTA's time in the latency case, where a CTA sees only two tiles).
  constexpr int kSlotLanes = TX * HG;  // lanes of one token slot, all heads
  constexpr int kSlotsPerWarp = kSlotLanes < kWarpSize ? kWarpSize / kSlotLanes : 1;
  constexpr int TZW = TZ / kSlotsPerWarp;  // slots left after the warp step: one per warp, or TZ (< 8) if fewer
  cp_async_wait<0>();  // copies issued past the end still write zeros into the stages
  __syncthreads();     // every thread is done with the stages before the epilogue overwrites them (the warps'
                       // out-of-contract flags are set)
  float* acc_s = reinterpret_cast<float*>(stage_s);  // [TZW][HG][HEAD]
  float* ml_s = acc_s + TZW * HG * HEAD;             // [TZW][HG][2]
  [[maybe_unused]] float* mine_s = ml_s + TZW * HG * 2;   // CLUSTER: this CTA's combined acc, [HG][HEAD]
  [[maybe_unused]] float* mine_ml_s = mine_s + HG * HEAD;  // CLUSTER: and its (m, l), [HG][2]
  const int zw = tz / kSlotsPerWarp;
  const bool writer = tz % kSlotsPerWarp == 0;  // this lane holds its warp's combined slot
  float big_m = m;
#pragma unroll
  for (int o = kSlotLanes; o < kWarpSize; o *= 2) big_m = fmaxf(big_m, __shfl_xor_sync(0xffffffffu, big_m, o));
  if (writer && tx == 0) ml_s[(zw * HG + ty) * 2] = big_m;
  __syncthreads();  // every warp's max is in shared memory
  big_m = -inf();
#pragma unroll
  for (int z = 0; z < TZW; ++z) big_m = fmaxf(big_m, ml_s[(z * HG + ty) * 2]);
  const float w = m == -inf() ? 0.0f : fast_exp2(m - big_m);  // an empty slot (no key) weighs nothing
  float lw = w * l;
  float acc_w = w;
  if constexpr (IsFp8<KV>::value) {
    acc_w *= kv_scale(v_scale, v_scales, v_scale_stride, kvh, kv_unit<KV>());
  }
#pragma unroll
  for (int v = 0; v < VPL; ++v)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[v][e] *= acc_w;
#pragma unroll
  for (int o = kSlotLanes; o < kWarpSize; o *= 2) {
    lw += __shfl_xor_sync(0xffffffffu, lw, o);
#pragma unroll
    for (int v = 0; v < VPL; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[v][e] += __shfl_xor_sync(0xffffffffu, acc[v][e], o);
  }
  if (writer) {
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
      const int c = tx + v * TX;
      if (c < NVEC) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc_s[(zw * HG + ty) * HEAD + c * VEC + e] = acc[v][e];
      }
    }
    if (tx == 0) ml_s[(zw * HG + ty) * 2 + 1] = lw;
  }
  __syncthreads();  // every warp's weighted (l, acc) is in shared memory
  for (int i = tid; i < nh * HEAD; i += kDecodeThreads) {
    const int g = i / HEAD;
    const int d = i % HEAD;
    float head_m = -inf();
    float big_l = 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int z = 0; z < TZW; ++z) {
      head_m = fmaxf(head_m, ml_s[(z * HG + g) * 2]);
      big_l += ml_s[(z * HG + g) * 2 + 1];
      o += acc_s[(z * HG + g) * HEAD + d];
    }
    big_l = poisoned_sum(big_l, *reinterpret_cast<const unsigned long long*>(bad_flags()) != 0ull);  // all 8
    const int hh = head0 + g;
    if constexpr (CLUSTER) {
      mine_s[i] = o;
      if (d == 0) {
        mine_ml_s[g * 2] = head_m;
        mine_ml_s[g * 2 + 1] = big_l;
      }
    } else if (num_parts == 1) {
      out[seq_late() * out_stride_s + hh * out_stride_h + d] = from_float<T>(normalized(o, big_l));
    } else {
      const long long at = (static_cast<long long>(seq_late()) * (num_kv_heads * group_size) + hh) * num_parts + part;
      part_acc[at * HEAD + d] = o;
      if (d == 0) {
        part_ml[at * 2] = head_m;
        part_ml[at * 2 + 1] = big_l;
      }
    }
  }
  if constexpr (CLUSTER) {
    // ---- The cluster's combine, as decode_simt_combine's: M = max_p m_p, w_p = 2^(m_p − M),
    // out = Σ_p w_p·acc_p / Σ_p w_p·l_p (zeros when no partition holds a key: every m_p = −inf). The cluster's CTAs
    // are the partitions, rank p = blockIdx.z; output element i goes to CTA i / kDecodeThreads % num_parts, whose
    // thread loads every partition's value of it at once (at most kMaxClusterParts, each a shared-memory round
    // trip within the GPC).
    cluster_sync();  // every partition's (acc, m, l) is in its CTA's shared memory, visible to the cluster
    for (int i = part * kDecodeThreads + tid; i < nh * HEAD; i += num_parts * kDecodeThreads) {
      const int g = i / HEAD;
      float m_p[kMaxClusterParts], l_p[kMaxClusterParts], o_p[kMaxClusterParts];
#pragma unroll
      for (int p = 0; p < kMaxClusterParts; ++p) {
        m_p[p] = -inf();
        l_p[p] = o_p[p] = 0.0f;
        if (p < num_parts) {
          m_p[p] = cluster_load(mine_ml_s + g * 2, p);
          l_p[p] = cluster_load(mine_ml_s + g * 2 + 1, p);
          o_p[p] = cluster_load(mine_s + i, p);
        }
      }
      float big_m = -inf();
#pragma unroll
      for (int p = 0; p < kMaxClusterParts; ++p) big_m = fmaxf(big_m, m_p[p]);
      float big_l = 0.0f;
      float o = 0.0f;
#pragma unroll
      for (int p = 0; p < kMaxClusterParts; ++p) {
        const float w = m_p[p] == -inf() ? 0.0f : fast_exp2(m_p[p] - big_m);  // an empty partition weighs nothing
        big_l += w * l_p[p];
        o += w * o_p[p];
      }
      out[seq_late() * out_stride_s + (head0 + g) * out_stride_h + i % HEAD] =
          from_float<T>(normalized(o, big_l));
    }
    cluster_sync();  // no CTA leaves (its shared memory with it) while another may still read from it
  }
}

}  // namespace cpa
