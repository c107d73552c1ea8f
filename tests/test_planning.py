"""CPU: which kernel, tiling, grid and split a call plans (``cupy_paged_attn.planning``), from shapes alone: no data,
no GPU. A few tests go through the argument checks on small arrays, to see the shape a checked call builds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import make_problem

from cupy_paged_attn import _checks, _specs, planning, tuning

H200 = planning.Device.h200()
DEFAULT = tuning.Tuning()


def decode_shape(num_seqs: int, heads: tuple[int, int], head_size: int, max_len: int, **kw: object) -> \
        planning.DecodeShape:
    return planning.DecodeShape(num_seqs=num_seqs, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                                max_len=max_len, **kw)


def test_the_docstring_example():
    launch = planning.plan_decode(decode_shape(64, (32, 8), 128, 4096), H200, DEFAULT)
    assert (launch.spec.key, launch.grid, launch.num_parts) == ("decode_mma_bf16_d128_nhd_r8_bias-none",
                                                                (512, 1, 3), 3)


def test_a_checked_call_plans_from_its_shape(rng):
    """The shape a checked problem hands planning holds its dims, dtypes, the bias's strides, and the most keys a
    sequence can have: what both the block table and the dense bias cover."""
    p = make_problem(rng, [5, 300], num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense",
                     bias_dtype="f16")
    shape = _checks.check_decode(*p.args(), **p.kwargs(), out=None).shape
    length = p.attn_bias.shape[-1]
    max_len = min(p.block_tables.shape[1] * 16, length)  # what the block table holds, and the bias
    assert shape == decode_shape(2, (8, 2), 64, max_len, dtype="bf16", bias="dense",
                                 bias_dtype="f16", bias_strides=(8 * length, length, 0, 1))


@pytest.mark.parametrize(
    ("num_seqs", "heads", "max_len", "expect_split"),
    [(64, (16, 16), 2048, False), (128, (32, 32), 4096, False), (1, (16, 16), 1024, True),
     (1, (32, 8), 65536, True), (32, (32, 8), 8192, True), (2, (8, 8), 100, False)],
)
def test_split_planning(num_seqs, heads, max_len, expect_split):
    """Grids that fill the GPU run unsplit; small ones split their keys into partitions of whole 128-key tiles, none
    empty (head size 32: the SIMT kernel, one CTA per (sequence, KV head, chunk of query heads))."""
    launch = planning.plan_decode(decode_shape(num_seqs, heads, 32, max_len, dtype="f32"), H200, DEFAULT)
    assert (launch.num_parts > 1) == expect_split
    assert launch.tokens_per_part % 128 == 0 and launch.num_parts * launch.tokens_per_part >= max_len
    assert (launch.num_parts - 1) * launch.tokens_per_part < max(max_len, 1), "no partition is empty"
    assert launch.grid == (num_seqs * heads[1] * -(-(heads[0] // heads[1]) // launch.spec.heads_per_cta), 1,
                           launch.num_parts)
    assert (launch.combine_grid, launch.combine_threads) == ((num_seqs, heads[0], 1), 128)


@pytest.mark.parametrize(
    ("num_seqs", "heads", "head_size", "num_sms", "switch", "expect"),
    [(64, (16, 16), 64, 132, True, True),      # ragged lengths: 1024 CTAs, two waves of 528
     (64, (16, 16), 64, 132, False, False),    # the switch off
     (256, (4, 4), 64, 132, True, True),       # the most sequences one ranking takes
     (257, (4, 4), 64, 132, True, False),      # one more
     (1, (16, 16), 64, 1, True, False),        # nothing to order
     (33, (16, 16), 64, 132, True, False),     # 528 CTAs: one wave (the tensor cores' 1.3, so the SIMT kernel)
     (2, (16, 16), 64, 4, True, True),         # a small GPU
     # Multi-head grids that fill the tensor cores unsplit (here 1.5 waves or more) run there, but for a ragged bias.
     # The tensor cores (bf16): group 4, 8 rows per CTA, three CTAs per SM (396 on 132 SMs).
     (64, (32, 8), 128, 132, True, True),      # 512 CTAs: 1.3 waves, split in three (tail_parts)
     (64, (32, 8), 128, 132, False, False),    # the switch off
     (49, (32, 8), 128, 132, True, False),     # 392 CTAs: one wave
     (128, (32, 8), 128, 132, True, True),     # 1024 CTAs: 2.6 waves, unsplit
     (256, (8, 2), 64, 132, True, True),       # the most sequences one ranking takes
     (257, (8, 2), 64, 132, True, False),      # one more
     (200, (32, 2), 128, 132, True, True)],    # group 16: 16 rows per CTA, two per SM (400 CTAs, 264 resident)
)
@pytest.mark.parametrize("bias", ["none", "dense", "ragged", "t5"])
def test_longest_first_planning(num_seqs, heads, head_size, num_sms, switch, expect, bias):
    """Grids of more than one wave over 2 to 256 sequences take them longest first, on either kernel and whatever the
    bias (the SIMT kernel unsplit grids only); the kernel argument says so."""
    from cupy_paged_attn import _launch

    shape = decode_shape(num_seqs, heads, head_size, 2048, bias=bias)
    launch = planning.plan_decode(shape, dataclasses.replace(H200, num_sms=num_sms),
                                  tuning.Tuning(longest_first=switch))
    multi_head = heads[0] == heads[1] and bias != "ragged" and 2 * num_seqs * heads[1] >= 3 * 3 * num_sms
    assert launch.tensor_cores == (heads[0] > heads[1] or multi_head)
    assert launch.longest_first == expect
    assert launch.num_parts == 1 or launch.tensor_cores  # the SIMT kernel orders unsplit grids only
    p = make_problem(np.random.default_rng(0), [3, 5], num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=head_size, dtype="bf16")
    args = _launch.attention_args(_checks.check_decode(*p.args(), **p.kwargs(), out=None),
                                  tiled=launch.tensor_cores, query_strides=(0, 0), table_stride=0,
                                  tokens_per_part=launch.tokens_per_part, num_parts=launch.num_parts,
                                  longest_first=launch.longest_first)
    assert dict(args)["longest_first"] == np.int32(expect)


@pytest.mark.parametrize("slots", [396, 264, 3])
@pytest.mark.parametrize("wave", [0.5, 1.0, 1.001, 1.1, 1.29, 1.45, 1.5, 2.0, 2.2, 2.59])
def test_tail_parts(slots, wave):
    """Only a grid of between one and one and a half waves splits, into the 2 or 3 partitions whose last wave is the
    fuller; split, it still fills at least one wave and never more than 4.5."""
    ctas = max(1, round(wave * slots))
    parts = planning.tail_parts(ctas, slots)
    if not slots < ctas < 1.5 * slots:
        assert parts == 1
        return
    assert parts in (2, 3)
    last = {p: ctas * p % slots or slots for p in (2, 3)}
    assert last[parts] == max(last.values()) and (last[2] < last[3] or parts == 2)


@pytest.mark.parametrize(("batch", "max_len", "parts"), [(64, 4096, 3), (64, 2048, 3), (64, 256, 2), (64, 128, 1),
                                                         (128, 4096, 1), (32, 8192, 1)])
def test_tensor_core_tail_split_planning(batch, max_len, parts):
    """B64 H32/8 d128 on 132 SMs is 512 CTAs where 396 fit: split in three (two where the keys allow no more: at
    most one partition per 128 keys, rounded up). B128 (2.6 waves) stays whole; B32 (256 CTAs, less than a wave)
    splits within one wave."""
    launch = planning.plan_decode(decode_shape(batch, (32, 8), 128, max_len), H200, DEFAULT)
    assert launch.tensor_cores and launch.grid == (batch * 8, 1, launch.num_parts)
    if batch == 32:
        assert launch.grid[0] * launch.num_parts <= 396 and not launch.longest_first
        return
    assert launch.num_parts == parts and launch.longest_first
    assert (launch.num_parts - 1) * launch.tokens_per_part < max_len <= launch.num_parts * launch.tokens_per_part


@pytest.mark.parametrize("smem_per_sm", [233472, 167936, 101376])
def test_split_grid_caps_its_ctas_per_sm(smem_per_sm):
    """A split grid of the SIMT kernel asks for the shared memory that keeps a fourth CTA off each SM (H100/H200:
    228 KB per SM); where three already fill the SM (A100: 164 KB) or fewer fit (100 KB), the kernel's own size
    stays. An unsplit grid always asks for the kernel's own size, so the registers' four CTAs per SM fit. (Partitions
    combined by the combine kernel: a grid combined in clusters runs one CTA per SM anyway.)"""
    device, combine = planning.Device(132, smem_per_sm=smem_per_sm), tuning.Tuning(cluster_combine=False)
    split = planning.plan_decode(decode_shape(1, (16, 16), 64, 1024, dtype="f32"), device, combine)
    whole = planning.plan_decode(decode_shape(64, (16, 16), 64, 64, dtype="f32"), device, combine)
    assert split.num_parts > 1 and whole.num_parts == 1 and not split.cluster
    assert whole.shared_mem == whole.spec.smem_bytes == _specs.DECODE_SIMT_SMEM_BYTES
    assert split.shared_mem >= split.spec.smem_bytes and split.shared_mem % 16 == 0
    resident = smem_per_sm // (split.shared_mem + 1024)
    own = smem_per_sm // (split.spec.smem_bytes + 1024)
    assert resident == min(own, 3)


@pytest.mark.parametrize(
    ("num_seqs", "max_len", "heads", "head_size", "dtype", "expect"),
    [(1, 1024, (16, 16), 64, "bf16", True),    # the latency case: 16 CTAs in 8 partitions, 128 of 132 SMs
     (1, 512, (16, 16), 64, "f16", True),      # 4 partitions
     (1, 700, (4, 1), 128, "f32", True),       # one CTA of 4 heads in 6 partitions
     (2, 1024, (16, 16), 64, "bf16", False),   # 256 CTAs: more than one per SM
     (1, 4096, (16, 16), 64, "bf16", False),   # 32 partitions: more than a cluster holds
     (64, 2048, (16, 16), 64, "bf16", False),  # unsplit
     (1, 1024, (32, 8), 128, "bf16", False)],  # the tensor-core kernel
)
@pytest.mark.parametrize("clusters", [True, False], ids=["clusters", "no-clusters"])
def test_cluster_combine_planning(num_seqs, max_len, heads, head_size, dtype, expect, clusters):
    """A split grid of the SIMT kernel of at most 8 partitions and at most one CTA per SM combines its partitions in
    clusters where the device has them (and the switch is on): the same grid and partitions, no combine kernel, no
    workspace, and the kernel's own shared memory (one wave whatever the cap)."""
    shape = decode_shape(num_seqs, heads, head_size, max_len, dtype=dtype)
    launch = planning.plan_decode(shape, planning.Device(132, launch_ex=clusters), DEFAULT)
    plain = planning.plan_decode(shape, H200, tuning.Tuning(cluster_combine=False))
    assert launch.cluster == (expect and clusters) and not plain.cluster
    assert launch.tensor_cores or launch.spec.cluster == launch.cluster
    assert (launch.grid, launch.num_parts, launch.tokens_per_part) == (plain.grid, plain.num_parts,
                                                                       plain.tokens_per_part)
    assert launch.combines == (launch.num_parts > 1 and not launch.cluster)
    assert launch.dependent == (clusters and launch.num_parts > 1)
    if launch.cluster:
        assert 1 < launch.num_parts <= _specs.DECODE_CLUSTER_MAX_PARTS
        assert launch.grid[0] * launch.num_parts <= 132 and launch.shared_mem == launch.spec.smem_bytes
        assert launch.spec.max_ctas_per_sm == _specs.DECODE_CLUSTER_MIN_CTAS


def test_dependent_launch_needs_a_split_the_device_and_the_switch():
    split = decode_shape(1, (16, 16), 64, 4096)
    assert planning.plan_decode(split, H200, DEFAULT).dependent
    assert not planning.plan_decode(split, H200, tuning.Tuning(dependent_launch=False)).dependent
    assert not planning.plan_decode(split, planning.Device(108, compute_capability=80), DEFAULT).dependent
    assert not planning.plan_decode(decode_shape(64, (16, 16), 64, 2048), H200, DEFAULT).dependent


@pytest.mark.parametrize(("dtype", "head_size", "heads", "tensor_cores", "rows"), [
    ("bf16", 128, (32, 8), True, 8), ("f16", 64, (40, 2), True, 16), ("bf16", 128, (64, 2), True, 16),
    ("f16", 96, (16, 2), True, 8), ("bf16", 128, (16, 16), False, 0), ("f32", 128, (32, 8), False, 0),
    ("bf16", 192, (32, 8), False, 0),
])
def test_tensor_core_decode_planning(dtype, head_size, heads, tensor_cores, rows):
    """Grouped-query 16-bit decode up to head size 128 runs the tensor-core kernel: one CTA per (sequence, 8 or 16
    query heads of a group, KV head) in x and per partition in z, partitions a multiple of its 64-key tile."""
    launch = planning.plan_decode(decode_shape(2, heads, head_size, 5008, dtype=dtype), H200, DEFAULT)
    assert launch.tensor_cores == tensor_cores
    if tensor_cores:
        tiles = -(-(heads[0] // heads[1]) // rows)
        assert launch.grid == (2 * tiles * heads[1], 1, launch.num_parts)
        assert launch.spec.rows == rows and launch.tokens_per_part % 64 == 0
        assert launch.threads == _specs.TILE_THREADS
        # One combine thread per output element of the rows that hold heads (4 with one group of partitions) and
        # group of partitions (8 partitions a group, up to 8 groups).
        groups = min(8, 1 << (-(-launch.num_parts // 8) - 1).bit_length())
        assert groups == _specs.combine_groups(launch.num_parts)
        vec = 4 if groups == 1 else 1
        head_rows = min(rows, heads[0] // heads[1]) if groups == 1 else rows
        assert (launch.combine_grid, launch.combine_threads) == (
            (2 * tiles * heads[1], 1, -(-head_rows * head_size * groups // (vec * 128))), _specs.COMBINE_THREADS)
    assert launch.num_parts * launch.tokens_per_part >= 5008


@pytest.mark.parametrize(("dtype", "head_size", "num_seqs", "heads", "bias", "tensor_cores"), [
    ("bf16", 64, 64, (16, 16), "none", True),        # 1024 CTAs: 2.6 waves of 396 (three a SM)
    ("f16", 128, 128, (32, 32), "dense", True),
    ("bf16", 64, 64, (16, 16), "t5", True),
    ("bf16", 64, 99, (4, 4), "none", True),          # 396 CTAs: one wave exactly
    ("bf16", 64, 64, (16, 16), "ragged", False),     # a ragged bias stays on the SIMT kernel
    ("bf16", 64, 33, (16, 16), "none", False),       # 528 CTAs: 1.3 waves, which the tensor cores would split
    ("bf16", 64, 37, (16, 16), "dense", False),      # 592 CTAs: 1.495 waves, still a tail split
    ("bf16", 64, 38, (16, 16), "dense", True),       # 608 CTAs: 1.54 waves, none
    ("bf16", 64, 1, (16, 16), "none", False),        # the latency case: split, on the SIMT kernel
    ("f32", 64, 64, (16, 16), "none", False),        # no float32 tensor-core decode
    ("bf16", 256, 64, (16, 16), "none", False),      # nor one past head size 128
])
def test_multi_head_tensor_core_planning(dtype, head_size, num_seqs, heads, bias, tensor_cores):
    """A multi-head problem runs on the tensor cores where their grid fills the GPU unsplit (a wave or more, no tail
    split) and the bias is not ragged; else on the SIMT kernel, and always there with the switch off."""
    shape = decode_shape(num_seqs, heads, head_size, 304, dtype=dtype, bias=bias)
    launch = planning.plan_decode(shape, H200, DEFAULT)
    assert launch.tensor_cores == tensor_cores == planning.uses_tensor_cores(shape, 132, DEFAULT)
    if tensor_cores:
        assert launch.num_parts == 1 and launch.spec.rows == 8 and launch.grid == (num_seqs * heads[0], 1, 1)
    assert not planning.plan_decode(shape, H200, tuning.Tuning(multi_head_tensor_cores=False)).tensor_cores


@pytest.mark.parametrize("kernel", ["tensor-cores", "simt"])
def test_decode_kernel_switch(kernel):
    """The decode_kernel switch puts every problem either kernel can take on it: a multi-head latency-sized problem
    with a ragged bias on the tensor cores, a grouped-query one on the SIMT kernel; a float32 one stays on the SIMT
    kernel either way. A value it does not know is refused by name."""
    chosen = tuning.Tuning(decode_kernel=kernel)
    for heads, bias in (((4, 4), "ragged"), ((8, 2), "dense")):
        shape = decode_shape(2, heads, 64, 304, bias=bias)
        assert planning.plan_decode(shape, H200, chosen).tensor_cores == (kernel == "tensor-cores")
    assert not planning.plan_decode(decode_shape(2, (8, 2), 64, 304, dtype="f32"), H200, chosen).tensor_cores
    with pytest.raises(ValueError, match="decode_kernel: expected one of 'auto', 'tensor-cores', 'simt', got 'fp32'"):
        tuning.Tuning(decode_kernel="fp32")


@pytest.mark.parametrize(("bias", "bias_dtype", "mode"), [
    ("dense", "bf16", "dense-rows"), ("dense", "f16", "dense-rows"), ("broadcast-seq", "bf16", "dense-rows"),
    ("broadcast-head", "f16", "dense-rows"), ("dense", "f32", "dense-rows"), ("dense-16-rows", "f32", "dense"),
    ("dense-16-rows", "bf16", "dense-rows"), ("strided", "bf16", "dense"), ("strided", "f32", "dense"),
    ("ragged", "bf16", "ragged-rows"), ("ragged", "f16", "ragged-rows"), ("ragged", "f32", "ragged-rows"),
    ("ragged-16-rows", "f32", "ragged"), ("ragged-strided", "bf16", "ragged"), ("ragged-12-heads", "bf16", "ragged"),
    ("ragged-12-heads", "f32", "ragged-rows"), ("t5-causal", "bf16", "t5"), ("none", "bf16", "none"),
])
def test_tensor_core_decode_bias_mode(rng, bias, bias_dtype, mode):
    """The tensor-core decode copies a bias whose elements of a tile lie side by side into shared memory with each
    tile: a dense one of adjacent keys (DenseRowsBias, "dense-rows"), a ragged one of adjacent heads whose keys lie a
    multiple of 16 bytes apart (RaggedRowsBias, "ragged-rows": 12 heads a key in float32, not in 16 bits). A float32
    one only where the stages have room for it (8 rows of head size 128, not 16). A dense one whose keys are apart, a
    ragged one stored head-major is read element by element. The SIMT kernel has one mode per kind. (Small arrays
    through the argument checks: the strides are the checks'.)"""
    num_heads = 12 if bias.endswith("-12-heads") else 32
    group = 16 if bias.endswith("-16-rows") else 4
    bias = bias.removesuffix("-12-heads").removesuffix("-16-rows")
    for heads, tensor_cores in (((num_heads, num_heads // group), True), ((8, 8), False)):
        p = make_problem(rng, [5, 30], num_heads=heads[0], num_kv_heads=heads[1], head_size=128, dtype="bf16",
                         bias=bias, bias_dtype=bias_dtype)
        problem = _checks.check_decode(*p.args(), **{**p.kwargs(), "out": None})
        launch = planning.plan_decode(problem.shape, H200, DEFAULT)
        assert launch.tensor_cores == tensor_cores
        assert launch.spec.bias == (mode if tensor_cores else problem.bias.mode)


def test_staged_bias_only_where_it_fits():
    """A bias kind whose stages would not fit beside the CTAs per SM falls back to element-by-element loads: head
    size 80 at 8 rows (three CTAs of 71 KB each) has no "ragged-rows" specialisation; 128 has; over fp8 caches (K/V
    stages of half the bytes) 80 has too."""
    for head_size, rows, mode in ((128, 8, "ragged-rows"), (80, 16, "ragged-rows"), (80, 8, "ragged")):
        shape = decode_shape(2, (32, 8), head_size, 64, bias="ragged")
        assert planning.tensor_core_bias_mode(shape, rows) == mode
    fp8 = decode_shape(2, (32, 8), 80, 64, bias="ragged", kv_cache="fp8_e4m3")
    assert planning.tensor_core_bias_mode(fp8, 8) == "ragged-rows"
    assert all(s.bias != "ragged-rows" or (s.head_size, s.rows, s.kv_cache) != (80, 8, None)
               for s in _specs.decode_mma_specs())


def prefill_shape(q_lens: list[int], max_len: int, head_size: int, dtype: str, heads: tuple[int, int] = (8, 2),
                  **kw: object) -> planning.PrefillShape:
    return planning.PrefillShape(num_seqs=len(q_lens), num_heads=heads[0], num_kv_heads=heads[1],
                                 head_size=head_size, max_len=max_len, dtype=dtype, total_q=sum(q_lens), **kw)


@pytest.mark.parametrize(("dtype", "head_size", "rows", "tile"), [
    ("bf16", 64, 128, 64), ("f16", 128, 128, 32), ("bf16", 96, 128, 32), ("bf16", 256, 64, 32), ("f32", 128, 64, 32),
])
def test_prefill_planning(dtype, head_size, rows, tile):
    """Prefill M tiles: 128 packed rows (two m tiles per warp) on the tensor cores up to head size 128, 64 past it
    and on the float32 kernel; a grid of ceil(total_q·G / rows) + num_seqs tiles, partitions whole key tiles."""
    shape = prefill_shape([300, 7, 0, 1], 1008, head_size, dtype)
    ampere = planning.Device(108, compute_capability=80)
    for sms in (1, 10**6):  # never split; split as far as the keys allow
        launch = planning.plan_prefill(shape, ampere, tuning.Tuning(num_sms=sms))
        assert launch.rows == rows == _specs.prefill_rows_per_cta(dtype, head_size)
        assert launch.num_tiles == -(-308 * 4 // rows) + 4
        assert launch.tokens_per_part % tile == 0 and launch.num_parts * launch.tokens_per_part >= 1008
        assert (launch.num_parts > 1) == (sms > 1)
    for parts in (1, 2, 9, 33, 200):
        elems = _specs.COMBINE_THREADS // _specs.combine_groups(parts) * _specs.combine_vec(parts)
        assert _specs.combine_chunks(rows, head_size, parts) * elems >= rows * head_size


@pytest.mark.parametrize(("dtype", "head_size", "hopper"), [
    ("bf16", 128, True), ("f16", 64, True), ("bf16", 96, False), ("bf16", 256, False), ("f32", 128, False),
])
def test_hopper_tiling_planning(dtype, head_size, hopper):
    """On a device that runs sm_90a code, 16-bit head sizes 64 and 128 take the Hopper tiling: 256 threads (two
    warpgroups), the same 128 rows per CTA (so the same grid and combine), 64-key tiles, its own key and options.
    Elsewhere, or with the switch off, the mma.sync tiling."""
    shape = prefill_shape([300, 1], 1008, head_size, dtype)
    many = tuning.Tuning(num_sms=10**6)
    plain = planning.plan_prefill(shape, H200, tuning.Tuning(wgmma=False, num_sms=10**6))
    launch = planning.plan_prefill(shape, H200, many)
    assert planning.plan_prefill(shape, planning.Device(108, compute_capability=80), many) == plain
    assert not plain.spec.wgmma and launch.spec.wgmma == hopper
    assert (launch.rows, launch.num_tiles) == (plain.rows, plain.num_tiles)
    if hopper:
        spec = launch.spec
        assert spec.threads == _specs.WGMMA_THREADS == 256 and launch.tokens_per_part % 64 == 0
        assert spec.key.startswith("prefill_wgmma_") and spec.source == "prefill_wgmma.cu"
        assert "-arch=sm_90a" in spec.options
        assert (spec.offline_arch("sm_90"), spec.offline_arch("sm_80")) == ("sm_90a", None)
        assert _specs.tile_smem_bytes(dtype, head_size, wgmma=True) <= 227 * 1024
    else:
        assert launch == plain


@pytest.mark.parametrize(("kv_heads", "max_distance", "hopper"), [(8, 128, True), (2, 128, True), (1, 128, False),
                                                                  (8, 800, True), (8, 900, False), (2, 20, True)])
def test_hopper_tiling_needs_the_whole_t5_table(kv_heads, max_distance, hopper):
    """The Hopper tiling reads T5 only from a CTA's table in shared memory (G·(2·(max_distance + 64 + span) + 1)
    floats of at most 2048, span the positions of its 128 rows); larger ones run on the mma.sync tiling."""
    shape = prefill_shape([300, 7], 384, 128, "bf16", heads=(8, kv_heads), bias="t5", t5_max_distance=max_distance)
    assert planning.t5_table_fits(shape) == hopper
    assert planning.plan_prefill(shape, H200, DEFAULT).spec.wgmma == hopper


def test_hopper_tiling_leaves_a_dense_bias_to_mma_sync():
    """A dense bias runs on the mma.sync tiling even where the Hopper tiling could (it measured faster there)."""
    shape = prefill_shape([300, 7], 384, 128, "bf16", bias="dense")
    assert not planning.plan_prefill(shape, H200, DEFAULT).spec.wgmma


@pytest.mark.parametrize("ctas", [1, 8, 32, 100, 263, 264, 1000])
@pytest.mark.parametrize("max_len", [1, 300, 8192, 65536])
def test_one_wave_split(ctas, max_len):
    """With ``resident``, a split never makes a second wave, never an empty partition, and partitions are whole
    tiles, at most one per 128 keys (rounded up)."""
    tokens, parts = planning.split_keys(ctas, max_len, 132, 64, resident=2)
    assert ctas * parts <= max(ctas, 2 * 132)
    assert tokens % 64 == 0 and parts * tokens >= max_len and (parts - 1) * tokens < max(max_len, 1)
    assert parts <= max(1, -(-max_len // 128))


def test_tuning_override_is_scoped_and_checked():
    before = tuning.current()
    with tuning.override(decode_kernel="simt", num_sms=1) as inside:
        assert tuning.current() == inside == dataclasses.replace(before, decode_kernel="simt", num_sms=1)
        assert not planning.plan_decode(decode_shape(64, (32, 8), 128, 4096), H200).tensor_cores
    assert tuning.current() == before
    with pytest.raises(TypeError, match="fast: not a tuning switch"), tuning.override(fast=True):
        pass
    with pytest.raises(ValueError, match="num_sms: expected None or a positive int, got 0"):
        tuning.Tuning(num_sms=0)
    with pytest.raises(TypeError, match="wgmma: expected a bool, got 1"):
        tuning.Tuning(wgmma=1)  # type: ignore[arg-type]
    assert tuning.current() == before


@pytest.mark.parametrize(("num_seqs", "heads", "head_size", "max_len"),
                         [(1, (32, 8), 128, 65536), (32, (32, 8), 128, 8192), (1, (16, 16), 64, 8192),
                          (200, (8, 2), 64, 2048)])
def test_window_splits_the_window_not_max_len(num_seqs, heads, head_size, max_len):
    """With a sliding window the split cuts the window's keys (plus the tile the kernels' first one may start before
    it), never max_len's, and the grid is not ranked longest first (the window, not the length, sizes the work)."""
    window = 1024
    launch = planning.plan_decode(decode_shape(num_seqs, heads, head_size, max_len, window_left=window), H200,
                                  DEFAULT)
    tile = _specs.tile_keys(head_size, launch.spec.rows) if launch.tensor_cores else _specs.DECODE_SIMT_TILE_MULTIPLE
    assert launch.tokens_per_part * (launch.num_parts - 1) < window + tile
    assert not launch.longest_first
    plain = planning.plan_decode(decode_shape(num_seqs, heads, head_size, min(max_len, window + tile)), H200,
                                 DEFAULT)
    assert (launch.tokens_per_part, launch.num_parts) == (plain.tokens_per_part, plain.num_parts)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_window_split(causal):
    """A causal prefill with a window splits the keys one CTA's rows can see; without causal every key from the
    window's first on can be seen, so the split is max_len's."""
    shape = planning.PrefillShape(num_seqs=1, num_heads=8, num_kv_heads=8, head_size=128, max_len=65536,
                                  total_q=128, causal=causal, window_left=512)
    launch = planning.plan_prefill(shape, H200, DEFAULT)
    plain = planning.plan_prefill(dataclasses.replace(shape, window_left=None), H200, DEFAULT)
    if causal:
        assert launch.tokens_per_part * launch.num_parts < 2048 < plain.tokens_per_part * plain.num_parts
    else:
        assert (launch.tokens_per_part, launch.num_parts) == (plain.tokens_per_part, plain.num_parts)


def test_masking_window():
    """One rule for planning and the kernels' argument: a window of max_len keys or more masks nothing."""
    assert [planning.masking_window(w, 10) for w in (None, 0, 9, 10, 11)] == [None, 0, 9, None, None]


def test_a_window_wider_than_max_len_changes_no_choice():
    """window_left >= max_len masks nothing: the same split and ranking as none, on the options' kernels."""
    base = decode_shape(64, (32, 8), 128, 8192)
    ragged = dataclasses.replace(base, num_seqs=200)
    for shape in (base, ragged, dataclasses.replace(base, head_size=256)):
        plain = planning.plan_decode(shape, H200, DEFAULT)
        wide = planning.plan_decode(dataclasses.replace(shape, window_left=shape.max_len), H200, DEFAULT)
        assert (wide.grid, wide.tokens_per_part, wide.longest_first) == (plain.grid, plain.tokens_per_part,
                                                                         plain.longest_first)
        assert wide.spec == dataclasses.replace(plain.spec, scores=True)


@pytest.mark.parametrize("head_size", [64, 128, 96])
def test_score_options_pick_their_kernels(head_size):
    """A call with a soft-cap or a window runs the kernels compiled with the score options; one without, those
    compiled without them (whose code is that of the kernels before the options)."""
    for num_heads, kv_heads in [(32, 8), (16, 16)]:
        base = decode_shape(64, (num_heads, kv_heads), head_size, 4096)
        for fields, scored in [({}, False), ({"soft_cap": True}, True), ({"window_left": 4096}, True),
                               ({"soft_cap": True, "window_left": 0}, True)]:
            assert planning.plan_decode(dataclasses.replace(base, **fields), H200, DEFAULT).spec.scores is scored
            prefill = planning.PrefillShape(**dataclasses.asdict(base), total_q=512, causal=True)
            launch = planning.plan_prefill(dataclasses.replace(prefill, **fields), H200, DEFAULT)
            assert launch.spec.scores is scored


@pytest.mark.parametrize(("heads", "head_size", "num_seqs", "kernel", "tensor_cores", "heads_per_cta"), [
    ((32, 8), 128, 8, "auto", True, None),
    ((32, 8), 128, 8, "simt", True, None),     # no SIMT kernel of fp8 caches with grouped queries up to 128
    ((16, 16), 64, 2, "auto", False, 1),       # a small multi-head grid: the SIMT decode, one head per CTA
    ((16, 16), 64, 64, "auto", True, None),    # one that fills the GPU: the tensor cores
    ((16, 4), 192, 8, "auto", False, 4),       # past head size 128: the SIMT decode with the group
])
def test_fp8_decode_planning(heads, head_size, num_seqs, kernel, tensor_cores, heads_per_cta):
    shape = decode_shape(num_seqs, heads, head_size, 4096, kv_cache="fp8_e5m2")
    launch = planning.plan_decode(shape, planning.Device.h200(), tuning.Tuning(decode_kernel=kernel))
    assert launch.tensor_cores == tensor_cores and launch.spec.kv_cache == "fp8_e5m2"
    assert launch.spec in set(_specs.all_specs())
    if heads_per_cta is not None:
        assert launch.spec.heads_per_cta == heads_per_cta and not launch.cluster
    else:  # fp8 stages of half the bytes and one 16-bit stage: no more shared memory than the 16-bit tiling
        assert launch.shared_mem <= dataclasses.replace(launch.spec, kv_cache=None).smem_bytes


def test_fp8_scale_arguments():
    """The kernels' fp8 scale parameters: addresses of the arrays, a stride of 0 for one scale and 1 per KV head, the
    numbers (1.0 where an array holds the scale)."""
    from cupy_paged_attn import _launch

    args = dict(_launch.kv_scale_args(_checks.KvScale(0.5), _checks.KvScale(array=np.ones(4, np.float32)),
                                      {"v_scale": 4096}))
    assert args == {"k_scales": 0, "v_scales": 4096, "k_scale.stride": 0, "v_scale.stride": 1, "k_scale": 0.5,
                    "v_scale": 1.0}
    one = dict(_launch.kv_scale_args(_checks.KvScale(array=np.ones(1, np.float32)), None, {"k_scale": 64}))
    assert one["k_scales"] == 64 and one["k_scale.stride"] == 0 and one["v_scale"] == 1.0


@pytest.mark.parametrize(("dtype", "head_size", "kernel", "message"), [
    ("f32", 64, "decode", r"query: an fp8 cache \(fp8_e4m3\) with a float32 query"),
    ("bf16", 120, "decode", r"head_size: an fp8 cache on the GPU takes head sizes"),
    ("f16", 120, "prefill", r"head_size: an fp8 cache on the GPU takes head sizes"),
])
def test_fp8_refusals_name_the_argument(dtype, head_size, kernel, message):
    cache = _checks.CacheGeometry(4, 16, 2, head_size, 16 * 2 * head_size, "fp8_e4m3")
    with pytest.raises(NotImplementedError, match=message):
        _checks.check_kernel_support(cache, dtype, kernel)
    _checks.check_kernel_support(cache, "bf16", "cache write")  # any query dtype and head size
    _checks.check_kernel_support(dataclasses.replace(cache, head_size=128), "f32", "prefill")
