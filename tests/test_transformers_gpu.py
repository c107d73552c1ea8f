"""GPU: :mod:`cupy_paged_attn.transformers` on the CUDA kernels. The attention function's packed calls (prefill,
chunked prefill and decode rows mixed, and decode steps only) at Llama-3.2-1B's head shapes with sequences of
hundreds to thousands of keys, float32 and bfloat16, against the float64 reference; and ``generate_batch`` on a
small float32 Llama on the GPU, under transformers' CUDA graphs, giving the greedy tokens of transformers' own SDPA.

Skips without torch, transformers (>= 5.24) or a GPU. No network: the model is built from a config.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import assert_close, causal_attention

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.24")

import cupy_paged_attn.transformers as cpt  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 64  # Llama-3.2-1B
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def packed_inputs(q_lens: list[int], k_lens: list[int], pad_q: int, pad_k: int, dtype: str, seed: int):
    """Query ``[1, H, total_q, d]`` and keys / values ``[1, Hkv, total_k, d]`` as transformers passes them (views of
    ``[total, heads, d]`` rows), ``pad_q`` / ``pad_k`` rows of padding at the end, on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(q_lens) + pad_q, sum(k_lens) + pad_k
    query = torch.randn(1, HEADS, total_q, HEAD_SIZE, generator=generator)
    key = torch.randn(total_k, KV_HEADS, HEAD_SIZE, generator=generator).transpose(0, 1).unsqueeze(0)
    value = torch.randn(total_k, KV_HEADS, HEAD_SIZE, generator=generator).transpose(0, 1).unsqueeze(0)
    return [x.to("cuda", DTYPES[dtype]) for x in (query, key, value)]


def check_sequences(out, query, key, value, cu_q, cu_k, scale, dtype, softcap, window) -> None:
    q = query[0].transpose(0, 1).double().cpu().numpy()
    k, v = (x[0].transpose(0, 1).double().cpu().numpy() for x in (key, value))
    got = out[0].float().cpu().numpy()
    for s in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        if rows.stop > rows.start:
            expected = causal_attention(q[rows], k[keys], v[keys], scale, softcap, window)
            assert_close(got[rows], expected, dtype, f"sequence {s}")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize(("softcap", "window"), [(None, None), (30.0, 256)])
def test_packed_call_on_the_gpu(dtype, softcap, window):
    """A prompt, a decode row over 1,500 keys, a chunk of 200 rows over 1,200 keys, a short prompt; padding rows
    and length-0 sequences at the end (transformers' padding to a graph size)."""
    q_lens, k_lens = [700, 1, 200, 33], [700, 1500, 1200, 33]
    query, key, value = packed_inputs(q_lens, k_lens, pad_q=5, pad_k=7, dtype=dtype, seed=11)
    cu_q = torch.tensor([0, *np.cumsum(q_lens), sum(q_lens)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *np.cumsum(k_lens), sum(k_lens)], dtype=torch.int32, device="cuda")
    scale = HEAD_SIZE**-0.5
    out, _ = cpt.attention_forward(
        None, query, key, value, None, scaling=scale, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
        max_length_q=max(q_lens), max_length_k=max(k_lens), is_causal=True, softcap=softcap, sliding_window=window)
    assert out.shape == (1, query.shape[2], HEADS, HEAD_SIZE) and out.dtype == query.dtype
    check_sequences(out, query, key, value, cu_q.cpu(), cu_k.cpu(), scale, dtype, softcap, window)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_packed_decode_call_on_the_gpu(dtype):
    """Decode steps only (max_length_q == 1) over 1 to 2,000 keys, a length-0 sequence at the end: the decode
    kernels, split-K included."""
    k_lens = [2000, 1, 517, 64, 1300]
    query, key, value = packed_inputs([1] * len(k_lens), k_lens, pad_q=0, pad_k=0, dtype=dtype, seed=12)
    cu_q = torch.tensor([*range(len(k_lens) + 1), len(k_lens)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *np.cumsum(k_lens), sum(k_lens)], dtype=torch.int32, device="cuda")
    scale = HEAD_SIZE**-0.5
    out, _ = cpt.attention_forward(
        None, query, key, value, None, scaling=scale, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=1,
        max_length_k=max(k_lens), is_causal=True)
    check_sequences(out, query, key, value, cu_q.cpu(), cu_k.cpu(), scale, dtype, None, None)


def test_generate_batch_on_the_gpu_gives_sdpa_tokens(monkeypatch):
    """A small float32 Llama (head size 64, GQA 4) on the GPU, ragged prompts of up to 300 tokens in chunks of a
    256-token batch, transformers' CUDA graphs on: our attention function runs inside a graph capture, and the greedy
    tokens (replayed from the graphs) are identical to transformers' SDPA in continuous batching."""
    config = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=64, vocab_size=512, max_position_embeddings=1024)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (300, 17, 129, 2, 260, 64)]
    generation = transformers.GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    captured = []
    attention = cpt.attention_forward

    def recording(*args, **kwargs):
        captured.append(torch.cuda.is_current_stream_capturing())
        return attention(*args, **kwargs)

    monkeypatch.setattr(cpt, "attention_forward", recording)  # registered by enable()
    tokens = {}
    for name in ("sdpa", cpt.NAME):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))
        model = model.to("cuda").eval()
        graphs = None
        if name != "sdpa":
            model, graphs = cpt.enable(model), True
        batching = transformers.ContinuousBatchingConfig(num_blocks=64, page_size=32, max_batch_tokens=256,
                                                         use_cuda_graph=graphs)
        outputs = model.generate_batch(inputs=prompts, generation_config=generation,
                                       continuous_batching_config=batching)
        tokens[name] = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert any(captured), "no attention call ran inside a CUDA graph capture"
    assert tokens[cpt.NAME] == tokens["sdpa"]
