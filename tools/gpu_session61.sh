#!/usr/bin/env bash
# One device call (session 61): the block-major kernels' K/V block by TMA, measured against the
# build before it.
#   1. kernels_cuda_msa on the staged build (every MSA entry vs the CPU reference; the canonical
#      block-major kernel == query-major bit for bit), and kernels_cuda_msa_<label> for each other
#      label that was staged with its own test binary;
#   2. msa_bench_<label> for each label of AB_LABELS (default "base new"; "new" is the staged
#      msa_bench) alternating over AB_REPS repetitions (AB_ARGS), tools/bench_ab.py over their JSON
#      -> $OUT/ab_summary.txt;
#   3. MODEL=1: model_cuda (the HF goldens through the engine, batch-invariant prefill included).
# Stage: M3_STAGE_TARGETS="kernels_cuda_msa model_cuda msa_bench" tools/gpu_stage.sh, then copy
#   the other builds' msa_bench into .dev/gpu/msa_bench_<label> and re-pack .dev/gpu.tar.xz.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step parity_msa 240 "$dir/kernels_cuda_msa"
grep -E "^\[  (PASSED|FAILED)|Failure" "$out/parity_msa.log" | head -5
read -r -a labels <<< "${AB_LABELS:-base new}"
for l in "${labels[@]}"; do
  [[ -x $dir/kernels_cuda_msa_$l ]] || continue
  step "parity_msa_$l" 240 "$dir/kernels_cuda_msa_$l"
  grep -E "^\[  (PASSED|FAILED)|Failure" "$out/parity_msa_$l.log" | head -5
done
files=()
for rep in $(seq 1 "${AB_REPS:-3}"); do
  for l in "${labels[@]}"; do
    bin=$dir/msa_bench_$l
    [[ $l == new ]] && bin=$dir/msa_bench
    # shellcheck disable=SC2086
    step "$l.$rep" 300 "$bin" ${AB_ARGS:---no-decode --prefill 8192,32768 --index-dtypes bf16 --no-baseline --iters 9} \
      --json "$out/$l.$rep.json" && files+=("$out/$l.$rep.json")
  done
done
(( ${#files[@]} > 0 )) && python3 "$root/tools/bench_ab.py" --base "${labels[0]}" --json "$out/ab_summary.json" \
  "${files[@]}" > "$out/ab_summary.txt" && cat "$out/ab_summary.txt"
if [[ ${MODEL:-0} != 0 ]]; then
  step model_cuda 300 "$dir/model_cuda"
  grep -E "^\[  (PASSED|FAILED)|Failure" "$out/model_cuda.log" | head -5
fi
echo "gpu_session61: overall status $status"
exit $status
