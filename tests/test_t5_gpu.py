"""GPU: a t5-small-sized T5 (seeded random weights) generating with every attention on our kernels
(:class:`cupy_paged_attn.t5.PagedT5`) against transformers' own greedy ``generate`` on the same CUDA model:
float32 tokens identical and logits within tolerance; bfloat16 logits within tolerance and no further from the
float32 model's than transformers' own bfloat16 run; ragged inputs; ``examples/t5_generate.py``.

Run: ``PYTHONPATH=. python -m pytest -m gpu tests/test_t5_gpu.py -s`` (``-s`` shows tokens/s and the differences).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_t5_cpu import EXAMPLE, NEW_TOKENS, ROOT, load_example  # noqa: E402  (after the skips)

from cupy_paged_attn.t5 import PagedT5  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def example() -> ModuleType:
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    return load_example()


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    """No TF32 in transformers' float32 matmuls while the test runs."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _batch(example: ModuleType) -> tuple[Any, Any]:
    return example.make_batch(example.LENGTHS, example.T5_SMALL["vocab_size"], seed=1, device="cuda")


def _report(name: str, c: Any) -> None:
    print(f"\n{name}: tokens identical {c.tokens_equal} (HF {tuple(c.hf_tokens.shape)}, ours "
          f"{tuple(c.our_tokens.shape)}), max |logit diff| {c.max_logit_diff:.3g}, smallest top-2 gap "
          f"{c.min_top2_gap:.3g}, tokens/s HF {c.hf_tokens_per_s:,.0f} ours {c.our_tokens_per_s:,.0f}")


@pytest.mark.parametrize("block_size", [8, 16])
def test_t5_small_float32_matches_transformers(example: ModuleType, exact_fp32: None, block_size: int) -> None:
    model = example.build_model(example.T5_SMALL, seed=0, device="cuda", dtype="float32")
    c = example.compare(model, *_batch(example), NEW_TOKENS, block_size=block_size)
    _report(f"float32, block_size {block_size}", c)
    assert c.tokens_equal, f"ours {c.our_tokens.tolist()}\nHF {c.hf_tokens.tolist()}"
    assert c.max_logit_diff <= example.LOGIT_ATOL["cuda", "float32"]


def test_t5_small_bfloat16_close_to_transformers(example: ModuleType, exact_fp32: None) -> None:
    """bfloat16 tokens may differ from transformers' (logits tie in bfloat16); the logits may not."""
    model = example.build_model(example.T5_SMALL, seed=0, device="cuda", dtype="bfloat16")
    fp32_model = example.build_model(example.T5_SMALL, seed=0, device="cuda", dtype="float32")
    c = example.compare(model, *_batch(example), NEW_TOKENS, fp32_model=fp32_model)
    _report("bfloat16", c)
    matching = int((c.hf_tokens == c.our_tokens).sum()) if c.hf_tokens.shape == c.our_tokens.shape else -1
    print(f"bfloat16: {matching}/{c.hf_tokens.numel()} tokens as transformers'; from the float32 model's logits: "
          f"ours {c.our_err_vs_fp32:.3g}, transformers {c.hf_err_vs_fp32:.3g}")
    assert c.max_logit_diff <= example.LOGIT_ATOL["cuda", "bfloat16"]
    assert c.our_err_vs_fp32 <= 2 * c.hf_err_vs_fp32 + 0.02  # our attention is no worse than transformers'


def test_ragged_inputs_match_padded(example: ModuleType, exact_fp32: None) -> None:
    model = example.build_model(example.T5_SMALL, seed=0, device="cuda", dtype="float32")
    input_ids, mask = _batch(example)
    paged = PagedT5(model, num_blocks=64)
    padded = paged.generate(input_ids, mask, max_new_tokens=NEW_TOKENS)
    ragged = paged.generate([ids[m.bool()] for ids, m in zip(input_ids, mask, strict=True)],
                            max_new_tokens=NEW_TOKENS)
    assert torch.equal(padded.tokens, ragged.tokens)
    assert padded.tokens.is_cuda and paged.self_caches[0][0].is_cuda  # the torch path, not the NumPy one


def test_example_runs_on_gpu(example: ModuleType) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on cuda" in run.stdout and "tokens identical to transformers: True" in run.stdout
    assert run.stdout.rstrip().endswith("OK"), run.stdout
