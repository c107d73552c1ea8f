"""Compile and load times of kernel specialisations, each measured in fresh processes (targets: a first compile
within 5 s; import plus a cached load within 100 ms).

For each specialisation, with a new, empty CuPy kernel cache (``CUPY_CACHE_DIR``):

- cold: a fresh process imports CuPy (and with it NumPy), then ``cupy_paged_attn``, creates the CUDA context, then
  fetches the kernel: NVRTC compile, CuPy's disk-cache write, module load;
- cached: a second fresh process does the same and finds the kernel in CuPy's disk cache.

Each child times each step with ``time.perf_counter``. The library's own cost is its import after the array
framework's (a caller with CuPy, PyTorch or JAX arrays has NumPy loaded already) plus the fetch; the framework's
import and the context creation (CuPy's first allocation) are shown apart.

The children import the library as an installed wheel does, from bytecode: pip compiles a wheel's modules at install
time, but a source checkout run with ``PYTHONDONTWRITEBYTECODE`` set compiles every module again in every process,
about 30-40 ms. So the children write and read their bytecode in a temporary
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
from collections.abc import Sequence
from typing import Any

#: The specialisations timed: one of each kernel family and tiling, at head size 128.
SPECS = ("decode-simt", "decode-mma", "prefill-mma", "prefill-wgmma", "prefill-simt", "cache-write")


def spec_of(name: str) -> Any:
    """The named specialisation (``cupy_paged_attn._specs``)."""
    from cupy_paged_attn import _specs

    specs = {
        "decode-simt": _specs.DecodeSimtSpec("bf16", 128, "nhd", 1, "dense"),
        "decode-mma": _specs.DecodeMmaSpec("bf16", 128, "nhd", "dense-rows", 8),
        "prefill-mma": _specs.PrefillSpec("bf16", 128, "nhd", "t5"),
        "prefill-wgmma": _specs.PrefillSpec("bf16", 128, "nhd", "t5", wgmma=True),  # sm_90a: an H100 / H200
        "prefill-simt": _specs.PrefillSpec("f32", 128, "nhd", "none"),
        "cache-write": _specs.CacheWriteSpec("bf16", "nhd", "i32"),
    }
    if name not in specs:
        raise ValueError(f"spec: expected one of {', '.join(SPECS)}, got {name!r}")
    return specs[name]


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
    from cupy_paged_attn import _compile

    spec = spec_of(name)
    _compile.kernels(spec, device)
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
        spec = spec_of(name)
        start = time.perf_counter()
        _compile.compile_offline(spec.source, list(spec.name_expressions()), spec.offline_arch(arch) or "sm_90a")
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
