#!/usr/bin/env bash
# Builds (Release, sm_90a) and stages what tools/gpu_check.sh runs on the GPU machine into
# .dev/gpu and the archive .dev/gpu.tar.xz (git-ignored; carry the archive): the GPU test binaries, the
# server binary, decode_bench, and the host libraries a bare machine may lack (OpenBLAS,
# gfortran, PCRE2). cuBLAS and the driver come from the GPU machine.
#   tools/gpu_stage.sh [BUILD_DIR]   (default: build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
stage=$root/.dev/gpu
# M3_STAGE_TARGETS picks a subset (the device tool carries at most 64 MiB with the tree).
read -r -a targets <<< "${M3_STAGE_TARGETS:-wgmma_identity_probe kernels_cuda_parity kernels_cuda_msa kernels_cuda_moe kernels_cuda_sampling model_cuda decode_bench msa_bench moe_bench mem_bench linear_bench m3serve}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"
rm -rf "$stage"
mkdir -p "$stage/lib"
for t in "${targets[@]}"; do
  bin=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
  [[ -n $bin ]] || { echo "gpu_stage: $t was not built" >&2; exit 1; }
  cp "$bin" "$stage/"
  strip --strip-debug "$stage/$t"
done
# spec_bench reads a public-domain corpus from ../shared, which the device copy lacks.
corpus=$root/../shared/data/corpus/pg1184-monte-cristo.txt
if [[ " ${targets[*]} " == *" spec_bench "* && -f $corpus ]]; then
  mkdir -p "$stage/data"
  cp "$corpus" "$stage/data/"
fi
source "$root/tools/gpu_stage_libs.sh"
stage_host_libs "$stage/lib" "$stage"/*
# M3_STAGE_BASE=<a decode_bench built from an older commit>: staged as decode_bench_base, the
# baseline tools/gpu_decode_compare.sh runs.
if [[ -n ${M3_STAGE_BASE:-} ]]; then
  cp "$M3_STAGE_BASE" "$stage/decode_bench_base"
  strip --strip-debug "$stage/decode_bench_base"
fi
# The device tool carries at most 64 MiB: ship one xz archive (gpu_check.sh unpacks it). xz -9's
# 64 MiB window finds the binaries' shared code (they link the same libraries): two 27 MB
# decode_bench builds and m3serve pack into ~12 MB, against ~17 MB with tar's default -6.
tar -C "$root/.dev" -cf - gpu | xz -9 -T2 > "$root/.dev/gpu.tar.xz"
du -sh "$stage" "$root/.dev/gpu.tar.xz"
# The device tool carries the tracked tree and the archive together, 64 MiB at most: say so when
# they do not fit (then stage fewer targets, or move an unused tracked model out for the call).
tracked=$(git -C "$root" ls-files -z | (cd "$root" && xargs -0 du -cb 2>/dev/null) | tail -1 | cut -f1)
archive=$(stat -c %s "$root/.dev/gpu.tar.xz")
if (( tracked + archive > 64 * 1024 * 1024 )); then
  echo "gpu_stage: tracked files ($((tracked >> 20)) MiB) + archive ($((archive >> 20)) MiB) exceed the device tool's 64 MiB" >&2
fi
