"""The facts planning needs of a real GPU (:class:`cupy_paged_attn.planning.Device`), read once per device."""

from __future__ import annotations

import functools

from . import _launch
from .planning import Device


@functools.cache
def query(device: int) -> Device:
    """SMs, shared memory per SM and per CTA's reservation, compute capability and whether the driver has
    ``cuLaunchKernelEx``, of CUDA device ``device``."""
    import cupy

    attributes = cupy.cuda.Device(device).attributes
    return Device(
        num_sms=int(attributes["MultiProcessorCount"]),
        smem_per_sm=int(attributes["MaxSharedMemoryPerMultiprocessor"]),
        reserved_smem_per_cta=int(attributes.get("ReservedSharedMemoryPerBlock", 1024)),
        compute_capability=int(cupy.cuda.Device(device).compute_capability),
        launch_ex=_launch.launch_kernel_ex() is not None,
    )
