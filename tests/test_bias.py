"""Bias helpers: T5 buckets exhaustively against the float32 formula and transformers, the T5 bias against
transformers' compute_bias, ALiBi slopes against the reference construction, argument errors, frameworks."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupy_paged_attn as cpa

# (num_buckets, max_distance, bidirectional): T5's own, and odd ones (non-power-of-two exact ranges).
T5_CONFIGS = [(32, 128, True), (32, 128, False), (64, 256, True), (10, 40, True), (48, 500, False),
              (32, 4096, True), (12, 100, False), (256, 1000, False), (6, 3, True)]
SPAN = 2**20  # every relative position with |n| <= SPAN is checked


def formula_bucket(rel: np.ndarray, num_buckets: int, max_distance: int, bidirectional: bool) -> np.ndarray:
    """T5's bucket written out directly, element by element in float32 as transformers does."""
    rel = rel.astype(np.int64)
    bucket = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        bucket += (rel > 0) * num_buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore", invalid="ignore"):
        large = max_exact + (
            np.log(rel.astype(np.float32) / np.float32(max_exact))
            / np.float32(math.log(max_distance / max_exact))
            * np.float32(num_buckets - max_exact)
        ).astype(np.int64)
    return bucket + np.where(rel < max_exact, rel, np.minimum(large, num_buckets - 1))


@pytest.mark.parametrize(("num_buckets", "max_distance", "bidirectional"), T5_CONFIGS)
def test_buckets_match_the_formula_exhaustively(num_buckets, max_distance, bidirectional):
    rel = np.arange(-SPAN, SPAN + 1)
    ours = cpa.t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                           max_distance=max_distance)
    np.testing.assert_array_equal(ours, formula_bucket(rel, num_buckets, max_distance, bidirectional))
    assert ours.min() >= 0 and ours.max() < num_buckets


@pytest.mark.parametrize(("num_buckets", "max_distance", "bidirectional"), T5_CONFIGS)
def test_buckets_match_transformers_exhaustively(num_buckets, max_distance, bidirectional):
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-SPAN, SPAN + 1)
    theirs = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                                      max_distance=max_distance)
    ours = cpa.t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                           max_distance=max_distance)
    assert isinstance(ours, torch.Tensor)
    assert torch.equal(ours, theirs.to(ours.dtype))


@pytest.mark.parametrize("is_decoder", [False, True])
def test_position_bias_matches_transformers_compute_bias(is_decoder):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=64, d_kv=16, num_heads=4, relative_attention_num_buckets=32,
                                   relative_attention_max_distance=128, is_decoder=is_decoder)
    attention = transformers.models.t5.modeling_t5.T5Attention(config, has_relative_attention_bias=True)
    torch.nn.init.normal_(attention.relative_attention_bias.weight)
    table = attention.relative_attention_bias.weight.detach()  # [num_buckets, num_heads]
    key_length = 700
    positions = [0, 1, 17, 300, 699]
    ours = cpa.t5_position_bias(table, torch.tensor(positions), key_length, bidirectional=not is_decoder)
    assert ours.shape == (len(positions), 4, key_length)
    for s, p in enumerate(positions):
        theirs = attention.compute_bias(1, key_length, past_seen_tokens=p)  # [1, heads, 1, keys]
        assert torch.equal(ours[s], theirs[0, :, 0, :])


def test_position_bias_definition():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((32, 3)).astype(np.float32)
    positions = np.array([4, 200], np.int32)
    bias = cpa.t5_position_bias(table, positions, 250, bidirectional=True)
    assert bias.dtype == np.float32 and bias.shape == (2, 3, 250)
    for s, p in enumerate(positions):
        buckets = cpa.t5_relative_position_bucket(np.arange(250) - p)
        np.testing.assert_array_equal(bias[s], table[buckets].T)


def reference_alibi(n: int) -> list[float]:
    """The construction of the ALiBi paper's code: recursive on the closest power of two."""
    def power_of_two(n: int) -> list[float]:
        return [2 ** (-(2 ** -(math.log2(n) - 3)) * (i + 1)) for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + reference_alibi(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("num_heads", [1, 2, 5, 8, 12, 16, 20, 32, 40, 64, 96])
def test_alibi_slopes(num_heads):
    slopes = cpa.alibi_slopes(num_heads)
    assert slopes.dtype == np.float32 and slopes.shape == (num_heads,)
    np.testing.assert_allclose(slopes, reference_alibi(num_heads), rtol=1e-6)
    if num_heads == 8:
        np.testing.assert_array_equal(slopes, [2.0**-i for i in range(1, 9)])


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: cpa.t5_relative_position_bucket(np.arange(3.0)), ValueError, r"relative_position: expected an "
         r"integer array, got dtype float64"),
        (lambda: cpa.t5_relative_position_bucket("3"), TypeError, r"relative_position: expected a NumPy"),
        (lambda: cpa.t5_relative_position_bucket(1, num_buckets=True), TypeError, r"num_buckets: expected an int"),
        (lambda: cpa.t5_relative_position_bucket(1, num_buckets=2), ValueError, r"num_buckets: expected an int >= 4"),
        (lambda: cpa.t5_relative_position_bucket(1, max_distance=8), ValueError,
         r"max_distance: expected an int >= 9, got 8"),
        (lambda: cpa.t5_relative_position_bucket(1, bidirectional=1), TypeError, r"bidirectional: expected a bool"),
        (lambda: cpa.t5_position_bias(np.zeros((16, 2)), np.array([1]), 5, bidirectional=True), ValueError,
         r"table: expected shape \(num_buckets=32, num_heads\), got \(16, 2\)"),
        (lambda: cpa.t5_position_bias(np.ones((32, 2)), np.array([1.5]), 5, bidirectional=True), ValueError,
         r"query_positions: expected a 1-D integer array"),
        (lambda: cpa.t5_position_bias(np.ones((32, 2)), np.array([1]), -1, bidirectional=True), ValueError,
         r"key_length: expected an int >= 0, got -1"),
        (lambda: cpa.t5_position_bias(np.ones((32, 2)), np.array([1]), 5), TypeError, r"bidirectional"),
        (lambda: cpa.alibi_slopes(0), ValueError, r"num_heads: expected an int >= 1, got 0"),
        (lambda: cpa.alibi_slopes(4.0), TypeError, r"num_heads: expected an int, got float"),
    ],
)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_same_framework_out():
    assert isinstance(cpa.t5_relative_position_bucket([[-3, 4]]), np.ndarray)
    torch = pytest.importorskip("torch")
    table = torch.randn(32, 2, dtype=torch.bfloat16)
    bias = cpa.t5_position_bias(table, torch.tensor([3]), 9, bidirectional=False)
    assert isinstance(bias, torch.Tensor) and bias.dtype == torch.bfloat16 and bias.shape == (1, 2, 9)


@pytest.mark.gpu
def test_gpu_arrays_stay_on_the_gpu():
    import cupy

    rel = cupy.arange(-300, 300)
    out = cpa.t5_relative_position_bucket(rel, bidirectional=False)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_array_equal(out.get(), formula_bucket(np.arange(-300, 300), 32, 128, False))
    torch = pytest.importorskip("torch")
    table = torch.randn(32, 4, device="cuda")
    bias = cpa.t5_position_bias(table, torch.tensor([5, 9], device="cuda"), 64, bidirectional=True)
    assert bias.is_cuda and bias.shape == (2, 4, 64)


# ---------------------------------------------------------------------------------------------------------------
# The in-kernel T5 bias (common.cuh T5Bias, the device code the attention kernels run) against the NumPy helper
# ---------------------------------------------------------------------------------------------------------------
_T5_PROBE = r"""
extern "C" __global__ void t5_probe(float* out, const void* table, const int* buckets, long long stride_b,
                                    long long stride_h, int dtype, int max_distance, int per_side_if_bidir,
                                    int num_heads, int query_pos, int num_keys) {
  const cpa::T5Bias bias = cpa::T5Bias::make(
      cpa::BiasArgs{table, buckets, {stride_b, stride_h, 0, 0}, dtype, max_distance, per_side_if_bidir});
  const cpa::T5Bias::Seq view = bias.seq(0);
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < num_keys; j += gridDim.x * blockDim.x) {
    for (int h = 0; h < num_heads; ++h) {
      out[static_cast<long long>(h) * num_keys + j] = bias.value(view.load(h, 0, query_pos, j));
    }
  }
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize(("num_buckets", "max_distance", "bidirectional"), T5_CONFIGS)
def test_kernel_t5_bias_matches_the_helper_exhaustively(num_buckets, max_distance, bidirectional):
    """Every relative position with |n| <= 2**20: the value the kernel adds is table[bucket, h] with the helper's
    bucket, bit for bit. The table encodes (bucket, head) in its values, so the bucket can be read back."""
    import cupy

    from cupy_paged_attn import _checks, _compile

    num_heads = 3
    source = _compile.inline_headers('#include "bias.cuh"\n' + _T5_PROBE)
    probe = cupy.RawModule(code=source, options=("-std=c++17",)).get_function("t5_probe")
    host_table = (np.arange(num_buckets)[:, None] * 1000 + np.arange(num_heads)[None, :]).astype(np.float32)
    bias = cpa.RelativePositionBias(cupy.asarray(host_table.T).T, num_buckets=num_buckets,  # strided table
                                    max_distance=max_distance, bidirectional=bidirectional)
    checked = _checks.check_bias(bias, {"attn_bias.table": bias.table, "attn_bias.buckets": bias.buckets},
                                 1, num_heads)
    num_keys = 2 * SPAN + 1
    out = cupy.empty((num_heads, num_keys), cupy.float32)
    i64, i32 = np.int64, np.int32
    probe((1024,), (256,), (out, checked.array, checked.index, i64(checked.strides[0]), i64(checked.strides[1]),
                            i32(checked.dtype_code), i32(checked.n), i32(checked.m), i32(num_heads), i32(SPAN),
                            i32(num_keys)))
    got = out.get()
    expected_bucket = cpa.t5_relative_position_bucket(np.arange(num_keys) - SPAN, bidirectional=bidirectional,
                                                      num_buckets=num_buckets, max_distance=max_distance)
    for h in range(num_heads):
        np.testing.assert_array_equal(got[h], host_table[expected_bucket, h], err_msg=f"head {h}")


@pytest.mark.gpu
@pytest.mark.parametrize(("num_buckets", "max_distance", "bidirectional"), T5_CONFIGS[:4])
def test_transformers_on_cuda_buckets_like_the_helper(num_buckets, max_distance, bidirectional):
    """transformers computes the bucket with torch on the model's device; on CUDA its float32 log may round
    differently from the CPU's. Record whether it does (the kernels follow the CPU definition)."""
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-SPAN, SPAN + 1, device="cuda")
    theirs = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                                      max_distance=max_distance).cpu()
    ours = cpa.t5_relative_position_bucket(rel.cpu(), bidirectional=bidirectional, num_buckets=num_buckets,
                                           max_distance=max_distance)
    differ = (ours != theirs.to(ours.dtype)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} positions differ, first at n = {int(rel[differ[0]])}"


@pytest.mark.parametrize(("num_buckets", "max_distance", "bidirectional"), T5_CONFIGS)
def test_bucket_table_is_the_bucket_of_each_distance(num_buckets, max_distance, bidirectional):
    """t5_bucket_table (what the kernels read) gives, for every distance on the past side, the helper's bucket."""
    table = cpa.t5_bucket_table(num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)
    assert table.dtype == np.int32 and table.shape == (max_distance + 1,)
    distances = np.arange(max_distance + 50)
    expected = cpa.t5_relative_position_bucket(-distances, bidirectional=bidirectional, num_buckets=num_buckets,
                                               max_distance=max_distance)
    np.testing.assert_array_equal(table[np.minimum(distances, max_distance)], expected)


def test_relative_position_bias_from_buckets_equals_the_constructor():
    table = np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32)
    built = cpa.RelativePositionBias(table, bidirectional=True)
    wrapped = cpa.RelativePositionBias.from_buckets(table, built.buckets, num_buckets=32, max_distance=128,
                                                    bidirectional=True)
    for name in ("num_buckets", "max_distance", "bidirectional", "per_side"):
        assert getattr(wrapped, name) == getattr(built, name)
    assert wrapped.buckets is built.buckets and wrapped.table is table
    with pytest.raises(ValueError, match=r"max_distance: expected an int >= 17, got 4"):
        cpa.RelativePositionBias.from_buckets(table, built.buckets, num_buckets=32, max_distance=4,
                                              bidirectional=False)
    with pytest.raises(ValueError, match=r"table: expected shape \(num_buckets=16, num_heads\), got \(32, 4\)"):
        cpa.RelativePositionBias(table, num_buckets=16)
