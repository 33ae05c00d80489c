#!/usr/bin/env bash
# Runs the CUDA parity test on a GPU machine; builds nothing. The test binary and the host
# libraries the machine may lack (OpenBLAS, gfortran) are expected in $1 (default .dev/cuda,
# the test binary at its top, libraries under lib/); cuBLAS comes from the machine. Results
# (log, table JSON, nvidia-smi, ldd, optional memcheck log) go to $OUT.
#   M3_SANITIZE=1  also run the test under compute-sanitizer memcheck (time-limited).
set -uo pipefail
dir=${1:-.dev/cuda}
out=${OUT:-${M3_OUT:-.}}
mkdir -p "$out"
bin="$dir/kernels_cuda_parity"
[[ -x $bin ]] || { echo "gpu_check: no test binary at $bin" >&2; exit 2; }

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv 2>&1 | tee "$out/nvidia_smi.txt"

# cuBLAS 13: the toolkit's copy if there is one, else any (PyTorch's nvidia wheels).
cublas_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -e $d/libcublasLt.so.13 ]] && { cublas_dir=$d; break; }
done
if [[ -z $cublas_dir ]]; then
  lt=$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
  [[ -n $lt ]] && cublas_dir=$(dirname "$lt")
fi
echo "gpu_check: cuBLAS from ${cublas_dir:-<not found>}"
export LD_LIBRARY_PATH="$dir/lib${cublas_dir:+:$cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd "$bin" > "$out/ldd.txt" 2>&1
grep -E "not found|cublas|openblas" "$out/ldd.txt"

M3_OUT="$out" "$bin" 2>&1 | tee "$out/parity.log"
rc=${PIPESTATUS[0]}

if [[ ${M3_SANITIZE:-0} == 1 ]]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [[ -n $cs ]]; then
    M3_OUT="$out/memcheck" timeout "${M3_SANITIZE_TIMEOUT:-150}" "$cs" --tool memcheck --leak-check no "$bin" \
      > "$out/memcheck.log" 2>&1
    echo "gpu_check: memcheck exit $? ($(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1))"
  else
    echo "gpu_check: compute-sanitizer not found"
  fi
fi
echo "gpu_check: parity test exit $rc"
sed -n '/^op /,/^wrote/p' "$out/parity.log"
exit "$rc"
