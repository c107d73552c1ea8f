"""The boundary with the caller's framework: wrap operands on the way in, answer in the caller's type on the way out.

Supported operands: NumPy arrays (CPU path, run by the reference), and CUDA arrays of CuPy, PyTorch and JAX (or any
other object with ``__dlpack__``, imported as CuPy would). torch and jax are imported lazily, only when an operand
of theirs arrives, so neither is a dependency.

Wrapped GPU operands are CuPy arrays, except torch tensors: they are read directly (pointer, shape, strides) through
:class:`TorchArray`, which costs far less per call than a DLPack round trip, and they are already ordered on
torch's current stream, where the kernels launch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ml_dtypes
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


def call_framework(named: dict[str, Any], optional: tuple[str, ...], *, stream: Any, out: Any) -> str:
    """:func:`common_framework` of an entry point's operands, after the refusals every entry point shares: a
    ``stream`` for NumPy arrays (they run on the CPU) and ``out=`` for JAX arrays (immutable)."""
    framework = common_framework(named, optional)
    if framework == "numpy" and stream is not None:
        raise TypeError("stream: NumPy arrays run on the CPU; expected stream=None")
    if framework == "jax" and out is not None:
        raise TypeError("out: JAX arrays are immutable; call without out= and use the returned array")
    return framework


@dataclass
class Operand:
    """One wrapped argument: ``array`` is a NumPy array (CPU path), a CuPy array or a :class:`TorchArray`."""

    name: str
    array: Any
    device: int  # CUDA device ordinal, -1 on the CPU


# ---------------------------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------------------------
@functools.cache
def _torch_numpy_dtypes() -> dict[Any, np.dtype]:
    """NumPy dtypes of torch dtypes (built on first use: torch is imported only when a tensor arrives)."""
    import torch

    return {
        torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
        torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
        torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8), torch.int16: np.dtype(np.int16),
        torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64), torch.bool: np.dtype(np.bool_),
        torch.complex64: np.dtype(np.complex64), torch.complex128: np.dtype(np.complex128),
        torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn), torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    }


#: NumPy dtypes that torch's ``Tensor.numpy()`` cannot give, and the torch dtype of the same width their bits
#: travel as: bfloat16 as int16, the float8 formats as uint8.
_BITS_DTYPES = {
    np.dtype(ml_dtypes.bfloat16): "int16",
    np.dtype(ml_dtypes.float8_e4m3fn): "uint8",
    np.dtype(ml_dtypes.float8_e5m2): "uint8",
}


class TorchArray:
    """A CUDA tensor seen through what the checks and launches read: shape, NumPy dtype, byte strides, pointer."""

    __slots__ = ("dtype", "ndim", "ptr", "shape", "strides", "tensor")

    def __init__(self, name: str, tensor: Any) -> None:
        try:
            self.dtype = _torch_numpy_dtypes()[tensor.dtype]
        except KeyError:
            raise ValueError(f"{name}: unsupported dtype {tensor.dtype}") from None
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.ndim = len(self.shape)
        self.strides = tuple(s * self.dtype.itemsize for s in tensor.stride())
        self.ptr = tensor.data_ptr()


def _check_torch_device(name: str, x: Any) -> int:
    if x.device.type != "cuda":
        raise ValueError(
            f"{name}: expected a CUDA tensor, got a tensor on {x.device}; pass NumPy arrays for the CPU path"
        )
    return int(x.device.index)


# ---------------------------------------------------------------------------------------------------------------
# Wrapping
# ---------------------------------------------------------------------------------------------------------------
def _jax_to_cupy(name: str, x: Any) -> Any:
    import cupy

    try:
        return cupy.from_dlpack(x)
    except BufferError as exc:  # JAX exports only compact strides
        raise ValueError(f"{name}: JAX could not export this array through DLPack ({exc})") from exc


def wrap(name: str, x: Any, framework: str) -> Operand:
    """Wrap one operand of ``framework`` (already checked to be its framework).

    CuPy imports (JAX, other DLPack producers) happen on CuPy's current stream: call this inside the launch
    stream's context so the producer orders its pending work before the launch.
    """
    if framework == "numpy":
        return Operand(name, np.asarray(x), -1)
    if framework == "torch":
        return Operand(name, TorchArray(name, x), _check_torch_device(name, x))
    if framework == "jax":
        arr = _jax_to_cupy(name, x)
    elif framework == "cupy":
        arr = x
        if not whole_elements(arr):  # the kernels step through arrays in whole elements
            raise ValueError(f"{name}: strides must be whole elements ({arr.itemsize} bytes), got {arr.strides} "
                             "bytes")
    else:
        import cupy

        arr = cupy.from_dlpack(x)
    return Operand(name, arr, arr.device.id)


def device_of(name: str, x: Any, framework: str) -> int:
    """CUDA ordinal of a GPU operand before it is wrapped (to enter its device and read its stream)."""
    if framework == "torch":
        return _check_torch_device(name, x)
    if framework == "jax":
        devices = list(x.devices())
        if len(devices) != 1 or devices[0].platform != "gpu":
            raise ValueError(f"{name}: expected a JAX array on one GPU, got one on {devices}")
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


def wrap_all(named: dict[str, Any], framework: str) -> dict[str, Any]:
    """Wrap every operand that is not None, by name; ValueError if they live on different devices."""
    ops = [wrap(name, x, framework) for name, x in named.items() if x is not None]
    same_device(ops)
    return {op.name: op.array for op in ops}


def to_array_module(name: str, x: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
    """``(array, xp, back)``: ``x`` as a NumPy (host) or CuPy (GPU) array, zero-copy where possible, its array
    module, and a function that turns a result computed with ``xp`` back into ``x``'s framework and device.

    Python scalars and lists become NumPy arrays (and results stay NumPy).
    """
    top = type(x).__module__.split(".")[0]
    if top == "torch":
        if x.device.type == "cuda":
            import cupy
            import torch

            return cupy.from_dlpack(x.detach()), cupy, torch.from_dlpack
        import torch

        t = x.detach()
        dtype = _torch_numpy_dtypes().get(t.dtype)
        if dtype in _BITS_DTYPES:
            return t.view(getattr(torch, _BITS_DTYPES[dtype])).numpy().view(dtype), np, torch_from_numpy
        return t.numpy(), np, torch_from_numpy
    if top in ("jax", "jaxlib"):
        import jax

        if all(d.platform == "cpu" for d in x.devices()):
            return np.asarray(x), np, jax.numpy.asarray
        import cupy

        return _jax_to_cupy(name, x), cupy, jax.dlpack.from_dlpack
    if top == "cupy":
        import cupy

        return x, cupy, _identity
    if isinstance(x, (np.ndarray, np.generic, int, float, list, tuple)):
        return np.asarray(x), np, _identity
    kind = f"{type(x).__module__}.{type(x).__name__}"
    raise TypeError(f"{name}: expected a NumPy, CuPy, PyTorch or JAX array, got {kind}")


def _identity(x: Any) -> Any:
    return x


def to_numpy(x: Any) -> Any:
    """A host NumPy copy of a NumPy, CuPy, PyTorch or JAX array (bfloat16 kept, through ml_dtypes); None stays None."""
    if x is None or isinstance(x, np.ndarray):
        return x
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return x.get()
    if module == "torch":
        return to_array_module("x", x.detach().cpu())[0]
    return np.asarray(x)


def torch_from_numpy(arr: np.ndarray) -> Any:
    """A CPU tensor over a NumPy array (over a contiguous copy if it is not contiguous); bfloat16 and the float8
    formats through their bits."""
    import torch

    arr = np.ascontiguousarray(arr)
    bits = _BITS_DTYPES.get(arr.dtype)
    if bits is not None:
        torch_dtype = {v: k for k, v in _torch_numpy_dtypes().items()}[arr.dtype]
        return torch.from_numpy(arr.view(bits)).view(torch_dtype)
    return torch.from_numpy(arr)


def data_ptr(arr: Any) -> int:
    """Device (or host) address of a wrapped array's first element."""
    if isinstance(arr, TorchArray):
        return arr.ptr
    if isinstance(arr, np.ndarray):
        return int(arr.ctypes.data)
    return int(arr.data.ptr)


def kernel_arg(arr: Any) -> np.uint64:
    """A wrapped GPU array as a kernel's pointer argument."""
    return np.uint64(data_ptr(arr))


def contiguous(arr: Any) -> Any:
    """A C-contiguous copy of a wrapped GPU array, in its own framework's memory (for inputs only)."""
    if isinstance(arr, TorchArray):
        return TorchArray("copy", arr.tensor.contiguous())
    import cupy

    return cupy.ascontiguousarray(arr)


def unit_last_stride(arr: Any) -> Any:
    """``arr`` itself if its last dimension is contiguous, else a contiguous copy (for inputs only)."""
    return arr if arr.strides[-1] == arr.dtype.itemsize else contiguous(arr)


# ---------------------------------------------------------------------------------------------------------------
# The fast path of a plan: torch and CuPy arrays read as they are, no wrapping
# ---------------------------------------------------------------------------------------------------------------
def whole_elements(x: Any) -> bool:
    """Whether a CuPy array's byte strides are whole elements (where a dimension has more than one)."""
    return not any(st % x.itemsize for st, n in zip(x.strides, x.shape, strict=True) if n > 1)


def signature(x: Any, kind: str) -> tuple[Any, ...]:
    """``(dtype, shape, strides in elements, device)`` of a torch (``kind="torch"``) or CuPy array: what a plan
    compares on every run, read in a few hundred nanoseconds."""
    if kind == "torch":
        return (x.dtype, x.shape, x.stride(), x.get_device())  # torch.Size: a tuple
    size = x.itemsize
    strides = tuple(s // size for s in x.strides)
    if any(s % size for s in x.strides) and not whole_elements(x):  # like no array the checks let through
        strides = ("bytes", *x.strides)
    return (x.dtype, x.shape, strides, x.device.id)


def signatures(arrays: dict[str, Any], kind: str) -> dict[str, tuple[Any, ...]]:
    """:func:`signature` of each array of ``arrays`` that is not None, by name; torch's read inline (a call's key
    reads six or seven)."""
    if kind == "torch":
        return {name: (x.dtype, x.shape, x.stride(), x.get_device()) for name, x in arrays.items() if x is not None}
    return {name: signature(x, kind) for name, x in arrays.items() if x is not None}


def describe_signature(sig: tuple[Any, ...]) -> str:
    dtype, shape, strides, device = sig
    unit = "elements"
    if strides[:1] == ("bytes",):
        strides, unit = strides[1:], "bytes, not whole elements"
    return f"dtype {dtype}, shape {tuple(shape)}, strides {tuple(strides)} ({unit}) on device {device}"


def native_pointer(x: Any, kind: str) -> int:
    return x.data_ptr() if kind == "torch" else x.data.ptr


def native_contiguous(x: Any, kind: str) -> Any:
    if kind == "torch":
        return x.contiguous()
    import cupy

    return cupy.ascontiguousarray(x)


def stream_current(kind: str, launch_stream: Any) -> Any:
    """A context in which ``launch_stream`` (from :func:`resolve_stream`) is the current stream of ``kind``'s
    framework, so work queued there (a copy) is ordered before the launch."""
    if kind == "torch":
        import torch

        explicit = getattr(launch_stream, "torch_stream", None)
        return torch.cuda.stream(explicit) if explicit is not None else contextlib.nullcontext()
    import cupy

    return launch_stream if isinstance(launch_stream, cupy.cuda.Stream) else contextlib.nullcontext()


def current_device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make ``device`` current for the block (a kernel launches into the current device's context); costs nothing
    when it already is."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device:
        yield
    else:
        with cupy.cuda.Device(device):
            yield


# ---------------------------------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------------------------------
class StreamPtr:
    """The one thing a CuPy launch reads from its ``stream=``: ``ptr``, the ``cudaStream_t``. ``torch_stream`` is
    the torch stream a caller passed explicitly (None for torch's current stream): torch allocates on it."""

    __slots__ = ("ptr", "torch_stream")

    def __init__(self, ptr: int, torch_stream: Any = None) -> None:
        self.ptr = ptr
        self.torch_stream = torch_stream


@contextlib.contextmanager
def launch_context(framework: str, device: int, stream: Any) -> Iterator[Any]:
    """Enter ``device`` and yield the launch stream (:func:`resolve_stream`). A CuPy stream is made current for the
    block, so DLPack imports (JAX, other producers) order their pending work before the launch; torch operands are
    read without an import and are already ordered on torch's current stream."""
    import cupy

    with cupy.cuda.Device(device):
        launch_stream = resolve_stream(stream, framework, device)
        with launch_stream if isinstance(launch_stream, cupy.cuda.Stream) else contextlib.nullcontext():
            yield launch_stream


def resolve_stream(stream: Any, framework: str, device: int) -> Any:
    """The stream to launch on: ``stream`` if given, else the framework's current stream on ``device``.

    Accepts a CuPy stream, a ``torch.cuda.Stream`` (torch operands only) or a raw ``cudaStream_t`` as an int. The
    current stream is read on every call, never cached, so CUDA-graph capture and ``torch.cuda.stream()`` work.
    Returns a CuPy stream (usable as a context for DLPack imports) or, for torch, a :class:`StreamPtr`.
    """
    import cupy

    if stream is None:
        if framework == "torch":
            return StreamPtr(_torch_current_stream(device))
        return cupy.cuda.get_current_stream()
    if isinstance(stream, int) and not isinstance(stream, bool):
        if framework == "torch":
            import torch

            return StreamPtr(stream, torch.cuda.ExternalStream(stream, device=device))
        return cupy.cuda.Stream.from_external(_RawStream(stream, device))
    module = type(stream).__module__.split(".")[0]
    if module == "cupy" and hasattr(stream, "ptr"):
        return stream
    if module == "torch" and hasattr(stream, "cuda_stream"):
        if framework != "torch":
            raise TypeError(f"stream: a torch stream cannot order {framework} arrays; pass a CuPy stream or an int")
        return StreamPtr(stream.cuda_stream, stream)
    raise TypeError(
        f"stream: expected None, a CuPy stream, a torch.cuda.Stream or a cudaStream_t int, got {type(stream).__name__}"
    )


@functools.cache
def _torch_stream_reader() -> Callable[[int], int]:
    """torch's current ``cudaStream_t`` of a device: its private raw getter when present (no Stream object built,
    as Triton reads it), else the public API."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def _torch_current_stream(device: int) -> int:
    return _torch_stream_reader()(device)


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
def empty(framework: str, shape: tuple[int, ...], dtype: Any, like: Any, stream: Any) -> tuple[Any, Any]:
    """Allocate ``(result_for_caller, wrapped_view)`` of ``shape`` and ``dtype`` where ``like`` lives, for use on
    ``stream`` (from :func:`resolve_stream`).

    torch results are allocated by torch (its caching allocator, safe under CUDA-graph capture), on the launch
    stream so that the allocator never hands the memory to other work while the kernel may still use it. CuPy and
    JAX results are allocated by CuPy, whose pool is stream-ordered too (JAX arrays are then made zero-copy from
    the CuPy buffer by :func:`finish`).
    """
    if framework == "numpy":
        arr = np.empty(shape, dtype=dtype)
        return arr, arr
    if framework == "torch":
        import torch

        with torch.cuda.stream(stream.torch_stream) if stream.torch_stream is not None else contextlib.nullcontext():
            result = torch.empty(shape, dtype=_torch_dtype(dtype), device=like.device)
        return result, TorchArray("out", result)
    import cupy

    arr = cupy.empty(shape, dtype=dtype)
    return arr, arr


def empty_like_torch(like: Any, stream: Any) -> Any:
    """A contiguous torch tensor of ``like``'s shape, dtype and device, allocated for use on ``stream`` as
    :func:`empty` allocates."""
    import torch

    if stream.torch_stream is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    with torch.cuda.stream(stream.torch_stream):
        return torch.empty_like(like, memory_format=torch.contiguous_format)


def scratch(framework: str, count: int, like: Any, stream: Any) -> tuple[Any, int]:
    """``count`` float32 of scratch memory where ``like`` lives, for use on ``stream``, allocated as :func:`empty`
    allocates: ``(owner, address)``, the owner to be kept until the work that uses it is queued."""
    if framework == "torch":
        import torch

        if stream.torch_stream is None:
            buffer = torch.empty(count, dtype=torch.float32, device=like.device)
        else:
            with torch.cuda.stream(stream.torch_stream):
                buffer = torch.empty(count, dtype=torch.float32, device=like.device)
        return buffer, buffer.data_ptr()
    import cupy

    arr = cupy.empty(count, dtype=np.float32)
    return arr, arr.data.ptr


def finish(framework: str, result: Any) -> Any:
    """Hand ``result`` (from :func:`empty`) back in the caller's framework."""
    if framework == "jax":
        import jax

        return jax.dlpack.from_dlpack(result)
    return result


@functools.cache
def _torch_dtype(dtype: Any) -> Any:
    wanted = np.dtype(dtype)
    return next(t for t, d in _torch_numpy_dtypes().items() if d == wanted)
