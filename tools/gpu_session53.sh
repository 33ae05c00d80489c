#!/usr/bin/env bash
# One device call (session 53): confirm the PDL race fix (bb6ad5e) with tools/gpu_determinism.sh, then
# the per-rank decode compute at TP 4 / 8 shapes (tools/gpu_tp_shard.sh).
#   M3_STAGE_TARGETS="spec_bench m3serve model_cuda decode_bench" tools/gpu_stage.sh; tools/gpu_session53.sh
here=$(dirname "$0")
bash "$here/gpu_determinism.sh"; rc1=$?
bash "$here/gpu_tp_shard.sh"; rc2=$?
exit $((rc1 | rc2))
