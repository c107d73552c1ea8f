"""Kernel sources and the compiled-kernel cache: a specialisation (``_specs``) in, its compiled functions out.

Every kernel family is one ``.cu`` file of ``kernels_cu/``, compiled by NVRTC through ``cupy.RawModule`` with the
specialisation's name expressions. Compiled modules live in :func:`functools.cache` here and in CuPy's own disk
cache (``CUPY_CACHE_DIR``), which keys on the source text: headers are inlined into it, so an edited header
recompiles.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from pathlib import Path
from typing import Any

from ._specs import COMPILE_OPTIONS, KernelSpec

_log = logging.getLogger("cupy_paged_attn")


def kernel_dir() -> Path:
    """Folder of the ``.cu`` sources: inside the installed package, else ``kernels_cu/`` of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise RuntimeError(f"cupy_paged_attn: kernel sources not found next to {here} (broken installation)")


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


@functools.cache
def kernel_source(filename: str) -> str:
    """The text of one kernel family with its ``#include "..."`` headers inlined, each once, where first included.

    CuPy's disk cache keys on the source text only, so headers are pasted in: an edit to a header then recompiles
    instead of silently reusing a stale cubin.
    """
    return inline_headers((kernel_dir() / filename).read_text())


def inline_headers(text: str) -> str:
    """``text`` with its ``#include "..."`` lines replaced by those headers of ``kernels_cu/`` (recursively), each
    header once."""
    folder = kernel_dir()
    seen: set[str] = set()

    def inline(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _INCLUDE.sub(inline, (folder / name).read_text().replace("#pragma once", ""))

    return _INCLUDE.sub(inline, text)


_NVRTC_HINT = (
    "NVRTC or the CUDA headers were not found; install the extra matching your CUDA driver: "
    "pip install 'cupy-paged-attn[cuda13]' (or [cuda12])"
)
# What a missing NVRTC library or missing CUDA headers look like in CuPy's and NVRTC's messages.
_MISSING_TOOLKIT = re.compile(r"cuda_fp16\.h|cuda_bf16\.h|libnvrtc|nvrtc64|CUDA path could not be detected", re.I)


def _compile_error(key: str, log: str) -> RuntimeError:
    """The error for a failed compile: the hint to install NVRTC / the headers if they are missing, else the log."""
    if _MISSING_TOOLKIT.search(log):
        return RuntimeError(f"{key}: {_NVRTC_HINT}\n{log}")
    return RuntimeError(f"{key}: NVRTC compilation failed:\n{log}")


@functools.cache
def _module(spec: KernelSpec, device_id: int) -> Any:
    """The compiled module of ``spec`` on ``device_id``."""
    import cupy

    names = spec.name_expressions()
    _log.info("compiling %s for device %d", spec.key, device_id)
    try:
        with cupy.cuda.Device(device_id):
            module = cupy.RawModule(code=kernel_source(spec.source), options=spec.options, name_expressions=names)
            module.compile()
    except cupy.cuda.compiler.CompileException as exc:
        raise _compile_error(spec.key, exc.get_message()) from exc
    except OSError as exc:  # the NVRTC library could not be loaded
        raise _compile_error(spec.key, str(exc)) from exc
    return module


_SMEM_ATTRIBUTE_LOCK = threading.Lock()


@functools.cache
def _functions(spec: KernelSpec, device_id: int) -> tuple[Any, ...]:
    module = _module(spec, device_id)
    return tuple(module.get_function(name) for name in spec.name_expressions())


def kernels(spec: KernelSpec, device_id: int, dynamic_smem: int | None = None) -> tuple[Any, ...]:
    """The compiled functions of ``spec`` on ``device_id``, in the order of its name expressions; the first is
    allowed at least ``dynamic_smem`` bytes of dynamic shared memory (default: the spec's own; past the default 48
    KB, CUDA wants it said; a split SIMT decode asks for more than the kernel needs, to cap its CTAs per SM)."""
    functions = _functions(spec, device_id)
    smem = spec.smem_bytes if dynamic_smem is None else dynamic_smem
    if smem and functions[0].max_dynamic_shared_size_bytes < smem:
        with _SMEM_ATTRIBUTE_LOCK:  # plans of two threads must not lower each other's limit
            if functions[0].max_dynamic_shared_size_bytes < smem:
                functions[0].max_dynamic_shared_size_bytes = smem
    return functions


def compile_offline(filename: str, names: list[str], arch: str, extra: str = "", *,
                    optimise: bool = True) -> tuple[bytes, dict[str, str]]:
    """Compile ``names`` of one kernel family for ``arch`` (e.g. ``"sm_90"``, ``"sm_90a"``) with no GPU present.

    Returns the binary and each name expression's lowered (mangled) symbol. ``extra`` is appended to the source
    (tests add ``static_assert``s comparing the kernels' constants with their host-side mirrors).

    ``optimise=True`` builds the cubin the library would load: the front end, the optimiser and ptxas. ``False``
    stops at unoptimised PTX for ``arch``'s virtual architecture (``-G``): every template instantiated,
    ``static_assert`` checked and kernel lowered, about a tenth of the time, but no ptxas checks (inline assembly
    against the target, shared memory per kernel).

    Uses CuPy's private NVRTC bindings (``RawModule.compile`` needs a device); kept in this one function so a
    CuPy upgrade that moves them breaks one place. Raises RuntimeError with the NVRTC log on failure.
    """
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy_backends.cuda.libs import nvrtc

    target = (f"-arch={arch}",) if optimise else (f"-arch={arch.replace('sm_', 'compute_')}", "-G")
    opts = assemble_cupy_compiler_options((*COMPILE_OPTIONS, *target))
    program = nvrtc.createProgram(kernel_source(filename) + extra, filename, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, list(opts))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"{filename} ({arch}): NVRTC compilation failed:\n{log}") from exc
        binary = nvrtc.getCUBIN(program) if optimise else nvrtc.getPTX(program)
        return binary, {name: nvrtc.getLoweredName(program, name) for name in names}
    finally:
        nvrtc.destroyProgram(program)
