#!/usr/bin/env bash
# Builds (Release, sm_90a) and stages what tools/msa_bench.sh runs on the GPU machine into
# .dev/msa (git-ignored; pass it to the device tool's `carry`): the MSA kernel parity test,
# the generic-kernel parity test, the MSA benchmark, and the host libraries a bare machine may
# lack (OpenBLAS, gfortran). cuBLAS and the driver come from the GPU machine.
#   tools/msa_stage.sh [BUILD_DIR]   (default: build-msa)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-msa}
stage=$root/.dev/msa
targets=(kernels_cuda_msa kernels_cuda_parity msa_bench)
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"
rm -rf "$stage"
mkdir -p "$stage/lib"
for t in "${targets[@]}"; do
  bin=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
  [[ -n $bin ]] || { echo "msa_stage: $t was not built" >&2; exit 1; }
  cp "$bin" "$stage/"
  strip --strip-debug "$stage/$t"
done
for bin in "$stage"/*; do
  [[ -f $bin ]] || continue
  ldd "$bin" | awk '/=> \// {print $3}' | grep -E 'openblas|gfortran|quadmath|pcre2|libgomp' || true
done | sort -u | while read -r lib; do cp -L "$lib" "$stage/lib/"; done
du -sh "$stage"
ls -la "$stage" "$stage/lib"
