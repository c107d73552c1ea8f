"""Shared fixtures: a fresh random generator per test, the choice of the single-pass or split-K path, and the
`gpu` marker's clean skip without a GPU."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

# JAX preallocates 75 % of the GPU when it starts: with the GPU tests spread over workers (pytest -n 8), the first
# worker to import JAX would leave the others out of memory. Set before any test module imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return 0


GPU_COUNT = _gpu_count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_COUNT:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh data for every test; the seed is printed on failure through the test id."""
    seed = np.random.SeedSequence().entropy % 2**32
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def tune() -> Iterator[Callable[..., object]]:
    """``tune(**switches)``: set :mod:`cupy_paged_attn.tuning` switches for the rest of the test (restored after it;
    later calls add to earlier ones)."""
    from cupy_paged_attn import tuning

    with contextlib.ExitStack() as stack:
        yield lambda **switches: stack.enter_context(tuning.override(**switches))


@pytest.fixture(params=["single-pass", "split-k"])
def split(request: pytest.FixtureRequest, tune: Callable[..., object]) -> str:
    """Force one path of decode and prefill: a 1-SM GPU never splits the keys; a huge one always does (as far as
    the keys allow)."""
    tune(num_sms=1 if request.param == "single-pass" else 10**6)
    return request.param
