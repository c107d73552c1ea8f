"""A decode step as a serving loop runs it, on the latency case (B1 H16/16 d64 L1024, bf16, block 16): the new
token's key and value written into the cache (``reshape_and_cache``), then ``DecodePlan.run``. GPU time per step of a
CUDA graph of 20 steps (L2 warm), median of 20 replays, with the split attention kernel launched plainly and as a
programmatic dependent of the cache write (``decode.DEPENDENT_ATTENTION``), for no bias, a dense bias and T5.

bench_decode.py times back-to-back attention calls, where each call's attention kernel follows the previous call's
reduction; here it follows the cache write, as in a model. Each step's output is checked against the plain launch.

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/serving_step.py``.
"""

from __future__ import annotations

from host_overhead import latency_case
from latency_split import replay_us

STEPS_PER_GRAPH = 20


def per_step_us(bias_kind: str, dependent: bool) -> tuple[float, object]:
    """(µs per step, the last step's output) of the latency case's decode step."""
    import torch

    import cupy_paged_attn as cpa
    from cupy_paged_attn import decode

    decode.DEPENDENT_ATTENTION = dependent
    torch.manual_seed(0)
    case = latency_case()
    operands = [case[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    heads, kv_heads, head_size = case["query"].shape[1], case["key_cache"].shape[2], case["query"].shape[2]
    bias = {"none": None, "dense": case["bias"],
            "t5": cpa.RelativePositionBias(torch.randn(32, heads, device="cuda", dtype=torch.bfloat16))}[bias_kind]
    plan = cpa.DecodePlan(*operands, attn_bias=bias)
    # The newest token's slot: the last position of the sequence (page block_tables[0, -1], its last offset).
    block = case["key_cache"].shape[1]
    slot = (case["block_tables"][:, -1].to(torch.int64) * block + block - 1).contiguous()
    new_k = torch.randn(1, kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
    new_v = torch.randn_like(new_k)

    def steps() -> list[torch.Tensor]:
        for _ in range(STEPS_PER_GRAPH):
            cpa.reshape_and_cache(new_k, new_v, case["key_cache"], case["value_cache"], slot)
            plan.run(*operands, attn_bias=bias, out=case["out"])
        return [case["out"]]

    return replay_us(steps, STEPS_PER_GRAPH), case["out"].clone()


def main() -> None:
    import torch

    from cupy_paged_attn import decode

    print(f"latency case, cache write + DecodePlan.run per step, graphs of {STEPS_PER_GRAPH} steps, L2 warm")
    for bias_kind in ("none", "dense", "t5"):
        plain_us, plain_out = per_step_us(bias_kind, False)
        dep_us, dep_out = per_step_us(bias_kind, True)
        same = bool(torch.equal(plain_out, dep_out))
        print(f"bias {bias_kind:5s}: plain launch {plain_us:6.2f} us/step, dependent launch {dep_us:6.2f} us/step "
              f"({dep_us - plain_us:+.2f}); outputs identical: {same}")
        if not same:
            raise SystemExit("the dependent launch changed the result")
    decode.DEPENDENT_ATTENTION = True


if __name__ == "__main__":
    main()
