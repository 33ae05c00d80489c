#!/usr/bin/env bash
# moe_block's entry (moe_block.mxfp8_routed_select.sm90: the router's select kernel hands the W8A16
# experts their routing at one or two tokens; off unless M3_MOE_HAND_OFF=1) on the GPU machine, in
# one device call, from one staged build (tools/gpu_stage.sh):
#   1. kernels_cuda_moe with M3_MOE_BLOCK_ONLY=1: moe_block against moe_router then moe_experts at
#      1-3 tokens, top-4 and top-8, ids / weights / output bit for bit, eager and graph replays;
#   2. moe_bench's dispatch rows at M3's shapes (TP1) with M3_MOE_HAND_OFF=1: moe_block (dispatch,
#      dispatch_invariant) against the two ops (dispatch_two_ops), MOE_BLOCK_REPS times (default 2)
#      -> moe_block_N.json.
# The decode step with and without it: tools/gpu_dense_stripes.sh with M3_ON_ENV=M3_MOE_HAND_OFF=1.
# Results go to $OUT; nonzero exit on a failure.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
M3_MOE_BLOCK_ONLY=1 step moe_block_parity 120 "$dir/kernels_cuda_moe"
sed -n '/^check /,/^wrote/p' "$out/moe_block_parity.log"
grep -E "FAILED|Failure|error" "$out/moe_block_parity.log" | head -10
for rep in $(seq 1 "${MOE_BLOCK_REPS:-2}"); do
  step "moe_block_$rep" 200 env M3_MOE_HAND_OFF=1 "$dir/moe_bench" --tokens "${MOE_BLOCK_TOKENS:-1,2,8}" --only dispatch --no-baseline \
    --iters "${MOE_BLOCK_ITERS:-30}" --json "$out/moe_block_$rep.json"
  grep -E "dispatch" "$out/moe_block_$rep.log" | sed "s/^/#$rep: /" | head -12
done
echo "gpu_moe_block: overall status $status"
exit $status
