#!/usr/bin/env bash
# Warp-stall profile of one kernel on one case, for a machine with ncu, after
# tools/gpu_check.sh has built the extension:
#   bash tools/gpu_profile.sh NAME KERNEL_REGEX CASE [--backward]
# CASE: a bench_fwd.py case number, or a bench_configs.py row's label ("1x8192 H32 D256").
# writes $OUT/NAME.txt: time, issue rate, and cycles per issued instruction by
# stall reason (which of barriers, shared memory, L2/DRAM, dependent math the
# kernel waits on), and the per-SASS-instruction stall samples as CSV.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
name=$1 kregex=$2 case=$3; shift 3
if [ -d /tmp/kda_site ]; then export PYTHONPATH=/tmp/kda_site:${PYTHONPATH:-}; fi
rep=/tmp/$name
case "$case" in
  ''|*[!0-9]*) which=(--config "$case") ;;
  *) which=(--case "$case") ;;
esac
ncu --clock-control none -k "regex:$kregex" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    -f -o "$rep" python3 benchmarks/profile_case.py "${which[@]}" --calls 2 "$@" > /dev/null 2>&1
{
  ncu --import "$rep.ncu-rep" --page details
  ncu --import "$rep.ncu-rep" --page raw --csv --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
} > "${OUT:-/tmp}/$name.txt" 2>&1
ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "${OUT:-/tmp}/$name.sass.csv" 2>&1 || true
