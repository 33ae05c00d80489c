#!/usr/bin/env bash
# One device call: the LM head on the wgmma kernel (BF16 weights, MmaLinearRule::wgmma_bf16), MSA
# index sharing's decode step (decode_bench on m3-layers:5, 2 sparse layers, reuse 1 vs 2), and
# eager verification on m3-layers:2 (is its output plain decoding's?; M3_S51_SKIP_SPEC=1 skips it).
#   M3_STAGE_TARGETS="linear_bench spec_bench m3serve decode_bench" tools/gpu_stage.sh; tools/gpu_session51.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step lm_head 120 "$dir/linear_bench" --rows 1,64,96,128,192,256,512 --rowdot-max 0 --iters 5 --shapes lm_head \
  --variants wgmma_ov,wgmma_ovsplit,wide --json "$out/lm_head.json"
grep -E "^lm_head|^device" "$out/lm_head.log"
ckpt=${TMPDIR:-/tmp}/m3-layers-5-mxfp8
step make_model5 200 "$dir/m3serve" make-model --preset m3-layers:5 --mxfp8 --seed 0 --out "$ckpt"
for reuse in 1 2; do
  step decode_reuse$reuse 150 "$dir/decode_bench" --model "$ckpt" --batch-sizes 1,32 --context 32768 --iters 10 \
    --msa-index-reuse $reuse --json "$out/decode_reuse$reuse.json"
  grep -E "graph step|B=" "$out/decode_reuse$reuse.log" | head -6 | sed "s/^/reuse $reuse: /"
done
[[ -n ${M3_S51_SKIP_SPEC:-} ]] && exit $status
ckpt2=${TMPDIR:-/tmp}/m3-layers-2-mxfp8
step make_model2 120 "$dir/m3serve" make-model --preset m3-layers:2 --mxfp8 --seed 0 --out "$ckpt2"
step spec_eager 150 "$dir/spec_bench" --model "$ckpt2" --tokenizer "$root/models/m3-small" \
  --corpus "$dir/data/pg1184-monte-cristo.txt" --device cuda --batch-sizes 1,8 --draft-lens 0,3 --output-len 48 \
  --spec-graphs 0 --json "$out/spec_eager.json"
grep batch "$out/spec_eager.log"
exit $status
