#!/usr/bin/env bash
# The MXFP8 MoE kernels on the GPU machine, in one device call (binaries staged by
# tools/gpu_stage.sh into .dev/gpu.tar.xz and carried there):
#   1. kernels_cuda_moe: both paths vs the CPU reference, routing exact, batch invariance, graph
#      capture + replay -> cuda_moe_parity.json (table in kernels_cuda_moe.log);
#   2. moe_bench: the MoE block, the experts and the GEMMs alone per path, the dispatch, fused vs
#      separate shared expert, the old grouped row-dot entry, copy bandwidth and FP8 ceiling, M3
#      TP1 shapes (MOE_BENCH_ARGS adds or overrides options) -> moe_bench.json;
#   3. mem_bench: read-bandwidth ceilings of one launch (ldg, cp.async and TMA patterns) against the
#      copy bandwidth -> mem_bench.json;
#   4. tools/moe_torch_baseline.py: torch._grouped_mm (BF16) and torch._scaled_grouped_mm (FP8
#      rowwise) on the same shapes -> moe_torch_baseline.json (skipped if torch is missing).
# Results go to $OUT (logs, JSON, summary.txt). Exit status: nonzero if any step failed.
#   M3_SANITIZE=1  also run kernels_cuda_moe (M3_MOE_QUICK) under compute-sanitizer memcheck.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step kernels_cuda_moe "${MOE_TEST_TIMEOUT:-180}" "$dir/kernels_cuda_moe"
sed -n '/^check /,/^wrote/p' "$out/kernels_cuda_moe.log" | tee -a "$out/summary.txt"
grep -E "FAILED|Failure|error" "$out/kernels_cuda_moe.log" | head -20
if [[ ${M3_SANITIZE:-0} == 1 ]]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [[ -n $cs ]] && M3_MOE_QUICK=1 step memcheck 300 "$cs" --tool memcheck --leak-check no "$dir/kernels_cuda_moe" &&
    grep -E "ERROR SUMMARY" "$out/memcheck.log" | tail -1
fi
# shellcheck disable=SC2086
step moe_bench "${MOE_BENCH_TIMEOUT:-240}" "$dir/moe_bench" --json "$out/moe_bench.json" ${MOE_BENCH_ARGS:-}
tee -a "$out/summary.txt" < "$out/moe_bench.log"
# What one launch can read (the ceiling the weight stream meets before the copy bandwidth).
step mem_bench 120 "$dir/mem_bench" --json "$out/mem_bench.json" && tee -a "$out/summary.txt" < "$out/mem_bench.log"
py=$(command -v python3 || command -v python)
if [[ -n $py ]]; then
  # shellcheck disable=SC2086
  step torch_baseline "${MOE_TORCH_TIMEOUT:-150}" "$py" "$root/tools/moe_torch_baseline.py" --json "$out/moe_torch_baseline.json" ${MOE_TORCH_ARGS:-}
  tee -a "$out/summary.txt" < "$out/torch_baseline.log"
else
  echo "moe_bench.sh: no python: torch baseline skipped" | tee -a "$out/summary.txt"
fi
echo "moe_bench.sh: overall status $status" | tee -a "$out/summary.txt"
exit $status
