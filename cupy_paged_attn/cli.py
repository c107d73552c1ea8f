"""``python -m cupy_paged_attn`` (or ``cupy-paged-attn``): what this machine has, a self-test, a short benchmark.

::

    python -m cupy_paged_attn info [--decode B,HQ/HKV,D,L] [--prefill B,HQ/HKV,D,L[,QLEN]] [--dtype bf16] [--bias t5]
    python -m cupy_paged_attn check [--quick]
    python -m cupy_paged_attn bench [--out DIR]

``info`` prints versions, the GPU, NVRTC and the kernel cache, and for a shape the kernel, grid and split a call would
run (planned for this GPU, or for an H200 where there is none). ``check`` runs decode, prefill and the cache write on
fresh random data against the float64 reference (on the GPU: every dtype, several head sizes and bias kinds, the
single-pass and split-K paths; without one: the NumPy path against an independent dense attention). ``bench`` times
a few decode and prefill cases against their floors, measured on the same GPU (memory copy bandwidth, float16 matrix
throughput), and writes ``bench.md`` and ``bench.png`` (the plot needs matplotlib: the ``[bench]`` extra).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _specs, planning, tuning

__all__ = ["main"]


# ---------------------------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------------------------
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpu() -> tuple[int, str] | None:
    """``(device id, description)`` of the current CUDA device, or None without CuPy or a GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        device = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        cc = device.compute_capability
        return device.id, f"{name}, compute capability {cc[0]}.{cc[1:]}, {props['multiProcessorCount']} SMs"
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return None


def _nvrtc() -> str:
    try:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return f"{major}.{minor}"
    except Exception as exc:  # the library or its Python bindings missing
        return f"not found ({type(exc).__name__}: install the [cuda13] or [cuda12] extra)"


def _kernel_cache() -> str:
    return os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


def _shape(text: str, name: str) -> tuple[int, int, int, int, int, int | None]:
    """``B,HQ/HKV,D,L[,QLEN]`` -> (B, HQ, HKV, D, L, QLEN or None)."""
    try:
        parts = text.split(",")
        heads = parts[1].split("/")
        q_len = int(parts[4]) if len(parts) == 5 else None
        if len(parts) not in (4, 5) or len(heads) not in (1, 2):
            raise ValueError
        hq, hkv = int(heads[0]), int(heads[-1])
        values = (int(parts[0]), hq, hkv, int(parts[2]), int(parts[3]), q_len)
        if min(v for v in values if v is not None) < 1 or hq % hkv:
            raise ValueError
        return values
    except (ValueError, IndexError):
        raise SystemExit(f"{name}: expected B,HQ/HKV,D,L (e.g. 64,32/8,128,4096), positive, HKV dividing HQ; "
                         f"got {text!r}") from None


def info(args: argparse.Namespace) -> int:
    import cupy_paged_attn

    print(f"cupy-paged-attn {cupy_paged_attn.__version__} ({os.path.dirname(cupy_paged_attn.__file__)})")
    print(f"python {platform.python_version()}, numpy {np.__version__}, cupy {_version('cupy-cuda13x')} (cuda13) / "
          f"{_version('cupy-cuda12x')} (cuda12), ml_dtypes {_version('ml_dtypes')}")
    print(f"torch {_version('torch')}, jax {_version('jax')}, transformers {_version('transformers')}")
    gpu = _gpu()
    print(f"GPU: {gpu[1] if gpu else 'none found (the NumPy path runs on the CPU)'}")
    print(f"NVRTC: {_nvrtc()}")
    print(f"kernel cache (CuPy's): {_kernel_cache()}")
    print(f"tuning: {tuning.current()}")
    if gpu is not None:
        from . import _device

        device, where = _device.query(gpu[0]), "this GPU"
    else:
        device, where = planning.Device.h200(), "an H200 (no GPU here)"
    if args.decode:
        b, hq, hkv, d, length, _ = _shape(args.decode, "--decode")
        shape = planning.DecodeShape(b, hq, hkv, d, length, args.dtype, args.layout, args.bias, bias_dtype=args.dtype,
                                     t5_max_distance=128)
        _check_head(d)
        launch = planning.plan_decode(shape, device)
        combine = "in thread block clusters" if launch.cluster else "by the combine kernel" if launch.combines else ""
        print(f"decode B{b} H{hq}/{hkv} d{d} L{length} {args.dtype} bias={args.bias}, planned for {where}:")
        print(f"  kernel {launch.spec.key} ({_specs_family(launch.spec)})")
        print(f"  grid {launch.grid}, {launch.threads} threads, {launch.shared_mem} B of dynamic shared memory")
        print(f"  keys in {launch.num_parts} partition(s) of {launch.tokens_per_part}" +
              (f", combined {combine}" if combine else "") +
              (", sequences longest first" if launch.longest_first else "") +
              (", programmatic dependent launch" if launch.dependent else ""))
    if args.prefill:
        b, hq, hkv, d, length, q_len = _shape(args.prefill, "--prefill")
        shape = planning.PrefillShape(b, hq, hkv, d, length, args.dtype, args.layout, args.bias,
                                      bias_dtype=args.dtype, t5_max_distance=128, total_q=b * (q_len or length))
        _check_head(d)
        launch = planning.plan_prefill(shape, device)
        print(f"prefill B{b} H{hq}/{hkv} d{d} L{length} q_len {q_len or length} {args.dtype} bias={args.bias}, "
              f"planned for {where}:")
        print(f"  kernel {launch.spec.key} ({_specs_family(launch.spec)})")
        print(f"  grid ({launch.num_tiles}, {hkv}, {launch.num_parts}), {launch.spec.threads} threads, "
              f"{launch.spec.smem_bytes} B of dynamic shared memory, {launch.rows} packed rows per CTA")
        print(f"  keys in {launch.num_parts} partition(s) of {launch.tokens_per_part}")
    return 0


def _check_head(head_size: int) -> None:
    if head_size not in _specs.HEAD_SIZES:
        raise SystemExit(f"head size {head_size} is not supported; supported: {_specs.HEAD_SIZES}")


def _specs_family(spec: Any) -> str:
    return {"decode_simt.cu": "the SIMT decode: float32 arithmetic on the CUDA cores",
            "decode_mma.cu": "the tensor-core decode (mma.sync)",
            "prefill.cu": "the mma.sync prefill" if spec.dtype != "f32" else "the float32 prefill",
            "prefill_wgmma.cu": "the Hopper prefill (wgmma)"}[spec.source]


# ---------------------------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------------------------
_TOLERANCE = {"f32": 2e-5, "f16": 4e-3, "bf16": 3e-2}  # max |out - ref| / max |ref| (bf16: 8 bits of mantissa)


def _progress(total: int, desc: str) -> Any:
    """A tqdm bar on stderr (tqdm is a dependency)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="case", file=sys.stderr, dynamic_ncols=True)


def _random_problem(rng: np.random.Generator, lens: list[int], hq: int, hkv: int, d: int, block: int,
                    dtype: Any) -> dict[str, Any]:
    """A paged decode problem as NumPy arrays: pages scattered, unused slots NaN, and each sequence's dense K/V."""
    num_blocks = sum(-(-n // block) for n in lens) + 2
    k_cache = np.full((num_blocks, block, hkv, d), np.nan, np.float32)
    v_cache = np.full_like(k_cache, np.nan)
    tables = np.zeros((len(lens), max(1, -(-max(lens) // block))), np.int32)
    free = list(rng.permutation(num_blocks))
    dense = []
    for s, n in enumerate(lens):
        k = rng.standard_normal((n, hkv, d)).astype(dtype)
        v = rng.standard_normal((n, hkv, d)).astype(dtype)
        dense.append((k.astype(np.float64), v.astype(np.float64)))
        for p in range(-(-n // block)):
            blk = tables[s, p] = free.pop()
            rows = slice(p * block, min(n, (p + 1) * block))
            k_cache[blk, : rows.stop - rows.start], v_cache[blk, : rows.stop - rows.start] = k[rows], v[rows]
    return {"query": rng.standard_normal((len(lens), hq, d)).astype(dtype), "key_cache": k_cache.astype(dtype),
            "value_cache": v_cache.astype(dtype), "block_tables": tables, "seq_lens": np.array(lens, np.int32),
            "dense": dense}


def _dense_attention(p: dict[str, Any], bias: np.ndarray | None) -> np.ndarray:
    """Decode attention from the dense per-sequence K/V, written apart from the library's reference."""
    q = p["query"].astype(np.float64)
    _, hq, d = q.shape
    out = np.zeros_like(q)
    for s, (k, v) in enumerate(p["dense"]):
        if len(k) == 0:
            continue
        group = hq // k.shape[1]
        for h in range(hq):
            logits = (k[:, h // group] @ q[s, h]) / np.sqrt(d)
            if bias is not None:
                logits = logits + bias[s, h, : len(k)].astype(np.float64)
            w = np.exp(logits - logits.max())
            out[s, h] = (w / w.sum()) @ v[:, h // group]
    return out


def _error(out: Any, ref: np.ndarray) -> float:
    from .reference import to_numpy

    got = to_numpy(out).astype(np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def check(args: argparse.Namespace) -> int:
    import ml_dtypes

    import cupy_paged_attn as cpa

    dtypes = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
    rng = np.random.default_rng()
    failures: list[str] = []
    gpu = _gpu()
    if gpu is None:
        print("no GPU: checking the NumPy path against an independent dense attention", file=sys.stderr)
        cases = [(dt, d, hq, hkv, bias) for dt in ("f32", "bf16") for d in (64, 128) for hq, hkv in ((4, 4), (8, 2))
                 for bias in ("none", "dense")]
        with _progress(len(cases), "check (NumPy)") as bar:
            for dt, d, hq, hkv, bias_kind in cases:
                p = _random_problem(rng, [1, 37, 300], hq, hkv, d, 16, dtypes[dt])
                bias = rng.standard_normal((3, hq, 300)).astype(np.float32) if bias_kind == "dense" else None
                out = cpa.paged_attention(*(p[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                                           "seq_lens")), attn_bias=bias)
                err = _error(out, _dense_attention(p, bias))
                if not err <= _TOLERANCE[dt]:
                    failures.append(f"numpy {dt} d{d} {hq}/{hkv} bias={bias_kind}: error {err:.2e}")
                bar.update()
    else:
        failures = _check_gpu(rng, dtypes, args.quick)
    for failure in failures:
        print(f"FAILED {failure}")
    print("check: " + (f"{len(failures)} failed" if failures else "every case matches the float64 reference"))
    return 1 if failures else 0


def _check_gpu(rng: np.random.Generator, dtypes: dict[str, Any], quick: bool) -> list[str]:
    """Decode (both kernels, every bias kind, single pass and split), prefill and the cache write on the GPU, each
    against the float64 reference, the output poisoned with NaN before the launch."""
    import cupy

    import cupy_paged_attn as cpa
    from cupy_paged_attn import reference

    head_sizes = (64, 128) if quick else (64, 96, 128, 256)
    failures = []
    decode_cases = [(dt, d, heads, bias, sms) for dt in ("f32", "f16", "bf16") for d in head_sizes
                    for heads in ((8, 8), (16, 2)) for bias in ("none", "dense", "ragged", "t5") for sms in (1, None)]
    prefill_cases = [(dt, d, bias, causal) for dt in ("f32", "bf16") for d in head_sizes
                     for bias in ("none", "dense", "t5") for causal in (True, False)]
    with _progress(len(decode_cases) + len(prefill_cases) + 1, "check (GPU)") as bar:
        for dt, d, (hq, hkv), bias_kind, sms in decode_cases:
            p = _random_problem(rng, [1, 0, 37, 700], hq, hkv, d, 16, dtypes[dt])
            args = [cupy.asarray(p[k]) for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
            host_bias, bias = None, None
            if bias_kind == "dense":
                host_bias = rng.standard_normal((4, hq, 700)).astype(np.float32)
                bias = cupy.asarray(host_bias)
            elif bias_kind == "ragged":
                host_bias = cpa.RaggedBias(rng.standard_normal((738, hq)).astype(dtypes[dt]),
                                           np.array([0, 1, 1, 38, 738], np.int32))
                bias = cpa.RaggedBias(cupy.asarray(host_bias.values), cupy.asarray(host_bias.offsets))
            elif bias_kind == "t5":
                table = rng.standard_normal((32, hq)).astype(np.float32)
                host_bias = cpa.RelativePositionBias(table)
                bias = cpa.RelativePositionBias(cupy.asarray(table))
            out = cupy.full(args[0].shape, np.nan, args[0].dtype)
            with tuning.override(num_sms=sms or 10**6):
                cpa.paged_attention(*args, attn_bias=bias, out=out)
            ref = reference.paged_attention_ref(*(p[k] for k in ("query", "key_cache", "value_cache",
                                                                 "block_tables", "seq_lens")), attn_bias=host_bias)
            err = _error(out, ref)
            if not err <= _TOLERANCE[dt]:
                failures.append(f"decode {dt} d{d} {hq}/{hkv} bias={bias_kind} "
                                f"{'single pass' if sms else 'split'}: error {err:.2e}")
            bar.update()
        for dt, d, bias_kind, causal in prefill_cases:
            failures += _check_prefill(rng, dtypes[dt], dt, d, bias_kind, causal)
            bar.update()
        failures += _check_cache_write(rng)
        bar.update()
    return failures


def _check_prefill(rng: np.random.Generator, dtype: Any, dt: str, d: int, bias_kind: str, causal: bool) -> list[str]:
    import cupy

    import cupy_paged_attn as cpa
    from cupy_paged_attn import reference

    lens, q_lens = [200, 33, 5], [200, 7, 5]
    p = _random_problem(rng, lens, 8, 2, d, 16, dtype)
    query = rng.standard_normal((sum(q_lens), 8, d)).astype(dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    host_bias = bias = None
    if bias_kind == "dense":
        host_bias = rng.standard_normal((3, 8, 200, 200)).astype(np.float32)
        bias = cupy.asarray(host_bias)
    elif bias_kind == "t5":
        table = rng.standard_normal((32, 8)).astype(np.float32)
        host_bias = cpa.RelativePositionBias(table, bidirectional=not causal)
        bias = cpa.RelativePositionBias(cupy.asarray(table), bidirectional=not causal)
    host = [query, *(p[k] for k in ("key_cache", "value_cache", "block_tables", "seq_lens")), starts]
    out = cupy.full(query.shape, np.nan, query.dtype)
    cpa.paged_prefill_attention(*(cupy.asarray(a) for a in host), causal=causal, attn_bias=bias, out=out)
    ref = reference.paged_prefill_attention_ref(*host, causal=causal, attn_bias=host_bias)
    err = _error(out, ref)
    return [] if err <= _TOLERANCE[dt] else [f"prefill {dt} d{d} bias={bias_kind} causal={causal}: error {err:.2e}"]


def _check_cache_write(rng: np.random.Generator) -> list[str]:
    import cupy

    import cupy_paged_attn as cpa
    from cupy_paged_attn import reference

    key, value = (rng.standard_normal((5, 2, 64)).astype(np.float16) for _ in range(2))
    caches = [rng.standard_normal((4, 16, 2, 64)).astype(np.float16) for _ in range(2)]
    slots = np.array([3, 17, -1, 63, 40], np.int64)
    expected = reference.reshape_and_cache_ref(key, value, *(c.copy() for c in caches), slots)
    device = [cupy.asarray(c) for c in caches]
    cpa.reshape_and_cache(cupy.asarray(key), cupy.asarray(value), *device, cupy.asarray(slots))
    same = all(np.array_equal(d.get(), e) for d, e in zip(device, expected, strict=True))
    return [] if same else ["cache write: the written caches differ from the reference's"]


# ---------------------------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------------------------
DECODE_CASES = [(64, 16, 16, 64, 2048), (32, 32, 8, 128, 8192), (1, 16, 16, 64, 1024)]  # B, Hq, Hkv, d, L
PREFILL_CASES = [(4, 32, 128, 4096), (8, 16, 64, 2048)]  # B, H, d, L (causal)


def _time_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median over ``reps`` of one call's GPU time (CUDA events), with L2 flushed before each."""
    import cupy

    flush = cupy.empty(256 * 2**20, cupy.uint8)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.fill(1)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def _copy_rate() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (2 GiB each way)."""
    import cupy

    src = cupy.empty(2**31, cupy.uint8)
    dst = cupy.empty_like(src)
    return 2 * src.nbytes / (_time_ms(lambda: dst.__setitem__(Ellipsis, src), 10) * 1e-3)


def _matmul_rate(rng: np.random.Generator) -> float:
    """float16 matrix-multiply throughput (8192^3 through cuBLAS), FLOP/s."""
    import cupy

    a = cupy.asarray(rng.standard_normal((8192, 8192)), cupy.float16)
    return 2 * 8192**3 / (_time_ms(lambda: a @ a, 10) * 1e-3)


def _paged(rng: np.random.Generator, b: int, hkv: int, d: int, length: int) -> tuple[Any, Any, Any, Any]:
    """Random float16 caches of b sequences of ``length`` keys (pages scattered), their block table and lengths."""
    import cupy

    pages = b * length // 16
    k = cupy.asarray(rng.standard_normal((pages, 16, hkv, d), np.float32), cupy.float16)
    v = cupy.asarray(rng.standard_normal((pages, 16, hkv, d), np.float32), cupy.float16)
    tables = cupy.asarray(rng.permutation(pages).astype(np.int32).reshape(b, -1))
    return k, v, tables, cupy.full(b, length, cupy.int32)


def _bench_decode(rng: np.random.Generator, case: tuple[int, ...], copy_bps: float, reps: int,
                  bar: Any) -> list[tuple[str, str, float, float, str]]:
    import cupy

    import cupy_paged_attn as cpa

    b, hq, hkv, d, length = case
    k, v, tables, lens = _paged(rng, b, hkv, d, length)
    q = cupy.asarray(rng.standard_normal((b, hq, d), np.float32), cupy.float16)
    dense = cupy.asarray(rng.standard_normal((b, hq, length), np.float32), cupy.float16)
    t5 = cpa.RelativePositionBias(cupy.asarray(rng.standard_normal((32, hq), np.float32)))
    out = cupy.empty_like(q)
    rows = []
    for label, bias in (("no bias", None), ("dense bias", dense), ("T5", t5)):
        nbytes = k.nbytes + v.nbytes + (dense.nbytes if bias is dense else 0) + 2 * q.nbytes
        ms = _time_ms(lambda bias=bias: cpa.paged_attention(q, k, v, tables, lens, attn_bias=bias, out=out), reps)
        rows.append((f"decode B{b} H{hq}/{hkv} d{d} L{length}", label, ms, 1e3 * nbytes / copy_bps, "copy"))
        bar.update()
    return rows


def _bench_prefill(rng: np.random.Generator, case: tuple[int, ...], flops: float, reps: int,
                   bar: Any) -> list[tuple[str, str, float, float, str]]:
    import cupy

    import cupy_paged_attn as cpa

    b, h, d, length = case
    k, v, tables, lens = _paged(rng, b, h, d, length)
    q = cupy.asarray(rng.standard_normal((b * length, h, d), np.float32), cupy.float16)
    starts = cupy.arange(0, b * length + 1, length, dtype=cupy.int32)
    t5 = cpa.RelativePositionBias(cupy.asarray(rng.standard_normal((32, h), np.float32)))
    out = cupy.empty_like(q)
    work = 4.0 * b * h * d * length * (length + 1) / 2
    rows = []
    for label, bias in (("no bias", None), ("T5", t5)):
        ms = _time_ms(lambda bias=bias: cpa.paged_prefill_attention(q, k, v, tables, lens, starts, attn_bias=bias,
                                                                    out=out), reps)
        rows.append((f"prefill B{b} H{h} d{d} L{length} causal", label, ms, 1e3 * work / flops, "fp16 matmul"))
        bar.update()
    return rows


def bench(args: argparse.Namespace) -> int:
    gpu = _gpu()
    if gpu is None:
        print("bench: no GPU found; the benchmark times CUDA kernels", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    rows: list[tuple[str, str, float, float, str]] = []  # (case, row, ms, floor ms, unit of the floor)
    with _progress(2 + len(DECODE_CASES) * 3 + len(PREFILL_CASES) * 2, "bench") as bar:
        copy_bps = _copy_rate()
        bar.update()
        flops = _matmul_rate(rng)
        bar.update()
        for case in DECODE_CASES:
            rows += _bench_decode(rng, case, copy_bps, args.reps, bar)
        for case in PREFILL_CASES:
            rows += _bench_prefill(rng, case, flops, args.reps, bar)
    header = (f"{gpu[1]}; copy {copy_bps / 1e9:.0f} GB/s, fp16 matmul {flops / 1e12:.0f} TFLOP/s; "
              f"median of {args.reps}, L2 flushed")
    lines = [header, "", "| case | row | ms | floor ms | % of floor |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {case} | {row} | {ms:.4f} | {floor:.4f} ({unit}) | {100 * floor / ms:.1f} |"
              for case, row, ms, floor, unit in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(table + "\n")
        print(_plot(rows, os.path.join(args.out, "bench.png"), header) or f"wrote {args.out}/bench.md, bench.png")
    return 0


def _plot(rows: list[tuple[str, str, float, float, str]], path: str, title: str) -> str | None:
    """A bar per row of the share of its floor reached; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'cupy-paged-attn[bench]')"
    labels = [f"{case}\n{row}" for case, row, *_ in rows]
    shares = [100 * floor / ms for _, _, ms, floor, _ in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(rows)), 5))
    ax.bar(range(len(rows)), shares, color=["C0" if "decode" in r[0] else "C1" for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("% of the floor (copy bandwidth; fp16 matmul rate)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cupy_paged_attn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, GPU, NVRTC, kernel cache; the kernel and split a shape would run")
    p.add_argument("--decode", metavar="B,HQ/HKV,D,L", help="plan a decode call of this shape")
    p.add_argument("--prefill", metavar="B,HQ/HKV,D,L[,QLEN]", help="plan a prefill call of this shape")
    p.add_argument("--dtype", default="bf16", choices=sorted(_specs.CUDA_TYPES))
    p.add_argument("--bias", default="none", choices=_specs.BIAS_MODES)
    p.add_argument("--layout", default="nhd", choices=_specs.KV_LAYOUTS)
    p = sub.add_parser("check", help="a self-test of this machine against the float64 reference")
    p.add_argument("--quick", action="store_true", help="fewer head sizes")
    p = sub.add_parser("bench", help="a short decode and prefill benchmark against the floor")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", metavar="DIR", help="write DIR/bench.md and DIR/bench.png")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    status = {"info": info, "check": check, "bench": bench}[args.command](args)
    if args.command != "info":
        print(f"{args.command}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return status
