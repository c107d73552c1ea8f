"""Compile and load times of kernel specialisations, each measured in fresh processes (issue 4: a first compile
within 5 s; import plus a cached load within 100 ms).

For each specialisation, with a new, empty CuPy kernel cache (``CUPY_CACHE_DIR``):

- cold: a fresh process imports CuPy (and with it NumPy), then ``cupy_paged_attn``, creates the CUDA context, then
  fetches the kernel: NVRTC compile, CuPy's disk-cache write, module load;
- cached: a second fresh process does the same and finds the kernel in CuPy's disk cache.

Each child times each step with ``time.perf_counter``. The library's own cost is its import after the array
framework's (a caller with CuPy, PyTorch or JAX arrays has NumPy loaded already) plus the fetch; the framework's
import and the context creation (CuPy's first allocation) are shown apart.

The children import the library as an installed wheel does, from bytecode: pip compiles a wheel's modules at install
time, but a source checkout run with ``PYTHONDONTWRITEBYTECODE`` set (as on the GPU machines lent here) compiles
every module again in every process, about 30-40 ms. So the children write and read their bytecode in a temporary
``PYTHONPYCACHEPREFIX`` (the cold child writes it); the column "no bytecode" is a third child's import with
``PYTHONDONTWRITEBYTECODE`` set and no bytecode, for comparison.

``--offline ARCH`` times only the NVRTC compile of each specialisation for ARCH (e.g. sm_90), in this process, with
no GPU.

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/compile_time.py``; anywhere: ``... --offline sm_90``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

#: The specialisations timed: one of each kernel family and tiling, at head size 128.
SPECS = ("decode-fp32", "decode-tensor-cores", "prefill", "prefill-hopper", "prefill-fp32", "cache-write")


def spec_of(name: str) -> tuple[Any, str, Callable[[int], Any]]:
    """``(spec, source file, fetch)`` of a named specialisation; ``fetch(device)`` compiles or loads it."""
    from cupy_paged_attn import _compile

    if name == "decode-fp32":
        spec = _compile.DecodeSpec("bf16", 128, "nhd", 1, "dense")
        return spec, "paged_decode.cu", lambda dev: _compile.get_decode_kernels(spec, dev, spec.smem_bytes)
    if name == "decode-tensor-cores":
        spec = _compile.PrefillSpec("bf16", 128, "nhd", "dense", _compile.DECODE_ROWS[0])
    elif name == "prefill":
        spec = _compile.PrefillSpec("bf16", 128, "nhd", "t5")
    elif name == "prefill-hopper":  # (sm_90a: an H100 / H200; offline, it compiles for sm_90a whatever ARCH says)
        spec = _compile.PrefillSpec("bf16", 128, "nhd", "t5", wgmma=True)
    elif name == "prefill-fp32":
        spec = _compile.PrefillSpec("f32", 128, "nhd", "none")
    elif name == "cache-write":
        spec = _compile.CacheWriteSpec("bf16", "nhd", "i32")
        return spec, "cache_write.cu", lambda dev: _compile.get_cache_write_kernel(spec, dev)
    else:
        raise ValueError(f"spec: expected one of {', '.join(SPECS)}, got {name!r}")
    return spec, "paged_prefill.cu", lambda dev: _compile.get_prefill_kernels(spec, dev)


def child(name: str, device: int) -> dict[str, float | str]:
    """One fresh process's timings, in seconds: CuPy's import, the library's, the context, the fetch."""
    start = time.perf_counter()
    import cupy

    t0 = time.perf_counter()
    import cupy_paged_attn  # noqa: F401

    t1 = time.perf_counter()
    cupy.cuda.Device(device).use()
    cupy.empty(1, dtype=cupy.float32)  # creates the context
    cupy.cuda.Device(device).synchronize()
    t2 = time.perf_counter()
    spec, _, fetch = spec_of(name)
    fetch(device)
    t3 = time.perf_counter()
    return {"key": spec.key, "framework": t0 - start, "import": t1 - t0, "context": t2 - t1, "fetch": t3 - t2}


def run_child(name: str, device: int, cache_dir: str, pycache: str | None) -> dict[str, Any]:
    """:func:`child` in a new Python process using the CuPy kernel cache ``cache_dir`` and the bytecode cache
    ``pycache`` (None: no bytecode written or read)."""
    env = {**os.environ, "CUPY_CACHE_DIR": cache_dir}
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("PYTHONPYCACHEPREFIX", None)
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    result = subprocess.run([sys.executable, __file__, "--child", name, "--device", str(device)], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: child process failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def offline(names: Sequence[str], arch: str) -> None:
    """Print the NVRTC compile time of each specialisation for ``arch`` (no GPU needed)."""
    from cupy_paged_attn import _compile

    print(f"NVRTC compile for {arch}, in this process (no GPU):")
    for name in names:
        spec, filename, _ = spec_of(name)
        start = time.perf_counter()
        target = spec.offline_arch(arch) if isinstance(spec, _compile.PrefillSpec) else arch
        _compile.compile_offline(filename, list(spec.name_expressions()), target or "sm_90a")
        print(f"{name:20s} {spec.key:45s} {time.perf_counter() - start:6.2f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default=",".join(SPECS), help=f"comma-separated subset of {','.join(SPECS)}")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--offline", metavar="ARCH", help="time the NVRTC compile for ARCH only, with no GPU")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.device)))
        return 0
    names = [n for n in args.specs.split(",") if n]
    unknown = sorted(set(names) - set(SPECS))
    if unknown or not names:
        parser.error(f"--specs: expected a comma-separated subset of {','.join(SPECS)}, got {args.specs!r}")
    if args.offline:
        offline(names, args.offline)
        return 0
    print(f"PYTHONDONTWRITEBYTECODE in this environment: {os.environ.get('PYTHONDONTWRITEBYTECODE', '(unset)')}")
    print("spec                 key                                           cupy import  our import   context"
          "  first fetch  cached fetch  our import + cached fetch  our import, no bytecode")
    for name in names:
        with tempfile.TemporaryDirectory() as cache_dir, tempfile.TemporaryDirectory() as pycache:
            cold = run_child(name, args.device, cache_dir, pycache)
            warm = run_child(name, args.device, cache_dir, pycache)
            no_bytecode = run_child(name, args.device, cache_dir, None)
        total_ms = (warm["import"] + warm["fetch"]) * 1e3
        print(f"{name:20s} {cold['key']:45s} {warm['framework'] * 1e3:8.0f} ms {warm['import'] * 1e3:7.0f} ms "
              f"{warm['context'] * 1e3:6.0f} ms {cold['fetch']:9.2f} s {warm['fetch'] * 1e3:9.1f} ms "
              f"{total_ms:22.0f} ms {no_bytecode['import'] * 1e3:20.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
