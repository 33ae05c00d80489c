#!/usr/bin/env bash
# On the GPU machine, one call: what the invariant linear's kernel rule (MmaLinearRule,
# docs/linear_kernels.md) should be. The parity of every kernel forced at every size
# (kernels_cuda_parity: linear_invariance), then linear_bench with every kernel forced over
# the decode and small-prefill row counts, summarised per shape by tools/linear_variants_summary.py.
# Stage first (here): M3_STAGE_TARGETS="kernels_cuda_parity linear_bench" tools/gpu_stage.sh
#   tools/gpu_linear_rule.sh   (LINEAR_ROWS, LINEAR_VARIANTS, LINEAR_SHAPES, LINEAR_RUNS override)
# The step limits (200 s parity, 170 s per sweep) keep two sweeps inside one 600-second device call.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
rows=${LINEAR_ROWS:-64,96,128,160,192,224,256,320,384,448,512,1024}
variants=${LINEAR_VARIANTS:-wgmma,wgmma_ov,narrow,nosplit,wide}
shapes=${LINEAR_SHAPES:-q_proj,o_proj,dense_mlp,kv_proj,attn_proj}
runs=${LINEAR_RUNS:-2}
step kernels_cuda_parity 200 "$dir/kernels_cuda_parity"
grep -E "linear|FAILED|Failure" "$out/kernels_cuda_parity.log" | head -20
jsons=()
for r in $(seq 1 "$runs"); do
  step "linear_variants_$r" 170 "$dir/linear_bench" --rows "$rows" --rowdot-max 0 --iters 10 --shapes "$shapes" \
    --variants "$variants" --json "$out/linear_variants_$r.json"
  [[ -f $out/linear_variants_$r.json ]] && jsons+=("$out/linear_variants_$r.json")
done
head -3 "$out/linear_variants_1.log"
[[ ${#jsons[@]} -gt 0 ]] && python3 "$root/tools/linear_variants_summary.py" "${jsons[@]}" || status=1
exit $status
