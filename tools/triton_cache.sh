# Sourced by the GPU scripts. fla's first call per shape autotunes its Triton
# kernels for a minute or more; Triton's cache (autotune results included)
# travels between device calls in .tcache/ (git-ignored): `triton_cache_restore`
# unpacks it, `triton_cache_save` writes it under $OUT in 15 MB parts (copy
# those into .tcache/ for the next call; nothing when the call added nothing).
# xz packs the cache 3x smaller than gzip (419 MB of cache: 21 MB in 48 MiB
# blocks, which 16 cores pack in parallel, against 63 MB), which matters because
# a device call carries at most 64 MiB; gzip parts are still read.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kda_triton_cache} TRITON_CACHE_AUTOTUNING=1

# stdin (xz or gzip, by its magic bytes) -> stdout, decompressed; Python's lzma
# where the xz tool is missing.
_tcache_decompress() {
  python3 -c '
import gzip, lzma, shutil, sys
data = sys.stdin.buffer
head = data.peek(6)[:6] if hasattr(data, "peek") else b""
opener = lzma.open if head.startswith(b"\xfd7zXZ") else gzip.open
shutil.copyfileobj(opener(data), sys.stdout.buffer, 1 << 20)'
}

triton_cache_restore() {  # once per cache directory (gpu_check.sh and gpu_bench.sh both call it)
  mkdir -p "$TRITON_CACHE_DIR"
  if [ ! -e "$TRITON_CACHE_DIR/.restored" ] && ls .tcache/tcache.part.* >/dev/null 2>&1; then
    cat .tcache/tcache.part.* | _tcache_decompress | tar xf - -C "$TRITON_CACHE_DIR" --strip-components=1
  fi
  touch "$TRITON_CACHE_DIR/.restored"
}

triton_cache_save() {  # only when this call added to the cache (autotuned a new shape)
  if [ -n "${OUT:-}" ] && [ -n "$(find "$TRITON_CACHE_DIR" -type f -newer "$TRITON_CACHE_DIR/.restored" -print -quit)" ]; then
    local pack="gzip"
    if command -v xz >/dev/null 2>&1; then pack="xz -9 -T0 --block-size=48MiB"; fi
    tar cf - -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")" | $pack | split -b 15M - "$OUT/tcache.part."
  fi
}
