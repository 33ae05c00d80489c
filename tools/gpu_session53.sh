#!/usr/bin/env bash
# One device call (session 53): confirm the PDL race fix (bb6ad5e) with tools/gpu_determinism.sh;
# EAGLE-3 on the GPU (model_cuda CudaEagle3, then spec_bench with a random draft on m3-layers:2:
# the draft's cost per step, acceptance ~0); then the per-rank decode compute at TP 4 / 8 shapes
# (tools/gpu_tp_shard.sh).
#   M3_STAGE_TARGETS="spec_bench m3serve model_cuda" tools/gpu_stage.sh (m3serve may be a CPU build:
#   it only writes checkpoints here); tools/gpu_session53.sh
here=$(dirname "$0")
bash "$here/gpu_determinism.sh"; rc1=$?
(
  source "$here/gpu_env.sh"
  step eagle3_test 200 "$dir/model_cuda" --gtest_filter='CudaEagle3*'
  grep -E "OK|FAIL|Failure" "$out/eagle3_test.log" | head -5
  ckpt=${TMPDIR:-/tmp}/m3-layers-2-mxfp8
  [[ -f $ckpt/config.json ]] || step make_model2 100 "$dir/m3serve" make-model --preset m3-layers:2 --mxfp8 --seed 0 --out "$ckpt"
  step make_draft2 100 "$dir/m3serve" make-draft --target "$ckpt" --out "$ckpt-draft"
  step eagle3_bench 200 "$dir/spec_bench" --model "$ckpt" --tokenizer "$root/models/m3-small" \
    --corpus "$dir/data/pg1184-monte-cristo.txt" --device cuda --batch-sizes 1,8 --draft-lens 0,3 --output-len 48 \
    --eagle3 "$ckpt-draft" --json "$out/eagle3_bench.json"
  grep -E "batch" "$out/eagle3_bench.log"
  # The bundled m3-small with its trained draft: real acceptance, eager and graph-replayed verification.
  for g in 0 1; do
    step eagle3_small_g$g 200 "$dir/spec_bench" --tokenizer "$root/models/m3-small" \
      --corpus "$dir/data/pg1184-monte-cristo.txt" --device cuda --batch-sizes 1,8,32 --draft-lens 0,3 --output-len 64 \
      --eagle3 "$root/models/m3-small-eagle3" --spec-graphs $g --json "$out/eagle3_small_g$g.json"
    grep -E "batch" "$out/eagle3_small_g$g.log" | sed "s/^/graphs $g: /"
  done
  exit $status
); rc2=$?
[[ -x $here/../.dev/gpu/decode_bench || ! -f $here/../.dev/gpu.tar.xz ]] && { bash "$here/gpu_tp_shard.sh"; rc3=$?; } || rc3=0
exit $((rc1 | rc2 | rc3))
