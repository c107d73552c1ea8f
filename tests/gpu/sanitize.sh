#!/usr/bin/env bash
# compute-sanitizer over representative launches of every kernel: memcheck, racecheck, initcheck, synccheck.
# Run on a GPU machine from the repository root: bash tests/gpu/sanitize.sh [OUT_DIR]. Prints each tool's summary.
# TOOLS="memcheck racecheck" picks some of the tools.
set -uo pipefail
out=${1:-.}
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
status=0
for tool in ${TOOLS:-memcheck racecheck initcheck synccheck}; do
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check no)
  compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 --print-limit 20 \
    python3 tests/gpu/sanitize_cases.py > "$out/sanitize-$tool.log" 2>&1
  rc=$?
  echo "$tool (exit $rc): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize-$tool.log" | tail -1)"
  [ $rc -ne 0 ] && status=1
done
exit $status
