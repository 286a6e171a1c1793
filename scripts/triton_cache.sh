# Sourced by the GPU scripts. fla's first call per shape autotunes its Triton
# kernels for a minute or more; Triton's cache (autotune results included)
# travels between device calls in .tcache/ (git-ignored): `triton_cache_restore`
# unpacks it, `triton_cache_save` writes it under $OUT in 15 MB parts (copy
# those into .tcache/ for the next call).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kda_triton_cache} TRITON_CACHE_AUTOTUNING=1

triton_cache_restore() {  # once per cache directory (gpu_check.sh and gpu_bench.sh both call it)
  mkdir -p "$TRITON_CACHE_DIR"
  if [ ! -e "$TRITON_CACHE_DIR/.restored" ] && ls .tcache/tcache.part.* >/dev/null 2>&1; then
    cat .tcache/tcache.part.* | tar xzf - -C "$TRITON_CACHE_DIR" --strip-components=1
  fi
  touch "$TRITON_CACHE_DIR/.restored"
}

triton_cache_save() {
  if [ -n "${OUT:-}" ]; then
    tar czf - -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")" | split -b 15M - "$OUT/tcache.part."
  fi
}
