#!/usr/bin/env bash
# Nsight Compute source view (SASS with warp-stall samples per instruction) of one kernel of
# a staged benchmark, plus its warp-state details:
#   tools/gpu_ncu_source.sh NAME KERNEL_REGEX BINARY ARGS...   -> $OUT/ncu_src_NAME.csv, ncu_state_NAME.txt
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
name=$1 regex=$2 bin=$3
shift 3
common=(--clock-control none --graph-profiling node -k "regex:$regex" --launch-skip "${NCU_SKIP:-0}" --launch-count 1)
timeout 240 "$ncu_bin" "${common[@]}" --section SourceCounters --section WarpStateStats --page source \
  --print-source sass --csv "$dir/$bin" "$@" > "$out/ncu_src_$name.csv" 2> "$out/ncu_src_$name.err"
echo "ncu source $name: exit $? ($(wc -l < "$out/ncu_src_$name.csv") lines)"
timeout 240 "$ncu_bin" "${common[@]}" --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --print-details all "$dir/$bin" "$@" > "$out/ncu_state_$name.txt" 2>&1
echo "ncu state $name: exit $?"
