#!/usr/bin/env bash
# One device call, one GPU: the per-rank compute of a tensor-parallel decode step at M3's TP-local
# shapes (decode_bench --tp-shard N: rank 0's slice, collectives not run) on an m3-layers:5 MXFP8
# checkpoint (dense and MSA layers, MoE), TP 1 / 4 / 8, with each shape's dispatch trace in the
# JSON. Add a measured NCCL all-reduce (tools/gpu_tp.sh on an x2 machine) to get a step.
#   M3_STAGE_TARGETS="decode_bench m3serve" tools/gpu_stage.sh; tools/gpu_tp_shard.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ckpt=${TMPDIR:-/tmp}/m3-layers-5-mxfp8
step make_model5 200 "$dir/m3serve" make-model --preset m3-layers:5 --mxfp8 --seed 0 --out "$ckpt"
for tp in 1 4 8; do
  step shard_tp$tp 200 "$dir/decode_bench" --model "$ckpt" --batch-sizes 1,32,128 --context 32768 --iters 10 \
    --tp-shard $tp --json "$out/shard_tp$tp.json"
  grep -E "one rank|graph step|projection" "$out/shard_tp$tp.log" | sed "s/^/tp $tp: /"
done
exit $status
