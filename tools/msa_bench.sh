#!/usr/bin/env bash
# The MSA kernels on the GPU machine, in one device call (binaries staged by
# tools/gpu_stage.sh into .dev/gpu.tar.xz and carried there):
#   1. kernels_cuda_msa: tuned MSA entries vs the CPU reference (exact selections in both
#      indexer layouts, attention within 2e-3, block-major == query-major and alone ==
#      batched bit for bit; kv_write BF16/FP8 bytes; CUDA-graph replays) -> cuda_msa_parity.json;
#   2. kernels_cuda_parity: every generic CUDA entry still matches (F32 caches);
#   3. msa_bench: one layer's MSA decode step, tuned vs the old simple entries, M3 TP1 shapes,
#      contexts x batches, and prefills of one sequence (MSA_BENCH_ARGS adds or overrides
#      options) -> msa_bench.json;
#   4. tools/msa_torch_dense.py: dense attention (PyTorch SDPA flash / cuDNN) on the same
#      shapes, if python3 has torch (TORCH_DENSE_ARGS) -> msa_torch_dense.json; never fails.
# Results go to $OUT (logs, JSON). Exit status: nonzero if any of steps 1-3 failed.
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
if command -v python3 >/dev/null; then
  # shellcheck disable=SC2086
  timeout "${TORCH_DENSE_TIMEOUT:-300}" python3 "$root/tools/msa_torch_dense.py" --json "$out/msa_torch_dense.json" \
    ${TORCH_DENSE_ARGS:-} > "$out/msa_torch_dense.log" 2>&1 || echo "msa_torch_dense: exit $? (ignored)"
  cat "$out/msa_torch_dense.log"
fi
echo "msa_bench.sh: overall status $status"
exit $status
