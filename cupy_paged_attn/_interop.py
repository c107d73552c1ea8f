"""The boundary with the caller's framework: wrap operands on the way in, answer in the caller's type on the way out.

Supported operands: NumPy arrays (CPU path, run by the reference), and CUDA arrays of CuPy, PyTorch and JAX (or any
other object with ``__dlpack__``, treated as CuPy would). torch and jax are imported lazily, only when an operand
of theirs arrives, so neither is a dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Frameworks by the top-level module of an operand's type.
_FRAMEWORKS = {"numpy": "numpy", "cupy": "cupy", "torch": "torch", "jax": "jax", "jaxlib": "jax"}


def framework_of(name: str, x: Any) -> str:
    """``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"`` or ``"dlpack"``; TypeError for anything else."""
    top = type(x).__module__.split(".")[0]
    if top in _FRAMEWORKS:
        return _FRAMEWORKS[top]
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    kind = "None" if x is None else f"{type(x).__module__}.{type(x).__name__}"
    raise TypeError(f"{name}: expected a NumPy, CuPy, PyTorch or JAX array, got {kind}")


def common_framework(named: dict[str, Any], optional: tuple[str, ...]) -> str:
    """The one framework of all operands (``optional`` ones may be None); TypeError naming the odd one out."""
    found: dict[str, str] = {}
    for name, x in named.items():
        if x is not None or name not in optional:
            found[name] = framework_of(name, x)
    first_name, first = next(iter(found.items()))
    for name, fw in found.items():
        if fw != first:
            raise TypeError(
                f"{name}: all arrays must come from one framework; {first_name} is {first}, {name} is {fw}"
            )
    return first


@dataclass
class Operand:
    """One wrapped argument: ``array`` is a NumPy array (CPU path) or a CuPy view of the caller's memory."""

    name: str
    array: Any
    device: int  # CUDA device ordinal, -1 on the CPU


def _torch_to_cupy(name: str, x: Any) -> Any:
    import cupy

    if x.device.type != "cuda":
        raise ValueError(
            f"{name}: expected a CUDA tensor, got a tensor on {x.device}; pass NumPy arrays for the CPU path"
        )
    return cupy.from_dlpack(x.detach())


def _jax_to_cupy(name: str, x: Any) -> Any:
    import cupy

    platforms = {d.platform for d in x.devices()}
    if platforms != {"gpu"}:
        raise ValueError(f"{name}: expected a JAX array on one GPU, got one on {sorted(platforms)}")
    try:
        return cupy.from_dlpack(x)
    except BufferError as exc:  # JAX exports only compact strides
        raise ValueError(f"{name}: JAX could not export this array through DLPack ({exc})") from exc


def wrap(name: str, x: Any, framework: str) -> Operand:
    """Wrap one operand of ``framework`` (already checked to be its framework)."""
    if framework == "numpy":
        return Operand(name, np.asarray(x), -1)
    if framework == "torch":
        arr = _torch_to_cupy(name, x)
    elif framework == "jax":
        arr = _jax_to_cupy(name, x)
    elif framework == "cupy":
        arr = x
    else:
        import cupy

        arr = cupy.from_dlpack(x)
    return Operand(name, arr, arr.device.id)


def device_of(name: str, x: Any, framework: str) -> int:
    """CUDA ordinal of a GPU operand before it is wrapped (to enter its device and read its stream)."""
    if framework == "torch":
        if x.device.type != "cuda":
            _torch_to_cupy(name, x)  # raises the CPU-tensor error
        return int(x.device.index)
    if framework == "jax":
        devices = list(x.devices())
        if len(devices) != 1 or devices[0].platform != "gpu":
            _jax_to_cupy(name, x)  # raises the placement error
        return int(devices[0].local_hardware_id)
    if framework == "cupy":
        return int(x.device.id)
    kind, ordinal = x.__dlpack_device__()
    if int(kind) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
        raise ValueError(f"{name}: expected a CUDA array, got DLPack device type {int(kind)}")
    return int(ordinal)


def same_device(operands: list[Operand]) -> int:
    """The device shared by all operands; ValueError naming the first that differs."""
    first = operands[0]
    for op in operands[1:]:
        if op.device != first.device:
            raise ValueError(
                f"{op.name}: expected an array on device {first.device} like {first.name}, got device {op.device}"
            )
    return first.device


# ---------------------------------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------------------------------
def resolve_stream(stream: Any, framework: str, device: int, like: Any) -> Any:
    """The CuPy stream to launch on: ``stream`` if given, else the framework's current stream on ``device``.

    Accepts a CuPy stream, a ``torch.cuda.Stream`` (torch operands only) or a raw ``cudaStream_t`` as an int. The
    current stream is read on every call, never cached, so CUDA-graph capture and ``torch.cuda.stream()`` work.
    """
    import cupy

    if stream is None:
        if framework == "torch":
            import torch

            return cupy.cuda.Stream.from_external(torch.cuda.current_stream(like.device))
        return cupy.cuda.get_current_stream()
    if isinstance(stream, int) and not isinstance(stream, bool):
        return cupy.cuda.Stream.from_external(_RawStream(stream, device))
    module = type(stream).__module__.split(".")[0]
    if module == "cupy" and hasattr(stream, "ptr"):
        return stream
    if module == "torch" and hasattr(stream, "cuda_stream"):
        if framework != "torch":
            raise TypeError(f"stream: a torch stream cannot order {framework} arrays; pass a CuPy stream or an int")
        return cupy.cuda.Stream.from_external(stream)
    raise TypeError(
        f"stream: expected None, a CuPy stream, a torch.cuda.Stream or a cudaStream_t int, got {type(stream).__name__}"
    )


class _RawStream:
    """A bare ``cudaStream_t`` presented through the ``__cuda_stream__`` protocol."""

    def __init__(self, ptr: int, device: int) -> None:
        self._ptr = ptr
        self.device = device

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._ptr)


# ---------------------------------------------------------------------------------------------------------------
# Results in the caller's type
# ---------------------------------------------------------------------------------------------------------------
def empty(framework: str, shape: tuple[int, ...], dtype: Any, like: Any) -> tuple[Any, Any]:
    """Allocate ``(result_for_caller, cupy_or_numpy_view)`` of ``shape`` and ``dtype`` where ``like`` lives.

    torch results are allocated by torch (its caching allocator, safe under CUDA-graph capture); CuPy and JAX
    results by CuPy (JAX arrays are then made zero-copy from the CuPy buffer by :func:`finish`).
    """
    if framework == "numpy":
        arr = np.empty(shape, dtype=dtype)
        return arr, arr
    if framework == "torch":
        import torch

        result = torch.empty(shape, dtype=_torch_dtype(dtype), device=like.device)
        return result, _torch_to_cupy("out", result)
    import cupy

    arr = cupy.empty(shape, dtype=dtype)
    return arr, arr


def finish(framework: str, result: Any) -> Any:
    """Hand ``result`` (from :func:`empty`) back in the caller's framework."""
    if framework == "jax":
        import jax

        return jax.dlpack.from_dlpack(result)
    return result


def _torch_dtype(dtype: Any) -> Any:
    import ml_dtypes
    import torch

    table = {
        np.dtype(np.float16): torch.float16,
        np.dtype(np.float32): torch.float32,
        np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
    }
    return table[np.dtype(dtype)]
