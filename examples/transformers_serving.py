"""transformers' continuous batching on cupy-paged-attn: the same workload with SDPA and with our kernels.

Run: python examples/transformers_serving.py --cpu          # CPU, NumPy path, a tiny Llama (automatic without a GPU)
     python examples/transformers_serving.py                # GPU: the tiny Llama, float32
     python examples/transformers_serving.py --preset 1b    # GPU: Llama-3.2-1B sizes in bfloat16, 64 requests of
                                                            # 512-2048 prompt tokens, 256 new tokens each

Builds a Llama from a config with seeded random weights (no download) and a batch of prompts of random lengths,
and generates greedily with ``model.generate_batch`` twice: with ``attn_implementation="sdpa"`` and after
``cupy_paged_attn.transformers.enable(model)``, the one line this example is about. Each run is timed after a short
warm-up run (compilation, CUDA graphs). Prints tokens/s of both and their ratio, then the check: in float32 the
tokens must be identical. In bfloat16 the two attentions round differently, and a random model's logits are
nearly flat (near-ties among 128,256 tokens), so one rounding step can send a request down another path for the
rest of it; the check is then on the first token of each request (the prefill's): at least ``MIN_SAME_FRACTION``
of the requests must agree, and the share of all positions that agree is printed. Ends
with "OK", or exits 1 with "FAILED: ...". Needs torch and transformers >= 5.24 (exits 3 with "cannot run: ..."
without them; 0 with ``--skip-missing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys
import time
from typing import Any

from _missing import cannot_run

MIN_SAME_FRACTION = 0.9  # bfloat16: the share of requests whose first token must match SDPA's


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model and a workload."""

    model: dict[str, int]
    dtype: str
    requests: int
    prompt_lens: tuple[int, int]  # lowest and highest, drawn uniformly
    new_tokens: int
    page_size: int
    max_batch_tokens: int


PRESETS = {
    # CPU: seconds on the float64 NumPy path; head size 32, GQA 2, prompts spanning several 16-token pages
    "tiny": Preset(dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512),
                   "float32", requests=8, prompt_lens=(2, 48), new_tokens=16, page_size=16, max_batch_tokens=128),
    # Llama-3.2-1B's shapes: head size 64, GQA 4
    "1b": Preset(dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
                      rope_theta=500000.0),
                 "bfloat16", requests=64, prompt_lens=(512, 2048), new_tokens=256, page_size=256,
                 max_batch_tokens=4096),
}


def skip_reason(preset: str, cuda: bool) -> str | None:
    """Why this example cannot run here, or None."""
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    try:  # the module refuses a transformers release it does not support, naming both versions
        import cupy_paged_attn.transformers  # noqa: F401
    except ImportError as error:
        return str(error)
    if preset == "1b" and not cuda:
        return "--preset 1b needs a CUDA GPU (on the CPU, use the tiny preset)"
    return None


def build_model(preset: Preset, *, seed: int, device: str, attn: str) -> Any:
    """A ``LlamaForCausalLM`` with seeded random weights, in eval mode, on ``device`` in the preset's dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**preset.model, attn_implementation=attn)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype=getattr(torch, preset.dtype)).eval()


def make_prompts(preset: Preset, *, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    low, high = preset.prompt_lens
    lens = torch.randint(low, high + 1, (preset.requests,), generator=generator).tolist()
    return [torch.randint(0, preset.model["vocab_size"], (n,), generator=generator).tolist() for n in lens]


def generate(model: Any, prompts: list[list[int]], preset: Preset, new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy ``generate_batch``: each request's tokens, in order, and the seconds it took."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pages = sum(math.ceil((len(p) + new_tokens) / preset.page_size) for p in prompts) + len(prompts)
    # auto_switch_to_flash=False: SDPA stays SDPA in bfloat16, where transformers would switch to FlashAttention
    cb_config = ContinuousBatchingConfig(num_blocks=pages, page_size=preset.page_size,
                                         max_batch_tokens=preset.max_batch_tokens, auto_switch_to_flash=False)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb_config)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))], seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (NumPy path); automatic without a GPU")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model and workload")
    parser.add_argument("--requests", type=int, help="override the preset's number of requests")
    parser.add_argument("--tokens", type=int, help="override the preset's new tokens per request")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="override the preset's dtype (float32: the tokens must be identical to sdpa's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-missing", action="store_true", help="exit 0 where this example cannot run")
    args = parser.parse_args(argv)
    cuda = not args.cpu and importlib.util.find_spec("torch") is not None and _cuda_available()
    reason = skip_reason(args.preset, cuda)
    if reason:
        cannot_run(reason)
    import torch

    import cupy_paged_attn.transformers

    device = "cuda" if cuda else "cpu"
    if device == "cpu":  # small matrices: threads only add synchronisation
        torch.set_num_threads(1)
    preset = PRESETS[args.preset]
    if args.requests:
        preset = dataclasses.replace(preset, requests=args.requests)
    if args.dtype:
        preset = dataclasses.replace(preset, dtype=args.dtype)
    new_tokens = args.tokens or preset.new_tokens
    prompts = make_prompts(preset, seed=args.seed + 1)
    lens = [len(p) for p in prompts]
    print(f"Llama {args.preset} {preset.model}, {preset.dtype} on {device}; {len(prompts)} requests of "
          f"{min(lens)}-{max(lens)} prompt tokens, {new_tokens} new tokens each")

    results = {}
    for name in ("sdpa", cupy_paged_attn.transformers.NAME):
        model = build_model(preset, seed=args.seed, device=device, attn="sdpa")
        if name != "sdpa":
            model = cupy_paged_attn.transformers.enable(model)  # the one line
        generate(model, prompts[:2], preset, 2)  # warm-up: compilation, CUDA graphs
        results[name] = generate(model, prompts, preset, new_tokens)
        del model
    (sdpa_tokens, sdpa_s), (our_tokens, our_s) = results.values()
    generated = sum(len(t) for t in sdpa_tokens)
    print(f"{'attention':<20} {'seconds':>9} {'tokens/s':>10}")
    for name, (_, seconds) in results.items():
        print(f"{name:<20} {seconds:>9.2f} {generated / seconds:>10,.0f}")
    print(f"ratio (ours / sdpa): {sdpa_s / our_s:.2f}x")

    pairs = [(a, b) for ref, ours in zip(sdpa_tokens, our_tokens, strict=True)
             for a, b in zip(ref, ours, strict=False)]
    same = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    first_same = sum(ref[:1] == ours[:1] for ref, ours in zip(sdpa_tokens, our_tokens, strict=True)) / len(prompts)
    identical = sdpa_tokens == our_tokens
    print(f"tokens identical to sdpa: {identical} ({same:.1%} of positions; first token of {first_same:.0%} of the "
          "requests)")
    if preset.dtype == "float32" and not identical:
        print("FAILED: generated tokens differ from sdpa's")
        return 1
    if first_same < MIN_SAME_FRACTION:
        print(f"FAILED: the first token differs from sdpa's in over {1 - MIN_SAME_FRACTION:.0%} of the requests")
        return 1
    print("OK")
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
