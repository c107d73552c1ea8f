"""GPU: the decode kernel against the float64 reference, across dtypes, head sizes, page sizes, GQA ratios,
layouts, bias kinds, ALiBi, ragged lengths and both the single-pass and split-K paths; interop with CuPy, PyTorch
and JAX; streams and CUDA graphs; hostile device data.
"""

from __future__ import annotations

import dataclasses
import itertools

import helpers
import numpy as np
import pytest
from helpers import BIAS_KINDS, DTYPES, assert_close, convert_bias, dense_attention, hostile_t5_bias, make_problem

import cupy_paged_attn as cpa
from cupy_paged_attn import _device, _specs, decode
from cupy_paged_attn.reference import paged_attention_ref, to_numpy

pytestmark = pytest.mark.gpu

SEQ_LENS = [1, 15, 17, 0, 513, 700]  # 1, odd, page boundaries, empty, long, the last at the table's capacity
HEADS = [(4, 4), (8, 2), (16, 2), (6, 2), (8, 1)]  # GQA ratios 1, 4, 8, 3 and MQA
DENSE_BIASES = ["none", "dense", "broadcast-seq", "broadcast-head", "strided"]  # as laid out in memory
GRID = [
    (dtype, head_size, block_size, i)
    for i, (dtype, head_size, block_size) in enumerate(
        itertools.product(["bf16", "f16", "f32"], [32, 64, 80, 96, 112, 120, 128, 192, 256], [8, 16, 32])
    )
]


@pytest.fixture(params=["single-pass", "split-k", "split-k-cluster"])
def split(request: pytest.FixtureRequest, tune) -> str:
    """conftest's ``split``, with the SIMT kernel's split-K partitions combined both ways: by the combine kernel
    ("split-k") and, where the device launches thread block clusters, in clusters ("split-k-cluster": the huge
    GPU puts every split grid of at most 8 partitions at one CTA per SM). The tensor-core kernel has one split
    path, taken by both."""
    tune(num_sms=1 if request.param == "single-pass" else 10**6, cluster_combine=request.param == "split-k-cluster")
    return request.param


def to_cupy(arr):
    """A CuPy copy of a NumPy array that keeps its strides (stride 0 stays 0): copy the owner, view it alike."""
    import cupy

    if arr is None:
        return None
    owner = arr
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if owner is arr or not owner.flags.c_contiguous:
        return cupy.asarray(arr)
    dev = cupy.asarray(owner)
    offset = arr.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
    return cupy.ndarray(arr.shape, arr.dtype, dev.data + offset, arr.strides)


def to_torch(arr, device="cuda"):
    import torch

    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    if arr.dtype == DTYPES["bf16"]:
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(arr).to(device)


def device_args(p, convert):
    kwargs = p.kwargs()
    return [convert(a) for a in p.args()], {**kwargs, "attn_bias": convert_bias(kwargs["attn_bias"], convert),
                                           "alibi_slopes": convert(p.alibi_slopes)}


def captured(call):
    """A torch CUDA graph of ``call()``, after a warm-up run on a side stream (compiles outside the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def run_cupy(p, poison_out=True):
    import cupy

    args, kwargs = device_args(p, to_cupy)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype) if poison_out else None
    result = cpa.paged_attention(*args, **kwargs, out=out)
    cupy.cuda.get_current_stream().synchronize()
    return to_numpy(result)


@pytest.mark.parametrize(("dtype", "head_size", "block_size", "i"), GRID,
                         ids=[f"{d}-d{h}-b{b}" for d, h, b, _ in GRID])
def test_decode_grid(rng, split, dtype, head_size, block_size, i):
    num_heads, num_kv_heads = HEADS[i % len(HEADS)]
    layout = ["nhd", "vllm", "hnd"][i % 3]
    bias = DENSE_BIASES[i % len(DENSE_BIASES)]
    p = make_problem(rng, SEQ_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                     block_size=block_size, dtype=dtype, kv_layout=layout, bias=bias, bias_dtype=dtype,
                     alibi=i % 3 == 0, extra_table_cols=0)
    what = f"{layout} heads={num_heads}/{num_kv_heads} bias={bias} alibi={i % 3 == 0} {split}"
    assert_close(run_cupy(p), paged_attention_ref(*p.args(), **p.kwargs()), dtype, what)


KERNEL_GRID = [  # (dtype, head_size, block_size, (num_heads, num_kv_heads), layout, bias kind)
    ("bf16", 128, 16, (32, 8), "nhd", "dense"), ("f16", 128, 8, (8, 2), "vllm", "ragged"),
    ("bf16", 64, 32, (16, 16), "nhd", "t5-bidir"), ("f16", 32, 16, (6, 2), "nhd", "broadcast-head"),
    ("bf16", 80, 16, (8, 1), "vllm", "t5-causal"), ("f16", 96, 32, (40, 2), "nhd", "dense"),
    ("bf16", 112, 8, (12, 4), "hnd", "none"), ("f16", 120, 16, (16, 4), "vllm", "strided"),
    ("bf16", 128, 16, (32, 2), "vllm", "t5-causal"), ("f16", 64, 16, (24, 2), "hnd", "dense"),
]


@pytest.mark.parametrize("kernel", ["tensor-cores", "simt"])
@pytest.mark.parametrize(("dtype", "head_size", "block_size", "heads", "layout", "bias"), KERNEL_GRID,
                         ids=[f"{d}-d{h}-b{b}-{q}of{k}-{lay}-{bias}" for d, h, b, (q, k), lay, bias in KERNEL_GRID])
def test_both_decode_kernels(rng, split, tune, kernel, dtype, head_size, block_size, heads, layout, bias):
    """16-bit decode with head sizes up to 128 has two kernels: the tensor-core one (decode_mma.cu) and the SIMT
    one (decode_simt.cu). Each, forced, on every group shape: MHA, GQA, MQA, more than 16 heads per KV head; the
    tensor-core kernel's CTAs of 8 rows (groups up to 8) and of 16 (9 to 16 heads, or two CTAs past 16)."""
    tune(decode_kernel=kernel)
    alibi = head_size in (64, 112)
    p = make_problem(rng, SEQ_LENS, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                     block_size=block_size, dtype=dtype, kv_layout=layout, bias=bias, bias_dtype=dtype, alibi=alibi,
                     extra_table_cols=0)
    out = run_cupy(p)
    used = {plan.launch.tensor_cores for plan in decode._PLANS.plans.values()}
    assert (kernel == "tensor-cores") in used
    what = f"{kernel} {split}"
    assert_close(out, paged_attention_ref(*p.args(), **p.kwargs()), dtype, what)
    assert_close(out, dense_attention(p), dtype, what + " (independent dense attention)")


KIND_GRID = [  # (dtype, head_size, (num_heads, num_kv_heads), layout, bias dtype)
    ("bf16", 128, (8, 2), "nhd", "bf16"), ("f16", 64, (4, 4), "vllm", "f32"), ("f32", 96, (6, 2), "nhd", "f16"),
    ("bf16", 256, (8, 1), "vllm", "f32"), ("f16", 80, (16, 2), "nhd", "f16"), ("bf16", 128, (32, 2), "vllm", "bf16"),
]


@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize(("dtype", "head_size", "heads", "layout", "bias_dtype"), KIND_GRID,
                         ids=[f"{d}-d{h}-{q}of{k}-{lay}-bias{b}" for d, h, (q, k), lay, b in KIND_GRID])
def test_bias_kinds(rng, split, kind, dtype, head_size, heads, layout, bias_dtype):
    alibi = head_size in (64, 256)
    p = make_problem(rng, SEQ_LENS, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, dtype=dtype,
                     kv_layout=layout, bias=kind, bias_dtype=bias_dtype, alibi=alibi, extra_table_cols=0)
    out = run_cupy(p)
    what = f"{kind} {split}"
    assert_close(out, paged_attention_ref(*p.args(), **p.kwargs()), dtype, what)
    assert_close(out, dense_attention(p), dtype, what + " (independent dense attention)")


def test_bias_kinds_equal_their_dense_form(rng):
    """The same logits whichever way the bias arrives: ragged and T5 in-kernel vs the materialised dense bias."""
    for kind in ("ragged", "t5-bidir"):
        p = make_problem(rng, [700, 1, 129], num_heads=8, num_kv_heads=2, head_size=128, dtype="f32", bias=kind)
        as_kind = run_cupy(p)
        p.bias_kind = None  # now attn_bias is the dense form
        np.testing.assert_allclose(as_kind, run_cupy(p), atol=2e-6, rtol=2e-6, err_msg=kind)


def test_single_pass_and_split_k_agree(rng, tune):
    p = make_problem(rng, [3000, 1, 2049], num_heads=8, num_kv_heads=2, head_size=128, dtype="f32", bias="dense")
    results = {}
    for name, sms in (("single", 1), ("split", 10**6)):
        tune(num_sms=sms)
        results[name] = run_cupy(p)
    np.testing.assert_allclose(results["single"], results["split"], atol=1e-5, rtol=1e-5)
    assert_close(results["split"], paged_attention_ref(*p.args(), **p.kwargs()), "f32")


CLUSTER_GRID = [  # (dtype, head_size, (num_heads, num_kv_heads), layout, bias, longest sequence): 2-8 partitions
    ("bf16", 64, (16, 16), "nhd", "dense", 1024),           # the latency case's shape: 8 partitions, 1 head a CTA
    ("f16", 128, (8, 4), "vllm", "ragged", 300),            # 3 partitions, 2 heads a CTA
    ("f32", 256, (8, 2), "nhd", "t5-bidir", 520),           # 5 partitions, 4 heads a CTA
    ("f32", 32, (8, 1), "nhd", "none", 129),                # 2 partitions, 8 heads a CTA
    ("bf16", 80, (4, 4), "vllm", "t5-causal", 900),         # 8 partitions, a partial last one
    ("f16", 192, (6, 2), "nhd", "broadcast-head", 640),     # 5 partitions, 3 heads in a CTA of 4
    ("bf16", 96, (8, 8), "nhd", "strided", 777),            # 7 partitions
]


@pytest.mark.parametrize(("dtype", "head_size", "heads", "layout", "bias", "longest"), CLUSTER_GRID,
                         ids=[f"{d}-d{h}-{q}of{k}-{lay}-{b}-L{n}" for d, h, (q, k), lay, b, n in CLUSTER_GRID])
def test_cluster_combine(rng, tune, dtype, head_size, heads, layout, bias, longest):
    """Split grids of the SIMT kernel that combine their partitions in thread block clusters (2 to 8 partitions,
    1 to 8 heads a CTA, every bias kind, ALiBi) against the reference and against the same grid combined by the
    combine kernel; the output poisoned, unused page slots NaN, an empty and a one-key sequence among longer
    ones (whole partitions with no key)."""
    if not _device.query(0).clusters:
        pytest.skip("thread block clusters need compute capability 9.0")
    tune(num_sms=10**6, decode_kernel="simt")  # whatever the group
    p = make_problem(rng, [longest, 0, 1, longest // 2 + 5], num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=head_size, dtype=dtype, kv_layout=layout, bias=bias, bias_dtype=dtype, alibi=True,
                     extra_table_cols=0)
    expected = paged_attention_ref(*p.args(), **p.kwargs())
    results = {}
    for cluster in (True, False):
        tune(cluster_combine=cluster)
        results[cluster], launch = run_plan_poisoned(p)
        assert not launch.tensor_cores and launch.cluster == cluster and launch.combines == (not cluster)
        assert 1 < launch.num_parts <= _specs.DECODE_CLUSTER_MAX_PARTS
        assert_close(results[cluster], expected, dtype, f"{'cluster' if cluster else 'kernel'} combine")
    np.testing.assert_allclose(results[True].astype(np.float32), results[False].astype(np.float32),
                               atol=1e-2 if dtype != "f32" else 1e-5, rtol=1e-2 if dtype != "f32" else 1e-5)


def ranked_problem(rng, num_seqs, longest, heads, head_size, bias, in_order=False):
    """A bf16 problem of ``num_seqs`` lengths below ``longest``, ties and an empty sequence among them, for the
    longest-first tests; ``in_order``: the lengths already longest first (each CTA's rank is then its own row)."""
    lens = [int(n) for n in rng.integers(0, longest, num_seqs)]
    lens[: min(num_seqs, 4)] = [longest - 1, 0, longest - 1, 1][: min(num_seqs, 4)]
    if in_order:
        lens.sort(reverse=True)
    return make_problem(rng, lens, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, dtype="bf16",
                        bias=bias, bias_dtype="bf16", alibi=True, spare_blocks=1, extra_table_cols=0)


def run_plan_poisoned(p):
    """``p`` through a DecodePlan whose output and split-K workspace hold NaN before the run: a partial that no CTA
    writes, or an output row, shows in the result. Returns the result and the plan's launch."""
    import cupy

    args, kwargs = device_args(p, to_cupy)
    plan = cpa.DecodePlan(*args, **kwargs)
    if plan._workspace is not None:
        plan._workspace.fill(np.nan)
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)
    plan.run(*args, **{k: kwargs[k] for k in ("attn_bias", "alibi_slopes")}, out=out)
    cupy.cuda.get_current_stream().synchronize()
    return to_numpy(out), plan.launch


def assert_order_changes_nothing(tune, p, check_launch):
    """Run ``p`` with the longest_first switch on and off (:func:`run_plan_poisoned`), ``check_launch(launch, order)``
    on each plan: the reference's answer both ways, and the same bits both ways when the grid is not split. (A
    ranked split grid cuts each sequence's own keys into its partitions, index order cuts max_len's: the partials
    then round differently.)"""
    results = {}
    for order in (True, False):
        tune(longest_first=order)
        results[order], launch = run_plan_poisoned(p)
        check_launch(launch, order)
        assert_close(results[order], paged_attention_ref(*p.args(), **p.kwargs()), "bf16", f"order {order}")
    if launch.num_parts == 1:
        np.testing.assert_array_equal(results[True], results[False])


@pytest.mark.parametrize(("num_seqs", "bias"), [(2, "dense"), (37, "dense"), (256, "dense"), (37, "ragged"),
                                                (37, "t5-causal"), (256, "t5-bidir")])
@pytest.mark.parametrize(("heads", "head_size", "mha"), [((4, 4), 64, False), ((4, 4), 64, True),
                                                        ((8, 2), 64, True), ((32, 2), 128, True)],
                         ids=["simt-kernel", "tensor-cores-mha", "tensor-cores-8-rows", "tensor-cores-16-rows"])
def test_longest_first_order(rng, tune, num_seqs, bias, heads, head_size, mha):
    """Sequences taken longest first (ties and an empty one among them) give the reference's answer, and what index
    order gives bit for bit where the grid is not split, on the SIMT kernel and the tensor-core one (8 and 16 rows
    per CTA: 128 threads rank two sequences each past 128), with each bias kind (T5's SIMT kernels reread the
    sequence from shared memory); every output row and partial is written (out and workspace poisoned). 256
    sequences is the most one ranking takes. (Lengths past the block table and negative ones:
    test_hostile_block_ids_and_lengths_stay_in_bounds, whose single-pass grids are ordered so too.)"""
    tune(num_sms=1, multi_head_tensor_cores=mha)  # every grid is then several waves (MHA: not with a ragged bias)

    def check_launch(launch, order):
        tensor_cores = heads[0] > heads[1] or (mha and bias != "ragged")
        assert launch.longest_first == order and launch.tensor_cores == tensor_cores
        assert launch.num_parts == 1 or launch.tensor_cores  # (2 sequences on the tensor cores: a tail split)

    assert_order_changes_nothing(tune, ranked_problem(rng, num_seqs, 300, heads, head_size, bias), check_launch)


@pytest.mark.parametrize(("num_seqs", "bias", "in_order"), [(37, "dense", False), (37, "ragged", False),
                                                            (256, "t5-bidir", False), (150, "none", False),
                                                            (37, "dense", True)])
@pytest.mark.parametrize(("heads", "head_size"), [((8, 2), 64), ((32, 2), 128)], ids=["8-rows", "16-rows"])
def test_longest_first_tail_split(rng, tune, num_seqs, bias, in_order, heads, head_size):
    """A tensor-core grid of between one wave and one and a half is split (planning.tail_parts) and still taken
    longest first: CTAs rank the sequences and take them sequence by sequence, each cut into the partitions by its own
    length (decode_mma.cu), their block ids then starting past the partition's first key. The reference's answer
    with every partial and row written (workspace and out poisoned), in either order; a batch already in order
    reads the first block ids that travelled while ranking only where its partition starts where they do."""
    rows = _specs.decode_rows(heads[0] // heads[1])
    resident = _specs.decode_ctas_per_sm(head_size, rows)
    ctas = num_seqs * heads[1] * -(-(heads[0] // heads[1]) // rows)
    tune(num_sms=max(1, int(ctas / (1.25 * resident))))  # about 1.25 waves

    def check_launch(launch, order):
        assert launch.tensor_cores and launch.num_parts in (2, 3) and launch.longest_first == order

    assert_order_changes_nothing(tune, ranked_problem(rng, num_seqs, 700, heads, head_size, bias, in_order),
                                 check_launch)


T5_GEOMETRY_GRID = [  # (dtype, head_size, group size, max_distance, bidirectional)
    ("bf16", 64, 1, 447, False), ("f16", 128, 1, 448, True), ("bf16", 128, 2, 191, True), ("f16", 64, 2, 192, False),
    ("bf16", 64, 4, 60, True), ("bf16", 128, 4, 128, False), ("f16", 96, 1, 20, False), ("bf16", 64, 8, 128, True),
    ("bf16", 64, 1, 255, True), ("f16", 64, 8, 160, False), ("f16", 96, 1, 200, True),
]


@pytest.mark.parametrize(("dtype", "head_size", "group", "max_distance", "bidirectional"), T5_GEOMETRY_GRID,
                         ids=[f"{d}-d{h}-g{g}-n{n}-{'bidir' if b else 'causal'}" for d, h, g, n, b in T5_GEOMETRY_GRID])
def test_tensor_core_t5_geometries(rng, split, tune, monkeypatch, dtype, head_size, group, max_distance,
                                   bidirectional):
    """The tensor-core decode with T5 (one head per KV head included, as multi-head problems now run there) over
    max_distances short and long, sequences shorter than, about and far past max_distance: tiles all far, all near
    and mixed; single pass and split (partitions that hold no near key). The CTA's near table and far constants come
    from shared memory where the table fits (max_distance < 256 and group · max_distance within the floats that the
    CTAs per SM leave over, 1024 at most: 255, 128 at group 8, 192 at head size 96 the largest here), else from
    loads per logit (447, 448, 160 at group 8, 200 at head size 96). The reference's answer, and an independent
    dense attention's."""
    tune(decode_kernel="tensor-cores")
    monkeypatch.setitem(helpers.T5_KIND_GEOMETRY, "t5-geometry", (32, max_distance, bidirectional))
    lens = [1, max_distance - 1, max_distance + 1, 0, 64, 3 * max_distance + 200]
    p = make_problem(rng, lens, num_heads=2 * group, num_kv_heads=2, head_size=head_size, dtype=dtype,
                     bias="t5-geometry", bias_dtype=dtype, alibi=group == 2)
    args, kwargs = device_args(p, to_cupy)
    assert cpa.DecodePlan(*args, **kwargs).launch.tensor_cores
    out = run_cupy(p)
    assert_close(out, paged_attention_ref(*p.args(), **p.kwargs()), dtype, split)
    assert_close(out, dense_attention(p), dtype, split + " (independent dense attention)")


@pytest.mark.parametrize(("q_dtype", "bias_dtype"), [("bf16", "f32"), ("bf16", "f16"), ("f16", "bf16"),
                                                     ("f32", "bf16"), ("f16", "f16")])
def test_bias_dtypes(rng, split, q_dtype, bias_dtype):
    p = make_problem(rng, [40, 7, 300], num_heads=8, num_kv_heads=4, dtype=q_dtype, bias="dense",
                     bias_dtype=bias_dtype)
    assert_close(run_cupy(p), paged_attention_ref(*p.args(), **p.kwargs()), q_dtype)


@pytest.mark.parametrize(("num_heads", "head_size", "dtype", "bias_dtype", "spec_bias"), [
    (8, 64, "bf16", "bf16", "dense-rows"), (8, 64, "bf16", "f32", "dense-rows"), (8, 128, "bf16", "bf16", "dense-rows"),
    (8, 128, "f16", "f32", "dense-rows"), (32, 128, "f16", "f16", "dense-rows"), (32, 128, "bf16", "f32", "dense")],
    ids=["8-rows-d64", "8-rows-d64-f32", "8-rows-d128", "8-rows-d128-f32", "16-rows-d128", "16-rows-d128-f32"])
@pytest.mark.parametrize("offset", [0, 1, 3], ids=["rows-aligned", "rows-offset1", "rows-offset3"])
def test_tensor_core_dense_bias_row_alignments(rng, split, num_heads, head_size, dtype, bias_dtype, spec_bias,
                                               offset):
    """The tensor-core decode kernel with dense bias rows of every alignment, copied tile by tile into shared memory
    (DenseRowsBias, "dense-rows"; float32 too where the stages have room for it) or read in place (a float32 bias at
    16 rows of head size 128, "dense"): an odd row length L puts row r at element r·L of the storage, so the rows'
    first keys take every offset in a 16-byte vector, and the storage starts offset elements before the first row.
    Lengths that end inside a tile and inside a vector, NaN past each sequence and before the first row (a staged
    first vector starts up to 16 bytes before its row; those are never used)."""
    lens = [700, 129, 64, 3, 0, 1000]
    p = make_problem(rng, lens, num_heads=num_heads, num_kv_heads=2, head_size=head_size, dtype=dtype,
                     bias="dense", bias_dtype=bias_dtype)
    width = p.attn_bias.shape[2]
    for length in (width, width + 1, width + 5):
        store = rng.standard_normal((len(lens), num_heads, length + offset)).astype(DTYPES[bias_dtype])
        store[0, 0, :offset] = np.nan
        bias = store[:, :, offset:]
        for s, n in enumerate(lens):
            bias[s, :, n:] = np.nan  # past each sequence: never read
        q = dataclasses.replace(p, attn_bias=bias)
        args, kwargs = device_args(q, to_cupy)
        launch = cpa.DecodePlan(*args, **kwargs).launch
        assert launch.tensor_cores and launch.spec.bias == spec_bias
        assert_close(run_cupy(q), paged_attention_ref(*q.args(), **q.kwargs()), dtype, f"L={length}")


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dtype", "bias_dtype", "spec_bias"), [
    (8, 2, "bf16", "bf16", "ragged-rows"), (32, 2, "f16", "f16", "ragged-rows"), (8, 2, "bf16", "f32", "ragged-rows"),
    (12, 3, "f16", "f32", "ragged-rows"), (32, 2, "bf16", "f32", "ragged")],
    ids=["8-rows", "16-rows", "8-rows-f32", "8-rows-f32-12-heads", "16-rows-f32"])
@pytest.mark.parametrize("offset", [0, 3], ids=["values-aligned", "values-offset"])
def test_tensor_core_staged_ragged_bias(rng, split, num_heads, num_kv_heads, dtype, bias_dtype, spec_bias, offset):
    """A ragged bias of adjacent heads whose keys lie a multiple of 16 bytes apart, copied tile by tile into shared
    memory (RaggedRowsBias; float32 too where the stages have room for it, else read in place, "ragged"): values
    starting on every alignment of a 16-byte vector (offset elements into their storage, so each CTA's first head
    falls anywhere in one), rows of num_heads or num_heads + 8 elements (a column slice; a float32 step need only be
    a multiple of 4 elements), NaN in the rows between sequences, in the columns past the heads and before the first
    value (a key's first vector starts up to 16 bytes before the CTA's heads; those are never used), lengths that end
    inside a tile and a sequence with no keys."""
    lens = [700, 129, 64, 3, 0, 1000]
    p = make_problem(rng, lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=128, dtype=dtype,
                     bias="ragged", bias_dtype=bias_dtype)
    values = p.bias_kind.values
    for width in (num_heads, num_heads + 8):
        store = np.full(offset + values.shape[0] * width, np.nan, dtype=values.dtype)
        rows = store[offset:].reshape(values.shape[0], width)
        rows[:, :num_heads] = values  # (NaN where values has it: the rows between sequences)
        q = dataclasses.replace(p, bias_kind=cpa.RaggedBias(rows[:, :num_heads], p.bias_kind.offsets))
        args, kwargs = device_args(q, to_cupy)
        assert cpa.DecodePlan(*args, **kwargs).launch.spec.bias == spec_bias
        assert_close(run_cupy(q), paged_attention_ref(*q.args(), **q.kwargs()), dtype, f"row of {width}")


def test_long_context_split(rng):
    p = make_problem(rng, [20000], num_heads=32, num_kv_heads=8, head_size=128, dtype="bf16", bias="dense",
                     bias_dtype="bf16", alibi=True)
    assert_close(run_cupy(p), paged_attention_ref(*p.args(), **p.kwargs()), "bf16")


def test_masked_bias_gives_zeros_not_nan(rng, split):
    p = make_problem(rng, [6, 70], num_heads=4, num_kv_heads=4, bias="dense")
    p.attn_bias[0, :, :3] = -np.inf
    p.attn_bias[1, 2, :70] = -np.inf  # every key of one head masked
    out = run_cupy(p)
    assert (out[1, 2] == 0).all()
    assert_close(out, paged_attention_ref(*p.args(), **p.kwargs()), "f32")


def test_empty_batch_and_empty_sequences(rng):
    import cupy

    p = make_problem(rng, [0, 0, 0], num_heads=4, num_kv_heads=2)
    assert (run_cupy(p) == 0).all()
    q = cupy.ones((0, 4, 64), cupy.float32)
    k = cupy.ones((2, 16, 2, 64), cupy.float32)
    out = cpa.paged_attention(q, k, k, cupy.zeros((0, 1), cupy.int32), cupy.zeros((0,), cupy.int32))
    assert out.shape == (0, 4, 64)


def test_noncontiguous_inputs_and_out_view(rng):
    import cupy

    p = make_problem(rng, [33, 5], num_heads=8, num_kv_heads=2, head_size=64, bias="strided")
    args, kwargs = device_args(p, to_cupy)
    wide = cupy.asarray(rng.standard_normal((2, 8, 3 * 64)).astype(np.float32))
    wide[:, :, 64:128] = args[0]
    args[0] = wide[:, :, 64:128]  # strided rows
    tables = cupy.zeros((2, 2 * p.block_tables.shape[1]), cupy.int32)
    tables[:, ::2] = args[3]
    args[3] = tables[:, ::2]  # non-unit last stride: copied
    out_base = cupy.full((2, 8, 128), np.nan, cupy.float32)
    out = out_base[:, :, :64]
    result = cpa.paged_attention(*args, **kwargs, out=out)
    assert result is out
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs()), "f32")
    assert np.isnan(to_numpy(out_base[:, :, 64:])).all(), "out= wrote outside its view"


# ---------------------------------------------------------------------------------------------------------------
# Frameworks
# ---------------------------------------------------------------------------------------------------------------
def test_torch_bf16_out_and_type(rng):
    torch = pytest.importorskip("torch")
    p = make_problem(rng, [1, 100, 17], num_heads=16, num_kv_heads=4, head_size=128, dtype="bf16", bias="dense",
                     bias_dtype="bf16", alibi=True)
    args, kwargs = device_args(p, to_torch)
    result = cpa.paged_attention(*args, **kwargs)
    assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16 and result.is_cuda
    expected = paged_attention_ref(*p.args(), **p.kwargs())
    assert_close(to_numpy(result), expected, "bf16")
    out = torch.full_like(args[0], float("nan"))
    assert cpa.paged_attention(*args, **kwargs, out=out) is out
    assert_close(to_numpy(out), expected, "bf16")
    args[0].requires_grad_(False)
    q_grad = args[0].float().requires_grad_(True).to(torch.bfloat16)  # a tensor in an autograd graph
    assert_close(to_numpy(cpa.paged_attention(q_grad, *args[1:], **kwargs)), expected, "bf16")


def test_torch_current_stream_and_graph(rng):
    torch = pytest.importorskip("torch")
    p = make_problem(rng, [300, 64, 5], num_heads=8, num_kv_heads=2, head_size=64, dtype="f16", bias="dense",
                     bias_dtype="f16")
    args, kwargs = device_args(p, to_torch)
    expected = paged_attention_ref(*p.args(), **p.kwargs())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # the launch must queue behind this on `side`
        result = cpa.paged_attention(*args, **kwargs)
    side.synchronize()
    assert_close(to_numpy(result), expected, "f16")

    out = torch.full_like(args[0], float("nan"))
    graph = captured(lambda: cpa.paged_attention(*args, **kwargs, out=out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(to_numpy(out), expected, "f16")
    new_q = torch.randn_like(args[0])
    args[0].copy_(new_q)  # replay reads the captured buffers' new contents
    graph.replay()
    torch.cuda.synchronize()
    p.query = to_numpy(new_q)
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs()), "f16")


def test_torch_explicit_stream_argument(rng):
    torch = pytest.importorskip("torch")
    import cupy

    p = make_problem(rng, [50, 9], num_heads=4, num_kv_heads=4, dtype="f32")
    args, kwargs = device_args(p, to_torch)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    result = cpa.paged_attention(*args, **kwargs, stream=s)
    s.synchronize()
    assert_close(to_numpy(result), paged_attention_ref(*p.args(), **p.kwargs()), "f32")
    with pytest.raises(TypeError, match="stream: a torch stream"):
        cpa.paged_attention(*device_args(p, to_cupy)[0], stream=s)
    with pytest.raises(TypeError, match="stream: expected"):
        cpa.paged_attention(*args, stream="default")
    cupy_stream = cupy.cuda.Stream(non_blocking=True)
    cupy_args = device_args(p, to_cupy)
    result = cpa.paged_attention(*cupy_args[0], **cupy_args[1], stream=cupy_stream)
    cupy_stream.synchronize()
    assert_close(to_numpy(result), paged_attention_ref(*p.args(), **p.kwargs()), "f32")


def test_jax_bf16(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU")
    p = make_problem(rng, [1, 100, 17], num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense",
                     bias_dtype="f32")
    args, kwargs = device_args(p, lambda a: None if a is None else jnp.asarray(np.ascontiguousarray(a)))
    result = cpa.paged_attention(*args, **kwargs)
    assert isinstance(result, jax.Array) and result.dtype == jnp.bfloat16
    assert_close(to_numpy(result), paged_attention_ref(*p.args(), **p.kwargs()), "bf16")
    with pytest.raises(TypeError, match="out: JAX arrays are immutable"):
        cpa.paged_attention(*args, **kwargs, out=args[0])


def test_torch_bias_kinds_and_graph(rng):
    """Ragged and T5 biases from torch tensors, eager and replayed from a CUDA graph (captured after a warm-up:
    RelativePositionBias builds its bucket table when constructed, nothing is allocated at the call)."""
    torch = pytest.importorskip("torch")
    for kind in ("ragged-strided", "t5-causal"):
        p = make_problem(rng, [300, 64, 5], num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias=kind,
                         bias_dtype="bf16")
        args, kwargs = device_args(p, to_torch)
        expected = paged_attention_ref(*p.args(), **p.kwargs())
        assert_close(to_numpy(cpa.paged_attention(*args, **kwargs)), expected, "bf16", kind)
        out = torch.full_like(args[0], float("nan"))
        graph = captured(lambda args=args, kwargs=kwargs, out=out: cpa.paged_attention(*args, **kwargs, out=out))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(to_numpy(out), expected, "bf16", kind + " graph")


def test_jax_bias_kinds(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU")
    for kind in ("ragged", "t5-bidir"):
        p = make_problem(rng, [1, 100, 17], num_heads=8, num_kv_heads=2, dtype="f16", bias=kind, bias_dtype="f32")
        args, kwargs = device_args(p, lambda a: None if a is None else jnp.asarray(np.ascontiguousarray(a)))
        result = cpa.paged_attention(*args, **kwargs)
        assert isinstance(result, jax.Array)
        assert_close(to_numpy(result), paged_attention_ref(*p.args(), **p.kwargs()), "f16", kind)


# ---------------------------------------------------------------------------------------------------------------
# DecodePlan: decided once, run many times
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("framework", ["torch", "cupy", "jax"])
@pytest.mark.parametrize("bias", ["dense", "ragged", "t5-causal", "none"])
def test_plan_runs_like_paged_attention(rng, split, framework, bias):
    """A plan built from one problem runs another of the same shapes (new data, new buffers) correctly."""
    if framework == "torch":
        pytest.importorskip("torch")
        convert = to_torch
    elif framework == "jax":
        jax = pytest.importorskip("jax")
        if not any(d.platform == "gpu" for d in jax.devices()):
            pytest.skip("jax has no GPU")
        def convert(a):
            return None if a is None else jax.numpy.asarray(np.ascontiguousarray(a))
    else:
        convert = to_cupy
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias=bias, bias_dtype="f32", alibi=True,
                 spare_blocks=2, extra_table_cols=1)
    first = make_problem(rng, [300, 17, 1], **shape)
    args, kwargs = device_args(first, convert)
    plan = cpa.DecodePlan(*args, **kwargs)
    run_kwargs = {k: kwargs[k] for k in ("attn_bias", "alibi_slopes")}
    assert_close(to_numpy(plan.run(*args, **run_kwargs)), paged_attention_ref(*first.args(), **first.kwargs()),
                 "bf16", "first")
    second = make_problem(rng, [300, 17, 1], **shape)  # same shapes: a table row per 300 keys, same cache size
    args2, kwargs2 = device_args(second, convert)
    expected = paged_attention_ref(*second.args(), **second.kwargs())
    result = plan.run(*args2, **{k: kwargs2[k] for k in ("attn_bias", "alibi_slopes")})
    assert_close(to_numpy(result), expected, "bf16", "second")
    if framework != "jax":
        out = convert(np.full(second.query.shape, np.nan, second.query.dtype))
        assert plan.run(*args2, **{k: kwargs2[k] for k in ("attn_bias", "alibi_slopes")}, out=out) is out
        assert_close(to_numpy(out), expected, "bf16", "out=")


@pytest.mark.parametrize("dependent", [True, False], ids=["dependent-launches", "plain-launches"])
@pytest.mark.parametrize("kernel", ["simt", "simt-cluster", "tensor-cores"])
def test_split_plan_reruns_and_replays(rng, tune, kernel, dependent):
    """Split-K runs of one plan, eager and as CUDA-graph replays, each on fresh data in the same buffers: the plan's
    workspace is reused by every run, and a sequence shorter than the partitions' span (3 keys) must not pick up a
    previous run's partials. Both kernels are launched both ways: with programmatic dependent launch (on devices
    that have it), where the combine starts while the attention kernel runs and the attention kernel while the
    kernel before it runs (here a kernel that has just written every input, or the previous run's combine), and
    plainly; the SIMT kernel also with its partitions combined in clusters (no combine kernel, no workspace)."""
    import cupy

    torch = pytest.importorskip("torch")
    has_launch_ex = int(cupy.cuda.Device().compute_capability) >= 90
    cluster = kernel == "simt-cluster"
    if cluster and not has_launch_ex:
        pytest.skip("thread block clusters need compute capability 9.0")
    tune(num_sms=10**6, decode_kernel="simt" if cluster else kernel, dependent_launch=dependent,
         cluster_combine=cluster)
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense", bias_dtype="bf16",
                 alibi=True, spare_blocks=0, extra_table_cols=0)
    lens = [900 if cluster else 1500, 3, 700]  # a cluster holds at most 8 partitions of 128 keys
    first = make_problem(rng, lens, **shape)
    args, kwargs = device_args(first, to_torch)
    plan = cpa.DecodePlan(*args, **kwargs)
    assert plan.launch.num_parts > 1 and plan.launch.tensor_cores == (kernel == "tensor-cores")
    assert plan.launch.cluster == cluster and (plan._workspace is None) == cluster
    assert plan.launch.dependent == (dependent and has_launch_ex)
    extra = ("attn_bias", "alibi_slopes")
    out = torch.full_like(args[0], float("nan"))
    graph = captured(lambda: plan.run(*args, **{k: kwargs[k] for k in extra}, out=out))
    for i in range(4):
        p = make_problem(rng, lens, **shape)
        expected = paged_attention_ref(*p.args(), **p.kwargs())
        new_args, new_kwargs = device_args(p, to_torch)
        assert_close(to_numpy(plan.run(*new_args, **{k: new_kwargs[k] for k in extra})), expected, "bf16",
                     f"eager run {i}")
        out.fill_(float("nan"))
        for dst, src in zip([*args, *(kwargs[k] for k in extra)], [*new_args, *(new_kwargs[k] for k in extra)],
                            strict=True):
            torch.mul(src, 1, out=dst)  # a kernel just before the run writes every input it reads
        plan.run(*args, **{k: kwargs[k] for k in extra}, out=out)
        torch.cuda.synchronize()
        assert_close(to_numpy(out), expected, "bf16", f"eager run {i} after a kernel wrote its inputs")
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(to_numpy(out), expected, "bf16", f"graph replay {i}")


def test_plan_rejects_what_it_was_not_built_for(rng):
    import cupy

    p = make_problem(rng, [40, 5], num_heads=4, num_kv_heads=2, bias="dense", alibi=True)
    args, kwargs = device_args(p, to_cupy)
    plan = cpa.DecodePlan(*args, **kwargs)
    run = {"attn_bias": kwargs["attn_bias"], "alibi_slopes": kwargs["alibi_slopes"]}
    with pytest.raises(ValueError, match=r"query: the plan was built for dtype float32, shape \(2, 4, 64\)"):
        plan.run(args[0][:1], *args[1:], **run)
    with pytest.raises(ValueError, match=r"block_tables: the plan was built for .* got dtype float32"):
        plan.run(*args[:3], args[3].astype(cupy.float32), args[4], **run)
    with pytest.raises(ValueError, match=r"attn_bias: the plan was built for a bias of kind ndarray, got NoneType"):
        plan.run(*args, alibi_slopes=run["alibi_slopes"])
    with pytest.raises(ValueError, match=r"alibi_slopes: expected an array like the plan's"):
        plan.run(*args, attn_bias=run["attn_bias"])
    with pytest.raises(ValueError, match=r"out: expected shape"):
        plan.run(*args, **run, out=cupy.empty((2, 4, 32), cupy.float32))
    with pytest.raises(TypeError, match=r"out: expected a cupy array like query, got ndarray"):
        plan.run(*args, **run, out=np.empty((2, 4, 64), np.float32))
    with pytest.raises(ValueError, match=r"key_cache: data must be 16-byte aligned"):
        plan.run(args[0], misaligned(args[1]), *args[2:], **run)
    # seq_lens 6 bytes apart: floored to whole elements it would read like the plan's (1,), wrongly
    odd = cupy.ndarray((2,), cupy.int32, cupy.asarray([40, 0, 5, 0], cupy.int32).data, strides=(6,))
    with pytest.raises(ValueError, match=r"seq_lens: the plan was built for .* got dtype int32, shape \(2,\), "
                                         r"strides \(6,\) \(bytes, not whole elements\)"):
        plan.run(*args[:4], odd, **run)
    with pytest.raises(ValueError, match=r"seq_lens: strides must be whole elements \(4 bytes\), got \(6,\) bytes"):
        cpa.paged_attention(*args[:4], odd, **kwargs)
    with pytest.raises(TypeError, match=r"query: a DecodePlan launches GPU kernels"):
        cpa.DecodePlan(*p.args(), **p.kwargs())


def misaligned(arr):
    """A CuPy array of ``arr``'s dtype, shape, strides and values whose data starts 4 bytes past a 16-byte boundary:
    what a plan's signature (dtype, shape, strides, device) cannot tell from an aligned one."""
    import cupy

    assert arr.flags.c_contiguous
    base = cupy.empty(arr.nbytes + 16, cupy.uint8)
    start = (4 - base.data.ptr % 16) % 16
    base[start:start + arr.nbytes] = arr.view(cupy.uint8).ravel()
    view = cupy.ndarray(arr.shape, arr.dtype, base.data + start, arr.strides)
    assert view.data.ptr % 16 == 4
    return view


def test_plan_fixes_the_t5_geometry(rng):
    """A RelativePositionBias of another geometry over a table of the same shape (its bucket array alike) is
    refused by a plan, not run with the plan's buckets per side; paged_attention plans it anew."""
    p = make_problem(rng, [300, 7], num_heads=4, num_kv_heads=4, dtype="f16", bias="t5-causal", bias_dtype="f16")
    args, kwargs = device_args(p, to_cupy)
    plan = cpa.DecodePlan(*args, **kwargs)
    table = kwargs["attn_bias"].table
    bidir = cpa.RelativePositionBias(table, num_buckets=32, max_distance=128, bidirectional=True)
    assert bidir.buckets.shape == kwargs["attn_bias"].buckets.shape
    with pytest.raises(ValueError, match=r"attn_bias: the plan was built for a bias of kind RelativePositionBias\("
                                         r"num_buckets=32, max_distance=128, bidirectional=False\), got "
                                         r"RelativePositionBias\(num_buckets=32, max_distance=128, "
                                         r"bidirectional=True\)"):
        plan.run(*args, attn_bias=bidir)
    for bias in (kwargs["attn_bias"], bidir, kwargs["attn_bias"]):
        host = cpa.RelativePositionBias(p.kwargs()["attn_bias"].table, num_buckets=32, max_distance=128,
                                        bidirectional=bias.bidirectional)
        expected = paged_attention_ref(*p.args(), **{**p.kwargs(), "attn_bias": host})
        assert_close(to_numpy(cpa.paged_attention(*args, **{**kwargs, "attn_bias": bias})), expected, "f16",
                     f"bidirectional={bias.bidirectional}")


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_paged_attention_reuses_its_plan_and_still_checks(rng, framework):
    """Repeated paged_attention calls with torch or CuPy arrays of the same signatures take the plan of the first
    (no checks run again: the host cost of a call drops ~5x) and give each call's own answer; what the signatures
    cannot show is still refused (a cache 4 bytes off alignment), and any other change of shape, dtype or argument
    is checked in full, as on a first call."""
    import cupy

    if framework == "torch":
        torch = pytest.importorskip("torch")
        convert = to_torch
    else:
        convert = to_cupy
    decode._PLANS.__dict__.pop("plans", None)
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense", bias_dtype="f32",
                 alibi=True, spare_blocks=1, extra_table_cols=0)
    for i in range(3):
        p = make_problem(rng, [300, 17, 1], **shape)
        args, kwargs = device_args(p, convert)
        assert_close(to_numpy(cpa.paged_attention(*args, **kwargs)), paged_attention_ref(*p.args(), **p.kwargs()),
                     "bf16", f"call {i}")
        assert len(decode._PLANS.plans) == 1
    out = convert(np.full(p.query.shape, np.nan, p.query.dtype))
    assert cpa.paged_attention(*args, **kwargs, out=out) is out
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs()), "bf16", "out=")
    assert len(decode._PLANS.plans) == 1

    if framework == "cupy":
        with pytest.raises(ValueError, match=r"value_cache: data must be 16-byte aligned"):
            cpa.paged_attention(*args[:2], misaligned(args[2]), *args[3:], **kwargs)
        with pytest.raises(TypeError, match=r"out: expected a cupy array like query, got Tensor"):
            cpa.paged_attention(*args, **kwargs, out=pytest.importorskip("torch").empty(3))
    else:
        with pytest.raises(TypeError, match=r"out: expected a torch array like query, got ndarray"):
            cpa.paged_attention(*args, **kwargs, out=np.empty(p.query.shape, np.float32))
        bad = torch.zeros(args[1].numel() + 8, dtype=args[1].dtype, device="cuda")
        view = bad.as_strided(args[1].shape, args[1].stride(), 2)  # 4 bytes in
        view.copy_(args[1])
        with pytest.raises(ValueError, match=r"key_cache: data must be 16-byte aligned"):
            cpa.paged_attention(args[0], view, *args[2:], **kwargs)
    with pytest.raises(ValueError, match=r"block_tables: expected dtype int32"):
        cpa.paged_attention(*args[:3], args[3][:, :] * 1.0, args[4], **kwargs)
    with pytest.raises(TypeError, match=r"scale: expected None or a finite real number, got bool"):
        cpa.paged_attention(*args, **{**kwargs, "scale": True})
    cpa.paged_attention(*args, **{**kwargs, "scale": 1})
    with pytest.raises(TypeError, match=r"scale: expected None or a finite real number, got bool"):
        cpa.paged_attention(*args, **{**kwargs, "scale": True})  # equal to 1 and of its hash, yet checked
    with pytest.raises(ValueError, match=r"seq_lens: sequence 0 has length"):
        lens = args[4] * 0 + 10**6
        cpa.paged_attention(*args[:4], lens, **kwargs, validate=True)
    cupy.cuda.Device().synchronize()


def test_plan_strided_operands_and_graph(rng):
    """A plan whose query has a strided last dimension copies it on every run, on the run's stream; a query of
    another dense order gets a contiguous result; a torch CUDA graph of plan.run replays the eager result."""
    torch = pytest.importorskip("torch")
    p = make_problem(rng, [500, 64, 5], num_heads=8, num_kv_heads=2, head_size=64, dtype="f16", bias="t5-causal",
                     bias_dtype="f16")
    args, kwargs = device_args(p, to_torch)
    wide = torch.zeros(3, 8, 128, dtype=torch.float16, device="cuda")
    wide[:, :, ::2] = args[0]
    strided = wide[:, :, ::2]
    expected = paged_attention_ref(*p.args(), **p.kwargs())
    plan = cpa.DecodePlan(strided, *args[1:], **kwargs)
    assert_close(to_numpy(plan.run(strided, *args[1:], attn_bias=kwargs["attn_bias"])), expected, "f16", "strided")
    # A dense query in another order (heads outermost): the result is allocated contiguous, as its strides say.
    permuted = args[0].permute(1, 0, 2).contiguous().permute(1, 0, 2)
    permuted_plan = cpa.DecodePlan(permuted, *args[1:], **kwargs)
    for result in (permuted_plan.run(permuted, *args[1:], attn_bias=kwargs["attn_bias"]),
                   cpa.paged_attention(permuted, *args[1:], **kwargs)):
        assert result.is_contiguous() and result.shape == permuted.shape
        assert_close(to_numpy(result), expected, "f16", "permuted query")

    plan = cpa.DecodePlan(*args, **kwargs)
    out = torch.full_like(args[0], float("nan"))
    graph = captured(lambda: plan.run(*args, attn_bias=kwargs["attn_bias"], out=out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(to_numpy(out), expected, "f16", "graph replay")


def test_mixed_frameworks_rejected(rng):
    torch = pytest.importorskip("torch")
    p = make_problem(rng, [5], num_heads=4, num_kv_heads=4)
    args = [to_torch(a) for a in p.args()]
    args[1] = to_cupy(p.key_cache)
    with pytest.raises(TypeError, match="key_cache: all arrays must come from one framework"):
        cpa.paged_attention(*args)
    cpu_q = torch.from_numpy(p.query)
    with pytest.raises(ValueError, match="query: expected a CUDA tensor"):
        cpa.paged_attention(cpu_q, *[to_torch(a) for a in p.args()[1:]])


def test_second_gpu(rng):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    p = make_problem(rng, [100, 3], num_heads=8, num_kv_heads=2, dtype="bf16", bias="dense", bias_dtype="bf16")
    args, kwargs = device_args(p, lambda a: to_torch(a, "cuda:1"))
    result = cpa.paged_attention(*args, **kwargs)
    assert result.device == torch.device("cuda:1")
    assert_close(to_numpy(result), paged_attention_ref(*p.args(), **p.kwargs()), "bf16")
    mixed = [to_torch(p.query, "cuda:0"), *args[1:]]
    with pytest.raises(ValueError, match="expected an array on device 0"):
        cpa.paged_attention(*mixed)


# ---------------------------------------------------------------------------------------------------------------
# Hostile device data: never a fault, whatever the indices say, and NaN rows for out-of-contract data
# ---------------------------------------------------------------------------------------------------------------
def assert_poisoned(out, rows, why):
    """Every element of ``out[rows]`` is NaN (out-of-contract device data is loud, never a plausible answer)."""
    assert np.isnan(out[rows].astype(np.float32)).all(), why


def check_hostile_launch(args, kwargs, split, spec_bias):
    """The launch a hostile-data test means to reach: the SIMT kernel (``spec_bias`` None) or the tensor-core kernel
    with that bias specialisation, split in partitions exactly when the ``split`` fixture asks for it."""
    launch = cpa.DecodePlan(*args, **kwargs).launch
    assert launch.tensor_cores == (spec_bias is not None) and (spec_bias is None or launch.spec.bias == spec_bias)
    assert (launch.num_parts > 1) == (split != "single-pass")
    assert launch.cluster == (split == "split-k-cluster" and spec_bias is None and _device.query(0).clusters)


@pytest.mark.parametrize(("dtype", "bias_dtype", "spec_bias"), [("f32", "f32", None), ("bf16", "f32", "dense"),
                                                             ("bf16", "bf16", "dense-rows")],
                         ids=["simt", "tc", "tc-staged"])
def test_hostile_block_ids_and_lengths_stay_in_bounds(rng, split, dtype, bias_dtype, spec_bias):
    """Block ids outside the cache and lengths negative or far past the block table's capacity, on the SIMT kernel and
    the tensor-core kernel (the bias read element by element, or staged in shared memory), single pass and split:
    never a fault; each such sequence's row is NaN, an empty one zeros, the others the reference's."""
    import cupy

    p = make_problem(rng, [400, 300, 200, 100, 0], num_heads=4, num_kv_heads=2, bias="dense", dtype=dtype,
                     bias_dtype=bias_dtype)
    tables = p.block_tables.copy()
    tables[0, 1] = -7  # used entries outside [0, num_blocks)
    tables[1, 0] = 2**31 - 1
    lens = np.array([400, -5, 10**9, 100, 0], np.int32)  # negative and far past the table's capacity
    args, kwargs = device_args(p, to_cupy)
    if spec_bias == "dense":  # keys two elements apart, which no stage takes: read element by element
        bias = kwargs["attn_bias"]
        spaced = cupy.full((*bias.shape, 2), cupy.nan, bias.dtype)
        spaced[..., 0] = bias
        kwargs["attn_bias"] = spaced[..., 0]
    check_hostile_launch(args, kwargs, split, spec_bias)
    args[3], args[4] = cupy.asarray(tables), cupy.asarray(lens)
    out = cpa.paged_attention(*args, **kwargs)
    cupy.cuda.get_current_stream().synchronize()  # an illegal access would raise here
    out = to_numpy(out)
    assert_poisoned(out, 0, "a used page outside the cache")
    assert_poisoned(out, 1, "a negative length")
    assert_poisoned(out, 2, "a length past the block table")
    assert_close(out[3], paged_attention_ref(*p.args(), **p.kwargs())[3], dtype)
    assert (out[4] == 0).all(), "an empty sequence gives zeros"
    # A length past a dense bias shorter than the block table (L = 150 < 400 keys): NaN.
    args[3] = to_cupy(p.block_tables)
    bias = kwargs["attn_bias"]
    kwargs["attn_bias"] = bias[:, :, :150]
    args[4] = cupy.asarray(np.array([400, 150, 149, 100, 0], np.int32))
    out = to_numpy(cpa.paged_attention(*args, **kwargs))
    assert_poisoned(out, 0, "a length past the dense bias")
    assert not np.isnan(out[1:]).any()
    kwargs["attn_bias"] = bias
    args[4] = cupy.asarray(lens)
    args[3] = cupy.asarray(tables)

    # validate=True finds each of them, naming the first offending sequence.
    with pytest.raises(ValueError, match=r"block_tables: sequence 0 uses block id -7, outside \[0, "):
        cpa.paged_attention(*args, **kwargs, validate=True)
    args[3] = to_cupy(p.block_tables)
    with pytest.raises(ValueError, match=r"seq_lens: sequence 1 has length -5, outside \[0, "):
        cpa.paged_attention(*args, **kwargs, validate=True)
    args[4] = to_cupy(p.seq_lens)
    assert_close(to_numpy(cpa.paged_attention(*args, **kwargs, validate=True)),
                 paged_attention_ref(*p.args(), **p.kwargs()), dtype)


def test_hostile_lengths_in_a_ranked_split_grid(rng, tune):
    """A tensor-core tail split taken longest first, with lengths negative and past the block table's capacity and a
    block id outside the cache: the ranking and each sequence's cut into partitions see the clamped lengths, never
    a fault; those sequences' rows are NaN and the sequences of valid data get the reference's answer."""
    import cupy

    tune(num_sms=2)  # 8 CTAs where 2 SMs hold 6: a tail split
    p = make_problem(rng, [400, 300, 200, 100], num_heads=8, num_kv_heads=2, head_size=128, bias="dense",
                     dtype="bf16", bias_dtype="bf16")
    args, kwargs = device_args(p, to_cupy)
    launch = cpa.DecodePlan(*args, **kwargs).launch
    assert launch.tensor_cores and launch.longest_first and launch.num_parts > 1
    tables = p.block_tables.copy()
    tables[2, 1] = -7
    args[3], args[4] = cupy.asarray(tables), cupy.asarray(np.array([400, -5, 10**9, 100], np.int32))
    out = cpa.paged_attention(*args, **kwargs)
    cupy.cuda.get_current_stream().synchronize()  # an illegal access would raise here
    out = to_numpy(out)
    assert_poisoned(out, [1, 2], "a length negative or past the block table (sequence 2 also uses block -7)")
    assert_close(out[[0, 3]], paged_attention_ref(*p.args(), **p.kwargs())[[0, 3]], "bf16")


def test_validate_reads_t5_buckets(rng):
    """``RelativePositionBias.from_buckets`` takes any bucket array; ``validate=True`` copies it to the host and names
    the first distance whose bucket lies outside the buckets of one side. Valid buckets pass."""
    p = make_problem(rng, [40, 7], num_heads=4, num_kv_heads=4, bias="t5-causal")
    args, kwargs = device_args(p, to_cupy)
    good = kwargs["attn_bias"]
    bad = good.buckets.copy()
    bad[3] = 32
    kwargs["attn_bias"] = cpa.RelativePositionBias.from_buckets(good.table, bad, num_buckets=32, max_distance=128,
                                                                bidirectional=False)
    with pytest.raises(ValueError, match=r"attn_bias.buckets: distance 3 has bucket 32, outside \[0, 32\)"):
        cpa.paged_attention(*args, **kwargs, validate=True)
    kwargs["attn_bias"] = good
    assert_close(to_numpy(cpa.paged_attention(*args, **kwargs, validate=True)),
                 paged_attention_ref(*p.args(), **p.kwargs()), "f32")


@pytest.mark.parametrize("kind", ["t5-causal", "t5-bidir", "t5-wide", "t5-many"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])  # the SIMT kernel; the tensor-core kernel (grouped queries)
def test_hostile_t5_buckets_stay_in_bounds(rng, split, dtype, kind):
    """Without ``validate``, the kernels hold each bucket of a ``from_buckets`` array inside the buckets of one
    side (near keys, far keys past max_distance, the SIMT kernel's column path and, at 150 per side, its table
    path): no read outside the table, and the result of the valid array the hostile one is held back to."""
    p = make_problem(rng, [1100, 130, 17, 1], num_heads=4, num_kv_heads=4 if dtype == "f32" else 2, bias=kind,
                     dtype=dtype)
    args, kwargs = device_args(p, to_cupy)
    good = kwargs["attn_bias"]
    kwargs["attn_bias"] = hostile_t5_bias(good, to_cupy)
    bad = to_numpy(kwargs["attn_bias"].buckets)
    assert ((bad < 0) | (bad >= good.per_side)).any()
    out = to_numpy(cpa.paged_attention(*args, **kwargs))  # an illegal access would raise here
    assert_close(out, paged_attention_ref(*p.args(), **p.kwargs()), dtype, kind)
    with pytest.raises(ValueError, match=r"attn_bias.buckets: distance \d+ has bucket -?\d+, outside \[0, "):
        cpa.paged_attention(*args, **kwargs, validate=True)


@pytest.mark.parametrize(("dtype", "bias_dtype", "spec_bias"), [("f32", "f32", None), ("f16", "f32", "ragged"),
                                                             ("f16", "f16", "ragged-rows")],
                         ids=["simt", "tc", "tc-staged"])
def test_hostile_ragged_offsets_stay_in_bounds(rng, split, dtype, bias_dtype, spec_bias):
    """Ragged offsets outside the values, on the SIMT kernel and on the tensor-core kernel (grouped queries), whose
    bias is read element by element (rows 36 bytes apart, which no stage takes) or, 16-bit with adjacent heads,
    staged in shared memory (RaggedRowsBias), single pass and split: nothing outside the rows is read."""
    import cupy

    p = make_problem(rng, [400, 300, 200, 100], num_heads=8, num_kv_heads=2, bias="ragged", dtype=dtype,
                     bias_dtype=bias_dtype)
    values, offsets = p.bias_kind.values, p.bias_kind.offsets.copy()
    total = values.shape[0]

    def on_device(values):  # the "tc" variant: rows of 9 heads' room, so the key step (36 bytes) is no stage's
        if spec_bias != "ragged":
            return to_cupy(values)
        padded = cupy.full((total, 9), cupy.nan, values.dtype)
        padded[:, :8] = to_cupy(values)
        return padded[:, :8]

    args, kwargs = device_args(p, to_cupy)
    kwargs["attn_bias"] = cpa.RaggedBias(on_device(values), to_cupy(offsets))
    check_hostile_launch(args, kwargs, split, spec_bias)
    # Offsets before, inside and past values; then rows too few for sequence 0 (its last 7 of 400) and for sequence 3
    # (50 of 100 before the end of values), sequences 1 and 2 intact.
    short = offsets.copy()
    short[0], short[3] = offsets[1] - 7, total - 50
    expected = paged_attention_ref(*p.args(), **p.kwargs())
    for bad in (np.array([-50, 46, 2**31 - 1, total - 5, total], np.int32), short):
        kwargs["attn_bias"] = cpa.RaggedBias(on_device(values), cupy.asarray(bad))
        out = to_numpy(cpa.paged_attention(*args, **kwargs))  # an illegal access would raise here
        if bad[0] < 0:
            assert_poisoned(out, [0, 2, 3], "a sequence with no rows, or too few before the end of values")
        else:
            assert_poisoned(out, [0, 3], "a sequence whose rows are too few")
            assert_close(out[1:3], expected[1:3], dtype)
        with pytest.raises(ValueError, match=r"attn_bias.offsets: sequence 0 has 400 keys but rows"):
            cpa.paged_attention(*args, **kwargs, validate=True)
    kwargs["attn_bias"] = cpa.RaggedBias(on_device(values), cupy.asarray(offsets))
    assert_close(to_numpy(cpa.paged_attention(*args, **kwargs, validate=True)), expected, dtype)
