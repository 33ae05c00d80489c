#!/usr/bin/env bash
# The MSA decode kernels on the GPU machine, in one device call (binaries staged by
# tools/gpu_stage.sh into .dev/gpu.tar.xz and carried there):
#   1. kernels_cuda_msa: tuned MSA entries vs the CPU reference (exact selections, attention
#      within 2e-3; kv_write BF16/FP8 bytes; CUDA-graph replays) -> cuda_msa_parity.json;
#   2. kernels_cuda_parity: every generic CUDA entry still matches (F32 caches);
#   3. msa_bench: one layer's MSA decode step, tuned vs the old simple entries, M3 TP1 shapes,
#      contexts x batches (MSA_BENCH_ARGS adds or overrides options) -> msa_bench.json.
# Results go to $OUT (logs, JSON). Exit status: nonzero if any step failed.
#   M3_SANITIZE=1  also run kernels_cuda_msa under compute-sanitizer memcheck.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step kernels_cuda_msa 240 "$dir/kernels_cuda_msa"
sed -n '/^case /,/^wrote/p' "$out/kernels_cuda_msa.log"
grep -E "FAILED|Failure|error" "$out/kernels_cuda_msa.log" | head -20
step kernels_cuda_parity 240 "$dir/kernels_cuda_parity"
grep -E "^(attention|indexer|kv_write)|FAILED" "$out/kernels_cuda_parity.log" | head -20
if [[ ${M3_SANITIZE:-0} == 1 ]]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [[ -n $cs ]] && step memcheck 400 "$cs" --tool memcheck --leak-check no "$dir/kernels_cuda_msa" &&
    grep -E "ERROR SUMMARY" "$out/memcheck.log" | tail -1
fi
# shellcheck disable=SC2086
step msa_bench "${MSA_BENCH_TIMEOUT:-540}" "$dir/msa_bench" --json "$out/msa_bench.json" ${MSA_BENCH_ARGS:-}
cat "$out/msa_bench.log"
echo "msa_bench.sh: overall status $status"
exit $status
