#!/usr/bin/env bash
# On the GPU machine, one call: speculative decoding (ngram drafts) against plain decoding with
# spec_bench on the bundled m3-small and on an m3-layers:N MXFP8 checkpoint made there (M3 widths,
# the m3-small tokenizer for the corpus prompts). Every point also says whether the outputs equal
# plain decoding's. Stage first (here):
#   M3_STAGE_TARGETS="spec_bench m3serve" tools/gpu_stage.sh
#   tools/gpu_spec.sh   (M3_SPEC_LAYERS=2, M3_SPEC_BATCHES=1,8,32)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
corpus=$dir/data/pg1184-monte-cristo.txt
[[ -f $corpus ]] || { echo "gpu_spec: no staged corpus at $corpus"; exit 2; }
batches=${M3_SPEC_BATCHES:-1,8,32}
# Eager verification steps, then graph-replayed ones (full-length drafts): both must give plain
# decoding's outputs ("same output yes"); the second shows how many steps replayed a graph.
for graphs in 0 1; do
  step spec_small_g$graphs 240 "$dir/spec_bench" --model "$root/models/m3-small" --corpus "$corpus" --device cuda \
    --batch-sizes "$batches" --draft-lens 0,3,5 --spec-graphs $graphs --json "$out/spec_small_g$graphs.json"
  grep -E "batch" "$out/spec_small_g$graphs.log" | sed "s/^/graphs=$graphs /"
done
layers=${M3_SPEC_LAYERS:-2}
layers_ckpt "$layers"
step spec_layers 300 "$dir/spec_bench" --model "$ckpt" --tokenizer "$root/models/m3-small" --corpus "$corpus" \
  --device cuda --batch-sizes "$batches" --draft-lens 0,3 --output-len 64 --spec-graphs 1 --json "$out/spec_layers.json"
grep -E "batch" "$out/spec_layers.log"
exit $status
