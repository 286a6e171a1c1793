#!/usr/bin/env bash
# A/B of an environment setting on the forward benchmark, in one device call,
# after tools/gpu_check.sh has built the extension:
#   bash tools/gpu_ab.sh VAR "A B ..." ROUNDS [bench_fwd.py arguments]
# runs benchmarks/bench_fwd.py with VAR set to each value in turn, ROUNDS times
# over (alternating, so that a drift of the machine shows as a drift, not as a
# difference), writes $OUT/ab_VAR=value_round.txt per run and prints each run's
# table rows. An empty value ('') leaves VAR unset.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
var=$1 values=$2 rounds=$3
shift 3
for ((r = 1; r <= rounds; r++)); do
  for v in $values; do
    [ "$v" = "''" ] && v=""
    log="${OUT:-/tmp}/ab_${var}=${v:-unset}_$r.txt"
    echo "== $var=${v:-unset} round $r"
    if [ -n "$v" ]; then
      env "$var=$v" bash tools/gpu_bench.sh "$@" > "$log" 2>&1
    else
      env -u "$var" bash tools/gpu_bench.sh "$@" > "$log" 2>&1
    fi
    grep -E "^ *[0-9]+ |speedup over" "$log"
  done
done
