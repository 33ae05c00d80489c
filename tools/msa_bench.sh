#!/usr/bin/env bash
# The MSA decode kernels on the GPU machine, in one device call (binaries staged by
# tools/msa_stage.sh into .dev/msa and carried there):
#   1. kernels_cuda_msa: tuned MSA entries vs the CPU reference (exact selections, attention
#      within 2e-3; kv_write BF16/FP8 bytes; CUDA-graph replays) -> cuda_msa_parity.json;
#   2. kernels_cuda_parity: every generic CUDA entry still matches (F32 caches);
#   3. msa_bench: one layer's MSA decode step, tuned vs the old simple entries, M3 TP1 shapes,
#      contexts x batches (MSA_BENCH_ARGS adds or overrides options) -> msa_bench.json.
# Results go to $OUT (logs, JSON). Exit status: nonzero if any step failed.
#   M3_SANITIZE=1  also run kernels_cuda_msa under compute-sanitizer memcheck.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${M3_MSA_DIR:-$root/.dev/msa}
out=${OUT:-${M3_OUT:-$root/.dev/msa-out}}
mkdir -p "$out"
[[ -x $dir/msa_bench ]] || { echo "msa_bench.sh: no staged binaries in $dir (run tools/msa_stage.sh)" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$out/nvidia_smi.txt"
cublas_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -e $d/libcublasLt.so.13 ]] && { cublas_dir=$d; break; }
done
if [[ -z $cublas_dir ]]; then
  lt=$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
  [[ -n $lt ]] && cublas_dir=$(dirname "$lt")
fi
export LD_LIBRARY_PATH="$dir/lib${cublas_dir:+:$cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export M3_SOURCE_DIR=$root M3_OUT=$out M3_BINARY_DIR=${TMPDIR:-/tmp}/m3-msa
mkdir -p "$M3_BINARY_DIR"
status=0
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "msa_bench.sh: $name exit $rc in $((SECONDS - t0)) s"
  [[ $rc == 0 ]] || status=1
  return $rc
}
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
