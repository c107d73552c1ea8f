"""The torch custom operators of ``cupy_paged_attn.torch``: fake shapes and ``opcheck`` on the CPU (the operators'
CPU kernels run the float64 reference), and on the GPU (marker ``gpu``) eager calls against the reference,
``torch.compile(fullgraph=True)`` and CUDA-graph capture and replay. Skipped where torch is not installed."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_same, convert_bias, make_problem
from prefill_helpers import make_prefill_problem

import cupy_paged_attn as cpa
from cupy_paged_attn.reference import (
    paged_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
    to_numpy,
)

torch = pytest.importorskip("torch")
cpt = pytest.importorskip("cupy_paged_attn.torch")

gpu = pytest.mark.gpu
DECODE_BIASES = ["none", "dense", "ragged", "t5-causal"]
PREFILL_BIASES = ["none", "dense", "t5-causal"]
SEQ_LENS = [1, 17, 0, 300]  # one key, a partial page, empty, several pages
PREFILL_SEQS = [(40, 7), (17, 17), (5, 1), (0, 0)]  # chunked, full, decode-like, empty


def tensor(arr: np.ndarray | None, device: str) -> torch.Tensor | None:
    """A torch copy of a NumPy array (bfloat16 through its bits), on ``device``."""
    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    if arr.dtype == np.dtype("bfloat16"):
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(arr).to(device)


def decode_inputs(p, device: str) -> tuple[list[torch.Tensor], dict]:
    """A decode problem's arguments as tensors, and the keyword arguments of the torch wrappers."""
    args = [tensor(a, device) for a in p.args()]
    kwargs = p.kwargs()
    bias = convert_bias(kwargs["attn_bias"], lambda a: tensor(a, device))
    return args, {"scale": kwargs["scale"], "attn_bias": bias, "alibi_slopes": tensor(p.alibi_slopes, device),
                  "kv_layout": kwargs["kv_layout"]}


def prefill_inputs(p, device: str) -> tuple[list[torch.Tensor], dict]:
    args = [tensor(a, device) for a in p.args()]
    kwargs = dict(p.kwargs())
    kwargs["attn_bias"] = convert_bias(kwargs["attn_bias"], lambda a: tensor(a, device))
    kwargs["alibi_slopes"] = tensor(p.alibi_slopes, device)
    return args, kwargs


def rewrite_last_tokens(rng, p, device: str):
    """New K/V for the last token of every sequence (slot -1 for an empty one): ``(key, value, slots)`` as
    tensors, and the caches the reference writes them into (NumPy copies)."""
    num_kv_heads, head_size = p.key_cache.shape[2], p.key_cache.shape[3]
    block_size = p.key_cache.shape[1]
    key = rng.standard_normal((len(p.seq_lens), num_kv_heads, head_size)).astype(p.key_cache.dtype)
    value = rng.standard_normal(key.shape).astype(p.key_cache.dtype)
    slots = np.array([-1 if n == 0 else p.block_tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
                      for s, n in enumerate(p.seq_lens.tolist())], np.int64)
    k_ref, v_ref = reshape_and_cache_ref(key, value, p.key_cache.copy(), p.value_cache.copy(), slots)
    return (tensor(key, device), tensor(value, device), tensor(slots, device)), (k_ref, v_ref)


# ---------------------------------------------------------------------------------------------------------------
# CPU: fake shapes, opcheck, eager and compiled (aot_eager) against the reference
# ---------------------------------------------------------------------------------------------------------------
def test_fake_implementations_give_shapes(rng):
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, dtype="bf16", bias="ragged")
    args, kwargs = decode_inputs(p, "cpu")
    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=8, num_kv_heads=2, dtype="f16", bias="t5-causal")
    pargs, pkwargs = prefill_inputs(pp, "cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) for a in args]
        ragged = cpa.RaggedBias(*(mode.from_tensor(x) for x in (kwargs["attn_bias"].values,
                                                                 kwargs["attn_bias"].offsets)))
        for bias in (None, ragged, torch.zeros(4, 8, 301)):  # made inside the mode: fake
            out = cpt.paged_attention(*fake, attn_bias=bias)
            assert (out.shape, out.dtype, out.device) == (torch.Size([4, 8, 64]), torch.bfloat16, torch.device("cpu"))
        fake_p = [mode.from_tensor(a) for a in pargs]
        out = cpt.paged_prefill_attention(*fake_p, attn_bias=pkwargs["attn_bias"], causal=True)
        assert out.shape == pargs[0].shape and out.dtype == torch.float16
        key = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
        k_cache, v_cache = cpt.reshape_and_cache(key, key, fake[1], fake[2], torch.zeros(3, dtype=torch.int32))
        assert k_cache is fake[1] and v_cache is fake[2]


def _opcheck_cases(rng):
    p = make_problem(rng, [5, 17, 0], num_heads=4, num_kv_heads=2, head_size=32, bias="dense", alibi=True)
    args, kw = decode_inputs(p, "cpu")
    tail = (kw["alibi_slopes"], None, "nhd")
    yield "paged_attention", (*args, kw["attn_bias"], *tail)
    r = make_problem(rng, [5, 17, 0], num_heads=4, num_kv_heads=2, head_size=32, bias="ragged")
    args, kw = decode_inputs(r, "cpu")
    yield "paged_attention_ragged", (*args, kw["attn_bias"].values, kw["attn_bias"].offsets, None, 0.5, "nhd", 30.0, 4)
    t = make_problem(rng, [5, 17, 0], num_heads=4, num_kv_heads=2, head_size=32, bias="t5-bidir")
    args, kw = decode_inputs(t, "cpu")
    yield "paged_attention_t5", (*args, *cpt._t5_args(kw["attn_bias"]), None, 1.0, "nhd")
    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=4, num_kv_heads=2, head_size=32, bias="dense")
    args, kw = prefill_inputs(pp, "cpu")
    yield "paged_prefill_attention", (*args, True, kw["attn_bias"], None, None, "nhd", None, 8)
    pt = make_prefill_problem(rng, PREFILL_SEQS, num_heads=4, num_kv_heads=2, head_size=32, bias="t5-causal")
    args, kw = prefill_inputs(pt, "cpu")
    yield "paged_prefill_attention_t5", (*args, False, *cpt._t5_args(kw["attn_bias"]), None, 1.0, "nhd")
    (key, value, slots), _ = rewrite_last_tokens(rng, p, "cpu")
    caches = [tensor(np.nan_to_num(c), "cpu") for c in (p.key_cache, p.value_cache)]
    yield "reshape_and_cache", (key, value, *caches, slots, "nhd")
    f = make_problem(rng, [5, 17, 0], num_heads=4, num_kv_heads=2, head_size=32)
    args, kw = decode_inputs(f, "cpu")
    args[1:3] = [torch.from_numpy(np.nan_to_num(c).astype("float8_e4m3fn").view(np.uint8)) for c in f.args()[1:3]]
    yield "paged_attention", (*args, None, None, None, "nhd", None, None, "fp8_e4m3", torch.ones(2), None, None, 0.5)
    caches8 = [torch.zeros(c.shape, dtype=torch.uint8) for c in caches]
    yield "reshape_and_cache", (key, value, *caches8, slots, "nhd", "fp8_e5m2", None, torch.ones(1), 2.0, None)


@pytest.mark.parametrize("index", range(8))
def test_opcheck(rng, index):
    """torch.library.opcheck: schema (mutation declared exactly), fake implementation, AOT dispatch."""
    name, args = list(_opcheck_cases(rng))[index]
    torch.library.opcheck(getattr(torch.ops.cupy_paged_attn, name).default, args)


@pytest.mark.parametrize("bias", DECODE_BIASES)
def test_cpu_operators_match_reference(rng, bias):
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, dtype="bf16", bias=bias, alibi=True)
    args, kwargs = decode_inputs(p, "cpu")
    out = cpt.paged_attention(*args, **kwargs)
    assert out.dtype == torch.bfloat16 and out.device.type == "cpu"
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs()), "bf16", bias)


@pytest.mark.parametrize("bias", ["dense", "t5-bidir"])
def test_cpu_operators_take_score_options(rng, bias):
    """The soft-cap and the sliding window pass through the operators (compiled whole), decode and prefill."""
    options = {"logits_soft_cap": 5.0, "window_left": 6}
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, dtype="bf16", bias=bias, alibi=True)
    args, kwargs = decode_inputs(p, "cpu")
    out = torch.compile(cpt.paged_attention, fullgraph=True, backend="aot_eager")(*args, **kwargs, **options)
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs(), **options), "bf16", bias)
    prefill_bias = "dense" if bias == "dense" else "t5-causal"
    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=4, num_kv_heads=2, head_size=32, bias=prefill_bias)
    pargs, pkwargs = prefill_inputs(pp, "cpu")
    out = cpt.paged_prefill_attention(*pargs, **pkwargs, **options)
    expected = paged_prefill_attention_ref(*pp.args(), **pp.kwargs(), **options)
    assert_close(to_numpy(out), expected, "f32", prefill_bias)


def test_cpu_compiled_cache_write_then_decode(rng):
    """fullgraph tracing and functionalisation of the mutating operator, without code generation (aot_eager)."""
    p = make_problem(rng, SEQ_LENS, num_heads=4, num_kv_heads=2, head_size=32, bias="dense")
    args, kwargs = decode_inputs(p, "cpu")
    new, (k_ref, v_ref) = rewrite_last_tokens(rng, p, "cpu")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(query, key_cache, value_cache, block_tables, seq_lens, bias, key, value, slots):
        cpt.reshape_and_cache(key, value, key_cache, value_cache, slots)
        return cpt.paged_attention(query * 1.0, key_cache, value_cache, block_tables, seq_lens, attn_bias=bias)

    out = step(*args, kwargs["attn_bias"], *new)
    expected = paged_attention_ref(p.query, k_ref, v_ref, p.block_tables, p.seq_lens, attn_bias=p.attn_bias)
    assert_close(to_numpy(out), expected, "f32")
    assert_same(to_numpy(args[1]), k_ref)  # the caller's cache was written


# ---------------------------------------------------------------------------------------------------------------
# GPU: eager, compiled, CUDA graphs
# ---------------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("bias", DECODE_BIASES)
def test_decode_eager(rng, bias):
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=128, dtype="bf16", bias=bias,
                     bias_dtype="f32", alibi=True)
    args, kwargs = decode_inputs(p, "cuda")
    out = cpt.paged_attention(*args, **kwargs)
    assert out.is_cuda and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert_close(to_numpy(out), paged_attention_ref(*p.args(), **p.kwargs()), "bf16", bias)


@gpu
@pytest.mark.parametrize("bias", PREFILL_BIASES)
def test_prefill_eager(rng, bias):
    p = make_prefill_problem(rng, PREFILL_SEQS, num_heads=8, num_kv_heads=2, head_size=64, dtype="f16", bias=bias,
                             alibi=True)
    args, kwargs = prefill_inputs(p, "cuda")
    out = cpt.paged_prefill_attention(*args, **kwargs)
    assert_close(to_numpy(out), paged_prefill_attention_ref(*p.args(), **p.kwargs()), "f16", bias)
    with pytest.raises(NotImplementedError, match="RaggedBias is a decode bias"):
        cpt.paged_prefill_attention(*args, attn_bias=cpa.RaggedBias(args[0], args[4]))


@gpu
def test_reshape_and_cache_eager(rng):
    p = make_problem(rng, SEQ_LENS, num_heads=4, num_kv_heads=2, dtype="bf16")
    args, _ = decode_inputs(p, "cuda")
    (key, value, slots), (k_ref, v_ref) = rewrite_last_tokens(rng, p, "cuda")
    k_cache, v_cache = cpt.reshape_and_cache(key, value, args[1], args[2], slots)
    assert k_cache is args[1] and v_cache is args[2]
    assert_same(to_numpy(k_cache), k_ref)
    assert_same(to_numpy(v_cache), v_ref)


@gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_decode_dense_bias(rng, mode):
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense",
                     bias_dtype="bf16")
    args, kwargs = decode_inputs(p, "cuda")

    @torch.compile(fullgraph=True, mode=mode)
    def layer(query, key_cache, value_cache, block_tables, seq_lens, bias):
        out = cpt.paged_attention(query * 2, key_cache, value_cache, block_tables, seq_lens, attn_bias=bias * 0.5,
                                  scale=0.05)
        return out.float() + 1

    expected = paged_attention_ref(p.query * 2, *p.args()[1:], attn_bias=p.attn_bias * 0.5, scale=0.05) + 1
    for _ in range(3):  # reduce-overhead records a CUDA graph after warm-up runs: check the replays too
        assert_close(to_numpy(layer(*args, kwargs["attn_bias"])), expected, "bf16", mode)


@gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_score_options(rng, mode):
    """Soft-cap and sliding window on the GPU through compiled operators (and the CUDA graph of reduce-overhead),
    decode with a T5 bias and prefill with a dense one."""
    options = {"logits_soft_cap": 20.0, "window_left": 40}
    p = make_problem(rng, [300, 1, 77, 1200], num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16",
                     bias="t5-bidir", alibi=True)
    args, kwargs = decode_inputs(p, "cuda")
    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=8, num_kv_heads=2, head_size=128, dtype="bf16",
                              bias="dense")
    pargs, pkwargs = prefill_inputs(pp, "cuda")
    prefill_kw = {k: v for k, v in pkwargs.items() if k != "attn_bias"}

    @torch.compile(fullgraph=True, mode=mode)
    def step(decode_args, prefill_args, dense):
        out = cpt.paged_attention(*decode_args, **kwargs, **options)
        return out, cpt.paged_prefill_attention(*prefill_args, attn_bias=dense, **prefill_kw, **options)

    expected = paged_attention_ref(*p.args(), **p.kwargs(), **options)
    expected_p = paged_prefill_attention_ref(*pp.args(), **pp.kwargs(), **options)
    for _ in range(3):
        out, out_p = step(args, pargs, pkwargs["attn_bias"])
        assert_close(to_numpy(out), expected, "bf16", mode)
        assert_close(to_numpy(out_p), expected_p, "bf16", mode)


@gpu
def test_compiled_cache_write_then_decode(rng):
    """The mutation is ordered before the attention that reads the caches, and reaches the caller's caches."""
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=128, dtype="f16", bias="dense",
                     bias_dtype="f32", alibi=True)
    args, kwargs = decode_inputs(p, "cuda")
    new, (k_ref, v_ref) = rewrite_last_tokens(rng, p, "cuda")

    @torch.compile(fullgraph=True)
    def step(query, key_cache, value_cache, block_tables, seq_lens, bias, slopes, key, value, slots):
        cpt.reshape_and_cache(key * 1, value, key_cache, value_cache, slots)
        return cpt.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, attn_bias=bias,
                                   alibi_slopes=slopes)

    out = step(*args, kwargs["attn_bias"], kwargs["alibi_slopes"], *new)
    expected = paged_attention_ref(p.query, k_ref, v_ref, p.block_tables, p.seq_lens, attn_bias=p.attn_bias,
                                   alibi_slopes=p.alibi_slopes)
    assert_close(to_numpy(out), expected, "f16")
    assert_same(to_numpy(args[1]), k_ref)
    assert_same(to_numpy(args[2]), v_ref)


@gpu
@pytest.mark.parametrize("bias", ["dense", "t5-causal"])
def test_compiled_prefill(rng, bias):
    p = make_prefill_problem(rng, PREFILL_SEQS, num_heads=8, num_kv_heads=2, head_size=128, dtype="bf16", bias=bias)
    args, kwargs = prefill_inputs(p, "cuda")
    t5 = kwargs["attn_bias"] if bias == "t5-causal" else None

    @torch.compile(fullgraph=True)
    def dense_layer(query, key_cache, value_cache, block_tables, seq_lens, starts, dense):
        return cpt.paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, starts,
                                           attn_bias=dense)

    @torch.compile(fullgraph=True)
    def t5_layer(query, key_cache, value_cache, block_tables, seq_lens, starts, table, buckets):
        # A T5 layer holds its table and the buckets of RelativePositionBias; the geometry is the model's.
        return torch.ops.cupy_paged_attn.paged_prefill_attention_t5(
            query, key_cache, value_cache, block_tables, seq_lens, starts, True, table, buckets, 32, 128, False,
            None, None, "nhd")

    out = t5_layer(*args, t5.table, t5.buckets) if t5 is not None else dense_layer(*args, kwargs["attn_bias"])
    assert_close(to_numpy(out), paged_prefill_attention_ref(*p.args(), **p.kwargs()), "bf16", bias)


@gpu
@pytest.mark.parametrize("bias", ["dense", "ragged", "t5-causal"])
def test_cuda_graph_replay(rng, bias):
    """Capture a cache write, a decode and a prefill; replay on new data in the same buffers: each equals the
    reference of the new data."""
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias=bias, bias_dtype="f32")
    p = make_problem(rng, SEQ_LENS, **shape)
    args, kwargs = decode_inputs(p, "cuda")
    new, _ = rewrite_last_tokens(rng, p, "cuda")
    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16")
    pargs, _ = prefill_inputs(pp, "cuda")

    def step():
        cpt.reshape_and_cache(*new[:2], args[1], args[2], new[2])
        return cpt.paged_attention(*args, **kwargs), cpt.paged_prefill_attention(*pargs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, plans built, before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoded, prefilled = step()

    # New data in the captured buffers, then one replay.
    p2 = make_problem(rng, SEQ_LENS, **shape)
    args[0].copy_(tensor(p2.query, "cuda"))
    for t in new[:2]:
        t.copy_(tensor(rng.standard_normal(t.shape).astype(p.key_cache.dtype), "cuda"))
    expected_caches = reshape_and_cache_ref(*(to_numpy(t) for t in new[:2]), to_numpy(args[1]), to_numpy(args[2]),
                                            to_numpy(new[2]))
    pargs[0].copy_(tensor(rng.standard_normal(pargs[0].shape).astype(pp.query.dtype), "cuda"))
    decoded.fill_(float("nan"))
    prefilled.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_attention_ref(p2.query, *expected_caches, p.block_tables, p.seq_lens, **p.kwargs())
    assert_close(to_numpy(decoded), expected, "bf16", f"{bias} decode replay")
    expected_p = paged_prefill_attention_ref(to_numpy(pargs[0]), *pp.args()[1:], **pp.kwargs())
    live = slice(0, int(pp.query_start_loc[-1]))
    assert_close(to_numpy(prefilled)[live], expected_p[live], "bf16", "prefill replay")


# ---------------------------------------------------------------------------------------------------------------
# fp8 caches through the operators
# ---------------------------------------------------------------------------------------------------------------
def _fp8_caches(p, device: str, k_scale: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``p``'s NHD caches as torch float8_e4m3fn (``value / k_scale[head]``; unused slots NaN), on ``device``; the
    problem's dense K/V become what the caches hold, dequantized."""
    from cupy_paged_attn.reference import fp8_quantize

    caches = []
    for c in (p.key_cache, p.value_cache):
        q8 = fp8_quantize(c.astype(np.float32), k_scale, "fp8_e4m3")
        caches.append(torch.from_numpy(q8.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(device))
    p.dense_k = [fp8_quantize(k, k_scale).astype(np.float64) * k_scale[:, None] for k in p.dense_k]
    p.dense_v = [fp8_quantize(v, k_scale).astype(np.float64) * k_scale[:, None] for v in p.dense_v]
    return caches[0], caches[1]


def _fp8_operator_run(rng, device: str, compiled) -> None:
    """Decode, prefill and the cache write over fp8 caches through the operators (a scale tensor, and a number)."""
    from helpers import dense_attention

    k_scale = np.float32([0.05, 0.2])
    p = make_problem(rng, SEQ_LENS, num_heads=8, num_kv_heads=2, head_size=64, dtype="bf16", bias="dense")
    args, kwargs = decode_inputs(p, device)
    args[1], args[2] = _fp8_caches(p, device, k_scale)
    scale_t = torch.from_numpy(k_scale).to(device)
    out = compiled(cpt.paged_attention)(*args, **kwargs, k_scale=scale_t, v_scale=scale_t)
    assert_close(to_numpy(out), dense_attention(p), "bf16", f"{device} decode")
    pp = make_prefill_problem(rng, PREFILL_SEQS, num_heads=4, num_kv_heads=2, head_size=64, dtype="f16")
    pargs, pkwargs = prefill_inputs(pp, device)
    pargs[1], pargs[2] = _fp8_caches(pp, device, np.float32([0.25, 0.25]))
    out = compiled(cpt.paged_prefill_attention)(*pargs, **pkwargs, k_scale=0.25, v_scale=0.25)
    expected = paged_prefill_attention_ref(
        *(to_numpy(a) for a in pargs), **pp.kwargs(), kv_cache_dtype="fp8_e4m3", k_scale=0.25, v_scale=0.25)
    assert_close(to_numpy(out), expected, "f16", f"{device} prefill")
    key = tensor(rng.standard_normal((5, 2, 64)).astype(np.float32), device)
    k8 = torch.zeros(4, 16, 2, 64, dtype=torch.uint8, device=device)
    v8 = torch.zeros_like(k8)
    slots = torch.tensor([3, 17, -1, 40, 63], dtype=torch.int64, device=device)
    cpt.reshape_and_cache(key, key * 2, k8, v8, slots, kv_cache_dtype="fp8_e5m2", k_scale=scale_t, v_scale=0.5)
    want_k, want_v = reshape_and_cache_ref(to_numpy(key), to_numpy(key * 2), np.zeros((4, 16, 2, 64), np.uint8),
                                           np.zeros((4, 16, 2, 64), np.uint8), to_numpy(slots),
                                           kv_cache_dtype="fp8_e5m2", k_scale=k_scale, v_scale=0.5)
    np.testing.assert_array_equal(k8.cpu().numpy(), want_k)
    np.testing.assert_array_equal(v8.cpu().numpy(), want_v)


def test_cpu_operators_take_fp8_caches(rng):
    """fp8 caches and their scales pass through the operators (compiled whole) to the reference."""
    _fp8_operator_run(rng, "cpu", lambda fn: torch.compile(fn, fullgraph=True, backend="aot_eager"))


@gpu
def test_fp8_operators_eager_and_compiled(rng):
    _fp8_operator_run(rng, "cuda", lambda fn: fn)
    _fp8_operator_run(rng, "cuda", lambda fn: torch.compile(fn, fullgraph=True))
