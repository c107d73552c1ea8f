"""CPU: the launch layer's argument slots and driver structs (``_launch``), which every kernel launch goes through."""

from __future__ import annotations

import ctypes

import numpy as np

from cupy_paged_attn import _launch


def test_packed_args_are_what_cuLaunchKernel_reads():
    """PackedArgs holds one 8-byte slot per argument, a 4-byte one in the slot's low half, and an array of the slots'
    addresses (kernelParams); a write after packing lands in the slot the launch reads."""
    named = [("ptr", np.uint64(2**63 + 5)), ("n", np.int32(-7)), ("scale", np.float32(0.125)), ("stride", np.int64(-3))]
    args = _launch.PackedArgs(named)
    params = (ctypes.c_void_p * len(named)).from_address(args.address)
    read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_int64]
    assert [t.from_address(p).value for t, p in zip(read, params, strict=True)] == [2**63 + 5, -7, 0.125, -3]
    args.set_pointer("ptr", 0xDEAD0000)
    args.set("n", np.int32(9))
    assert ctypes.c_uint64.from_address(params[0]).value == 0xDEAD0000
    assert ctypes.c_int32.from_address(params[1]).value == 9
    assert ctypes.c_uint32.from_address(params[1] + 4).value == 0  # the high half of a 4-byte argument's slot


def test_launch_ex_structs_match_the_driver_abi():
    """The ctypes mirrors of cuLaunchKernelEx's structs have cuda.h's layout (CUDA 12 and 13, 64-bit):
    CUlaunchAttribute is an int id, 4 bytes of padding and a 64-byte value union (72 bytes); CUlaunchConfig is six
    unsigned dims and the shared-memory size (28 bytes), the stream at 32, the attributes at 40, their count at 48
    (56 bytes). Programmatic stream serialisation is attribute 6 with the value 1, a cluster's dimensions attribute
    4 with three unsigned values (CUlaunchAttributeValue's clusterDim). A launch with neither has no config: it goes
    through cuLaunchKernel."""
    assert ctypes.sizeof(_launch.LaunchAttribute) == 72 and _launch.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_launch.LaunchConfig) == 56
    assert [getattr(_launch.LaunchConfig, f).offset for f in ("shared_mem", "stream", "attrs", "num_attrs")] == \
        [24, 32, 40, 48]
    args = _launch.PackedArgs([("n", np.int32(5))])
    for dependent, cluster in ((True, None), (False, (1, 1, 8)), (True, (1, 1, 3))):
        launch = _launch.Launch(0x1234, (3, 2, 1), 128, args, 4096, dependent=dependent, cluster=cluster)
        config = launch._config
        assert list(config.grid) == [3, 2, 1] and list(config.block) == [128, 1, 1] and config.shared_mem == 4096
        expected = ([(6, [1, 0, 0])] if dependent else []) + ([(4, list(cluster))] if cluster else [])
        assert [(a.id, list(a.value)) for a in (config.attrs[i] for i in range(config.num_attrs))] == expected
    assert _launch.Launch(0x1234, (3, 2, 1), 128, args)._config is None
    # Without a driver (a CPU machine) there is no cuLaunchKernelEx, and nothing fails on import or lookup.
    assert _launch.launch_kernel_ex() is None or callable(_launch.launch_kernel_ex())
