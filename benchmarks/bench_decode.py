"""Decode-attention benchmark: ``cupy_paged_attn.paged_attention`` against the memory floor and a PyTorch peer.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_decode.py [--cases 0,2] [--reps 100] [--json bench_out/decode.json]

What is measured
----------------
Copy bandwidth
    ``dst.copy_(src)`` of a 4 GiB buffer into another, counting bytes read + written: the practical ceiling of
    memory traffic, measured in the same run so that the percentages below hold for the machine at hand.
Implementations, per case (bf16 or fp16, ``block_size`` 16, ``kv_layout="nhd"``, pages scattered at random)
    ``ours``       ``paged_attention(q, k_cache, v_cache, block_tables, seq_lens)`` on torch tensors, no bias.
    ``ours+bias``  the same with ``attn_bias=bias``, a dense ``[B, Hq, L]`` bias of the query's dtype.
    ``peer``       what a PyTorch user writes without a paged kernel: gather K and V through the block table,
                   repeat the KV heads for GQA, build the float mask (the bias with ``-inf`` past each sequence's
                   length) and call ``torch.nn.functional.scaled_dot_product_attention``. Timed whole: gather,
                   mask and SDPA.
Each implementation is timed twice: *eager* (one Python call after another, host overhead included) and as
replays of a *CUDA graph* captured around the same calls (GPU time only). The graph time is the reported time
when capture works, else the eager time; the speed-up compares like with like.

Every time is a median over ``--reps`` repetitions (``triton.testing.do_bench`` when triton is importable, else
a CUDA-event loop) with the L2 cache flushed before each repetition. A repetition calls the implementation once
on each of ``--sets`` input sets (own query, bias and block table; own caches too while all sets' caches fit in
2 GiB, else shared caches many times larger than L2) and the time is divided by the number of sets, so no call
finds its data in L2 and graph-launch overhead is spread.

The floor
---------
Decode attention is memory-bound: it must read each used K and V row once. The bytes it cannot avoid are

* K and V of the tokens actually used: ``sum(seq_lens) * Hkv * d * 2 * itemsize``;
* with a bias, its entries for those tokens: ``sum(seq_lens) * Hq * itemsize(bias)``;
* the query and the output: ``2 * B * Hq * d * itemsize``;
* the block-table entries read (``ceil(seq_len / 16)`` per sequence) and ``seq_lens``: 4 bytes each.

GB/s = those bytes / time, for every implementation (the peer moves more than that: its GB/s is an effective
bandwidth that says how far it is from the floor). "% copy" = GB/s / copy bandwidth, and the floor time is
bytes / copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

BLOCK_SIZE = 16
KV_LAYOUT = "nhd"
EXTRA_PAGES = 8  # pages in the cache beyond those the block tables use
COPY_BYTES = 4 << 30  # size of the copy-bandwidth buffer (each of source and destination)
FLUSH_BYTES = 256 << 20  # zeroed before every repetition to flush L2 (H200: 50 MB of L2)
OWN_CACHES_BUDGET = 2 << 30  # each input set gets its own caches while all of them fit in this
MIN_SETS = 2
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}  # max |ours+bias - peer| before a warning


@dataclass(frozen=True)
class Case:
    """One decode problem: ``batch`` sequences of up to ``max_len`` keys.

    Sequences all have ``max_len`` keys, or, when ``min_len`` is set, lengths drawn uniformly from
    ``[min_len, max_len]`` with a fixed seed.
    """

    batch: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_len: int
    dtype: str = "bfloat16"
    min_len: int | None = None

    @property
    def name(self) -> str:
        """Short label, e.g. ``"B64 H16/16 d64 L2048"``."""
        lens = f"L{self.max_len}" if self.min_len is None else f"L{self.min_len}-{self.max_len}"
        name = f"B{self.batch} H{self.num_heads}/{self.num_kv_heads} d{self.head_size} {lens}"
        return name if self.dtype == "bfloat16" else f"{name} {self.dtype.replace('float', 'fp')}"

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def blocks_per_seq(self) -> int:
        """Columns of the block table: pages of the longest sequence."""
        return -(-self.max_len // BLOCK_SIZE)


CASES = (
    Case(64, 16, 16, 64, 2048),
    Case(64, 16, 16, 64, 2048, min_len=1024),
    Case(128, 32, 32, 128, 4096),
    Case(32, 32, 8, 128, 8192),
    Case(1, 16, 16, 64, 1024),
    Case(16, 32, 8, 128, 16384, dtype="float16"),
)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------
def parse_case_indices(text: str) -> list[int]:
    """Parse ``--cases``: comma-separated indices into :data:`CASES`, e.g. ``"0,2,5"``.

    Parameters
    ----------
    text : str
        The option's value.

    Returns
    -------
    list of int
        The indices, in the order given.
    """
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    bad = [i for i in indices if not 0 <= i < len(CASES)]
    if bad or not indices:
        raise argparse.ArgumentTypeError(f"expected indices in [0, {len(CASES) - 1}], got {text!r}")
    return indices


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; default ``sys.argv[1:]``.

    Returns
    -------
    argparse.Namespace
    """
    listing = "\n".join(f"  {i}: {case.name}" for i, case in enumerate(CASES))
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\ncases:\n" + listing,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The module docstring explains what is measured and the floor.",
    )
    parser.add_argument("--cases", type=parse_case_indices, default=list(range(len(CASES))),
                        help="comma-separated case indices (default: all)")
    parser.add_argument("--reps", type=int, default=100, help="timed repetitions per measurement (default: 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before timing (default: 10)")
    parser.add_argument("--sets", type=int, default=4,
                        help=f"input sets rotated within a repetition, at least {MIN_SETS} (default: 4)")
    parser.add_argument("--timer", choices=("auto", "triton", "events"), default="auto",
                        help="auto: triton.testing.do_bench if importable, else a CUDA-event loop")
    parser.add_argument("--peer-gqa", choices=("repeat", "enable_gqa"), default="repeat",
                        help="how the peer handles GQA: repeat_interleave the KV heads (default; keeps SDPA's "
                             "fused kernels with a float mask) or SDPA's enable_gqa=True")
    parser.add_argument("--no-graph", action="store_true", help="time eager calls only")
    parser.add_argument("--seed", type=int, default=0, help="seed of all random data (default: 0)")
    parser.add_argument("--json", metavar="PATH", help="write all results to PATH as JSON")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    if args.sets < MIN_SETS:
        parser.error(f"--sets must be >= {MIN_SETS}")
    return args


def progress(message: str) -> None:
    """Print one progress line on stderr (through tqdm when it drives a bar, so the bar stays intact)."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(message, file=sys.stderr, flush=True)
    else:
        tqdm.write(message, file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------
class Timer:
    """Median GPU time of a callable, L2 flushed before each repetition.

    Parameters
    ----------
    backend : {"auto", "triton", "events"}
        ``"triton"``: ``triton.testing.do_bench`` (median); ``"events"``: own loop of CUDA events;
        ``"auto"``: triton when importable.
    reps : int
        Timed repetitions.
    warmup : int
        Untimed calls first.
    """

    def __init__(self, backend: str, reps: int, warmup: int) -> None:
        import torch

        self.reps, self.warmup = reps, warmup
        self._do_bench = None
        if backend in ("auto", "triton"):
            try:
                from triton.testing import do_bench
            except ImportError:
                if backend == "triton":
                    raise
            else:
                self._do_bench = do_bench
        self.backend = "triton.testing.do_bench" if self._do_bench is not None else "cuda-events"
        self._flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def median_ms(self, fn: Callable[[], Any]) -> float:
        """Median time of one ``fn()`` in milliseconds.

        Parameters
        ----------
        fn : callable
            Enqueues GPU work on torch's current stream (may spend host time first: that is then measured too).

        Returns
        -------
        float
        """
        import torch

        fn()  # first call may compile kernels: never part of an estimate
        torch.cuda.synchronize()
        if self._do_bench is not None:
            # do_bench picks its repetitions as rep_ms / (its estimate of flush + fn): aim at self.reps of them.
            per_rep = self._estimate_ms(fn)
            return float(self._do_bench(fn, warmup=max(self.warmup, 1) * per_rep,
                                        rep=1.1 * self.reps * per_rep, quantiles=[0.5]))
        for _ in range(self.warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends, strict=True):
            self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    def _estimate_ms(self, fn: Callable[[], Any]) -> float:
        """Mean time of ``flush + fn()`` over 5 calls, in milliseconds."""
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            self._flush.zero_()
            fn()
        end.record()
        torch.cuda.synchronize()
        return max(start.elapsed_time(end) / 5, 1e-3)


def capture_graph(fn: Callable[[], list[Any]]) -> tuple[Any, str | None]:
    """Capture ``fn`` in a torch CUDA graph and check that a replay writes its outputs.

    Parameters
    ----------
    fn : callable
        Returns the list of output tensors it wrote; their memory is the graph's, rewritten by every replay.

    Returns
    -------
    graph : torch.cuda.CUDAGraph or None
        None when capture failed or a replay left an output unwritten (a launch that escaped capture).
    error : str or None
        Why there is no graph.
    """
    import torch

    side = torch.cuda.Stream()  # warm up off the default stream, as torch recommends before a capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = fn()
        torch.cuda.synchronize()
    except Exception as exc:  # any capture failure means "eager only", never a failed benchmark
        torch.cuda.synchronize()
        return None, f"capture failed: {type(exc).__name__}: {exc}"
    for out in outputs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    if any(bool(out.isnan().any()) for out in outputs):
        return None, "a graph replay left outputs unwritten (a launch escaped the capture)"
    return graph, None


# ---------------------------------------------------------------------------------------------------------------
# Inputs and the floor
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class InputSet:
    """Arguments of one call (torch CUDA tensors).

    Attributes
    ----------
    query : ``[B, Hq, d]``, case dtype
    key_cache, value_cache : ``[num_blocks, 16, Hkv, d]``, case dtype
    block_tables : ``[B, ceil(L / 16)]``, int32 (a random permutation of page ids: pages are scattered)
    seq_lens : ``[B]``, int32
    bias : ``[B, Hq, L]``, case dtype
    out : ``[B, Hq, d]``, case dtype (preallocated for graph capture)
    """

    query: Any
    key_cache: Any
    value_cache: Any
    block_tables: Any
    seq_lens: Any
    bias: Any
    out: Any


def draw_seq_lens(case: Case, seed: int) -> list[int]:
    """Sequence lengths of ``case``: all ``max_len``, or uniform in ``[min_len, max_len]`` (seeded, on the host).

    Returns
    -------
    list of int
        ``batch`` lengths.
    """
    import torch

    if case.min_len is None:
        return [case.max_len] * case.batch
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(case.min_len, case.max_len + 1, (case.batch,), generator=gen).tolist()


def build_inputs(case: Case, seq_lens: list[int], num_sets: int, seed: int) -> tuple[list[InputSet], bool]:
    """Random inputs of ``case`` on the current CUDA device.

    Every block table holds all its ``ceil(L / 16)`` columns as valid, distinct page ids (the peer gathers whole
    rows), so the cache holds ``B * ceil(L / 16) + EXTRA_PAGES`` pages.

    Parameters
    ----------
    case : Case
    seq_lens : list of int
        ``batch`` lengths, from :func:`draw_seq_lens`.
    num_sets : int
        Input sets to build.
    seed : int

    Returns
    -------
    sets : list of InputSet
    own_caches : bool
        Whether each set has its own caches (else all share the first set's).
    """
    import torch

    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = case.batch * case.blocks_per_seq + EXTRA_PAGES
    cache_shape = (num_blocks, BLOCK_SIZE, case.num_kv_heads, case.head_size)
    cache_bytes = 2 * math.prod(cache_shape) * dtype.itemsize
    own_caches = num_sets * cache_bytes <= OWN_CACHES_BUDGET
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")

    def randn(*shape: int) -> Any:
        return torch.randn(shape, dtype=dtype, device="cuda", generator=gen)

    sets: list[InputSet] = []
    for i in range(num_sets):
        if i == 0 or own_caches:
            key_cache, value_cache = randn(*cache_shape), randn(*cache_shape)
        pages = torch.randperm(num_blocks, device="cuda", generator=gen)[: case.batch * case.blocks_per_seq]
        tables = pages.view(case.batch, case.blocks_per_seq).to(torch.int32)
        query = randn(case.batch, case.num_heads, case.head_size)
        sets.append(InputSet(
            query=query, key_cache=key_cache, value_cache=value_cache, block_tables=tables, seq_lens=lens,
            bias=randn(case.batch, case.num_heads, case.max_len), out=torch.empty_like(query),
        ))
    return sets, own_caches


def floor_bytes(case: Case, seq_lens: list[int], with_bias: bool) -> int:
    """Bytes decode attention cannot avoid moving (see the module docstring).

    Parameters
    ----------
    case : Case
    seq_lens : list of int
    with_bias : bool
        Count the bias entries of the used tokens.

    Returns
    -------
    int
    """
    import torch

    itemsize = getattr(torch, case.dtype).itemsize
    tokens = sum(seq_lens)
    kv = tokens * case.num_kv_heads * case.head_size * 2 * itemsize
    bias = tokens * case.num_heads * itemsize if with_bias else 0
    query_out = 2 * case.batch * case.num_heads * case.head_size * itemsize
    tables = 4 * sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 4 * case.batch
    return kv + bias + query_out + tables


# ---------------------------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------------------------
def ours(s: InputSet, with_bias: bool, out: Any = None) -> Any:
    """``cupy_paged_attn.paged_attention`` on one input set, launched on torch's current stream.

    Returns
    -------
    torch.Tensor ``[B, Hq, d]``
    """
    from cupy_paged_attn import paged_attention

    return paged_attention(
        s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens,
        attn_bias=s.bias if with_bias else None, kv_layout=KV_LAYOUT, out=out,
    )


def peer(s: InputSet, gqa: str) -> Any:
    """Gather + SDPA with a float mask: decode attention as plain PyTorch, for one input set.

    Parameters
    ----------
    s : InputSet
    gqa : {"repeat", "enable_gqa"}
        ``"repeat"``: ``repeat_interleave`` the gathered K and V heads; ``"enable_gqa"``: let SDPA broadcast them
        (with a float mask this falls back to SDPA's math backend in torch 2.x).

    Returns
    -------
    torch.Tensor ``[B, Hq, d]``
    """
    import torch
    import torch.nn.functional as F

    batch, num_heads, head_size = s.query.shape
    num_kv_heads = s.key_cache.shape[2]
    max_len = s.bias.shape[-1]
    tokens = s.block_tables.shape[1] * BLOCK_SIZE
    pages = s.block_tables.reshape(-1)

    def gather(cache: Any) -> Any:  # [B, Hkv, L, d]
        rows = cache.index_select(0, pages).view(batch, tokens, num_kv_heads, head_size)
        return rows[:, :max_len].transpose(1, 2)

    key, value = gather(s.key_cache), gather(s.value_cache)
    kwargs = {}
    if num_heads != num_kv_heads:
        if gqa == "repeat":
            key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
            value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
        else:
            kwargs["enable_gqa"] = True
    position = torch.arange(max_len, device=s.query.device)
    mask = s.bias.masked_fill(position >= s.seq_lens[:, None, None], float("-inf"))
    out = F.scaled_dot_product_attention(s.query[:, :, None, :], key, value, attn_mask=mask[:, :, None, :], **kwargs)
    return out[:, :, 0, :]


@dataclass
class Timing:
    """Times of one implementation on one case, per call, in microseconds."""

    impl: str
    bytes: int
    eager_us: float
    graph_us: float | None = None
    graph_error: str | None = None

    @property
    def us(self) -> float:
        """The reported time: graph replay when available (GPU time), else eager."""
        return self.graph_us if self.graph_us is not None else self.eager_us


def time_impl(impl: str, nbytes: int, call: Callable[[InputSet, bool], Any], sets: list[InputSet], timer: Timer,
              use_graph: bool) -> Timing:
    """Time ``call`` eagerly and, if requested and capturable, as CUDA-graph replays.

    Parameters
    ----------
    impl : str
        Name of the implementation.
    nbytes : int
        Floor bytes of one call.
    call : callable
        ``call(input_set, for_graph)`` runs one call and returns its output; ``for_graph`` asks it to write into
        preallocated memory where it can.
    sets : list of InputSet
        Rotated within a repetition; times are divided by ``len(sets)``.
    timer : Timer
    use_graph : bool

    Returns
    -------
    Timing
    """
    n = len(sets)
    timing = Timing(impl, nbytes, 1e3 * timer.median_ms(lambda: [call(s, False) for s in sets]) / n)
    if use_graph:
        graph, timing.graph_error = capture_graph(lambda: [call(s, True) for s in sets])
        if graph is not None:
            timing.graph_us = 1e3 * timer.median_ms(graph.replay) / n
        del graph
    return timing


def max_abs_diff(a: Any, b: Any) -> float:
    """``max |a - b|`` in float32 (NaN if either holds a NaN)."""
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------
def measure_copy_bandwidth(timer: Timer) -> dict[str, float]:
    """Device-to-device copy bandwidth: ``dst.copy_(src)`` of a :data:`COPY_BYTES` bfloat16 buffer.

    Returns
    -------
    dict
        ``bytes`` (read + written), ``us`` (median per copy), ``bytes_per_s``.
    """
    import torch

    def copy_us() -> float:  # the buffers die with this frame
        src = torch.ones(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        return 1e3 * timer.median_ms(lambda: dst.copy_(src))

    us = copy_us()
    torch.cuda.empty_cache()
    nbytes = 2 * COPY_BYTES
    return {"bytes": nbytes, "us": us, "bytes_per_s": nbytes / (us * 1e-6)}


def run_case(index: int, case: Case, args: argparse.Namespace, timer: Timer) -> dict[str, Any]:
    """Build one case's inputs, time every implementation, check ours against the peer.

    Parameters
    ----------
    index : int
        Position in :data:`CASES`.
    case : Case
    args : argparse.Namespace
    timer : Timer

    Returns
    -------
    dict
        JSON-ready results; ``"timings"`` holds :class:`Timing` objects.
    """
    seq_lens = draw_seq_lens(case, args.seed + index)
    sets, own_caches = build_inputs(case, seq_lens, args.sets, args.seed + index)
    use_graph = not args.no_graph
    bytes_bias, bytes_plain = floor_bytes(case, seq_lens, True), floor_bytes(case, seq_lens, False)
    timings = [
        time_impl("ours", bytes_plain, lambda s, g: ours(s, False, s.out if g else None), sets, timer, use_graph),
        time_impl("ours+bias", bytes_bias, lambda s, g: ours(s, True, s.out if g else None), sets, timer, use_graph),
        time_impl("peer", bytes_bias, lambda s, g: peer(s, args.peer_gqa), sets, timer, use_graph),
    ]
    diff = max_abs_diff(ours(sets[0], True), peer(sets[0], args.peer_gqa))
    del sets
    return {
        "index": index, "name": case.name, "case": asdict(case), "block_size": BLOCK_SIZE, "kv_layout": KV_LAYOUT,
        "seq_lens_sum": sum(seq_lens), "num_sets": args.sets, "own_caches": own_caches,
        "floor_bytes": {"no_bias": bytes_plain, "bias": bytes_bias},
        "max_abs_diff_vs_peer": diff, "tolerance": TOLERANCE[case.dtype], "timings": timings,
    }


def speedup(result: dict[str, Any]) -> tuple[float, str]:
    """Peer time / ours+bias time, like with like: graph vs graph when both captured, else eager vs eager."""
    t = {timing.impl: timing for timing in result["timings"]}
    ours_t, peer_t = t["ours+bias"], t["peer"]
    if ours_t.graph_us is not None and peer_t.graph_us is not None:
        return peer_t.graph_us / ours_t.graph_us, "graph"
    return peer_t.eager_us / ours_t.eager_us, "eager"


def rows(results: list[dict[str, Any]], copy_bps: float) -> list[dict[str, Any]]:
    """One row per (case, implementation), with derived bandwidths.

    Returns
    -------
    list of dict
        Keys: case, impl, us, via, eager_us, graph_us, graph_error, bytes, floor_us, gb_per_s, pct_copy,
        speedup (ours+bias rows only), speedup_via.
    """
    out = []
    for result in results:
        ratio, via = speedup(result)
        for t in result["timings"]:
            bias_row = t.impl == "ours+bias"
            out.append({
                "case": result["name"], "impl": t.impl, "us": t.us, "via": "eager" if t.graph_us is None else "graph",
                "eager_us": t.eager_us, "graph_us": t.graph_us, "graph_error": t.graph_error, "bytes": t.bytes,
                "floor_us": 1e6 * t.bytes / copy_bps, "gb_per_s": t.bytes / (t.us * 1e-6) / 1e9,
                "pct_copy": 100 * t.bytes / (t.us * 1e-6) / copy_bps,
                "speedup": ratio if bias_row else None, "speedup_via": via if bias_row else None,
            })
    return out


def print_table(table: list[dict[str, Any]], copy: dict[str, float]) -> None:
    """Print the results table on stdout."""
    print(f"\ncopy bandwidth: {copy['bytes_per_s'] / 1e9:.0f} GB/s (read + written)")
    header = ("case", "impl", "µs", "via", "eager µs", "floor µs", "GB/s", "% copy", "bias speed-up vs peer")
    lines = [header]
    for r in table:
        lines.append((
            r["case"], r["impl"], f"{r['us']:.1f}", r["via"], f"{r['eager_us']:.1f}", f"{r['floor_us']:.1f}",
            f"{r['gb_per_s']:.0f}", f"{r['pct_copy']:.1f}",
            "" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['speedup_via']})",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for k, line in enumerate(lines):
        pairs = enumerate(zip(line, widths, strict=True))
        cells = [cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in pairs]
        print(" | ".join(cells))
        if k == 0:
            print("-+-".join("-" * w for w in widths))
    for r in table:
        if r["graph_error"]:
            print(f"note: {r['case']} {r['impl']}: eager only ({r['graph_error']})")


def environment(timer: Timer) -> dict[str, Any]:
    """Device and library versions for the JSON record."""
    import cupy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import cupy_paged_attn

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cupy": cupy.__version__, "cupy_cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "triton": triton_version,
        "cupy_paged_attn": cupy_paged_attn.__version__, "timer": timer.backend,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring.

    Returns
    -------
    int
        Exit status: 0, or 2 without a CUDA device.
    """
    args = parse_args(argv)
    if args.list:
        for i, case in enumerate(CASES):
            print(f"{i}: {case.name}")
        return 0
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("bench_decode: no CUDA device; this benchmark needs a GPU (--help and --list work without one)",
              file=sys.stderr)
        return 2
    timer = Timer(args.timer, args.reps, args.warmup)
    env = environment(timer)
    progress(f"{env['device']}, torch {env['torch']}, cupy {env['cupy']}, timer {env['timer']}, reps {args.reps}")
    copy = measure_copy_bandwidth(timer)
    progress(f"copy bandwidth: {copy['bytes_per_s'] / 1e9:.0f} GB/s ({copy['us']:.0f} µs per 2 x 4 GiB)")

    try:
        from tqdm import tqdm

        selected = tqdm(args.cases, desc="cases", file=sys.stderr)
    except ImportError:
        selected = args.cases
    results = []
    for index in selected:
        case = CASES[index]
        start = time.perf_counter()
        result = run_case(index, case, args, timer)
        results.append(result)
        gc.collect()
        torch.cuda.empty_cache()  # free this case's caches before the next one allocates
        t = {timing.impl: timing for timing in result["timings"]}
        ratio, via = speedup(result)
        progress(
            f"[{index}] {case.name}: ours {t['ours'].us:.1f} µs, ours+bias {t['ours+bias'].us:.1f} µs, "
            f"peer {t['peer'].us:.1f} µs, speed-up {ratio:.2f}x ({via}), "
            f"max|diff| {result['max_abs_diff_vs_peer']:.2e}, {time.perf_counter() - start:.1f} s"
        )
        diff = result["max_abs_diff_vs_peer"]
        if not diff <= result["tolerance"]:  # also catches NaN
            progress(f"WARNING: {case.name}: max |ours+bias - peer| = {diff:.3e} > {result['tolerance']:.0e}")

    table = rows(results, copy["bytes_per_s"])
    print_table(table, copy)
    if args.json:
        for result in results:
            result["timings"] = [asdict(timing) | {"us": timing.us} for timing in result["timings"]]
        record = {**env, "args": vars(args), "copy": copy, "cases": results, "table": table}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
