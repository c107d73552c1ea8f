"""Host cost of each piece of a ``paged_attention`` / ``DecodePlan.run`` call (the latency case, torch tensors):
the torch and CuPy primitives a call is made of, the library's stages, then the whole calls.

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/host_pieces.py``. Each row is the median of 4000 calls of
one piece (after 300 warm-up calls; the GPU synchronised every 200), timed by ``time.perf_counter`` around the
call, the Python call of the timed lambda included ("empty python call" is that overhead alone). The stages call
private functions of ``cupy_paged_attn.decode`` as a call runs them; a launch row queues the kernel on the null
stream with the plan's last arguments. Where ``host_overhead.py`` says what a call costs, this says where it goes.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
from host_overhead import host_times, latency_case

#: latency_case's arrays, in the order of paged_attention's operands, then the bias and an out.
CASE_ARRAYS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "bias", "out")


def median_us(fn: Callable[[], Any], calls: int = 4000) -> tuple[float, float]:
    """Median and 10th percentile of ``fn``'s host time, µs."""
    times = sorted(host_times(fn, calls, warmup=300))
    return times[len(times) // 2] * 1e6, times[len(times) // 10] * 1e6


def row(label: str, fn: Callable[[], Any]) -> None:
    median, p10 = median_us(fn)
    print(f"{label:58s} {median:7.2f} us  (p10 {p10:.2f})", flush=True)


def primitives(case: dict[str, Any], plan: Any) -> None:
    """What torch, CuPy and Python cost per call of the things a call does."""
    import cupy
    import torch

    from cupy_paged_attn import _interop

    q, k = case["query"], case["key_cache"]
    heads = q.shape[1]
    slots, numpy_slots = array.array("Q", bytes(64)), np.zeros(8, np.uint64)
    row("empty python call", lambda: None)
    row("q.dtype", lambda: q.dtype)
    row("q.shape", lambda: q.shape)
    row("q.stride()", lambda: q.stride())
    row("q.get_device()", lambda: q.get_device())
    row("q.data_ptr()", lambda: q.data_ptr())
    row("q.device", lambda: q.device)
    row("signature(q)", lambda: _interop.signature(q, "torch"))
    row("signature(k) == sig", lambda: _interop.signature(k, "torch") == plan._signatures["key_cache"])
    row("torch.empty(shape, dtype, device=q.device)",
        lambda: torch.empty((1, heads, 64), dtype=torch.bfloat16, device=q.device))
    row("torch.empty_like(q)", lambda: torch.empty_like(q))
    row("torch.empty_like(q, contiguous)", lambda: torch.empty_like(q, memory_format=torch.contiguous_format))
    row("q.new_empty(shape)", lambda: q.new_empty((1, heads, 64)))
    row("torch.empty(n, float32, device=q.device)",
        lambda: torch.empty(8 * 16 * 66, dtype=torch.float32, device=q.device))
    row("torch.empty(n, float32, device=0)", lambda: torch.empty(8 * 16 * 66, dtype=torch.float32, device=0))
    row("_interop.empty(torch)", lambda: _interop.empty("torch", (1, heads, 64), plan._query.dtype, q,
                                                        _interop.StreamPtr(0)))
    row("cupy.cuda.runtime.getDevice()", lambda: cupy.cuda.runtime.getDevice())
    row("_interop.current_device()", _interop.current_device)
    row("torch.cuda.current_device()", torch.cuda.current_device)
    row("_torch_current_stream(0)", lambda: _interop._torch_current_stream(0))
    row("resolve_stream(None, torch, 0)", lambda: _interop.resolve_stream(None, "torch", 0))
    row("array.array slot write", lambda: slots.__setitem__(3, 12345678))
    row("numpy slot write", lambda: numpy_slots.__setitem__(3, 12345678))


def stages(case: dict[str, Any], plan: Any) -> None:
    """The library's steps of a call with a dense bias, one at a time."""
    from cupy_paged_attn import _checks, _interop, decode

    q, k, v, tables, lens, bias, out = (case[n] for n in CASE_ARRAYS)
    row("_operands(...)", lambda: decode._operands(q, k, v, tables, lens, None, None))
    row("_operands(..., dense)", lambda: decode._operands(q, k, v, tables, lens, bias, None))
    named = decode._operands(q, k, v, tables, lens, bias, None)
    key, signatures, _ = decode._plan_key(named, None, "nhd", bias)
    row("_plan_key(dense)", lambda: decode._plan_key(named, None, "nhd", bias))
    row("bias_geometry(dense)", lambda: _checks.bias_geometry(bias))
    row("hash(key)", lambda: hash(key))
    stream = _interop.resolve_stream(None, "torch", 0)
    row("plan._point_at(signatures given)", lambda: plan._point_at(named, "torch", stream, signatures))
    row("plan._point_at(checking)", lambda: plan._point_at(named, "torch", stream, None))
    row("plan._launch_into(out)", lambda: plan._launch_into(out, q, stream))
    row("plan._launch_into(None)", lambda: plan._launch_into(None, q, stream))
    launch = plan.launch
    if not launch.cluster:  # a kernel that combines its partitions in clusters runs only in them
        row("one cuLaunchKernel (attention, via cupy driver)",
            lambda: plan._args.launch(plan._function, launch.grid, launch.threads, launch.shared_mem, 0))
    if plan._attention_launch is not None:
        row("one cuLaunchKernelEx (attention, ctypes)", lambda: plan._attention_launch.launch(0))
    if plan._reduce_launch is not None:
        row("one cuLaunchKernelEx (reduce, ctypes)", lambda: plan._reduce_launch.launch(0))


def calls(case: dict[str, Any], plan_none: Any, plan_dense: Any) -> None:
    import cupy_paged_attn as cpa

    q, k, v, tables, lens, bias, out = (case[n] for n in CASE_ARRAYS)
    for label, call, kwargs in (
        ("paged_attention none", cpa.paged_attention, {}),
        ("paged_attention none out=", cpa.paged_attention, {"out": out}),
        ("paged_attention dense out=", cpa.paged_attention, {"attn_bias": bias, "out": out}),
        ("paged_attention dense", cpa.paged_attention, {"attn_bias": bias}),
        ("plan.run none out=", plan_none.run, {"out": out}),
        ("plan.run none", plan_none.run, {}),
        ("plan.run dense out=", plan_dense.run, {"attn_bias": bias, "out": out}),
    ):
        row(label, lambda call=call, kwargs=kwargs: call(q, k, v, tables, lens, **kwargs))


def main() -> None:
    import cupy_paged_attn as cpa

    for heads, kv_heads in ((16, 16), (32, 8)):
        case = latency_case(heads, kv_heads)
        operands = [case[n] for n in CASE_ARRAYS[:5]]
        plan_none = cpa.DecodePlan(*operands)
        plan_dense = cpa.DecodePlan(*operands, attn_bias=case["bias"])
        launch = plan_none.launch
        print(f"== H{heads}/{kv_heads}: {launch.num_parts} parts, tensor cores {launch.tensor_cores}, "
              f"clusters {launch.cluster}, attention by cuLaunchKernelEx {plan_none._attention_launch is not None}")
        if heads == 16:
            primitives(case, plan_none)
            stages(case, plan_dense)
        calls(case, plan_none, plan_dense)


if __name__ == "__main__":
    main()
