#!/usr/bin/env bash
# The GPU side of a kernel change, in one device call: tools/gpu_check.sh (the
# build and every GPU test, slow tier included, then the rest of the suite),
# compute-sanitizer's memcheck and racecheck on the given cases of
# tools/sanitize_cases.py, then the benchmarks named in BENCHES (files of
# benchmarks/, without .py, run with no arguments):
#   BENCHES="bench_head_sizes bench_configs" bash tools/gpu_validate.sh head_sizes segments
# Logs go to $OUT (or /tmp); the summary line of each step is printed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ "$#" -gt 0 ] || { echo "usage: [BENCHES=...] gpu_validate.sh CASE... (cases of tools/sanitize_cases.py)"; exit 2; }
LOGS=${OUT:-/tmp}
rc=0
GPU_ONLY=${GPU_ONLY:-0} bash tools/gpu_check.sh || rc=1
if [ -d /tmp/kda_site ]; then export PYTHONPATH=/tmp/kda_site:${PYTHONPATH:-}; fi
for case in "$@"; do
  for tool in memcheck racecheck; do
    log="$LOGS/sanitize_${case}_$tool.txt"
    compute-sanitizer --tool "$tool" --error-exitcode 1 python3 tools/sanitize_cases.py "$case" > "$log" 2>&1 || rc=1
    echo "$tool $case: $(grep -E 'ERROR SUMMARY|hazards displayed' "$log" | tail -1)"
  done
done
for bench in ${BENCHES:-}; do
  BENCH=$bench bash tools/gpu_bench.sh || rc=1
done
exit "$rc"
