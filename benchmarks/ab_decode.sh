#!/usr/bin/env bash
# Same-call A/B of two source trees of the library (each a checkout, or a `git archive` of one commit): the GPU time
# of bench_decode.py's cases, each tree in turn for several rounds, then the host time per call of both trees in
# one process (host_ab.py). From the repository root of a source checkout on the GPU machine:
#
#   bash benchmarks/ab_decode.sh OLD NEW [CASES] [ROUNDS]     CASES: bench_decode.py's indices (default 4, the
#                                                             latency case); ROUNDS: default 2
#
# Each tree runs its own benchmarks/bench_decode.py (no peers, --reps 20); the tables end each round's output.
set -uo pipefail
old=$1 new=$2 cases=${3:-4} rounds=${4:-2}
export PYTHONUNBUFFERED=1
status=0
for round in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    echo "== round $round: $tree"
    log=$(mktemp)
    (cd "$tree" && PYTHONPATH=. python3 benchmarks/bench_decode.py --cases "$cases" --peers none --reps 20) \
      > "$log" 2>&1 || status=1
    sed -n '/^copy bandwidth/,/^$/p; /^case  *| impl/,/^$/p' "$log" | grep -v "^$" || tail -n 20 "$log"
    { echo "== round $round: $tree"; cat "$log"; } >> "${OUT:-/tmp}/ab-decode.log"
    rm -f "$log"
  done
done
echo "== host time (host_ab.py)"
python3 benchmarks/host_ab.py "$old" "$new" || status=1
exit $status
