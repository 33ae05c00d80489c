# Sourced by the scripts that run on the GPU machine (gpu_check.sh, msa_bench.sh): unpacks
# the staged binaries (tools/gpu_stage.sh) if only the archive came, finds cuBLAS, sets the
# library path and test environment, and defines `step NAME TIMEOUT CMD...`, which logs CMD
# to $out/NAME.log, prints its exit status and time, and records a failure in $status.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${M3_GPU_DIR:-$root/.dev/gpu}
out=${OUT:-${M3_OUT:-$root/.dev/gpu-out}}
mkdir -p "$out"
if [[ ! -d $dir && -f $root/.dev/gpu.tar.xz ]]; then
  tar -C "$root/.dev" -xJf "$root/.dev/gpu.tar.xz"
fi
[[ -d $dir ]] || { echo "no staged binaries in $dir (run tools/gpu_stage.sh)" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv > "$out/nvidia_smi.txt" 2>&1
cat "$out/nvidia_smi.txt"
cublas_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -e $d/libcublasLt.so.13 ]] && { cublas_dir=$d; break; }
done
if [[ -z $cublas_dir ]]; then
  lt=$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
  [[ -n $lt ]] && cublas_dir=$(dirname "$lt")
fi
export LD_LIBRARY_PATH="$dir/lib${cublas_dir:+:$cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export M3_SOURCE_DIR=$root M3_OUT=$out M3_BINARY_DIR=${TMPDIR:-/tmp}/m3-gpu
mkdir -p "$M3_BINARY_DIR"
status=0
# A step whose staged binary is absent (a partial stage, M3_STAGE_TARGETS) is skipped.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ $1 == "$dir"/* && ! -x $1 ]]; then
    echo "gpu: $name skipped ($(basename "$1") not staged)"
    return 0
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "gpu: $name exit $rc in $((SECONDS - t0)) s"
  [[ $rc == 0 ]] || status=1
  return $rc
}
# `layers_ckpt N`: sets $ckpt to the m3-layers:N MXFP8 checkpoint (seed 0) under $TMPDIR, made with
# the staged m3serve if this machine has none yet (a `make_model` step).
layers_ckpt() {
  ckpt=${TMPDIR:-/tmp}/m3-layers-$1-mxfp8
  [[ -f $ckpt/config.json ]] || step make_model 300 "$dir/m3serve" make-model --preset "m3-layers:$1" --mxfp8 \
    --seed 0 --out "$ckpt"
}
