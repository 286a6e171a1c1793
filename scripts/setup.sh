#!/usr/bin/env bash
# Installs what torch_kda needs and builds its extension in place.
# Sourced by demo.sh and test.sh; safe to run again (a rebuild is incremental).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}

# torch itself: keep an installed one (a GPU machine brings its own build);
# otherwise pip's default, which on these machines is the local CUDA 13 build.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "${TORCH_SPEC:-torch}"
fi
"$PY" -m pip install --quiet -r requirements.txt

# torch derives CUDA_HOME from `which nvcc`, which is wrong where nvcc is a
# symlink outside the toolkit; prefer the toolkit's own folder when present.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

"$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
"$PY" -c "import torch, torch_kda; print('torch_kda ready: torch', torch.__version__, '| CUDA kernels built:', torch_kda.cuda_built())"
