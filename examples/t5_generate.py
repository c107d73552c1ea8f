"""T5 greedy generation with every attention on cupy-paged-attn, checked against transformers' own ``generate``.

Run: python examples/t5_generate.py                  # GPU: t5-small sizes, float32
     python examples/t5_generate.py --dtype bfloat16 # GPU: bfloat16 (tokens may differ; reported, not required)
     python examples/t5_generate.py --cpu            # CPU, NumPy path, a tiny config (automatic without a GPU)

Builds a ``T5ForConditionalGeneration`` from a config with seeded random weights (no download), a padded batch of
inputs of lengths 7, 19, 33 and 50, and generates 32 tokens greedily twice: with transformers
(``model.generate(..., do_sample=False, num_beams=1)``, attention mask for the padding) and with
:class:`cupy_paged_attn.t5.PagedT5` (ragged lengths, paged caches, our kernels). Prints whether the tokens are
identical, the largest difference between the two models' logits for the same prefix (HF's tokens fed to both,
teacher-forced), and tokens/s of both. Ends with "OK", or exits 1 with "FAILED: ...". Needs torch and transformers
(exits 3 with "cannot run: ..." without them; 0 with ``--skip-missing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from typing import Any

from _missing import cannot_run

LENGTHS = (7, 19, 33, 50)
# Max |ours - HF| over the logits of every step (logits of magnitude ~5), by (device, dtype). float32: the two
# differ only in rounding (CPU: our float64 attention vs HF's float32, measured 3e-6); a wrong bias or a padding
# mistake moves the logits by 0.04 to 4. bfloat16 rounds every activation of both models, differently.
LOGIT_ATOL = {("cpu", "float32"): 1e-4, ("cuda", "float32"): 1e-3,
              ("cpu", "bfloat16"): 0.25, ("cuda", "bfloat16"): 0.25}

T5_SMALL = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                relative_attention_num_buckets=32, relative_attention_max_distance=128)
# CPU: small enough for the float64 NumPy path to take seconds; max_distance 20 < the longest input, so the far
# buckets are used too. d_kv 32 is a supported head size.
T5_TINY = dict(vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
               relative_attention_num_buckets=32, relative_attention_max_distance=20)


@dataclasses.dataclass
class Comparison:
    """What :func:`compare` measured."""

    hf_tokens: Any  # [num_seqs, n_hf] int64, start token excluded
    our_tokens: Any  # [num_seqs, n_ours] int64
    tokens_equal: bool
    max_logit_diff: float  # max |ours - HF| over every step's logits, same (HF's) prefix
    max_abs_logit: float  # the logits' scale, for context
    min_top2_gap: float  # smallest HF top-1 minus top-2 logit over the steps: how close greedy came to a tie
    our_err_vs_fp32: float | None  # with a float32 twin of the model: max |ours - its logits|, same prefix
    hf_err_vs_fp32: float | None  # ... and max |HF - its logits|: the error the dtype itself brings
    hf_tokens_per_s: float
    our_tokens_per_s: float


def skip_reason() -> str | None:
    """Why this example cannot run here, or None."""
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def build_model(sizes: dict[str, int], *, seed: int, device: str, dtype: str) -> Any:
    """A ``T5ForConditionalGeneration`` with seeded random weights, in eval mode, on ``device`` in ``dtype``.

    The LM head gets its own random weights (untied, as T5 v1.1 / flan-t5 checkpoints have it): with the random
    embeddings tied to the head, greedy decoding just repeats the decoder start token, which would test little.
    """
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(**sizes, num_decoder_layers=sizes["num_layers"], dropout_rate=0.0, feed_forward_proj="relu",
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


def make_batch(lengths: tuple[int, ...], vocab_size: int, *, seed: int, device: str) -> tuple[Any, Any]:
    """A right-padded batch: ``input_ids [num_seqs, max_len]`` int64 (pad 0) and its ``attention_mask``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for s, n in enumerate(lengths):
        input_ids[s, :n] = torch.randint(2, vocab_size, (n,), generator=gen)  # no pad (0) or EOS (1) in the input
        mask[s, :n] = 1
    return input_ids.to(device), mask.to(device)


def _timed(fn: Any, device: str) -> tuple[Any, float]:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def compare(model: Any, input_ids: Any, attention_mask: Any, max_new_tokens: int, *, block_size: int = 16,
            fp32_model: Any = None) -> Comparison:
    """Generate with transformers and with :class:`PagedT5`; compare tokens and the logits of every step.

    ``input_ids`` and ``attention_mask`` are ``[num_seqs, max_len]`` on the model's device. With ``fp32_model`` (the
    same weights in float32), both models' logits are also compared with its logits for HF's prefix.
    """
    import torch

    from cupy_paged_attn.t5 import PagedT5

    device = model.device.type
    # Pages for this batch: each input's tokens (source pool), max_new_tokens per sequence (target pool).
    source_pages = int(((attention_mask.sum(1) + block_size - 1) // block_size).sum())
    target_pages = len(input_ids) * -(-max_new_tokens // block_size)
    paged = PagedT5(model, num_blocks=max(source_pages, target_pages), block_size=block_size)

    def hf_generate() -> Any:
        return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, num_beams=1,
                              max_new_tokens=max_new_tokens)

    def our_generate() -> Any:
        return paged.generate(input_ids, attention_mask, max_new_tokens=max_new_tokens)

    with torch.no_grad():
        hf_generate(), our_generate()  # warm-up: kernel compilation, allocator, caches
        hf_out, hf_seconds = _timed(hf_generate, device)
        ours, our_seconds = _timed(our_generate, device)
        hf_tokens = hf_out[:, 1:]  # HF's output starts with the decoder start token
        # The logits of every step for HF's prefix: teacher-forced, from HF's model and from ours.
        hf_logits = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=hf_out[:, :-1]).logits
        our_logits = paged.score(input_ids, attention_mask, hf_tokens)
        exact = None
        if fp32_model is not None:
            exact = fp32_model(input_ids=input_ids, attention_mask=attention_mask,
                               decoder_input_ids=hf_out[:, :-1]).logits
    hf_logits = hf_logits.float()
    top2 = hf_logits.topk(2, dim=-1).values
    return Comparison(
        hf_tokens=hf_tokens.cpu(),
        our_tokens=ours.tokens.cpu(),
        tokens_equal=hf_tokens.shape == ours.tokens.shape and bool((hf_tokens == ours.tokens).all()),
        max_logit_diff=float((our_logits - hf_logits).abs().max()),
        max_abs_logit=float(hf_logits.abs().max()),
        min_top2_gap=float((top2[..., 0] - top2[..., 1]).min()),
        our_err_vs_fp32=None if exact is None else float((our_logits - exact).abs().max()),
        hf_err_vs_fp32=None if exact is None else float((hf_logits - exact).abs().max()),
        hf_tokens_per_s=hf_tokens.numel() / hf_seconds,
        our_tokens_per_s=ours.tokens.numel() / our_seconds,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (NumPy path); automatic without a GPU")
    parser.add_argument("--config", choices=["small", "tiny"], help="model sizes (default: small on GPU, tiny on CPU)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per sequence")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-missing", action="store_true", help="exit 0 where torch or transformers is missing")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason:
        cannot_run(reason)
    import torch

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cpu":  # small matrices: threads only add synchronisation (10x slower on a busy 2-core machine)
        torch.set_num_threads(1)
    elif args.dtype == "float32":  # exact float32 matmuls in transformers' attention and in the projections
        torch.set_float32_matmul_precision("highest")
    sizes = {"small": T5_SMALL, "tiny": T5_TINY}[args.config or ("small" if device == "cuda" else "tiny")]
    model = build_model(sizes, seed=args.seed, device=device, dtype=args.dtype)
    input_ids, attention_mask = make_batch(LENGTHS, sizes["vocab_size"], seed=args.seed + 1, device=device)
    print(f"T5 {args.config or ('small' if device == 'cuda' else 'tiny')} {sizes}, {args.dtype} on {device}; "
          f"input lengths {LENGTHS}, {args.tokens} new tokens")

    fp32_model = None
    if args.dtype != "float32":  # the same weights in float32: how far each model's logits are from exact ones
        fp32_model = build_model(sizes, seed=args.seed, device=device, dtype="float32")
    c = compare(model, input_ids, attention_mask, args.tokens, fp32_model=fp32_model)
    atol = LOGIT_ATOL[device, args.dtype]
    matching = sum(int(a == b) for a, b in zip(c.hf_tokens.flatten().tolist(), c.our_tokens.flatten().tolist(),
                                               strict=False))
    print(f"tokens identical to transformers: {c.tokens_equal} ({matching}/{c.hf_tokens.numel()} positions, "
          f"HF generated {tuple(c.hf_tokens.shape)}, ours {tuple(c.our_tokens.shape)})")
    print(f"max |logit difference| over all steps (HF's prefix): {c.max_logit_diff:.3g} "
          f"(tolerance {atol:g}; logits up to {c.max_abs_logit:.3g}, "
          f"smallest top-1/top-2 gap {c.min_top2_gap:.3g})")
    if c.our_err_vs_fp32 is not None:
        print(f"max |logit difference| from the float32 model: ours {c.our_err_vs_fp32:.3g}, "
              f"transformers {c.hf_err_vs_fp32:.3g}")
    print(f"tokens/s: transformers {c.hf_tokens_per_s:,.0f}, cupy-paged-attn {c.our_tokens_per_s:,.0f}")
    if c.our_tokens.shape[1] < args.tokens:
        print(f"note: every sequence reached EOS after {c.our_tokens.shape[1]} tokens")
    if args.dtype == "float32" and not c.tokens_equal:
        print("FAILED: generated tokens differ from transformers'")
        return 1
    if c.max_logit_diff > atol:
        print(f"FAILED: logits differ by {c.max_logit_diff:.3g} > {atol:g}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
