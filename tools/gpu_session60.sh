#!/usr/bin/env bash
# One device call (session 60): the block-major kernels' K/V block by TMA, measured against the
# build before it, then the whole GPU check on the same build.
#   1. kernels_cuda_msa (the staged build: every MSA entry vs the CPU reference, block-major ==
#      query-major bit for bit for the canonical variant);
#   2. msa_bench_base (the build before) and msa_bench alternating over AB_REPS repetitions
#      (AB_ARGS), tools/bench_ab.py over their JSON -> $OUT/ab_summary.txt;
#   3. unless GPU_CHECK=0, tools/gpu_check.sh (M3_CHECK_MOE=0 M3_BENCH_LAYERS=0 unless set: the MoE
#      and decode benchmark paths did not change).
# Stage: M3_STAGE_TARGETS="wgmma_identity_probe kernels_cuda_parity kernels_cuda_msa
#   kernels_cuda_sampling model_cuda m3serve msa_bench" tools/gpu_stage.sh, then copy the base
#   msa_bench into .dev/gpu/msa_bench_base and re-pack .dev/gpu.tar.xz.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step parity_msa 240 "$dir/kernels_cuda_msa"
grep -E "^\[  (PASSED|FAILED)|Failure" "$out/parity_msa.log" | head -5
files=()
for rep in $(seq 1 "${AB_REPS:-3}"); do
  for l in base new; do
    bin=$dir/msa_bench
    [[ $l == base ]] && bin=$dir/msa_bench_base
    # shellcheck disable=SC2086
    step "$l.$rep" 300 "$bin" ${AB_ARGS:---no-decode --prefill 8192,32768 --index-dtypes bf16 --no-baseline --iters 9} \
      --json "$out/$l.$rep.json" && files+=("$out/$l.$rep.json")
  done
done
(( ${#files[@]} > 0 )) && python3 "$root/tools/bench_ab.py" --base base --json "$out/ab_summary.json" "${files[@]}" \
  > "$out/ab_summary.txt" && cat "$out/ab_summary.txt"
if [[ ${GPU_CHECK:-1} != 0 ]]; then
  M3_CHECK_MOE=${M3_CHECK_MOE:-0} M3_BENCH_LAYERS=${M3_BENCH_LAYERS:-0} bash "$root/tools/gpu_check.sh" || status=1
fi
echo "gpu_session60: overall status $status"
exit $status
