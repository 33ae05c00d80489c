#!/usr/bin/env bash
# Nsight Compute on the GPU machine: per-kernel duration, throughput, occupancy and warp
# stall reasons for the staged benchmarks (tools/gpu_stage.sh), one report per profile.
#   NCU_PROFILES="name|binary args|kernel-regex;..." tools/gpu_ncu.sh
# Clocks are left alone (--clock-control none); L2 and caches are flushed per kernel (ncu's default).
# NCU_SECTIONS adds sections (e.g. "ComputeWorkloadAnalysis SchedulerStats InstructionStats").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[[ -n $ncu_bin ]] || { echo "gpu_ncu: ncu not found" >&2; exit 2; }
extra=()
for sec in ${NCU_SECTIONS:-}; do extra+=(--section "$sec"); done
IFS=';' read -r -a profiles <<< "${NCU_PROFILES:?set NCU_PROFILES}"
for p in "${profiles[@]}"; do
  IFS='|' read -r name cmd regex <<< "$p"
  read -r -a argv <<< "$cmd"
  timeout "${NCU_TIMEOUT:-240}" "$ncu_bin" --clock-control none --graph-profiling node -k "regex:$regex" \
    --launch-count "${NCU_LAUNCHES:-6}" --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis ${extra[@]+"${extra[@]}"} --csv --page details \
    "$dir/${argv[0]}" "${argv[@]:1}" > "$out/ncu_$name.csv" 2> "$out/ncu_$name.err"
  echo "gpu_ncu: $name exit $? ($(wc -l < "$out/ncu_$name.csv") lines)"
done
