"""Bias kinds and helpers, framework-agnostic.

The kinds ``attn_bias`` accepts besides a dense array: :class:`RaggedBias` (memory linear in the tokens used) and
:class:`RelativePositionBias` (T5's bias, computed in the kernel from its ``[num_buckets, num_heads]`` table).
The helpers: T5's relative-position buckets and the dense bias they give, and ALiBi slopes. Arrays of NumPy, CuPy,
PyTorch or JAX go in; results come back in the same framework and on the same device (computed with NumPy on the
host, with CuPy on a GPU).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np

from . import _interop

__all__ = [
    "RaggedBias",
    "RelativePositionBias",
    "alibi_slopes",
    "t5_bucket_table",
    "t5_position_bias",
    "t5_relative_position_bucket",
]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def _t5_geometry(bidirectional: Any, num_buckets: Any, max_distance: Any) -> tuple[bool, int, int, int]:
    """(bidirectional, buckets per direction, max_exact, max_distance), checked."""
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise TypeError(f"bidirectional: expected a bool, got {type(bidirectional).__name__} {bidirectional!r}")
    num_buckets = _check_int("num_buckets", num_buckets, 4 if bidirectional else 2)
    per_side = num_buckets // 2 if bidirectional else num_buckets
    max_exact = per_side // 2
    max_distance = _check_int("max_distance", max_distance, max_exact + 1)
    return bool(bidirectional), per_side, max_exact, max_distance


@functools.cache
def _bucket_table(per_side: int, max_exact: int, max_distance: int) -> np.ndarray:
    """Bucket of each distance 0 <= n < max_distance on one side; every n >= max_distance is in per_side - 1.

    The first max_exact distances have a bucket each; the rest are log-spaced up to max_distance, in float32
    arithmetic truncated toward zero exactly as transformers' ``T5Attention._relative_position_bucket`` computes
    them (checked against it for every |n| <= 2**20). A table makes the kernels and this module agree bit for bit.
    """
    n = np.arange(max_distance, dtype=np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = (
            np.log(n.astype(np.float32) / np.float32(max_exact))
            / np.float32(math.log(max_distance / max_exact))
            * np.float32(per_side - max_exact)
        )
    large = np.minimum(max_exact + np.where(n >= max_exact, scaled, 0).astype(np.int64), per_side - 1)
    return np.where(n < max_exact, n, large)


def _relative_bucket(xp: Any, rel: Any, bidirectional: bool, per_side: int, max_exact: int, max_distance: int) -> Any:
    table = xp.asarray(_bucket_table(per_side, max_exact, max_distance))
    rel = rel.astype(xp.int64)
    if bidirectional:
        offset = xp.where(rel > 0, per_side, 0)
        distance = xp.abs(rel)
    else:
        offset = 0
        distance = -xp.minimum(rel, 0)
    far = distance >= max_distance
    return offset + xp.where(far, per_side - 1, table[xp.where(far, 0, distance)])


def t5_relative_position_bucket(
    relative_position: Any, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Any:
    """T5's bucket of each relative position ``key_position - query_position`` (Raffel et al.).

    Identical to transformers' ``T5Attention._relative_position_bucket``: with ``bidirectional`` the buckets are
    split by sign (positive positions in the upper half); on each side the first half of the buckets are exact
    distances and the rest log-spaced up to ``max_distance``, beyond which everything shares the last bucket.
    Without ``bidirectional`` positive positions (the future) all fall in bucket 0.

    Parameters
    ----------
    relative_position : integer array of any shape (NumPy, CuPy, PyTorch, JAX), or a Python int / list
    bidirectional : bool
        True for encoders, False for T5's decoder self-attention.
    num_buckets : int
        ``relative_attention_num_buckets`` of the model (T5: 32).
    max_distance : int
        ``relative_attention_max_distance`` of the model (T5: 128); must exceed the exact range.

    Returns
    -------
    int64 array of the same shape and framework, values in ``[0, num_buckets)``.
    """
    bidirectional, per_side, max_exact, max_distance = _t5_geometry(bidirectional, num_buckets, max_distance)
    rel, xp, back = _interop.to_array_module("relative_position", relative_position)
    if rel.dtype.kind not in "iu":
        raise ValueError(f"relative_position: expected an integer array, got dtype {rel.dtype}")
    return back(_relative_bucket(xp, rel, bidirectional, per_side, max_exact, max_distance))


def t5_position_bias(
    table: Any,
    query_positions: Any,
    key_length: int,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Any:
    """The dense T5 bias ``[num_seqs, num_heads, key_length]`` for one query per sequence, from the bias table.

    ``out[s, h, j] = table[bucket(j - query_positions[s]), h]``. In decode the query of sequence ``s`` sits at
    position ``seq_lens[s] - 1``; this is the ``attn_bias`` that T5 attention adds to ``<q, k>`` (T5 uses
    ``scale=1.0``). Use it to materialise the bias, e.g. for tests or for an unsupported path.

    Parameters
    ----------
    table : array ``[num_buckets, num_heads]``, float
        T5's ``relative_attention_bias.weight``, as the model holds it.
    query_positions : integer array ``[num_seqs]`` (same framework as ``table``)
    key_length : int
        Keys per sequence in the result (``>= max(seq_lens)`` to serve as ``attn_bias``).
    bidirectional, num_buckets, max_distance
        As in :func:`t5_relative_position_bucket`; ``num_buckets`` must equal ``table.shape[0]``.

    Returns
    -------
    array ``[num_seqs, num_heads, key_length]`` of ``table``'s dtype, framework and device.
    """
    bidirectional, per_side, max_exact, max_distance = _t5_geometry(bidirectional, num_buckets, max_distance)
    key_length = _check_int("key_length", key_length, 0)
    weights, xp, back = _interop.to_array_module("table", table)
    positions, _, _ = _interop.to_array_module("query_positions", query_positions)
    if weights.ndim != 2 or weights.shape[0] != num_buckets:
        raise ValueError(
            f"table: expected shape (num_buckets={num_buckets}, num_heads), got {tuple(weights.shape)}"
        )
    if positions.ndim != 1 or positions.dtype.kind not in "iu":
        raise ValueError(
            f"query_positions: expected a 1-D integer array [num_seqs], got shape {tuple(positions.shape)} "
            f"dtype {positions.dtype}"
        )
    positions = xp.asarray(positions)
    rel = xp.arange(key_length, dtype=xp.int64)[None, :] - positions.astype(xp.int64)[:, None]
    buckets = _relative_bucket(xp, rel, bidirectional, per_side, max_exact, max_distance)  # [num_seqs, key_length]
    return back(xp.ascontiguousarray(weights[buckets].transpose(0, 2, 1)))


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes (Press et al.) for ``num_heads`` heads, float32 NumPy ``[num_heads]``.

    For a power of two ``n``: ``2**(-8/n * (i + 1))``. Otherwise the slopes of the largest power of two below ``n``,
    followed by every other slope of twice that power, as in the reference implementation.
    """
    num_heads = _check_int("num_heads", num_heads, 1)

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    base = 2 ** (num_heads.bit_length() - 1)  # the largest power of two <= num_heads
    slopes = power_of_two(base) + power_of_two(2 * base)[0::2][: num_heads - base]
    return np.asarray(slopes, dtype=np.float32)


class RaggedBias:
    """A bias stored ragged, sequence after sequence: memory linear in the tokens actually used.

    Sequence ``s``'s bias for query head ``h`` and key ``j`` is ``values[offsets[s] + j, h]``. Pass it as
    ``attn_bias=RaggedBias(values, offsets)`` (decode only).

    Parameters
    ----------
    values : array ``[total, num_heads]``, float32 / float16 / bfloat16, any strides
        The rows of all sequences; rows between sequences (gaps) are never read.
    offsets : array ``[num_seqs + 1]``, int32
        First row of each sequence; requires ``offsets[s + 1] - offsets[s] >= seq_lens[s]`` and
        ``0 <= offsets[s]``, ``offsets[s] + seq_lens[s] <= total``. On the GPU these device values are checked only
        with ``validate=True``; unchecked, a sequence whose rows fall outside ``values`` is cut short (no
        out-of-bounds read).

    Both arrays come from the framework of the other operands; they are checked when the bias is used.
    """

    __slots__ = ("offsets", "values")

    def __init__(self, values: Any, offsets: Any) -> None:
        self.values = values
        self.offsets = offsets

    def __repr__(self) -> str:
        return f"RaggedBias(values={_describe(self.values)}, offsets={_describe(self.offsets)})"


class RelativePositionBias:
    """T5's relative-position bias, computed in the kernel: nothing of size ``seq_len`` is materialised.

    For a query at position ``p`` and key ``j`` the kernel adds ``table[bucket(j - p), h]``, with
    ``bucket`` exactly :func:`t5_relative_position_bucket` (in decode ``p = seq_lens[s] - 1``). T5 attention uses
    ``scale=1.0``. Pass it as ``attn_bias=RelativePositionBias(layer.relative_attention_bias.weight,
    num_buckets=..., max_distance=..., bidirectional=...)``; build it once per layer and reuse it.

    Parameters
    ----------
    table : array ``[num_buckets, num_heads]``, float32 / float16 / bfloat16, any strides
        T5's ``relative_attention_bias.weight`` as the model holds it (NumPy, CuPy, PyTorch or JAX).
    num_buckets, max_distance : int
        The model's ``relative_attention_num_buckets`` / ``relative_attention_max_distance`` (T5: 32, 128).
    bidirectional : bool
        False for T5's decoder self-attention (keys after the query share bucket 0), True for its encoder.

    Attributes
    ----------
    buckets : int32 array ``[max_distance + 1]``, in ``table``'s framework and on its device
        The bucket of each distance on one side (``max_distance`` and beyond share the last entry): computed once
        here, on the host, in float32 exactly as transformers does, and read by the kernel.
    """

    __slots__ = ("bidirectional", "buckets", "max_distance", "num_buckets", "per_side", "table")

    def __init__(self, table: Any, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = False) -> None:
        bidirectional, per_side, _, max_distance = _t5_geometry(bidirectional, num_buckets, max_distance)
        weights, xp, back = _interop.to_array_module("table", table)
        if weights.ndim != 2 or weights.shape[0] != num_buckets:
            raise ValueError(
                f"table: expected shape (num_buckets={num_buckets}, num_heads), got {tuple(weights.shape)}"
            )
        host = t5_bucket_table(num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)
        if xp is np:
            buckets = back(host)
        else:
            with xp.cuda.Device(weights.device.id):
                buckets = back(xp.asarray(host))
        self.table = table
        self.num_buckets = int(num_buckets)
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.per_side = per_side
        self.buckets = buckets

    @classmethod
    def from_buckets(cls, table: Any, buckets: Any, *, num_buckets: int, max_distance: int,
                     bidirectional: bool) -> RelativePositionBias:
        """The bias around a table and a bucket array that already exist (``buckets`` as :func:`t5_bucket_table`
        gives it, in the table's framework and device): no allocation, no host copy, so it can be built inside a
        traced function, a custom operator or a CUDA-graph capture. ``buckets``' shape and dtype are checked when the
        bias is used; its values (each in ``[0, num_buckets)``, or ``[0, num_buckets // 2)`` when bidirectional) on
        the NumPy path and with ``validate=True``. Otherwise the GPU kernels hold a value outside that range to the
        last bucket of the side (a negative one too): a wrong weight, never a read outside the table."""
        bidirectional, per_side, _, max_distance = _t5_geometry(bidirectional, num_buckets, max_distance)
        bias = cls.__new__(cls)
        bias.table, bias.buckets = table, buckets
        bias.num_buckets, bias.max_distance = int(num_buckets), max_distance
        bias.bidirectional, bias.per_side = bidirectional, per_side
        return bias

    def __repr__(self) -> str:
        return (f"RelativePositionBias(table={_describe(self.table)}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional})")


def t5_bucket_table(*, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False) -> np.ndarray:
    """The bucket of each distance ``0 ... max_distance`` on one side (``max_distance`` stands for every farther
    one), int32 NumPy ``[max_distance + 1]``: what :class:`RelativePositionBias` uploads and the kernels read. Keys
    after the query add ``num_buckets // 2`` when bidirectional (and use bucket 0 when not)."""
    _, per_side, max_exact, max_distance = _t5_geometry(bidirectional, num_buckets, max_distance)
    return np.append(_bucket_table(per_side, max_exact, max_distance), per_side - 1).astype(np.int32)


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"{type(x).__module__.split('.')[0]} {getattr(x, 'dtype', '?')} {tuple(shape) if shape is not None else '?'}"
