"""The library's tuning switches: which kernel, tiling and launch mechanism a call uses where several could run.

The defaults are what measured fastest on the H200 (docs/performance.md); a switch exists so that tests cover every
path and a benchmark can compare two in one process. They are process-wide::

    import cupy_paged_attn as cpa

    with cpa.tuning.override(decode_kernel="simt", cluster_combine=False):
        out = cpa.paged_attention(...)        # the SIMT decode, partitions combined by the combine kernel
    cpa.tuning.current()                      # the switches in force

A plan (``DecodePlan``, or the per-call plans ``paged_attention`` caches) keeps the choices of the tuning it was made
under; the cached plans are keyed by it, so a call under other switches is planned again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Tuning", "current", "override"]

_DECODE_KERNELS = ("auto", "tensor-cores", "simt")


@dataclass(frozen=True)
class Tuning:
    """The switches. Every field's default is the library's normal behaviour.

    Attributes
    ----------
    decode_kernel : {"auto", "tensor-cores", "simt"}
        ``"auto"``: float16 / bfloat16 decode of head sizes up to 128 runs on the tensor cores when it has grouped
        queries, or multi-head queries whose grid fills the GPU unsplit (``multi_head_tensor_cores``); the rest on
        the SIMT kernel (float32 arithmetic on the CUDA cores). ``"tensor-cores"``: every problem the tensor-core
        kernel can take goes there, multi-head ones of any grid and bias too. ``"simt"``: every problem on the SIMT
        kernel, but grouped queries over fp8 caches up to head size 128 (the SIMT kernel of fp8 caches serves one
        query head per CTA there).
    multi_head_tensor_cores : bool
        With ``"auto"``, multi-head problems (one query head per KV head) may run on the tensor cores.
    wgmma : bool
        Prefill on an H100 / H200 (compute capability 9.0) runs the Hopper tiling (wgmma) where it applies; False
        keeps every prefill on the mma.sync tiling.
    cluster_combine : bool
        A split SIMT decode grid small enough combines its partitions in thread block clusters (compute capability
        9.0 and later); False: always by the combine kernel.
    dependent_launch : bool
        A split decode grid and its combine are launched with programmatic dependent launch (compute capability 9.0
        and later); False: plain launches.
    longest_first : bool
        A decode grid of more than one wave takes its sequences longest first; False: in index order.
    num_sms : int or None
        Plan as if the GPU had this many SMs (None: the device's own). 1 never splits the keys; a huge number
        splits as far as the keys allow.
    """

    decode_kernel: str = "auto"
    multi_head_tensor_cores: bool = True
    wgmma: bool = True
    cluster_combine: bool = True
    dependent_launch: bool = True
    longest_first: bool = True
    num_sms: int | None = None

    def __post_init__(self) -> None:
        if self.decode_kernel not in _DECODE_KERNELS:
            raise ValueError(f"decode_kernel: expected one of {', '.join(map(repr, _DECODE_KERNELS))}, got "
                             f"{self.decode_kernel!r}")
        for name in ("multi_head_tensor_cores", "wgmma", "cluster_combine", "dependent_launch", "longest_first"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        sms = self.num_sms
        if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
            raise ValueError(f"num_sms: expected None or a positive int, got {sms!r}")


_lock = threading.Lock()
_current = Tuning()


def current() -> Tuning:
    """The switches in force."""
    return _current


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Tuning]:
    """Change some switches for the block (process-wide), then restore them; yields the switches in force.

    Raises TypeError for a name that is no switch, and as :class:`Tuning` does for a bad value.
    """
    global _current
    fields = {f.name for f in dataclasses.fields(Tuning)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"{unknown[0]}: not a tuning switch; the switches are {', '.join(sorted(fields))}")
    with _lock:
        saved = _current
        _current = dataclasses.replace(saved, **changes)  # type: ignore[arg-type]
        changed = _current
    try:
        yield changed
    finally:
        with _lock:
            _current = saved
