#!/usr/bin/env bash
# Decode step before/after on the GPU machine: decode_bench of the staged build (.dev/gpu) and of
# a baseline build staged from an older commit (.dev/gpu-base: its decode_bench only), on the
# same m3-layers:N MXFP8 checkpoint made here, same contexts and batches -> $OUT/decode_*.json.
#   M3_BENCH_LAYERS=2 M3_BENCH_CONTEXTS=32768,131072 M3_BENCH_BATCHES=1,32,128 tools/gpu_decode_compare.sh
# Stage the baseline here with: git worktree add /tmp/base REV; build decode_bench there (Release,
# CUDA); mkdir -p .dev/gpu-base && cp <that decode_bench> .dev/gpu-base/ && strip it;
# tar -C .dev -cJf .dev/gpu-base.tar.xz gpu-base.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
base=$root/.dev/gpu-base
[[ -d $base || ! -f $root/.dev/gpu-base.tar.xz ]] || tar -C "$root/.dev" -xJf "$root/.dev/gpu-base.tar.xz"
layers=${M3_BENCH_LAYERS:-2}
ckpt=${TMPDIR:-/tmp}/m3-layers-$layers-mxfp8
[[ -f $ckpt/config.json ]] || step make_model 300 "$dir/m3serve" make-model --preset "m3-layers:$layers" --mxfp8 \
  --seed 0 --out "$ckpt"
IFS=',' read -r -a contexts <<< "${M3_BENCH_CONTEXTS:-32768,131072}"
for ctx in "${contexts[@]}"; do
  for which in base new; do
    bin=$dir/decode_bench
    [[ $which == base ]] && bin=$base/decode_bench
    [[ -x $bin ]] || { echo "gpu_decode_compare: no $which decode_bench"; continue; }
    step "decode_${which}_$ctx" "${M3_BENCH_TIMEOUT:-240}" "$bin" --model "$ckpt" --batch-sizes "${M3_BENCH_BATCHES:-1,32,128}" \
      --context "$ctx" --iters "${M3_BENCH_ITERS:-10}" --json "$out/decode_${which}_$ctx.json"
    grep -E "graph step|roofline" "$out/decode_${which}_$ctx.log" | sed "s/^/$which $ctx: /"
  done
done
echo "gpu_decode_compare: overall status $status"
exit $status
