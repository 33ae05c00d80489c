#!/usr/bin/env bash
# One device call: (1) invariance_probe, op by op, verification step (1 + 3 tokens) against one-token
# steps, on m3-small (control: bit-identical in spec_bench) and on an m3-layers:2 MXFP8 checkpoint
# (where spec_bench saw greedy tokens differ); (2) what tools/gpu_session51.sh left: the LM head on
# wgmma and index sharing's decode step (M3_S51_SKIP_SPEC=1).
# (3) kernels_cuda_msa on the TP-local shapes (TP2 32/2, TP8 8/1) and multi-token queries.
#   M3_STAGE_TARGETS="invariance_probe kernels_cuda_msa linear_bench m3serve decode_bench" tools/gpu_stage.sh
#   tools/gpu_session52.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step probe_small 120 "$dir/invariance_probe" --model "$root/models/m3-small" --device cuda --prompt-lens 300,3000 \
  --json "$out/probe_small.json"
grep -v " same$" "$out/probe_small.log" | sed "s/^/small: /"
ckpt2=${TMPDIR:-/tmp}/m3-layers-2-mxfp8
step make_model2 150 "$dir/m3serve" make-model --preset m3-layers:2 --mxfp8 --seed 0 --out "$ckpt2"
step probe_layers2 200 "$dir/invariance_probe" --model "$ckpt2" --device cuda --prompt-lens 300,3000 \
  --json "$out/probe_layers2.json"
grep -v " same$" "$out/probe_layers2.log" | sed "s/^/layers2: /"
M3_MSA_CASES=tp2_decode_ragged,tp8_decode_ragged,tp8_multi_token,tp8_prefill_chunk,tp1_multi_token,tp4_multi_token \
  step msa_tp 240 "$dir/kernels_cuda_msa"
grep -E "^tp|PASS|FAIL" "$out/msa_tp.log" | tail -12
[[ -n ${M3_S52_PROBE_ONLY:-} ]] && exit $status
M3_S51_SKIP_SPEC=1 bash "$root/tools/gpu_session51.sh" || status=1
exit $status
