#!/usr/bin/env bash
# Everything the GPU machine checks, in one device call (binaries staged by tools/gpu_stage.sh
# into .dev/gpu.tar.xz and carried there; unpacked here):
#   1. kernel parity: every CUDA entry vs the CPU reference over a shape sweep (table);
#   2. the sample op on the GPU vs the CPU reference, and inside a CUDA graph;
#   3. the model on the GPU: HF goldens (tiny, trained small; MXFP8 native and as BF16) and
#      the CUDA engine vs the CPU engine (greedy equality, graphs == eager, batch invariance);
#   4. a decode step of `m3serve generate --device cuda --trace-dispatch` (the dispatch trace);
#   5. decode_bench on an m3-layers:N MXFP8 checkpoint made on the machine (M3_BENCH_LAYERS,
#      default 4; 0 skips), batches M3_BENCH_BATCHES (default 1,8,32,128).
# Results go to $OUT (logs, JSON). Exit status: nonzero if any check failed.
#   M3_SANITIZE=1  also run the kernel parity test under compute-sanitizer memcheck.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${M3_GPU_DIR:-$root/.dev/gpu}
out=${OUT:-${M3_OUT:-$root/.dev/gpu-out}}
mkdir -p "$out"
if [[ ! -x $dir/kernels_cuda_parity && -f $root/.dev/gpu.tar.xz ]]; then
  tar -C "$root/.dev" -xJf "$root/.dev/gpu.tar.xz"
fi
[[ -x $dir/kernels_cuda_parity ]] || { echo "gpu_check: no staged binaries in $dir (run tools/gpu_stage.sh)" >&2; exit 2; }

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
export M3_SOURCE_DIR=$root M3_OUT=$out M3_BINARY_DIR=${TMPDIR:-/tmp}/m3-gpu-check
mkdir -p "$M3_BINARY_DIR"
status=0
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "gpu_check: $name exit $rc in $((SECONDS - t0)) s"
  [[ $rc == 0 ]] || status=1
  return $rc
}

step kernels_cuda_parity 240 "$dir/kernels_cuda_parity"
sed -n '/^op /,/^wrote/p' "$out/kernels_cuda_parity.log"
grep -E "FAILED|Failure|error" "$out/kernels_cuda_parity.log" | head -20
step kernels_cuda_sampling 120 "$dir/kernels_cuda_sampling"
grep -E "^\s*(rows|[0-9]+x)|FAILED|Failure" "$out/kernels_cuda_sampling.log" | head -30
step model_cuda 400 "$dir/model_cuda"
grep -E "prompt [0-9]|steps,|FAILED|Failure|diverge" "$out/model_cuda.log" | head -60

# One decode step's dispatch trace (first use of each op/entry/shape class, with the reason).
step generate_trace 120 "$dir/m3serve" generate --model "$root/models/m3-small-mxfp8" --device cuda --trace-dispatch \
  --print-steps --prompt "The old house on the hill" --max-tokens 8 --temperature 0
grep -E "dispatch:|graph|tok/s|loaded" "$out/generate_trace.log" | head -60

if [[ ${M3_SANITIZE:-0} == 1 ]]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [[ -n $cs ]] && step memcheck 200 "$cs" --tool memcheck --leak-check no "$dir/kernels_cuda_parity" &&
    grep -E "ERROR SUMMARY" "$out/memcheck.log" | tail -1
fi

layers=${M3_BENCH_LAYERS:-4}
if [[ $layers -gt 0 ]]; then
  ckpt=${TMPDIR:-/tmp}/m3-layers-$layers-mxfp8
  [[ -f $ckpt/config.json ]] || step make_model 300 "$dir/m3serve" make-model --preset "m3-layers:$layers" --mxfp8 \
    --seed 0 --out "$ckpt"
  tail -3 "$out/make_model.log" 2>/dev/null
  step decode_bench "${M3_BENCH_TIMEOUT:-300}" "$dir/decode_bench" --model "$ckpt" \
    --batch-sizes "${M3_BENCH_BATCHES:-1,8,32,128}" --context "${M3_BENCH_CONTEXT:-4096}" --json "$out/decode_bench.json"
  cat "$out/decode_bench.log"
fi
echo "gpu_check: overall status $status"
exit $status
