#!/usr/bin/env bash
# A/B of two builds (the working tree against an earlier commit) on the forward
# or backward benchmark, in one device call:
#   here:        bash tools/gpu_tree_ab.sh prepare REV
#                  writes `git archive REV` into .abtree/ (git-ignored; the device
#                  copy has no history), to be carried with the call
#   the device:  bash tools/gpu_tree_ab.sh run ROUNDS [bench_fwd.py arguments]
#                  after tools/gpu_check.sh has built the working tree: builds
#                  .abtree in place, then runs tools/gpu_bench.sh (BENCH as set)
#                  ROUNDS times over for the baseline (.abtree, through PYTHONPATH)
#                  and the working tree, alternating, and prints each run's rows;
#                  logs in $OUT/tree_ab_{base,work}_ROUND.txt.
# Times of one call compare; a drift of the machine shows as a drift between
# rounds, not as a difference between the builds.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cmd=${1:-}
case "$cmd" in
  prepare)
    rev=${2:?usage: gpu_tree_ab.sh prepare REV}
    rm -rf .abtree && mkdir .abtree && git archive "$rev" | tar -x -C .abtree || exit 1
    echo "$(git rev-parse --short "$rev")" > .abtree/REV
    echo ".abtree: $(cat .abtree/REV); carry it with the device call"
    ;;
  run)
    rounds=${2:?usage: gpu_tree_ab.sh run ROUNDS [bench arguments]}
    shift 2
    [ -d .abtree ] || { echo ".abtree is missing: run 'prepare REV' here and carry .abtree"; exit 2; }
    nvidia-smi >/dev/null 2>&1 || { echo "no GPU here: 'run' is for the device machine"; exit 2; }
    # Built here, against this machine's torch, every time (setup.py is incremental).
    ( cd .abtree && TORCH_KDA_CUDA_ARCHS=${TORCH_KDA_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} \
        python3 setup.py build_ext --inplace > "${OUT:-/tmp}/tree_ab_build.log" 2>&1 ) \
      || { tail -30 "${OUT:-/tmp}/tree_ab_build.log"; echo "baseline build failed"; exit 1; }
    # Older commits keep the GPU scripts under scripts/.
    base_bench=.abtree/tools/gpu_bench.sh
    [ -f "$base_bench" ] || base_bench=.abtree/scripts/gpu_bench.sh
    # The benchmarks' result lines: bench_fwd/bench_bwd's numbered cases and speedups,
    # bench_configs' labelled rows, and the per-kernel lines of --stages.
    rows='^ *[0-9]+ |speedup over|^ +[0-9.]+ ms|^[0-9]+x[0-9]+ H[0-9]+'
    for ((r = 1; r <= rounds; r++)); do
      echo "== baseline $(cat .abtree/REV 2>/dev/null) round $r"
      PYTHONPATH=$PWD/.abtree bash "$base_bench" "$@" > "${OUT:-/tmp}/tree_ab_base_$r.txt" 2>&1
      grep -E "$rows" "${OUT:-/tmp}/tree_ab_base_$r.txt"
      echo "== working tree round $r"
      bash tools/gpu_bench.sh "$@" > "${OUT:-/tmp}/tree_ab_work_$r.txt" 2>&1
      grep -E "$rows" "${OUT:-/tmp}/tree_ab_work_$r.txt"
    done
    ;;
  *)
    echo "usage: gpu_tree_ab.sh prepare REV | run ROUNDS [bench arguments]"
    exit 2
    ;;
esac
