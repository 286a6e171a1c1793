#!/usr/bin/env bash
# The full GPU check in one command, for a machine with a Hopper GPU:
# build for sm_90a, run the GPU tests and then the rest of the suite, print a summary.
# fla-core (the oracle of some GPU tests) and expecttest may travel as wheels in .whl/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
procs=${GPU_CHECK_PROCS:-4}  # pytest processes for the GPU tests (below)
case "$procs" in
  ''|*[!0-9]*) echo "GPU_CHECK_PROCS must be a whole number, got '$procs'"; exit 2 ;;
esac
# The tests' float64 references run on the CPU: each pytest process takes its
# share of the cores, where a thread per core each would oversubscribe them.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( procs > 1 && cores / procs > 0 ? cores / procs : procs > 1 ? 1 : cores ))}
export TORCH_KDA_CUDA_ARCHS=${TORCH_KDA_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} FLA_FLASH_KDA=0 PYTHONUNBUFFERED=1
LOG=${GPU_CHECK_LOG:-${OUT:-/tmp}/gpu_check.log}
source tools/triton_cache.sh  # fla's autotune results from earlier runs, if carried
triton_cache_restore
: > "$LOG"

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kda_site .whl/*.whl \
    && export PYTHONPATH=/tmp/kda_site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOG"

start=$(date +%s)
if ! "$PY" -m pip install -q --no-build-isolation --no-deps -e . >>"$LOG" 2>&1; then
  tail -50 "$LOG"; echo "BUILD FAILED"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s" | tee -a "$LOG"

# GPU_CHECK_PROCS pytest processes share the GPU (pytest-xdist, where installed):
# the suite took ~5 min on an H200 in four, where one spends most of its time in
# fla's autotuning. Under xdist -s shows nothing, so the tests' printed errors come
# from the summary of passed tests (the P of -rsP), each under its test's name.
if [ "$procs" -gt 1 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then
  run_opts=(-n "$procs" -rsP)
else
  run_opts=(-s -rs)
fi
# GPU_CHECK_TIMEOUT (seconds) cuts the GPU tests short but leaves time to save
# what fla autotuned (below), which a `timeout` around this script would not.
timeout -k 10 "${GPU_CHECK_TIMEOUT:-0}" "$PY" -m pytest tests/test_cuda_*.py -v "${run_opts[@]}" --durations=8 "$@" 2>&1 | tee -a "$LOG" \
  | grep -E "^_{3,} test|PASSED|FAILED|ERROR|SKIPPED|rel |passed|failed|Error|assert" 
gpu_rc=${PIPESTATUS[0]}
triton_cache_save  # fla's autotuning in its comparison tests (minutes a shape for its backward)
rest_rc=0
if [ "${GPU_ONLY:-0}" != "1" ]; then
  "$PY" -m pytest tests -q -x --ignore-glob='tests/test_cuda_*.py' 2>&1 | tee -a "$LOG" | tail -3
  rest_rc=${PIPESTATUS[0]}
fi
echo "summary: GPU tests rc=$gpu_rc, other tests rc=$rest_rc (full log: $LOG)"
[ "$gpu_rc" -eq 0 ] && [ "$rest_rc" -eq 0 ]
