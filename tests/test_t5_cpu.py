"""CPU: :class:`cupy_paged_attn.t5.PagedT5` on the library's NumPy path against transformers' own greedy ``generate``,
on a tiny T5 (seeded random weights): identical tokens, logits of every step within tolerance, padding (left, right,
none), EOS handling, page bookkeeping, argument errors, and ``examples/t5_generate.py --cpu``.

Skips without torch or transformers (CI has neither). The comparison code is the example's (loaded from its path),
so the example is tested too.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cupy_paged_attn.t5 import PagedT5  # noqa: E402  (needs torch)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "t5_generate.py"
NEW_TOKENS = 32


def load_example() -> ModuleType:
    """``examples/t5_generate.py`` as a module: ``build_model``, ``make_batch``, ``compare``, ``LOGIT_ATOL``."""
    spec = importlib.util.spec_from_file_location("t5_generate", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["t5_generate"] = module  # dataclasses look their module up by name
    sys.path.insert(0, str(EXAMPLE.parent))  # its sibling _missing.py
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return module


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Small CPU matrices: torch's threads only add synchronisation (10x slower on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example()


@pytest.fixture(scope="module")
def model(example: ModuleType) -> Any:
    return example.build_model(example.T5_TINY, seed=0, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def batch(example: ModuleType) -> tuple[Any, Any]:
    """Right-padded ``input_ids [4, 50]`` and ``attention_mask``, lengths 7, 19, 33, 50."""
    return example.make_batch(example.LENGTHS, example.T5_TINY["vocab_size"], seed=1, device="cpu")


def hf_generate(model: Any, input_ids: Any, attention_mask: Any, max_new_tokens: int = NEW_TOKENS) -> Any:
    """transformers' greedy tokens ``[num_seqs, n]``, decoder start token dropped."""
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, num_beams=1,
                             max_new_tokens=max_new_tokens)
    return out[:, 1:]


@pytest.mark.parametrize("block_size", [1, 16])
def test_generate_matches_transformers(example: ModuleType, model: Any, batch: tuple[Any, Any],
                                       block_size: int) -> None:
    c = example.compare(model, *batch, NEW_TOKENS, block_size=block_size)
    assert c.hf_tokens.shape == (4, NEW_TOKENS)  # no early EOS with this seed: every step is compared
    assert c.tokens_equal, f"ours {c.our_tokens.tolist()}\nHF {c.hf_tokens.tolist()}"
    assert c.max_logit_diff <= example.LOGIT_ATOL["cpu", "float32"], c
    assert min(len(set(row.tolist())) for row in c.hf_tokens) > 5  # greedy output that is not a single token


def test_ragged_and_left_padded_inputs(model: Any, batch: tuple[Any, Any]) -> None:
    """No padding at all, and left padding, give transformers' right-padded tokens."""
    input_ids, mask = batch
    expected = hf_generate(model, input_ids, mask)
    paged = PagedT5(model, num_blocks=64, block_size=4)
    ragged = [ids[m.bool()] for ids, m in zip(input_ids, mask, strict=True)]
    assert torch.equal(paged.generate(ragged, max_new_tokens=NEW_TOKENS).tokens, expected)
    shift = mask.shape[1] - mask.sum(1, keepdim=True)  # move each row's tokens to the right end
    index = (torch.arange(mask.shape[1]) - shift) % mask.shape[1]
    left_ids, left_mask = input_ids.gather(1, index), mask.gather(1, index)
    assert bool((left_mask[:, -1] == 1).all()) and bool((left_mask[0, :-7] == 0).all())
    assert torch.equal(paged.generate(left_ids, left_mask, max_new_tokens=NEW_TOKENS).tokens, expected)
    assert torch.equal(hf_generate(model, left_ids, left_mask), expected)  # T5 is padding-side agnostic


def test_eos_ends_sequences_like_transformers(model: Any, batch: tuple[Any, Any]) -> None:
    """A sequence that emits EOS continues with padding; generation stops when every sequence has."""
    input_ids, mask = batch
    free_run = hf_generate(model, input_ids, mask)
    eos_model = copy.deepcopy(model)
    eos_model.generation_config.eos_token_id = int(free_run[0, 5])  # sequence 0 ends at step 5 at the latest
    expected = hf_generate(eos_model, input_ids, mask)
    assert bool((expected == eos_model.generation_config.pad_token_id).any())  # somebody finished early
    result = PagedT5(eos_model, num_blocks=64).generate(input_ids, mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(result.tokens, expected)
    assert result.logits.shape == (*expected.shape, eos_model.config.vocab_size)


def test_score_is_generate_teacher_forced(model: Any, batch: tuple[Any, Any]) -> None:
    paged = PagedT5(model, num_blocks=64)
    result = paged.generate(*batch, max_new_tokens=8)
    assert torch.equal(paged.score(*batch, result.tokens), result.logits)


def test_pages_run_out_and_come_back(model: Any, batch: tuple[Any, Any]) -> None:
    input_ids, mask = batch
    paged = PagedT5(model, num_blocks=4, block_size=16)
    with pytest.raises(RuntimeError, match=r"source pages: out of pages: 10 needed, 4 free"):
        paged.generate(input_ids, mask, max_new_tokens=4)  # 1 + 2 + 3 + 4 pages of inputs
    long_input = [input_ids[3, :40]]  # 3 source pages; 70 new tokens need 5 target pages
    with pytest.raises(RuntimeError, match=r"target pages: out of pages: 1 needed, 0 free"):
        paged.generate(long_input, max_new_tokens=70)
    expected = hf_generate(model, input_ids[3:, :40], mask[3:, :40])
    assert torch.equal(paged.generate(long_input, max_new_tokens=NEW_TOKENS).tokens, expected)  # all pages back


def test_errors(model: Any, batch: tuple[Any, Any]) -> None:
    input_ids, mask = batch
    paged = PagedT5(model, num_blocks=64)
    holes = mask.clone()
    holes[1, 3] = 0
    with pytest.raises(ValueError, match=r"attention_mask: row 1 is not one contiguous run of ones"):
        paged.generate(input_ids, holes)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(4, 50\)"):
        paged.generate(input_ids, mask[:, :10])
    with pytest.raises(ValueError, match=r"attention_mask: only with a padded input_ids"):
        paged.generate(list(input_ids), mask)
    with pytest.raises(ValueError, match=r"input_ids: expected at least one sequence of >= 1 token each"):
        paged.generate([input_ids[0], input_ids[0, :0]])
    with pytest.raises(ValueError, match=r"input_ids\[0\]: expected a 1-D tensor"):
        paged.generate([input_ids])
    with pytest.raises(ValueError, match=r"max_new_tokens: expected an int >= 1, got 0"):
        paged.generate(input_ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"block_size: expected a power of two from 1 to 256, got 12"):
        PagedT5(model, block_size=12)
    with pytest.raises(TypeError, match=r"model: expected a transformers T5ForConditionalGeneration"):
        PagedT5(torch.nn.Linear(2, 2))
    model.train()
    try:
        with pytest.raises(ValueError, match=r"model: expected eval mode"):
            PagedT5(model)
    finally:
        model.eval()


def test_example_runs_on_cpu() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(EXAMPLE), "--cpu"], capture_output=True, text=True, env=env,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tokens identical to transformers: True" in run.stdout
    assert run.stdout.rstrip().endswith("OK"), run.stdout
