"""CPU: :mod:`cupy_paged_attn.transformers` on the library's NumPy path. transformers' continuous batching
(``generate_batch``) on tiny Llama-, Qwen2-, Mistral- (sliding window shorter than the prompts) and Gemma-2-style
(soft-cap, sliding and full layers alternating) decoders gives the greedy tokens of transformers' own attention, in
continuous batching and in ``model.generate``; the attention function against a dense float64 reference on both of
its calls (packed ragged sequences with GQA, and block-table decode writing the cache); every refusal.

Skips without torch or transformers. No network: models are built from configs with seeded random weights.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.24")

from helpers import causal_attention  # noqa: E402

import cupy_paged_attn.torch as ops  # noqa: E402  (needs torch)
import cupy_paged_attn.transformers as cpt  # noqa: E402  (needs transformers)

PROMPT_LENS = (5, 17, 33, 2, 40)
NEW_TOKENS = 8
VOCAB = 128
SLIDING_WINDOW = 8  # shorter than most prompts: the window is exercised in prefill and decode
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)


def llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def qwen2() -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**SMALL, "num_key_value_heads": 1}))


def mistral() -> torch.nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=SLIDING_WINDOW))


def gemma2() -> torch.nn.Module:
    # A soft-cap of 2 bites on these logits (a realistic 50 would change nothing for random weights)
    config = transformers.Gemma2Config(**SMALL, head_dim=32, sliding_window=SLIDING_WINDOW,
                                       attn_logit_softcapping=2.0, query_pre_attn_scalar=32)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return transformers.Gemma2ForCausalLM(config)


# builder, transformers' implementation to compare with (SDPA has no soft-cap: eager for Gemma 2)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "llama": (llama, "sdpa"), "qwen2": (qwen2, "sdpa"), "mistral": (mistral, "sdpa"), "gemma2": (gemma2, "eager"),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def generation_config() -> transformers.GenerationConfig:
    return transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)


def generate_batch(model: torch.nn.Module, inputs: list[list[int]]) -> list[list[int]]:
    # Small pages and batches: prompts are split into chunks, and sequences of several pages are mixed with decodes
    config = transformers.ContinuousBatchingConfig(num_blocks=32, page_size=16, max_batch_tokens=64)
    outputs = model.generate_batch(inputs=inputs, generation_config=generation_config(),
                                   continuous_batching_config=config)
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(inputs))]


def generate(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    return model.generate(torch.tensor([prompt]), generation_config=generation_config())[0, len(prompt):].tolist()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the library's operator calls made by the attention function, by name."""
    counts = {"paged_prefill_attention": 0, "paged_attention": 0, "reshape_and_cache": 0}
    def counting(name: str) -> Callable:
        op = getattr(ops, name)

        def call(*args, **kwargs):
            counts[name] += 1
            return op(*args, **kwargs)
        return call

    for name in counts:
        monkeypatch.setattr(ops, name, counting(name))
    return counts


# ---------------------------------------------------------------------------------------------------------------
# Whole models: the tokens of transformers' own attention
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_batch_gives_the_tokens_of_transformers_attention(name, calls):
    reference = build(name)
    reference.set_attn_implementation(MODELS[name][1])
    inputs = prompts()
    expected = generate_batch(reference, inputs)
    ours = cpt.enable(build(name))
    assert ours.config._attn_implementation == cpt.NAME
    assert generate_batch(ours, inputs) == expected
    # every layer of every step ran here: batches with a prompt's tokens on the prefill kernels, batches of decode
    # steps only on the decode kernels
    layers = SMALL["num_hidden_layers"]
    assert calls["paged_prefill_attention"] + calls["paged_attention"] >= NEW_TOKENS * layers
    assert calls["paged_prefill_attention"] >= layers and calls["paged_attention"] >= layers
    # and each request's tokens are what the model gives it alone
    for prompt, tokens in zip(inputs[:2], expected[:2], strict=True):
        assert generate(reference, prompt) == tokens


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_model_generate_outside_continuous_batching_goes_to_sdpa(name, calls):
    reference = build(name)
    reference.set_attn_implementation("sdpa")
    ours = cpt.enable(build(name))
    prompt = prompts()[2]
    assert generate(ours, prompt) == generate(reference, prompt)
    assert calls["paged_prefill_attention"] == 0
    # a padded batch: the masks transformers builds for SDPA come through
    batch = torch.tensor([[0, 0, 0, *prompt[:9]], prompt[:12]])
    mask = torch.tensor([[0, 0, 0] + [1] * 9, [1] * 12])
    config = generation_config()
    ours_out = ours.generate(batch, attention_mask=mask, generation_config=config)
    torch.testing.assert_close(ours_out, reference.generate(batch, attention_mask=mask, generation_config=config))


# ---------------------------------------------------------------------------------------------------------------
# The attention function alone, against a dense reference
# ---------------------------------------------------------------------------------------------------------------
HEADS, KV_HEADS, HEAD_SIZE = 8, 2, 32
OPTIONS = [(None, None), (None, 4), (3.0, None), (3.0, 4)]  # (softcap, sliding_window)


@pytest.mark.parametrize(("softcap", "window"), OPTIONS)
def test_packed_call_against_a_dense_reference(softcap, window):
    # a prefill, a decode, a chunk of a long prompt, a short prefill; then two padded sequences of length 0
    q_lens, k_lens = [5, 1, 17, 3], [5, 9, 30, 3]
    pad_q, pad_k = 3, 5  # padded rows at the end of the query and the keys
    generator = torch.Generator().manual_seed(2)
    total_q, total_k = sum(q_lens) + pad_q, sum(k_lens) + pad_k
    query = torch.randn(1, HEADS, total_q, HEAD_SIZE, generator=generator)
    # as transformers passes them: [1, Hkv, total_k, d] views of [total_k, Hkv, d] rows
    key = torch.randn(total_k, KV_HEADS, HEAD_SIZE, generator=generator).transpose(0, 1).unsqueeze(0)
    value = torch.randn(total_k, KV_HEADS, HEAD_SIZE, generator=generator).transpose(0, 1).unsqueeze(0)
    cu_q = torch.tensor([0, *np.cumsum(q_lens), sum(q_lens), sum(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(k_lens), sum(k_lens), sum(k_lens)], dtype=torch.int32)
    scale = 0.3
    out, weights = cpt.attention_forward(
        None, query, key, value, None, scaling=scale, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
        max_length_q=max(q_lens), max_length_k=max(k_lens), is_causal=True, softcap=softcap, sliding_window=window)
    assert weights is None and out.shape == (1, total_q, HEADS, HEAD_SIZE)
    q = query[0].transpose(0, 1).double().numpy()
    k, v = (x[0].transpose(0, 1).double().numpy() for x in (key, value))
    for s in range(len(q_lens)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        expected = causal_attention(q[rows], k[keys], v[keys], scale, softcap, window)
        np.testing.assert_allclose(out[0, rows].numpy(), expected, atol=2e-5, rtol=1e-5, err_msg=f"sequence {s}")


@pytest.mark.parametrize(("softcap", "window"), OPTIONS)
def test_packed_decode_call_against_a_dense_reference(softcap, window):
    """max_length_q == 1 (decode steps only): each sequence's one query row attends all its keys; a trailing
    sequence of length 0 (no row, no keys) changes nothing."""
    k_lens = [9, 1, 30, 4]
    generator = torch.Generator().manual_seed(3)
    total_q, total_k = len(k_lens), sum(k_lens)
    query = torch.randn(1, HEADS, total_q, HEAD_SIZE, generator=generator)
    key = torch.randn(total_k, KV_HEADS, HEAD_SIZE, generator=generator).transpose(0, 1).unsqueeze(0)
    value = torch.randn(total_k, KV_HEADS, HEAD_SIZE, generator=generator).transpose(0, 1).unsqueeze(0)
    cu_q = torch.tensor([*range(total_q + 1), total_q], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(k_lens), total_k], dtype=torch.int32)
    out, _ = cpt.attention_forward(
        None, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=1,
        max_length_k=max(k_lens), is_causal=True, softcap=softcap, sliding_window=window)
    assert out.shape == (1, total_q, HEADS, HEAD_SIZE)
    q = query[0].transpose(0, 1).double().numpy()
    k, v = (x[0].transpose(0, 1).double().numpy() for x in (key, value))
    for s in range(len(k_lens)):
        keys = slice(cu_k[s], cu_k[s + 1])
        expected = causal_attention(q[s:s + 1], k[keys], v[keys], 0.3, softcap, window)
        np.testing.assert_allclose(out[0, s:s + 1].numpy(), expected, atol=2e-5, rtol=1e-5, err_msg=f"sequence {s}")


@pytest.mark.parametrize(("softcap", "window"), OPTIONS)
def test_block_table_call_writes_the_cache_and_decodes_in_place(softcap, window):
    page_size, num_pages = 4, 12
    seq_lens = [1, 6, 13, 0]  # the new token included; the last sequence is padding
    tables = torch.full((len(seq_lens), 5), -1, dtype=torch.int32)
    pages = iter(torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).tolist())
    for s, n in enumerate(seq_lens):
        for j in range(math.ceil(n / page_size)):
            tables[s, j] = next(pages)
    generator = torch.Generator().manual_seed(4)
    k_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_SIZE, generator=generator)
    v_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_SIZE, generator=generator)
    untouched = k_cache.clone()
    for s, n in enumerate(seq_lens):  # the new tokens' slots hold NaN: they must be written before they are read
        if n:
            k_cache[tables[s, (n - 1) // page_size], (n - 1) % page_size] = math.nan
            v_cache[tables[s, (n - 1) // page_size], (n - 1) % page_size] = math.nan
    num_rows = len(seq_lens) + 1  # one query row past the block table (padding)
    query = torch.randn(1, HEADS, num_rows, HEAD_SIZE, generator=generator)
    key = torch.randn(1, KV_HEADS, num_rows, HEAD_SIZE, generator=generator)
    value = torch.randn(1, KV_HEADS, num_rows, HEAD_SIZE, generator=generator)
    cu_k = torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32)
    out, _ = cpt.attention_forward(
        None, query, key, value, None, scaling=0.3, cu_seq_lens_q=torch.arange(num_rows, dtype=torch.int32),
        cu_seq_lens_k=cu_k, max_length_q=1, max_length_k=1, block_table=tables, k_cache=k_cache, v_cache=v_cache,
        softcap=softcap, sliding_window=window)
    assert out.shape == (1, num_rows, HEADS, HEAD_SIZE)
    written = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for s, n in enumerate(seq_lens):
        if n == 0:
            np.testing.assert_array_equal(out[0, s].numpy(), 0.0)
            continue
        page, offset = tables[s, (n - 1) // page_size], (n - 1) % page_size
        written[page, offset] = True
        torch.testing.assert_close(k_cache[page, offset], key[0, :, s], rtol=0, atol=0)
        torch.testing.assert_close(v_cache[page, offset], value[0, :, s], rtol=0, atol=0)
        k = torch.cat([k_cache[p] for p in tables[s, :math.ceil(n / page_size)]])[:n].double().numpy()
        v = torch.cat([v_cache[p] for p in tables[s, :math.ceil(n / page_size)]])[:n].double().numpy()
        q = query[0, :, s:s + 1].transpose(0, 1).double().numpy()
        expected = causal_attention(q, k, v, 0.3, softcap, window)[0]
        np.testing.assert_allclose(out[0, s].numpy(), expected, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[0, -1].numpy(), 0.0)
    torch.testing.assert_close(k_cache[~written], untouched[~written], rtol=0, atol=0)  # nothing else written


# ---------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------
def test_enable_refuses_what_is_not_a_transformers_model():
    with pytest.raises(TypeError, match="model: expected a transformers PreTrainedModel, got object"):
        cpt.enable(object())


def test_enable_refuses_an_unsupported_head_size():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "num_attention_heads": 8}))
    with pytest.raises(NotImplementedError, match="model: head_size 16 is not supported; supported: 32, 64"):
        cpt.enable(model)


def test_enable_refuses_attention_dropout_in_training():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attention_dropout=0.1))
    with pytest.raises(NotImplementedError, match=r"attention dropout 0.1 in training mode .* model.eval\(\)"):
        cpt.enable(model.train())
    cpt.enable(model.eval())


def test_enable_refuses_attention_sinks():
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=VOCAB,
                                       num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(NotImplementedError, match=r"model: attention sinks \(s_aux, in model.layers.0.self_attn\)"):
        cpt.enable(transformers.GptOssForCausalLM(config))


def test_enable_refuses_latent_attention_caches():
    config = transformers.DeepseekV3Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16,
                                           qk_nope_head_dim=16, v_head_dim=32, first_k_dense_replace=1)
    with pytest.raises(NotImplementedError, match=r"model: multi-head latent attention \(kv_lora_rank=16\)"):
        cpt.enable(transformers.DeepseekV3ForCausalLM(config))


def test_enable_refuses_attention_outside_the_interface():
    no_backend = type("NoBackend", (transformers.LlamaForCausalLM,), {"_supports_attention_backend": False})
    with pytest.raises(NotImplementedError, match="NoBackend does not dispatch its attention through"):
        cpt.enable(no_backend(transformers.LlamaConfig(**SMALL)))


def test_soft_cap_outside_continuous_batching_says_to_use_generate_batch():
    model = cpt.enable(build("gemma2"))
    with pytest.raises(ValueError, match=r"softcap: .* continuous batching only \(model.generate_batch\)"):
        generate(model, prompts()[0])


def packed(**kwargs) -> tuple[torch.Tensor, None]:
    q = torch.ones(1, HEADS, 2, HEAD_SIZE)
    k = torch.ones(1, KV_HEADS, 2, HEAD_SIZE)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    return cpt.attention_forward(None, q, k, k, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_k=2, **kwargs)


def test_the_attention_refuses_sinks_and_dropout():
    with pytest.raises(NotImplementedError, match="s_aux: attention sinks are not supported by flash_cupy_paged"):
        packed(s_aux=torch.zeros(HEADS))
    with pytest.raises(NotImplementedError, match=r"dropout: expected 0 .*, got 0\.1"):
        packed(dropout=0.1)
    assert torch.isfinite(packed(s_aux=None)[0]).all()


@pytest.mark.parametrize("version", ["4.57.1", "5.23.0"])
def test_older_transformers_is_refused_at_import(monkeypatch, version):
    # the module object in sys.modules, which transformers may have replaced since this file imported it
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    monkeypatch.delitem(sys.modules, "cupy_paged_attn.transformers")
    with pytest.raises(ImportError, match=rf"needs transformers >= 5\.24 .*, got {re.escape(version)}"):
        importlib.import_module("cupy_paged_attn.transformers")


def test_importing_the_package_imports_neither_torch_nor_transformers():
    code = "import sys, cupy_paged_attn; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.strip() == "[]"
