#!/usr/bin/env bash
# What closes a change on a GPU machine, in parts that each fit in ten minutes. From the repository root of a source
# checkout (results go to $OUT, or bench_out):
#
#   bash benchmarks/gpu.sh tests        every GPU test (8 workers), compute-sanitizer memcheck over representative
#                                       launches of every kernel, the examples
#   bash benchmarks/gpu.sh bench        bench_decode.py and bench_prefill.py with every peer, host time per call,
#                                       compile and load times, python -m cupy_paged_attn check and bench
#   bash benchmarks/gpu.sh ab OLD       same-call A/B of the source tree OLD against this one (benchmarks/ab.py)
#   bash benchmarks/gpu.sh two-gpu      what needs two GPUs
#
# Each part ends with its summary lines; the exit status is non-zero if any step failed.
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX in several test workers at once must not take the whole GPU
export NCCL_NVLS_ENABLE=0                   # NVLink multicast off
out=${OUT:-bench_out}
mkdir -p "$out"
status=0
step() {  # step NAME SECONDS COMMAND...: run, keep the tail, remember a failure
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-12}" "$out/$name.log"
  echo "== $name: exit $rc"
  [ $rc -ne 0 ] && status=1
}

case "${1:-tests}" in
  tests)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    TAIL=25 step gpu-tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/
    TAIL=6 step sanitize 200 env TOOLS=memcheck bash tests/gpu/sanitize.sh "$out"
    step serving-loop 60 python3 examples/serving_loop.py
    step t5-generate 150 python3 examples/t5_generate.py
    ;;
  bench)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    TAIL=40 step bench-decode 400 python3 benchmarks/bench_decode.py --reps 20 --out "$out"
    TAIL=12 step bench-prefill 240 python3 benchmarks/bench_prefill.py --reps 10 --out "$out"
    step host-overhead 60 python3 benchmarks/host_overhead.py --calls 1000
    step compile-time 120 python3 benchmarks/compile_time.py
    step cli 120 python3 -m cupy_paged_attn check --quick
    ;;
  ab)
    TAIL=60 step ab 560 python3 benchmarks/ab.py "${2:?usage: gpu.sh ab OLD}" . --out "$out"
    ;;
  two-gpu)
    nvidia-smi --query-gpu=index,name --format=csv,noheader
    step two-gpu-tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ -k "second_gpu or two_gpu"
    step tensor-parallel 200 python3 examples/tensor_parallel.py
    ;;
  *)
    echo "usage: bash benchmarks/gpu.sh tests|bench|ab OLD|two-gpu" >&2
    exit 2
    ;;
esac
exit $status
