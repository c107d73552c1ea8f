"""GPU: the prefill kernels (tensor cores for float16 / bfloat16, SIMT for float32) against the float64 reference,
across dtypes, head sizes, page sizes, GQA ratios, layouts, bias kinds, ALiBi, causal or not, chunked and full
prefill, ragged lengths, empty sequences, and both the single-pass and split-K paths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import assert_close, hostile_t5_bias
from prefill_helpers import DENSE_KINDS, T5_KINDS, make_prefill_problem
from test_decode_gpu import to_cupy, to_torch

import cupy_paged_attn as cpa
from cupy_paged_attn import _checks, _device, planning
from cupy_paged_attn.prefill import paged_prefill_attention
from cupy_paged_attn.reference import paged_prefill_attention_ref, to_numpy

pytestmark = pytest.mark.gpu

# (seq_len, q_len): full prefill of 300, chunks of 7 and 64 behind longer contexts, decode-like rows, empty
# sequences (no keys; keys but no queries), the last at the block table's capacity.
SEQS = [(300, 300), (77, 7), (64, 64), (1, 1), (0, 0), (513, 0), (40, 1), (700, 64)]
HEADS = [(4, 4), (8, 2), (16, 2), (6, 2), (8, 1)]  # GQA ratios 1, 4, 8, 3 and MQA
BIASES = ["none", *DENSE_KINDS, *T5_KINDS]
GRID = [
    (dtype, head_size, block_size, i)
    for i, (dtype, head_size, block_size) in enumerate(
        itertools.product(["bf16", "f16", "f32"], [32, 64, 80, 96, 112, 120, 128, 192, 256], [16, 32])
    )
]


def device_kwargs(p, convert):
    kwargs = p.kwargs()
    bias = p.attn_bias
    if isinstance(bias, cpa.RelativePositionBias):
        kwargs["attn_bias"] = cpa.RelativePositionBias(
            convert(np.asarray(bias.table)), num_buckets=bias.num_buckets, max_distance=bias.max_distance,
            bidirectional=bias.bidirectional)
    elif bias is not None:
        kwargs["attn_bias"] = convert(bias)
    kwargs["alibi_slopes"] = convert(p.alibi_slopes)
    return kwargs


def run_cupy(p):
    import cupy

    args = [to_cupy(a) for a in p.args()]
    if p.query.shape[0] == 0:  # an empty out= has zero strides, which the out= check refuses
        return to_numpy(paged_prefill_attention(*args, **device_kwargs(p, to_cupy)))
    out = cupy.full(p.query.shape, np.nan, dtype=p.query.dtype)  # poisoned: every row must be written
    result = paged_prefill_attention(*args, **device_kwargs(p, to_cupy), out=out)
    assert result is out
    cupy.cuda.get_current_stream().synchronize()
    return to_numpy(result)


@pytest.mark.parametrize(("dtype", "head_size", "block_size", "i"), GRID,
                         ids=[f"{d}-d{h}-b{b}" for d, h, b, _ in GRID])
def test_prefill_grid(rng, split, dtype, head_size, block_size, i):
    num_heads, num_kv_heads = HEADS[i % len(HEADS)]
    layout = ["nhd", "vllm", "hnd"][i % 3]
    bias = BIASES[i % len(BIASES)]
    causal = i % 4 != 1
    p = make_prefill_problem(rng, SEQS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                             block_size=block_size, dtype=dtype, kv_layout=layout, bias=bias, bias_dtype=dtype,
                             alibi=i % 3 == 0, causal=causal, extra_table_cols=0)
    what = f"{layout} heads={num_heads}/{num_kv_heads} bias={bias} alibi={i % 3 == 0} causal={causal} {split}"
    assert_close(run_cupy(p), paged_prefill_attention_ref(*p.args(), **p.kwargs()), dtype, what)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("bias", ["none", *DENSE_KINDS, *T5_KINDS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_bias_kinds(rng, split, dtype, bias, causal):
    p = make_prefill_problem(rng, [(130, 130), (90, 33), (5, 2)], num_heads=8, num_kv_heads=2, head_size=128,
                             dtype=dtype, bias=bias, bias_dtype="bf16" if dtype == "f32" else "f32", alibi=True,
                             causal=causal, block_size=8)
    assert_close(run_cupy(p), paged_prefill_attention_ref(*p.args(), **p.kwargs()), dtype, f"{bias} {causal}")


@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_single_query_rows_equal_paged_attention(rng, group, dtype):
    """q_len == 1 everywhere: the same numbers as decode, for a dense bias, T5 and ALiBi."""
    import cupy

    seqs = [(1, 1), (17, 1), (300, 1), (1000, 1), (64, 1)]
    for bias in ("dense", "t5-causal"):
        p = make_prefill_problem(rng, seqs, num_heads=2 * group, num_kv_heads=2, head_size=128, dtype=dtype,
                                 bias=bias, alibi=True, block_size=16)
        args = [to_cupy(a) for a in p.args()]
        kwargs = device_kwargs(p, to_cupy)
        got = to_numpy(paged_prefill_attention(*args, **kwargs))
        decode_kwargs = {k: v for k, v in kwargs.items() if k != "causal"}
        if bias == "dense":
            decode_kwargs["attn_bias"] = to_cupy(np.ascontiguousarray(p.attn_bias[:, :, 0, :]))
        want = to_numpy(cpa.paged_attention(*args[:5], **decode_kwargs))
        cupy.cuda.get_current_stream().synchronize()
        assert_close(got, want.astype(np.float64), dtype, bias)


@pytest.mark.parametrize(("heads", "max_distance", "bidirectional"), [
    ((4, 4), 128, True),    # one table per CTA (G·(2·(max_distance + tile + span) + 1) fits)
    ((4, 4), 40, False),    # the same, unidirectional, most tiles far
    ((32, 2), 128, True),   # G = 16: the table is too large, one load chain per logit
    ((4, 4), 3000, True),   # max_distance past the table: per logit
])
def test_t5_table_and_per_logit_paths(rng, split, heads, max_distance, bidirectional):
    """Both ways the tensor-core kernel adds T5's bias (a per-CTA table of relative positions, or a bucket and a
    weight load per logit), on sequences long enough for near and far key tiles and several M tiles each."""
    p = make_prefill_problem(rng, [(700, 700), (3500, 300), (50, 9)], num_heads=heads[0], num_kv_heads=heads[1],
                             head_size=64, dtype="bf16", causal=not bidirectional)
    table = rng.standard_normal((32, heads[0])).astype(np.float32)
    p.attn_bias = cpa.RelativePositionBias(table, num_buckets=32, max_distance=max_distance,
                                           bidirectional=bidirectional)
    assert_close(run_cupy(p), paged_prefill_attention_ref(*p.args(), **p.kwargs()), "bf16",
                 f"heads={heads} max_distance={max_distance}")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_softmax_reference_moves_lazily_and_exactly(rng, split, dtype):
    """Logits that climb along the keys (a bias ramp, with a jump of 30) move the online softmax's reference many
    times, by less and by more than the kernel's slack: the tensor-core kernels (prefill and the decode tiling)
    still match the reference, including in float16, whose P then holds values up to 2^8."""
    from helpers import make_problem

    from cupy_paged_attn.reference import paged_attention_ref

    def climbing(bias):  # the bias plus 0.02 per key and 30 from key 777 on, in the bias's own dtype
        keys = np.arange(bias.shape[-1])
        return (bias + (0.02 * keys + 30.0 * (keys >= 777))).astype(bias.dtype)

    p = make_prefill_problem(rng, [(900, 900), (1500, 70)], num_heads=4, num_kv_heads=4, head_size=64,
                             dtype=dtype, bias="dense", causal=False)
    p.attn_bias = climbing(p.attn_bias)
    assert_close(run_cupy(p), paged_prefill_attention_ref(*p.args(), **p.kwargs()), dtype, "prefill")

    d = make_problem(rng, [1500, 900, 64], num_heads=16, num_kv_heads=4, head_size=128, dtype=dtype, bias="dense")
    d.attn_bias = climbing(d.attn_bias)
    args = [to_cupy(a) for a in d.args()]
    got = to_numpy(cpa.paged_attention(*args, **{**d.kwargs(), "attn_bias": to_cupy(d.attn_bias)}))
    assert_close(got, paged_attention_ref(*d.args(), **d.kwargs()), dtype, "decode")


# The Hopper tiling's cases (bias, layout, causal, page size, KV heads of 8 query heads): every bias kind, both
# layouts, GQA, ALiBi, causal or not, page sizes 16 and 32; the last, T5 with 8 query heads per KV head, has a table
# too large for a CTA's shared memory and runs on the mma.sync tiling everywhere.
HOPPER_CASES = [("t5-causal", "nhd", True, 16, 8), ("t5-short", "vllm", False, 32, 2), ("dense", "nhd", False, 32, 8),
                ("strided", "vllm", True, 16, 2), ("none", "vllm", True, 32, 8), ("t5-bidir", "nhd", False, 16, 2),
                ("t5-causal", "nhd", True, 16, 1)]


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma-sync"])
@pytest.mark.parametrize(("dtype", "head_size"), [("bf16", 128), ("f16", 128), ("bf16", 64), ("f16", 64)])
def test_both_tensor_core_tilings(rng, split, tune, wgmma, dtype, head_size):
    """16-bit head sizes 64 and 128 without bias or with T5 run the Hopper tiling (wgmma) on devices of compute
    capability 9.0 and the mma.sync tiling elsewhere (and with the wgmma switch off, a dense bias, or a T5 table
    that does not fit): each against the reference, and the plan says which."""
    import cupy

    tune(wgmma=wgmma)
    hopper = int(cupy.cuda.Device().compute_capability) == 90
    for i, (bias, layout, causal, block_size, kv_heads) in enumerate(HOPPER_CASES):
        p = make_prefill_problem(rng, SEQS, num_heads=8, num_kv_heads=kv_heads, head_size=head_size,
                                 block_size=block_size, dtype=dtype, kv_layout=layout, bias=bias, bias_dtype=dtype,
                                 alibi=i == 4, causal=causal, extra_table_cols=0)
        problem = _checks.check_prefill(*p.args(), causal=causal, scale=None, attn_bias=p.attn_bias,
                                        alibi_slopes=None, kv_layout=layout, out=None,
                                        bias_arrays=_checks.bias_operands(p.attn_bias))
        fits = bias not in T5_KINDS or planning.t5_table_fits(problem.shape)
        assert fits == (kv_heads != 1), "the case list covers both sides of the T5 table's limit"
        launch = planning.plan_prefill(problem.shape, _device.query(0))
        assert launch.spec.wgmma == (wgmma and hopper and fits and bias in ("none", *T5_KINDS))
        assert_close(run_cupy(p), paged_prefill_attention_ref(*p.args(), **p.kwargs()), dtype,
                     f"{bias} {layout} causal={causal} b{block_size} G={8 // kv_heads} wgmma={wgmma} {split}")


def test_single_pass_and_split_k_agree(rng, tune):
    p = make_prefill_problem(rng, [(3000, 100), (1, 1), (2049, 2049)], num_heads=8, num_kv_heads=2, head_size=64,
                             dtype="f16", bias="t5-causal")
    results = {}
    for name, sms in (("single", 1), ("split", 10**6)):
        tune(num_sms=sms)
        results[name] = run_cupy(p)
    np.testing.assert_allclose(results["single"], results["split"], atol=2e-3, rtol=2e-3)
    assert_close(results["split"], paged_prefill_attention_ref(*p.args(), **p.kwargs()), "f16")


def test_masked_bias_gives_zeros_not_nan(rng, split):
    p = make_prefill_problem(rng, [(70, 70), (6, 3)], num_heads=4, num_kv_heads=4, bias="dense", dtype="bf16")
    p.attn_bias[0, 2, 5, :] = -np.inf  # every key of one row masked
    p.attn_bias[1, :, :, :2] = -np.inf
    out = run_cupy(p)
    assert (out[5, 2] == 0).all()
    assert_close(out, paged_prefill_attention_ref(*p.args(), **p.kwargs()), "bf16")


def test_empty_batches(rng):
    import cupy

    p = make_prefill_problem(rng, [(0, 0), (5, 0)], num_heads=4, num_kv_heads=2, dtype="bf16")
    assert run_cupy(p).shape == (0, 4, 64)
    p = make_prefill_problem(rng, [(0, 0), (3, 3), (0, 0)], num_heads=4, num_kv_heads=2, dtype="bf16")
    assert_close(run_cupy(p), paged_prefill_attention_ref(*p.args(), **p.kwargs()), "bf16")
    q = cupy.ones((0, 4, 64), cupy.float16)
    k = cupy.ones((2, 16, 2, 64), cupy.float16)
    out = paged_prefill_attention(q, k, k, cupy.zeros((0, 1), cupy.int32), cupy.zeros((0,), cupy.int32),
                                  cupy.zeros((1,), cupy.int32))
    assert out.shape == (0, 4, 64)


def test_noncontiguous_query_and_out_view(rng):
    import cupy

    p = make_prefill_problem(rng, [(33, 20), (5, 5)], num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16")
    args = [to_cupy(a) for a in p.args()]
    wide = cupy.zeros((25, 8, 3 * 64), p.query.dtype)
    wide[:, :, 64 + 3:128 + 3] = args[0]
    args[0] = wide[:, :, 64 + 3:128 + 3]  # rows not 16-byte aligned: the element-wise query load
    out_base = cupy.full((25, 8, 128), np.nan, p.query.dtype)
    out = out_base[:, :, :64]
    assert paged_prefill_attention(*args, **device_kwargs(p, to_cupy), out=out) is out
    assert_close(to_numpy(out), paged_prefill_attention_ref(*p.args(), **p.kwargs()), "bf16")
    assert np.isnan(to_numpy(out_base[:, :, 64:]).astype(np.float32)).all(), "out= wrote outside its view"


def test_torch_bf16_t5_encoder(rng):
    torch = pytest.importorskip("torch")
    p = make_prefill_problem(rng, [(100, 100), (17, 17)], num_heads=16, num_kv_heads=4, head_size=128,
                             dtype="bf16", bias="t5-bidir", causal=False, scale=1.0)
    args = [to_torch(a) for a in p.args()]
    result = paged_prefill_attention(*args, **device_kwargs(p, to_torch))
    assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16
    assert_close(to_numpy(result), paged_prefill_attention_ref(*p.args(), **p.kwargs()), "bf16")


@pytest.mark.parametrize(("heads", "max_distance", "bidirectional"), [
    ((4, 4), 128, True),    # the CTA's table of relative positions
    ((4, 4), 128, False),
    ((4, 4), 3000, True),   # per logit
])
def test_hostile_t5_buckets_stay_in_bounds(rng, split, heads, max_distance, bidirectional):
    """Without ``validate``, the prefill kernels hold each bucket of a ``from_buckets`` array inside the buckets of
    one side, in the table of relative positions and per logit: the result of the valid array."""
    p = make_prefill_problem(rng, [(700, 700), (3500, 300), (50, 9)], num_heads=heads[0], num_kv_heads=heads[1],
                             head_size=64, dtype="bf16", causal=not bidirectional)
    table = rng.standard_normal((32, heads[0])).astype(np.float32)
    p.attn_bias = cpa.RelativePositionBias(table, num_buckets=32, max_distance=max_distance,
                                           bidirectional=bidirectional)
    want = paged_prefill_attention_ref(*p.args(), **p.kwargs())
    kwargs = device_kwargs(p, to_cupy)
    kwargs["attn_bias"] = hostile_t5_bias(kwargs["attn_bias"], to_cupy)
    args = [to_cupy(a) for a in p.args()]
    out = to_numpy(paged_prefill_attention(*args, **kwargs))  # an illegal access would raise here
    assert_close(out, want, "bf16", f"max_distance={max_distance}")
    with pytest.raises(ValueError, match=r"attn_bias.buckets: distance \d+ has bucket -?\d+, outside \[0, "):
        paged_prefill_attention(*args, **kwargs, validate=True)


def test_hostile_block_ids_and_lengths_stay_in_bounds(rng, split):
    import cupy

    p = make_prefill_problem(rng, [(40, 10), (30, 30), (20, 5), (10, 10)], num_heads=4, num_kv_heads=2,
                             dtype="bf16", bias="dense")
    tables = p.block_tables.copy()
    tables[0, 1] = -7
    tables[1, 0] = 2**31 - 1
    lens = np.array([40, -5, 10**9, 10], np.int32)
    args = [to_cupy(a) for a in p.args()]
    args[3], args[4] = cupy.asarray(tables), cupy.asarray(lens)
    out = paged_prefill_attention(*args, **device_kwargs(p, to_cupy))
    cupy.cuda.get_current_stream().synchronize()  # an illegal access would raise here
    want = paged_prefill_attention_ref(*p.args(), **p.kwargs())
    out = to_numpy(out).astype(np.float32)
    # Rows: sequence 0 holds 0-9 (every row's tile reads the page of block -7), 1 10-39 (length -5), 2 40-44 (length
    # past the table), 3 45-54.
    assert np.isnan(out[:45]).all(), "out-of-contract sequences give NaN rows"
    assert_close(out[45:], want[45:], "bf16", "the untouched sequence")
    with pytest.raises(ValueError, match=r"block_tables: sequence 0 uses block id -7"):
        paged_prefill_attention(*args, **device_kwargs(p, to_cupy), validate=True)
