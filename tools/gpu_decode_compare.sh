#!/usr/bin/env bash
# Decode step before/after on the GPU machine: decode_bench of the staged build (.dev/gpu) and of
# a baseline build from an older commit, on the same m3-layers:N MXFP8 checkpoint made here, same
# contexts and batches, M3_BENCH_REPS (default 1) alternating repetitions -> $OUT/decode_*.json.
#   M3_BENCH_LAYERS=2 M3_BENCH_CONTEXTS=32768,131072 M3_BENCH_BATCHES=1,32,128 tools/gpu_decode_compare.sh
# The baseline: .dev/gpu/decode_bench_base (stage it with M3_STAGE_BASE=<that decode_bench>
# tools/gpu_stage.sh: one archive, the two builds' shared code packed once), or else
# .dev/gpu-base/decode_bench (from .dev/gpu-base.tar.xz). Build it from a worktree:
#   git worktree add /tmp/base REV && cmake -S /tmp/base -B /tmp/base/build -DCMAKE_BUILD_TYPE=Release \
#     && cmake --build /tmp/base/build -j2 --target decode_bench
# Or M3_BASE_DISABLE=entry[,entry]: the baseline is the staged decode_bench with those dispatch
# entries removed (--disable-entries), no second build.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
base_bin=$dir/decode_bench_base
base_args=()
if [[ -n ${M3_BASE_DISABLE:-} ]]; then
  base_bin=$dir/decode_bench
  base_args=(--disable-entries "$M3_BASE_DISABLE")
elif [[ ! -x $base_bin ]]; then
  base=$root/.dev/gpu-base
  [[ -d $base || ! -f $root/.dev/gpu-base.tar.xz ]] || tar -C "$root/.dev" -xJf "$root/.dev/gpu-base.tar.xz"
  base_bin=$base/decode_bench
fi
layers=${M3_BENCH_LAYERS:-2}
layers_ckpt "$layers"
IFS=',' read -r -a contexts <<< "${M3_BENCH_CONTEXTS:-32768,131072}"
for ctx in "${contexts[@]}"; do
  for rep in $(seq 1 "${M3_BENCH_REPS:-1}"); do
    for which in base new; do
      bin=$dir/decode_bench
      extra=()
      [[ $which == base ]] && bin=$base_bin && extra=("${base_args[@]}")
      [[ -x $bin ]] || { echo "gpu_decode_compare: no $which decode_bench"; continue; }
      name=decode_${which}_$ctx
      (( ${M3_BENCH_REPS:-1} > 1 )) && name=${name}_$rep
      step "$name" "${M3_BENCH_TIMEOUT:-240}" "$bin" --model "$ckpt" --batch-sizes "${M3_BENCH_BATCHES:-1,32,128}" \
        --context "$ctx" --iters "${M3_BENCH_ITERS:-10}" --json "$out/$name.json" "${extra[@]}"
      grep -E "graph step|roofline|projection to" "$out/$name.log" | sed "s/^/$which $ctx #$rep: /"
    done
  done
done
echo "gpu_decode_compare: overall status $status"
exit $status
