#!/usr/bin/env bash
# A/B of benchmark arguments, in one device call, after tools/gpu_check.sh has
# built the extension:
#   bash tools/gpu_ab.sh ROUNDS "ARGS A" "ARGS B" ... [-- COMMON ARGS]
# e.g. bash tools/gpu_ab.sh 3 "--recurrence-block 2x2" "--recurrence-block 4x4" -- --cases 6,7 --stages
# runs the benchmark (tools/gpu_bench.sh: bench_fwd.py, or BENCH=bench_bwd) with
# each argument set in turn, ROUNDS times over (alternating, so that a drift of
# the machine shows as a drift, not as a difference), writes
# $OUT/ab_<variant>_<round>.txt per run and prints each run's table rows.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=$1
shift
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  variants+=("$1")
  shift
done
[ $# -gt 0 ] && shift  # the --
for ((r = 1; r <= rounds; r++)); do
  for i in "${!variants[@]}"; do
    v=${variants[$i]}
    log="${OUT:-/tmp}/ab_${i}_$r.txt"
    echo "== [$i] $v round $r"
    # shellcheck disable=SC2086  # each variant is a list of arguments
    bash tools/gpu_bench.sh $v "$@" > "$log" 2>&1
    grep -E "^ *[0-9]+ |speedup over" "$log"
  done
done
