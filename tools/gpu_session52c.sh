#!/usr/bin/env bash
# One device call: is the engine's greedy output on m3-layers:2 (MXFP8, M3 widths) the same from run
# to run? gpu_session52b found a speculative engine that never verified a draft giving another
# output than the plain one at B = 1. spec_bench repeats the plain run (draft lengths 0,0,3): every
# run is compared with the first; a difference prints its position and the top-2 margin there.
#   M3_STAGE_TARGETS="spec_bench m3serve" tools/gpu_stage.sh; tools/gpu_session52c.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ckpt=${TMPDIR:-/tmp}/m3-layers-2-mxfp8
[[ -f $ckpt/config.json ]] || step make_model2 100 "$dir/m3serve" make-model --preset m3-layers:2 --mxfp8 --seed 0 --out "$ckpt"
for lp in ${M3_LP:-2}; do
  step spec_repeat_lp$lp 150 "$dir/spec_bench" --model "$ckpt" --tokenizer "$root/models/m3-small" \
    --corpus "$dir/data/pg1184-monte-cristo.txt" --device cuda --batch-sizes 1 --draft-lens 0,0,3 --output-len ${M3_OUT_LEN:-40} \
    --spec-graphs 0 --logprobs $lp --json "$out/spec_repeat_lp$lp.json"
  grep -E "batch|differs" "$out/spec_repeat_lp$lp.log" | sed "s/^/logprobs $lp: /"
done
exit $status
