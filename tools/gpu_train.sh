#!/usr/bin/env bash
# The training example on the GPU(s), after tools/gpu_check.sh has built the extension:
# one GPU eager and compiled (tokens/s), then, given two GPUs, FSDP2 over NCCL with
# torch.compile on one process and on two, and their loss series compared.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
DIR=${OUT:-/tmp}
# NVLink multicast stays off on shared hosts (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
STEPS=${TRAIN_STEPS:-300}
FSDP_STEPS=${FSDP_STEPS:-50}
rc=0
if [ "${SKIP_SINGLE:-0}" != "1" ]; then
  for mode in eager compile; do
    flag=; [ $mode = compile ] && flag=--compile
    echo "== one GPU, $mode, $STEPS steps"
    timeout ${TRAIN_TIMEOUT:-240} "$PY" examples/train_tiny_lm.py --device cuda $flag --steps "$STEPS" --log-every 50 \
      --loss-file "$DIR/train_$mode.json" 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -14 || rc=1
  done
fi
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -ge 2 ]; then
  for n in 1 2; do
    echo "== FSDP2, NCCL, --compile, $n process(es), $FSDP_STEPS steps"
    timeout ${TRAIN_TIMEOUT:-240} torchrun --standalone --nproc_per_node=$n examples/train_tiny_lm.py --device cuda --fsdp \
      --compile --steps "$FSDP_STEPS" --log-every 10 --loss-file "$DIR/fsdp_$n.json" 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -14 || rc=1
  done
  "$PY" tools/compare_loss_series.py "$DIR/fsdp_1.json" "$DIR/fsdp_2.json" || rc=1
fi
exit $rc
