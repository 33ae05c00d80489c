#!/usr/bin/env bash
# One device call after tools/gpu_session52.sh (which found a single sequence's verification step
# bit-identical to its one-token steps on m3-layers:2): (1) the same with a rejected draft's KV left
# in the pages (--stale verify / singles); (2) the engine's eager verification on m3-layers:2
# (spec_bench: is the output plain decoding's?); (3) decode_bench with the LM head on wgmma from 96
# rows (MmaLinearRule::wgmma_bf16 on); (4) kernels_cuda_parity (the BF16 wgmma bits).
#   M3_STAGE_TARGETS="invariance_probe spec_bench m3serve decode_bench kernels_cuda_parity" tools/gpu_stage.sh
#   tools/gpu_session52b.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ckpt=${TMPDIR:-/tmp}/m3-layers-2-mxfp8
step make_model2 150 "$dir/m3serve" make-model --preset m3-layers:2 --mxfp8 --seed 0 --out "$ckpt"
for stale in verify singles; do
  step probe_stale_$stale 120 "$dir/invariance_probe" --model "$ckpt" --device cuda --prompt-lens 300,3000 \
    --stale $stale --json "$out/probe_stale_$stale.json"
  grep -E "differs|first difference|bit-identical" "$out/probe_stale_$stale.log" | head -8 | sed "s/^/stale $stale: /"
done
step spec_eager 200 "$dir/spec_bench" --model "$ckpt" --tokenizer "$root/models/m3-small" \
  --corpus "$dir/data/pg1184-monte-cristo.txt" --device cuda --batch-sizes 1,8 --draft-lens 0,3 --output-len 48 \
  --spec-graphs 0 --json "$out/spec_eager.json"
grep batch "$out/spec_eager.log"
step decode_lm 200 "$dir/decode_bench" --model "$ckpt" --batch-sizes 1,64,96,128,256 --context 4096 --iters 10 \
  --json "$out/decode_lm.json"
grep -E "graph step|final norm|head" "$out/decode_lm.log" | head -20
step parity 300 "$dir/kernels_cuda_parity"
grep -E "linear|FAIL|PASSED|FAILED" "$out/parity.log" | tail -8
exit $status
