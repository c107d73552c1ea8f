"""Decode-attention benchmark: ``cupy_paged_attn.paged_attention`` against the memory floor and PyTorch peers.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_decode.py [--cases 0,2] [--peers sdpa,flex] [--reps 50] [--out bench_out]
    python3 benchmarks/bench_decode.py --dry-run     # no GPU: the cases, their byte counts and floors

What is measured
----------------
Copy bandwidth
    ``dst.copy_(src)`` of a 4 GiB buffer into another, counting bytes read + written: the practical ceiling of
    memory traffic, measured in the same run so that the percentages below hold for the machine at hand.
Cases
    ``--list`` shows them: six of 1-128 sequences up to 16k keys, and three long contexts (64k, 32k and up to 128k
    keys). A ragged case draws its lengths uniformly from ``[min_len, max_len]`` with NumPy's
    ``default_rng(seed + index)``, so ``--dry-run`` counts the same bytes without torch or a GPU.
Implementations, per case (bf16 or fp16, ``block_size`` 16, ``kv_layout="nhd"``, pages scattered at random)
    ``ours``         ``paged_attention(q, k_cache, v_cache, block_tables, seq_lens)`` on torch tensors, no bias.
    ``ours+dense``   the same with ``attn_bias=bias``, a dense ``[B, Hq, L]`` bias of the query's dtype.
    ``ours+ragged``  ``attn_bias=RaggedBias(values, offsets)``: the same bias entries, packed as
                     ``values[offsets[s] + j, h]`` (``[sum(seq_lens), Hq]``, contiguous).
    ``ours+dense-f32``, ``ours+ragged-f32``
                     the same two biases in float32 (``torch.randn``'s default dtype, and a float32 model's):
                     the same values, twice the bytes.
    ``ours+t5``      ``attn_bias=RelativePositionBias(table, bidirectional=False)``: T5's bias computed in the
                     kernel from a ``[32, Hq]`` table (default scale kept: it does not change the speed).
                     The two rows above run only where ``cupy_paged_attn`` has ``RaggedBias`` /
                     ``RelativePositionBias``.
    ``sdpa``         what a PyTorch user writes without a paged kernel: gather K and V through the block table,
                     repeat the KV heads for GQA, build the float mask (the bias with ``-inf`` past each
                     sequence's length) and call ``torch.nn.functional.scaled_dot_product_attention``. Timed whole:
                     gather, mask and SDPA.
    ``flex``         ``torch.compile``d FlexAttention on contiguous, unpaged K/V ``[B, Hkv, L, d]`` (built once,
                     untimed: a layout FlexAttention reads natively), ``enable_gqa=True`` for GQA, the bias read by
                     ``score_mod`` (``score + bias[b, h, kv_idx]``) and the lengths as a ``BlockMask``
                     (``kv_idx < seq_lens[b]``). Compiled once per case (``dynamic=False``), untimed.
    ``flex-nobias``  the same without ``score_mod``.
Each implementation is timed twice: *eager* (one Python call after another, host overhead included) and as
replays of a *CUDA graph* captured around the same calls (GPU time only). The graph time is the reported time
when capture works, else the eager time. Each peer is compared with ours on the same bias (``sdpa`` and ``flex``
with ``ours+dense``, ``flex-nobias`` with ``ours``), like with like: graph against graph when both captured, else
eager against eager. A peer that fails (out of memory, no triton, an older torch) is reported as skipped.

Every time is a median over ``--reps`` repetitions (``triton.testing.do_bench`` when triton is importable, else
a CUDA-event loop) with the L2 cache flushed before each repetition. A repetition calls the implementation once
on each of ``--sets`` input sets (own query, bias and block table; own caches too while all sets' caches fit in
2 GiB, else shared caches many times larger than L2; long-context cases use at most 2 sets) and the time is
divided by the number of sets, so no call finds its data in L2 and graph-launch overhead is spread.

Every row's output on the first input set is checked: ``ours+ragged``, ``sdpa`` and ``flex`` against
``ours+dense``, ``flex-nobias`` against ``ours``, ``ours+t5`` against ``ours`` with the dense bias of
``t5_position_bias``. A difference above the dtype's tolerance is flagged.

The floor
---------
Decode attention is memory-bound: it must read each used K and V row once. The bytes it cannot avoid are

* K and V of the tokens actually used: ``sum(seq_lens) * Hkv * d * 2 * itemsize``;
* with a dense or ragged bias, its entries for those tokens: ``sum(seq_lens) * Hq * itemsize(bias)``; none for
  the T5 bias (a table of ``32 * Hq`` entries, computed into the logits);
* the query and the output: ``2 * B * Hq * d * itemsize``;
* the block-table entries read (``ceil(seq_len / 16)`` per sequence) and ``seq_lens``: 4 bytes each.

Each row counts the floor of its problem (the peers: the dense-bias or no-bias floor), so GB/s = those bytes /
time for every implementation (the peers move more than that: their GB/s is an effective bandwidth that says how
far they are from the floor). "% copy" = GB/s / copy bandwidth, and the floor time is bytes / copy bandwidth.

Output
------
Progress goes to stderr (a tqdm bar when tqdm is importable, else one line per step); the results table and
the speed-ups per case are printed last on stdout. ``--out DIR`` also writes ``DIR/decode.json`` (every row, the
machine and versions) and ``DIR/decode.png`` (% of copy bandwidth per case and implementation; needs matplotlib).
FlexAttention compiles twice per case (seconds each): ``--peers sdpa,flex`` or ``--peers none`` shortens a run.
Exit status: 0; 1 when one of our rows failed, any row missed its check or the run stopped early (the cases
finished are still reported); 2 without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

BLOCK_SIZE = 16
KV_LAYOUT = "nhd"
EXTRA_PAGES = 8  # pages in the cache beyond those the block tables use
COPY_BYTES = 4 << 30  # size of the copy-bandwidth buffer (each of source and destination)
FLUSH_BYTES = 256 << 20  # zeroed before every repetition to flush L2 (H200: 50 MB of L2)
OWN_CACHES_BUDGET = 2 << 30  # each input set gets its own caches while all of them fit in this
MIN_SETS = 2
NOMINAL_COPY_GBPS = 4270.0  # H200 device-to-device copy, measured; only for --dry-run's floor times
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}  # max |row - what it is checked against|
T5_NUM_BUCKETS, T5_MAX_DISTANCE = 32, 128

# Implementations, in table order: (name, bias kind, one of BIAS_KINDS).
OURS = (("ours", "none"), ("ours+dense", "dense"), ("ours+ragged", "ragged"), ("ours+dense-f32", "dense-f32"),
        ("ours+ragged-f32", "ragged-f32"), ("ours+t5", "t5"))
#: Bias kinds: the bias's entries a kind reads, and their bytes (the f32 kinds: the query dtype's values in float32).
BIAS_KINDS = ("none", "dense", "ragged", "dense-f32", "ragged-f32", "t5")
PEERS = (("sdpa", "dense"), ("flex", "dense"), ("flex-nobias", "none"))
NEEDS_API = {"ours+ragged": "RaggedBias", "ours+ragged-f32": "RaggedBias", "ours+t5": "RelativePositionBias"}
#: The output each row's output is checked against ("ours+t5-dense": ours with t5_position_bias's dense bias).
CHECK_AGAINST = {"ours+ragged": "ours+dense", "ours+dense-f32": "ours+dense", "ours+ragged-f32": "ours+dense",
                 "ours+t5": "ours+t5-dense", "sdpa": "ours+dense", "flex": "ours+dense",
                 "flex-nobias": "ours"}
#: Our row each peer's time is compared with (the same bias).
COMPARE_WITH = {"sdpa": "ours+dense", "flex": "ours+dense", "flex-nobias": "ours"}


@dataclass(frozen=True)
class Case:
    """One decode problem: ``batch`` sequences of up to ``max_len`` keys.

    Sequences all have ``max_len`` keys, or, when ``min_len`` is set, lengths drawn uniformly from
    ``[min_len, max_len]`` with a fixed seed. ``max_sets`` caps the input sets (long contexts: each call is long
    and each set large).
    """

    batch: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_len: int
    dtype: str = "bfloat16"
    min_len: int | None = None
    max_sets: int | None = None

    @property
    def name(self) -> str:
        """Short label, e.g. ``"B64 H16/16 d64 L2048"``."""
        lens = f"L{self.max_len}" if self.min_len is None else f"L{self.min_len}-{self.max_len}"
        name = f"B{self.batch} H{self.num_heads}/{self.num_kv_heads} d{self.head_size} {lens}"
        return name if self.dtype == "bfloat16" else f"{name} {self.dtype.replace('float', 'fp')}"

    @property
    def itemsize(self) -> int:
        """Bytes per element of q, K, V, out and the bias."""
        return ITEMSIZE[self.dtype]

    @property
    def blocks_per_seq(self) -> int:
        """Columns of the block table: pages of the longest sequence."""
        return -(-self.max_len // BLOCK_SIZE)

    @property
    def num_blocks(self) -> int:
        """Pages in the cache: every table column of every sequence, plus :data:`EXTRA_PAGES`."""
        return self.batch * self.blocks_per_seq + EXTRA_PAGES

    def num_sets(self, requested: int) -> int:
        """Input sets to build when ``--sets`` asks for ``requested``."""
        return max(MIN_SETS, min(requested, self.max_sets or requested))

    def cache_bytes(self) -> int:
        """Bytes of one key cache and one value cache together."""
        return 2 * self.num_blocks * BLOCK_SIZE * self.num_kv_heads * self.head_size * self.itemsize

    def own_caches(self, num_sets: int) -> bool:
        """Whether each of ``num_sets`` input sets gets its own caches (all of them fit the budget)."""
        return num_sets * self.cache_bytes() <= OWN_CACHES_BUDGET


LONG = 2  # input sets of the long-context cases
CASES = (
    Case(64, 16, 16, 64, 2048),
    Case(64, 16, 16, 64, 2048, min_len=1024),
    Case(128, 32, 32, 128, 4096),
    Case(32, 32, 8, 128, 8192),
    Case(1, 16, 16, 64, 1024),
    Case(16, 32, 8, 128, 16384, dtype="float16"),
    Case(1, 32, 8, 128, 65536, max_sets=LONG),
    Case(4, 32, 8, 128, 32768, max_sets=LONG),
    Case(8, 16, 16, 64, 131072, min_len=4096, max_sets=LONG),
    # Widely spread lengths, as a serving batch has them (the grid's tail: planning.longest_first).
    Case(64, 16, 16, 64, 8192, min_len=128),
    Case(128, 8, 8, 128, 4096, min_len=64),
    # The same, grouped queries (the tensor-core decode: 512 and 1024 CTAs where an H200 holds 396).
    Case(64, 32, 8, 128, 8192, min_len=128),
    Case(128, 32, 8, 128, 4096, min_len=64),
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


def parse_peers(text: str) -> list[str]:
    """Parse ``--peers``: ``"none"``, ``"all"`` or comma-separated names from :data:`PEERS`.

    Returns
    -------
    list of str
        The selected peers, in table order.
    """
    names = [name for name, _ in PEERS]
    wanted = {part.strip() for part in text.split(",") if part.strip()}
    if wanted == {"none"}:
        return []
    if wanted == {"all"}:
        return names
    unknown = sorted(wanted - set(names))
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"expected 'none', 'all' or a comma-separated subset of {names}, got {text!r}")
    return [name for name in names if name in wanted]


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
    parser.add_argument("--peers", type=parse_peers, default=[name for name, _ in PEERS],
                        help="peers to time: 'none', 'all' or a comma-separated subset of "
                             f"{','.join(name for name, _ in PEERS)} (default: all)")
    parser.add_argument("--reps", type=int, default=50, help="timed repetitions per measurement (default: 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before timing (default: 10)")
    parser.add_argument("--sets", type=int, default=4,
                        help=f"input sets rotated within a repetition, at least {MIN_SETS} (default: 4; "
                             f"long-context cases use at most {LONG})")
    parser.add_argument("--timer", choices=("auto", "triton", "events"), default="auto",
                        help="auto: triton.testing.do_bench if importable, else a CUDA-event loop")
    parser.add_argument("--peer-gqa", choices=("repeat", "enable_gqa"), default="repeat",
                        help="how sdpa handles GQA: repeat_interleave the KV heads (default; keeps SDPA's "
                             "fused kernels with a float mask) or SDPA's enable_gqa=True")
    parser.add_argument("--no-graph", action="store_true", help="time eager calls only")
    parser.add_argument("--kernel", choices=("auto", "tensor-cores", "simt"), default="auto",
                        help="our decode kernel: auto (the library's choice), or force the tensor-core one (16-bit, "
                             "head size <= 128) or the SIMT one, for comparisons")
    parser.add_argument("--seed", type=int, default=0, help="seed of all random data (default: 0)")
    parser.add_argument("--out", metavar="DIR", help="write DIR/decode.json and DIR/decode.png")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the cases, rows, byte counts and floors, and exit (no GPU needed)")
    parser.add_argument("--copy-gbps", type=float, default=NOMINAL_COPY_GBPS,
                        help=f"copy bandwidth for --dry-run's floor times (default: {NOMINAL_COPY_GBPS:.0f})")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    if args.sets < MIN_SETS:
        parser.error(f"--sets must be >= {MIN_SETS}")
    if args.copy_gbps <= 0:
        parser.error("--copy-gbps must be > 0")
    return args


def library_api() -> dict[str, bool]:
    """Which optional bias classes ``cupy_paged_attn`` has (all False when it cannot be imported)."""
    try:
        import cupy_paged_attn
    except ImportError:
        return dict.fromkeys(NEEDS_API.values(), False)
    return {name: hasattr(cupy_paged_attn, name) for name in NEEDS_API.values()}


def planned_impls(peers: Sequence[str], api: dict[str, bool]) -> list[tuple[str, str]]:
    """The (implementation, bias kind) rows of every case, in table order: ours where the API has them, peers."""
    ours = [(impl, kind) for impl, kind in OURS if impl not in NEEDS_API or api[NEEDS_API[impl]]]
    return ours + [(impl, kind) for impl, kind in PEERS if impl in peers]


# ---------------------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------------------
class Progress:
    """Progress on stderr: a tqdm bar over ``total`` steps when tqdm is importable, else one line per step."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True)
        self._done, self._total = 0, total

    def write(self, message: str) -> None:
        """Print one line on stderr (through tqdm when it drives a bar, so the bar stays intact)."""
        if self._bar is None:
            print(message, file=sys.stderr, flush=True)
        else:
            self._bar.write(message, file=sys.stderr)

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Announce a step, run the ``with`` body, count it done."""
        if self._bar is None:
            print(f"[{self._done + 1}/{self._total}] {label}", file=sys.stderr, flush=True)
        else:
            self._bar.set_description(label)
        try:
            yield
        finally:
            self._done += 1
            if self._bar is not None:
                self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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
        return None, f"capture failed: {type(exc).__name__}: {first_line(exc)}"
    for out in outputs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    if any(bool(out.isnan().any()) for out in outputs):
        return None, "a graph replay left outputs unwritten (a launch escaped the capture)"
    return graph, None


def first_line(exc: BaseException | str, limit: int = 200) -> str:
    """The first line of an exception's message (or of a text), cut to ``limit`` characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Inputs and the floor
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class InputSet:
    """Arguments of one call (torch CUDA tensors, and the library's bias objects once a row has made them).

    Attributes
    ----------
    query : ``[B, Hq, d]``, case dtype
    key_cache, value_cache : ``[num_blocks, 16, Hkv, d]``, case dtype
    block_tables : ``[B, ceil(L / 16)]``, int32 (a random permutation of page ids: pages are scattered)
    seq_lens : ``[B]``, int32
    bias : ``[B, Hq, L]``, case dtype
    out : ``[B, Hq, d]``, case dtype (preallocated for graph capture)
    ragged_values : ``[sum(seq_lens), Hq]``, case dtype: ``bias``'s used entries, packed (:func:`ragged_values`)
    offsets : ``[B + 1]``, int32: where each sequence's rows start in ``ragged_values``
    t5_table : ``[32, Hq]``, case dtype: T5's ``relative_attention_bias.weight`` (shared by all sets)
    ragged_bias : ``RaggedBias(ragged_values, offsets)``, made by the ``ours+ragged`` row
    bias_f32, ragged_bias_f32 : ``bias`` and ``ragged_bias`` in float32, made by the ``-f32`` rows
    t5_bias : ``RelativePositionBias(t5_table, bidirectional=False)``, made by the ``ours+t5`` row
    """

    query: Any
    key_cache: Any
    value_cache: Any
    block_tables: Any
    seq_lens: Any
    bias: Any
    out: Any
    ragged_values: Any
    offsets: Any
    t5_table: Any = None
    ragged_bias: Any = None
    bias_f32: Any = None
    ragged_bias_f32: Any = None
    t5_bias: Any = None

    def make_bias_object(self, kind: str) -> None:
        """Wrap the ragged values (``"ragged"``) or the T5 table (``"t5"``) in the library's bias class; the float32
        copies of the bias for the ``-f32`` kinds."""
        import cupy_paged_attn

        if kind == "ragged":
            self.ragged_bias = cupy_paged_attn.RaggedBias(self.ragged_values, self.offsets)
        elif kind == "dense-f32":
            self.bias_f32 = self.bias.float()
        elif kind == "ragged-f32":
            self.ragged_bias_f32 = cupy_paged_attn.RaggedBias(self.ragged_values.float(), self.offsets)
        elif kind == "t5":
            self.t5_bias = cupy_paged_attn.RelativePositionBias(
                self.t5_table, num_buckets=T5_NUM_BUCKETS, max_distance=T5_MAX_DISTANCE, bidirectional=False)


def draw_seq_lens(case: Case, seed: int) -> list[int]:
    """Sequence lengths of ``case``: all ``max_len``, or uniform in ``[min_len, max_len]`` (seeded, NumPy).

    Returns
    -------
    list of int
        ``batch`` lengths.
    """
    if case.min_len is None:
        return [case.max_len] * case.batch
    return np.random.default_rng(seed).integers(case.min_len, case.max_len + 1, case.batch).tolist()


def build_inputs(case: Case, seq_lens: list[int], num_sets: int, seed: int) -> tuple[list[InputSet], bool]:
    """Random inputs of ``case`` on the current CUDA device.

    Every block table holds all its ``ceil(L / 16)`` columns as valid, distinct page ids (the peers gather whole
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
    cache_shape = (case.num_blocks, BLOCK_SIZE, case.num_kv_heads, case.head_size)
    own_caches = case.own_caches(num_sets)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device="cuda")

    def randn(*shape: int) -> Any:
        return torch.randn(shape, dtype=dtype, device="cuda", generator=gen)

    sets: list[InputSet] = []
    for i in range(num_sets):
        if i == 0 or own_caches:
            key_cache, value_cache = randn(*cache_shape), randn(*cache_shape)
        pages = torch.randperm(case.num_blocks, device="cuda", generator=gen)[: case.batch * case.blocks_per_seq]
        query = randn(case.batch, case.num_heads, case.head_size)
        bias = randn(case.batch, case.num_heads, case.max_len)
        sets.append(InputSet(
            query=query, key_cache=key_cache, value_cache=value_cache,
            block_tables=pages.view(case.batch, case.blocks_per_seq).to(torch.int32), seq_lens=lens, bias=bias,
            out=torch.empty_like(query), ragged_values=ragged_values(bias, seq_lens), offsets=offsets,
        ))
    t5_table = randn(T5_NUM_BUCKETS, case.num_heads)  # drawn last: the other inputs are those of earlier versions
    for s in sets:
        s.t5_table = t5_table
    return sets, own_caches


def ragged_values(bias: Any, seq_lens: list[int]) -> Any:
    """The used entries of a dense bias, packed: ``values[offsets[s] + j, h] = bias[s, h, j]`` for ``j < len_s``.

    Parameters
    ----------
    bias : torch.Tensor ``[B, Hq, L]``
    seq_lens : list of int

    Returns
    -------
    torch.Tensor ``[sum(seq_lens), Hq]``, contiguous
    """
    import torch

    return torch.cat([bias[s, :, :n].transpose(0, 1) for s, n in enumerate(seq_lens)]).contiguous()


def bias_bytes(case: Case, seq_lens: list[int], kind: str) -> int:
    """Bytes of the bias a row must read: the used entries for the dense and ragged kinds (4 bytes each for the
    ``-f32`` kinds), else 0."""
    if kind in ("dense", "ragged"):
        return sum(seq_lens) * case.num_heads * case.itemsize
    return sum(seq_lens) * case.num_heads * 4 if kind in ("dense-f32", "ragged-f32") else 0


def floor_bytes(case: Case, seq_lens: list[int], kind: str) -> int:
    """Bytes decode attention cannot avoid moving (see the module docstring).

    Parameters
    ----------
    case : Case
    seq_lens : list of int
    kind : one of BIAS_KINDS
        The bias kind.

    Returns
    -------
    int
    """
    tokens = sum(seq_lens)
    kv = tokens * case.num_kv_heads * case.head_size * 2 * case.itemsize
    query_out = 2 * case.batch * case.num_heads * case.head_size * case.itemsize
    tables = 4 * sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 4 * case.batch
    return kv + bias_bytes(case, seq_lens, kind) + query_out + tables


def input_bytes(case: Case, seq_lens: list[int], num_sets: int, flex: bool) -> int:
    """Device memory of a case's inputs: caches, per-set bias (dense and packed, in the case's dtype and in
    float32) and FlexAttention's K/V."""
    own = case.own_caches(num_sets)
    caches = case.cache_bytes() * (num_sets if own else 1)
    dense = case.batch * case.num_heads * case.max_len
    biases = num_sets * (dense * (case.itemsize + 4) + bias_bytes(case, seq_lens, "ragged") +
                         bias_bytes(case, seq_lens, "ragged-f32"))
    dense_kv = 2 * case.batch * case.num_kv_heads * case.max_len * case.head_size * case.itemsize
    return caches + biases + (dense_kv * (num_sets if own else 1) if flex else 0)


# ---------------------------------------------------------------------------------------------------------------
# Implementations. Each row is a Call: call(input_set, for_graph) runs one call and returns its output.
# ---------------------------------------------------------------------------------------------------------------
Call = Callable[[InputSet, bool], Any]


class Skipped(Exception):
    """A row that cannot run here (missing package, unsupported torch, out of memory): reported, not fatal."""


def ours(s: InputSet, attn_bias: Any, out: Any = None) -> Any:
    """``cupy_paged_attn.paged_attention`` on one input set, launched on torch's current stream.

    Returns
    -------
    torch.Tensor ``[B, Hq, d]``
    """
    from cupy_paged_attn import paged_attention

    return paged_attention(s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens,
                           attn_bias=attn_bias, kv_layout=KV_LAYOUT, out=out)


def bias_argument(s: InputSet, kind: str) -> Any:
    """The ``attn_bias`` of ``s`` for a bias kind."""
    return {"none": None, "dense": s.bias, "ragged": s.ragged_bias, "dense-f32": s.bias_f32,
            "ragged-f32": s.ragged_bias_f32, "t5": s.t5_bias}[kind]


def ours_call(kind: str) -> Call:
    """Our row for a bias kind; under graph capture it writes into the set's preallocated ``out``."""
    return lambda s, for_graph: ours(s, bias_argument(s, kind), s.out if for_graph else None)


def sdpa(s: InputSet, gqa: str) -> Any:
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

    num_heads, num_kv_heads = s.query.shape[1], s.key_cache.shape[2]
    max_len = s.bias.shape[-1]
    key, value = gather_dense(s.key_cache, s.block_tables, max_len), gather_dense(s.value_cache, s.block_tables,
                                                                                  max_len)
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


def gather_dense(cache: Any, block_tables: Any, max_len: int) -> Any:
    """Every sequence's first ``max_len`` rows of a paged cache, gathered: a ``[B, Hkv, L, d]`` view (strided)."""
    batch = block_tables.shape[0]
    _, _, num_kv_heads, head_size = cache.shape
    rows = cache.index_select(0, block_tables.reshape(-1))
    return rows.view(batch, -1, num_kv_heads, head_size)[:, :max_len].transpose(1, 2)


def flex_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Two plain functions around FlexAttention, to be ``torch.compile``d: with a dense bias, and without.

    The bias is an argument of the compiled function (``score_mod`` is defined inside it), so input sets with
    different bias tensors of one shape reuse one compiled kernel.

    Returns
    -------
    biased : callable
        ``biased(query [B, Hq, 1, d], key [B, Hkv, L, d], value, bias [B, Hq, L], block_mask)``
    plain : callable
        ``plain(query, key, value, block_mask)``
    """
    from torch.nn.attention.flex_attention import flex_attention

    def biased(query: Any, key: Any, value: Any, bias: Any, block_mask: Any) -> Any:
        def add_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + bias[b, h, kv_idx]

        return flex_attention(query, key, value, score_mod=add_bias, block_mask=block_mask,
                              enable_gqa=query.shape[1] != key.shape[1])

    def plain(query: Any, key: Any, value: Any, block_mask: Any) -> Any:
        return flex_attention(query, key, value, block_mask=block_mask, enable_gqa=query.shape[1] != key.shape[1])

    return biased, plain


class FlexPeer:
    """FlexAttention for one case: contiguous K/V per input set and the lengths' ``BlockMask``, built once.

    Parameters
    ----------
    case : Case
    sets : list of InputSet
    own_caches : bool
        Whether the sets have their own caches: then each gets its own dense K/V, else all share the first
        set's (many times larger than L2 either way).

    Raises
    ------
    Skipped
        When FlexAttention is not importable.
    """

    def __init__(self, case: Case, sets: list[InputSet], own_caches: bool) -> None:
        import torch

        self._first_set = sets[0]
        try:
            from torch.nn.attention.flex_attention import create_block_mask
        except ImportError as exc:
            raise Skipped(f"no FlexAttention in torch {torch.__version__}: {first_line(exc)}") from exc
        torch.compiler.reset()  # a fresh compile cache per case: shapes of earlier cases never count to its limit
        lens = sets[0].seq_lens

        def within_length(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx < lens[b]

        self.block_mask = create_block_mask(within_length, case.batch, None, 1, case.max_len, device=lens.device)
        self.kv: dict[int, tuple[Any, Any]] = {}
        for s in sets if own_caches else sets[:1]:
            self.kv[id(s)] = tuple(gather_dense(c, s.block_tables, case.max_len).contiguous()
                                   for c in (s.key_cache, s.value_cache))
        self._first_kv = self.kv[id(sets[0])]

    def call(self, with_bias: bool) -> tuple[Call, float]:
        """Compile the row (``dynamic=False``) and run it once.

        Returns
        -------
        call : Call
        compile_s : float
            Seconds of the compile and first call.

        Raises
        ------
        Skipped
            When compiling or the first call fails (no triton, an unsupported shape or torch).
        """
        import torch

        biased, plain = flex_functions()
        compiled = torch.compile(biased if with_bias else plain, dynamic=False)

        def call(s: InputSet, for_graph: bool) -> Any:
            key, value = self.kv.get(id(s), self._first_kv)
            args = (s.query[:, :, None, :], key, value) + ((s.bias,) if with_bias else ())
            return compiled(*args, self.block_mask)[:, :, 0, :]

        start = time.perf_counter()
        try:
            call(self._first_set, False)
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # any compile failure skips the row
            raise Skipped(f"torch.compile(flex_attention) failed: {type(exc).__name__}: {first_line(exc)}") from exc
        return call, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """One implementation on one case: times per call in microseconds, or why there are none."""

    impl: str
    bias: str
    bytes: int
    eager_us: float | None = None
    graph_us: float | None = None
    graph_error: str | None = None
    skipped: str | None = None  # "skipped (OOM)", "skipped (...)", or "FAILED: ..." for one of our rows
    setup_s: float | None = None  # compile and first call (FlexAttention)
    check_against: str | None = None
    max_abs_diff: float | None = None
    tolerance: float | None = None

    @property
    def us(self) -> float | None:
        """The reported time: graph replay when available (GPU time), else eager; None when skipped."""
        return self.graph_us if self.graph_us is not None else self.eager_us

    @property
    def check_failed(self) -> bool:
        """Whether the output check ran and missed its tolerance (NaN misses it too)."""
        return self.max_abs_diff is not None and not self.max_abs_diff <= self.tolerance


def time_call(timing: Timing, call: Call, sets: list[InputSet], timer: Timer, use_graph: bool) -> None:
    """Time ``call`` eagerly and, if requested and capturable, as CUDA-graph replays, into ``timing``.

    Times are per call: a repetition calls once per input set and is divided by ``len(sets)``.
    """
    n = len(sets)
    timing.eager_us = 1e3 * timer.median_ms(lambda: [call(s, False) for s in sets]) / n
    if use_graph:
        graph, timing.graph_error = capture_graph(lambda: [call(s, True) for s in sets])
        if graph is not None:
            timing.graph_us = 1e3 * timer.median_ms(graph.replay) / n
        del graph


def max_abs_diff(a: Any, b: Any) -> float:
    """``max |a - b|`` in float32 (NaN if either holds a NaN)."""
    return float((a.float() - b.float()).abs().max())


class CaseRun:
    """Runs every row of one case on its input sets and checks each row's output on the first set."""

    def __init__(self, case: Case, sets: list[InputSet], own_caches: bool, args: argparse.Namespace,
                 timer: Timer) -> None:
        self.case, self.sets, self.own_caches, self.args, self.timer = case, sets, own_caches, args, timer
        self._flex: FlexPeer | None = None
        self._flex_skip: str | None = None  # why FlexAttention cannot run in this case
        self._expected: dict[str, Any] = {}

    def row(self, impl: str, kind: str, nbytes: int) -> Timing:
        """Time one row and check its output; a failure is recorded in ``skipped``, never raised."""
        import torch

        timing = Timing(impl, kind, nbytes, tolerance=TOLERANCE[self.case.dtype])
        try:
            call = self._make_call(impl, kind, timing)
            time_call(timing, call, self.sets, self.timer, use_graph=not self.args.no_graph)
            self._check(timing, call)
        except Skipped as exc:
            timing.skipped = f"skipped ({exc})"
        except torch.cuda.OutOfMemoryError:
            timing.skipped = "skipped (OOM)"
        except Exception as exc:  # recorded and reported; the benchmark goes on to the next row
            verdict = "FAILED" if impl.startswith("ours") else "skipped"
            timing.skipped = f"{verdict}: {type(exc).__name__}: {first_line(exc)}"
        if timing.skipped:
            timing.eager_us = timing.graph_us = None
        gc.collect()
        torch.cuda.empty_cache()
        return timing

    def _make_call(self, impl: str, kind: str, timing: Timing) -> Call:
        if impl.startswith("ours"):
            for s in self.sets:
                s.make_bias_object(kind)
            return ours_call(kind)
        if impl == "sdpa":
            return lambda s, for_graph: sdpa(s, self.args.peer_gqa)
        if self._flex is None and self._flex_skip is None:
            try:
                self._flex = FlexPeer(self.case, self.sets, self.own_caches)
            except Skipped as exc:
                self._flex_skip = str(exc)
        if self._flex is None:
            raise Skipped(self._flex_skip)
        call, timing.setup_s = self._flex.call(with_bias=impl == "flex")
        return call

    def _check(self, timing: Timing, call: Call) -> None:
        """Compare the row's output on the first set with what it must equal (see :data:`CHECK_AGAINST`)."""
        against = CHECK_AGAINST.get(timing.impl)
        if against is None:
            return
        timing.check_against = against
        timing.max_abs_diff = max_abs_diff(call(self.sets[0], False), self.expected(against))

    def expected(self, against: str) -> Any:
        """Our output on the first set, by the name in :data:`CHECK_AGAINST` (each computed once)."""
        if against not in self._expected:
            s = self.sets[0]
            if against == "ours+t5-dense":
                from cupy_paged_attn import t5_position_bias

                bias = t5_position_bias(s.t5_table, s.seq_lens - 1, self.case.max_len, bidirectional=False,
                                        num_buckets=T5_NUM_BUCKETS, max_distance=T5_MAX_DISTANCE)
                self._expected[against] = ours(s, bias)
            else:
                self._expected[against] = ours(s, s.bias if against == "ours+dense" else None)
        return self._expected[against]

    def close(self) -> None:
        """Drop every tensor of the case (inputs, FlexAttention's K/V and compiled code, expected outputs)."""
        import torch

        self.sets.clear()
        if self._flex is not None:
            self._flex = None
            torch.compiler.reset()  # compiled code may hold the case's tensors
        self._expected.clear()


def run_case(index: int, case: Case, args: argparse.Namespace, timer: Timer, api: dict[str, bool],
             progress: Progress) -> dict[str, Any]:
    """Build one case's inputs, time and check every row.

    Parameters
    ----------
    index : int
        Position in :data:`CASES`.
    case : Case
    args : argparse.Namespace
    timer : Timer
    api : dict
        From :func:`library_api`.
    progress : Progress

    Returns
    -------
    dict
        JSON-ready results; ``"timings"`` holds :class:`Timing` objects.
    """
    import torch

    start = time.perf_counter()
    seq_lens = draw_seq_lens(case, args.seed + index)
    num_sets = case.num_sets(args.sets)
    impls = planned_impls(args.peers, api)
    why = ""  # why the inputs could not be built
    with progress.step(f"[{index}] {case.name}: inputs"):
        try:
            sets, own_caches = build_inputs(case, seq_lens, num_sets, args.seed + index)
        except Exception as exc:  # e.g. out of memory: this case's rows are reported as failed, the next case runs
            sets, own_caches = [], False
            why = f"FAILED: inputs: {type(exc).__name__}: {first_line(exc)}"
    run = CaseRun(case, sets, own_caches, args, timer)
    timings = []
    for impl, kind in impls:
        with progress.step(f"[{index}] {case.name}: {impl}"):
            nbytes = floor_bytes(case, seq_lens, kind)
            timings.append(run.row(impl, kind, nbytes) if sets else Timing(impl, kind, nbytes, skipped=why))
        t = timings[-1]
        progress.write(f"[{index}] {case.name} {impl}: " + (t.skipped or f"{t.us:.1f} µs") +
                       ("" if t.setup_s is None else f", compiled in {t.setup_s:.1f} s") +
                       ("" if t.max_abs_diff is None else f", max|diff| vs {t.check_against} {t.max_abs_diff:.2e}"))
    run.close()
    gc.collect()
    torch.cuda.empty_cache()  # free this case's inputs before the next one allocates
    return {
        "index": index, "name": case.name, "case": asdict(case), "block_size": BLOCK_SIZE, "kv_layout": KV_LAYOUT,
        "seq_lens": seq_lens, "seq_lens_sum": sum(seq_lens), "num_sets": num_sets, "own_caches": own_caches,
        "floor_bytes": {kind: floor_bytes(case, seq_lens, kind) for kind in BIAS_KINDS},
        "timings": timings, "seconds": time.perf_counter() - start,
    }


def speedup(timings: list[Timing], impl: str) -> tuple[float, str] | None:
    """Peer time / time of ours on the same bias (:data:`COMPARE_WITH`), like with like; None if either is missing.

    Returns
    -------
    (ratio, via) or None
        ``via`` is ``"graph"`` when both have graph times, else ``"eager"``.
    """
    by_impl = {t.impl: t for t in timings}
    peer, ours_t = by_impl.get(impl), by_impl.get(COMPARE_WITH.get(impl, ""))
    if peer is None or ours_t is None or peer.us is None or ours_t.us is None:
        return None
    if peer.graph_us is not None and ours_t.graph_us is not None:
        return peer.graph_us / ours_t.graph_us, "graph"
    return peer.eager_us / ours_t.eager_us, "eager"


def rows(results: list[dict[str, Any]], copy_bps: float) -> list[dict[str, Any]]:
    """One row per (case, implementation), with derived bandwidths and the peers' speed-ups.

    Returns
    -------
    list of dict
        Keys: case, impl, bias, us, via, eager_us, graph_us, graph_error, skipped, setup_s, bytes, floor_us,
        gb_per_s, pct_copy, speedup and speedup_via (peer rows: the peer's time over ours on the same bias),
        speedup_vs, check_against, max_abs_diff, tolerance, check_ok.
    """
    out = []
    for result in results:
        for t in result["timings"]:
            ratio = speedup(result["timings"], t.impl)
            row = {"case": result["name"], "impl": t.impl, "bias": t.bias, "us": t.us,
                   "via": None if t.us is None else "eager" if t.graph_us is None else "graph",
                   "eager_us": t.eager_us, "graph_us": t.graph_us, "graph_error": t.graph_error,
                   "skipped": t.skipped, "setup_s": t.setup_s, "bytes": t.bytes, "floor_us": 1e6 * t.bytes / copy_bps,
                   "gb_per_s": None, "pct_copy": None,
                   "speedup": None if ratio is None else ratio[0], "speedup_via": None if ratio is None else ratio[1],
                   "speedup_vs": COMPARE_WITH.get(t.impl), "check_against": t.check_against,
                   "max_abs_diff": t.max_abs_diff, "tolerance": t.tolerance,
                   "check_ok": None if t.max_abs_diff is None else not t.check_failed}
            if t.us is not None:
                row["gb_per_s"] = t.bytes / (t.us * 1e-6) / 1e9
                row["pct_copy"] = 100 * t.bytes / (t.us * 1e-6) / copy_bps
            out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------------
def format_table(header: Sequence[str], lines: list[Sequence[str]], left: int, left_last: bool = False) -> str:
    """Columns padded to width: the first ``left`` columns (and the last with ``left_last``) left-aligned, the
    others right-aligned."""
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    text = []
    for k, line in enumerate([header, *lines]):
        cells = [cell.ljust(w) if i < left or (left_last and i == len(widths) - 1) else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(line, widths, strict=True))]
        text.append(" | ".join(cells).rstrip())
        if k == 0:
            text.append("-+-".join("-" * w for w in widths))
    return "\n".join(text)


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or ``"-"`` for None."""
    return "-" if value is None else format(value, spec)


def print_report(table: list[dict[str, Any]], copy: dict[str, float], env: dict[str, Any]) -> None:
    """Print the notes, the results table and the speed-ups per case on stdout (the table last but one)."""
    print(f"\n{env['device']} ({env['sm_count']} SMs), torch {env['torch']}, cupy {env['cupy']}, {env['date']}")
    print(f"copy bandwidth: {copy['bytes_per_s'] / 1e9:.0f} GB/s (read + written)")
    for r in table:
        if r["graph_error"] and not r["skipped"]:
            print(f"note: {r['case']} {r['impl']}: eager only ({r['graph_error']})")
        if r["check_ok"] is False:
            print(f"WARNING: {r['case']} {r['impl']}: max |diff| vs {r['check_against']} = {r['max_abs_diff']:.3e} "
                  f"> {r['tolerance']:.0e}")
    header = ("case", "impl", "µs", "via", "floor µs", "GB/s", "% copy", "ours speed-up", "max|diff|", "note")
    lines = []
    for r in table:
        ratio = "" if r["speedup"] is None else f"{r['speedup']:.2f}x {r['speedup_via']}"
        check = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}" + ("" if r["check_ok"] else " BAD")
        note = f"vs {r['speedup_vs']}" if r["speedup_vs"] else ""
        if r["skipped"]:
            note = first_line(r["skipped"], limit=100)
        lines.append((r["case"], r["impl"], fmt(r["us"], ".1f"), r["via"] or "-", fmt(r["floor_us"], ".1f"),
                      fmt(r["gb_per_s"], ".0f"), fmt(r["pct_copy"], ".1f"), ratio, check, note))
    print()
    print(format_table(header, lines, left=2, left_last=True))
    print()
    print(format_table(("case", "ours(dense) vs sdpa", "ours(dense) vs flex", "ours vs flex-nobias"),
                       speedup_lines(table), left=1))


def speedup_lines(table: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One line per case: the peers' speed-ups (peer time / ours on the same bias), ``-`` where missing."""
    cases = list(dict.fromkeys(r["case"] for r in table))
    lines = []
    for case in cases:
        by_impl = {r["impl"]: r for r in table if r["case"] == case}
        cells = []
        for peer in ("sdpa", "flex", "flex-nobias"):
            r = by_impl.get(peer)
            cells.append("-" if r is None or r["speedup"] is None else f"{r['speedup']:.2f}x ({r['speedup_via']})")
        lines.append((case, *cells))
    return lines


def plot(table: list[dict[str, Any]], path: str, title: str) -> str | None:
    """Grouped bars of % copy bandwidth per case and implementation, saved to ``path``.

    Returns
    -------
    str or None
        Why there is no plot (matplotlib missing), else None.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not importable ({exc})"
    cases = list(dict.fromkeys(r["case"] for r in table))
    impls = list(dict.fromkeys(r["impl"] for r in table))
    pct = {(r["case"], r["impl"]): r["pct_copy"] for r in table}
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(cases)), 5.5))
    for k, impl in enumerate(impls):
        heights = [pct.get((case, impl)) for case in cases]
        xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, [math.nan if h is None else h for h in heights], width, label=impl)
    ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cases)), [case.replace(" L", "\nL") for case in cases], fontsize=8)
    ax.set_ylabel("% of copy bandwidth (floor bytes / time)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=len(impls), loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def environment(timer: Timer, api: dict[str, bool]) -> dict[str, Any]:
    """Device and library versions for the JSON record."""
    import cupy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import cupy_paged_attn

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name, "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1), "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cupy": cupy.__version__,
        "cupy_cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "triton": triton_version,
        "cupy_paged_attn": cupy_paged_attn.__version__, "api": api, "timer": timer.backend,
    }


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


def write_json(out_dir: str, env: dict[str, Any], args: argparse.Namespace, copy: dict[str, float],
               results: list[dict[str, Any]], stopped: str | None) -> str:
    """Write ``out_dir/decode.json``: the machine, the options, every case with its rows, and the table.

    Returns
    -------
    str
        The file's path.
    """
    cases = [{**result, "timings": [asdict(t) | {"us": t.us} for t in result["timings"]]} for result in results]
    record = {"machine": env, "args": vars(args), "copy": copy, "cases": cases,
              "table": rows(results, copy["bytes_per_s"]), "stopped": stopped}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "decode.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)  # a run killed while writing leaves the previous case's file whole
    return path


def dry_run(args: argparse.Namespace) -> int:
    """Print the selected cases, their rows, byte counts and floors at ``--copy-gbps``; no GPU, no torch."""
    api = library_api()
    impls = planned_impls(args.peers, api)
    print(f"rows per case: {', '.join(impl for impl, _ in impls)}")
    missing = [name for name, present in api.items() if not present]
    if importlib.util.find_spec("cupy_paged_attn") is None:
        print("cupy_paged_attn is not importable (run from the repository root with PYTHONPATH=.): the rows that "
              "need RaggedBias and RelativePositionBias are left out")
    elif missing:
        print(f"absent from cupy_paged_attn (rows left out): {', '.join(missing)}")
    bps = args.copy_gbps * 1e9
    header = ("#", "case", "sets", "tokens", "K+V MB", "bias MB", "floor µs: no bias", "dense, ragged", "f32 bias",
              "t5", "inputs GB")
    lines = []
    for index in args.cases:
        case = CASES[index]
        seq_lens = draw_seq_lens(case, args.seed + index)
        num_sets = case.num_sets(args.sets)
        tokens = sum(seq_lens)
        floors = {kind: floor_bytes(case, seq_lens, kind) for kind in BIAS_KINDS}
        lines.append((
            str(index), case.name, str(num_sets), str(tokens),
            f"{tokens * case.num_kv_heads * case.head_size * 2 * case.itemsize / 1e6:.1f}",
            f"{bias_bytes(case, seq_lens, 'dense') / 1e6:.1f}",
            *(f"{1e6 * floors[kind] / bps:.1f}" for kind in ("none", "dense", "dense-f32", "t5")),
            f"{input_bytes(case, seq_lens, num_sets, any(i.startswith('flex') for i, _ in impls)) / 1e9:.2f}",
        ))
    print(f"floors at {args.copy_gbps:.0f} GB/s (pass --copy-gbps to change):")
    print(format_table(header, lines, left=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring.

    Returns
    -------
    int
        Exit status: 0; 1 when one of our rows failed, any row missed its check or the run stopped early; 2
        without a CUDA device.
    """
    args = parse_args(argv)
    if args.list:
        for i, case in enumerate(CASES):
            print(f"{i}: {case.name}")
        return 0
    if args.dry_run:
        return dry_run(args)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("bench_decode: no CUDA device; this benchmark needs a GPU (--help, --list and --dry-run work without "
              "one)", file=sys.stderr)
        return 2
    from cupy_paged_attn import tuning

    with tuning.override(decode_kernel=args.kernel):
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    """The GPU part of :func:`main`: every case and row, then the report."""
    start = time.perf_counter()
    api = library_api()
    timer = Timer(args.timer, args.reps, args.warmup)
    env = environment(timer, api)
    impls = planned_impls(args.peers, api)
    progress = Progress(1 + len(args.cases) * (1 + len(impls)))
    progress.write(f"{env['device']} ({env['sm_count']} SMs), torch {env['torch']}, cupy {env['cupy']}, "
                   f"timer {env['timer']}, reps {args.reps}, rows {', '.join(impl for impl, _ in impls)}")
    with progress.step("copy bandwidth"):
        copy = measure_copy_bandwidth(timer)
    progress.write(f"copy bandwidth: {copy['bytes_per_s'] / 1e9:.0f} GB/s ({copy['us']:.0f} µs per 2 x 4 GiB)")
    results, stopped = [], None
    try:
        for index in args.cases:
            results.append(run_case(index, CASES[index], args, timer, api, progress))
            if args.out:  # after every case, so that a run cut short keeps what it measured
                write_json(args.out, env, args, copy, results, None)
    except (KeyboardInterrupt, Exception) as exc:  # a broken CUDA context, Ctrl-C: report the cases finished
        traceback.print_exc()
        stopped = f"{type(exc).__name__}: {first_line(exc)}"
        progress.write(f"bench_decode stopped early ({stopped}); reporting the {len(results)} cases finished")
    progress.close()

    table = rows(results, copy["bytes_per_s"])
    if args.out:
        progress.write(f"wrote {write_json(args.out, env, args, copy, results, stopped)}")
        title = (f"Paged decode attention, {env['device']}, copy {copy['bytes_per_s'] / 1e9:.0f} GB/s "
                 "(missing bars: skipped)")
        png = os.path.join(args.out, "decode.png")
        progress.write(plot(table, png, title) or f"wrote {png}")
    print(f"bench_decode: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if stopped:
        print(f"\nSTOPPED EARLY after {len(results)} of {len(args.cases)} cases: {stopped}")
    print_report(table, copy, env)
    failed = [r for r in table if r["check_ok"] is False or (r["impl"].startswith("ours") and r["skipped"])]
    return 1 if failed or stopped else 0


if __name__ == "__main__":
    sys.exit(main())
