#!/usr/bin/env bash
# One device call: is greedy decoding on M3 shapes deterministic from run to run, and if not, where?
# Session 52 (H100): two identical plain engines on m3-layers:2 (MXFP8) at B = 1 gave different
# greedy outputs (output 30 of 48, CUDA graphs on, logprobs off). spec_bench repeats the plain run
# (draft lengths 0,0,0: each compared with the first) under three settings: graphs (the engine's
# default), eager (--enforce-eager 1), and graphs with programmatic dependent launch off
# (M3_CUDA_NO_PDL=1). A setting that stays deterministic names the suspect.
# Then model_cuda's CudaDeterminism (an M3-shaped MXFP8 checkpoint, B = 1 and 4, repeated and eager).
#   M3_STAGE_TARGETS="spec_bench m3serve model_cuda" tools/gpu_stage.sh; tools/gpu_determinism.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ckpt=${TMPDIR:-/tmp}/m3-layers-2-mxfp8
[[ -f $ckpt/config.json ]] || step make_model2 100 "$dir/m3serve" make-model --preset m3-layers:2 --mxfp8 --seed 0 --out "$ckpt"
run() {  # run NAME NO_PDL [spec_bench options...]
  local name=$1 no_pdl=$2
  shift 2
  step det_$name 200 env M3_CUDA_NO_PDL=$no_pdl "$dir/spec_bench" --model "$ckpt" --tokenizer "$root/models/m3-small" \
    --corpus "$dir/data/pg1184-monte-cristo.txt" --device cuda --batch-sizes 1,8 --draft-lens 0,0,0 --output-len 64 \
    --json "$out/det_$name.json" "$@"
  grep -E "batch|differs" "$out/det_$name.log" | sed "s/^/$name: /"
}
run graphs 0
run eager 0 --enforce-eager 1
run no_pdl 1
step det_test 300 "$dir/model_cuda" --gtest_filter='CudaDeterminism*'
grep -E "OK|FAIL|Failure|output" "$out/det_test.log" | head -10
exit $status
