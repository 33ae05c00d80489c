#!/usr/bin/env bash
# On a GPU machine with 2+ GPUs (nvidia-h100-x2 / h200-x2), one call: tensor parallelism through
# NCCL. kernels_cuda_nccl (rank-order sums, all-gather, graphs), model_cuda's CudaTensorParallel
# (TP 2 = TP 1's tokens on m3-small, graphs = eager, alone = batched), then spec_bench plain
# decoding (draft 0) on an m3-layers:2 MXFP8 checkpoint at TP 1 and TP 2 (tokens/s, same output).
# NCCL comes from PyTorch's site-packages (nvidia/nccl/lib). Stage first (here):
#   M3_STAGE_TARGETS="kernels_cuda_nccl model_cuda spec_bench m3serve" tools/gpu_stage.sh; tools/gpu_tp.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[[ -z $nccl_lib ]] && nccl_lib=$(dirname "$(find / -name 'libnccl.so.2*' 2>/dev/null | head -1)")
echo "NCCL from: ${nccl_lib:-none}"
export LD_LIBRARY_PATH="$LD_LIBRARY_PATH${nccl_lib:+:$nccl_lib}"
nvidia-smi topo -m > "$out/topo.txt" 2>&1; cat "$out/topo.txt"
step nccl 120 "$dir/kernels_cuda_nccl"
grep -E "ranks|OK|FAIL|SKIP" "$out/nccl.log"
step model_tp 300 "$dir/model_cuda" --gtest_filter='CudaTensorParallel*'
grep -E "OK|FAIL|SKIP|Failure" "$out/model_tp.log" | head -20
corpus=$dir/data/pg1184-monte-cristo.txt
ckpt=${TMPDIR:-/tmp}/m3-layers-2-mxfp8
step make_model 150 "$dir/m3serve" make-model --preset m3-layers:2 --mxfp8 --seed 0 --out "$ckpt"
for tp in 1 2; do
  step spec_tp$tp 200 "$dir/spec_bench" --model "$ckpt" --tokenizer "$root/models/m3-small" --corpus "$corpus" \
    --device cuda --batch-sizes 1,8,32 --draft-lens 0 --output-len 64 --tensor-parallel-size $tp --json "$out/spec_tp$tp.json"
  grep batch "$out/spec_tp$tp.log" | sed "s/^/tp $tp: /"
done
exit $status
