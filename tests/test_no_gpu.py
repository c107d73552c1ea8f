"""CPU: the package imports and the NumPy path works without CuPy; compile failures raise RuntimeError with the
NVRTC log, or with the extra to install when NVRTC or the CUDA headers are missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cupy_paged_attn import _compile, _specs

ROOT = Path(__file__).resolve().parent
INSTALL_HINT = r"pip install 'cupy-paged-attn\[cuda13\]'"


def test_numpy_path_needs_no_cupy():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None  # any import of cupy now fails
        import numpy as np
        sys.path.insert(0, sys.argv[1])
        from helpers import dense_attention, make_problem
        import cupy_paged_attn as cpa
        p = make_problem(np.random.default_rng(1), [5, 17, 0], bias="dense", alibi=True)
        out = cpa.paged_attention(*p.args(), **p.kwargs())
        assert np.abs(out - dense_attention(p)).max() < 1e-5
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


class _FakeDevice:
    def __init__(self, device_id: int) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(
    ("failure", "match"),
    [
        ("compile: cuda_bf16.h: catastrophic error: cannot open source file", INSTALL_HINT),
        ("compile: kernel.cu(3): error: identifier \"oops\" is undefined", r"NVRTC compilation failed:\n.*oops"),
        ("load: libnvrtc.so.13: cannot open shared object file", INSTALL_HINT),
    ],
)
def test_compile_failures_are_explained(monkeypatch, failure, match):
    import cupy
    from cupy.cuda.compiler import CompileException

    kind, message = failure.split(": ", 1)

    class FakeModule:
        def __init__(self, **kwargs: object) -> None:
            pass

        def compile(self) -> None:
            if kind == "compile":
                raise CompileException(message, "source", "name", (), "nvrtc")
            raise OSError(message)

    monkeypatch.setattr(cupy.cuda, "Device", _FakeDevice)
    monkeypatch.setattr(cupy, "RawModule", FakeModule)
    with pytest.raises(RuntimeError, match=match):
        _compile._module(_specs.CacheWriteSpec("f32", "nhd", "i32"), 1000 + len(message))  # (not cached before)
