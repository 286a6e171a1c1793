#!/usr/bin/env bash
# A benchmark on a GPU machine, after tools/gpu_check.sh has built the
# extension: benchmarks/bench_fwd.py (or BENCH=bench_bwd) with the given arguments.
# Triton's cache for fla comes from and goes back to .tcache/ (triton_cache.sh),
# also when BENCH_TIMEOUT (seconds) cuts the benchmark short.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
source tools/triton_cache.sh
export FLA_FLASH_KDA=0 PYTHONUNBUFFERED=1
if [ -d /tmp/kda_site ]; then export PYTHONPATH=/tmp/kda_site:${PYTHONPATH:-}; fi
triton_cache_restore
BENCH=${BENCH:-bench_fwd}
timeout "${BENCH_TIMEOUT:-0}" "$PY" "benchmarks/$BENCH.py" "$@" 2>&1 | tee "${OUT:-/tmp}/$BENCH.txt"
rc=${PIPESTATUS[0]}
triton_cache_save
exit "$rc"
