#!/usr/bin/env bash
# Decode step of several variants of one staged build on the GPU machine (tools/gpu_stage.sh):
# each variant is "LABEL|ENV|ARGS" (ENV: space-separated VAR=value set for that run; ARGS: extra
# decode_bench arguments such as --disable-entries NAME,...), run on the same m3-layers:N MXFP8
# checkpoint made here, M3_BENCH_REPS (default 2) repetitions in alternating order ->
# $OUT/variants_<label>_<ctx>_<rep>.json, and one line per (variant, batch) with every rep's step.
#   M3_BENCH_CONTEXTS=4096 M3_BENCH_BATCHES=1,8,32 tools/gpu_decode_variants.sh \
#     "base|M3_X=0|--disable-entries some.entry.sm90" "new||"
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
layers=${M3_BENCH_LAYERS:-2}
layers_ckpt "$layers"
IFS=',' read -r -a contexts <<< "${M3_BENCH_CONTEXTS:-4096}"
reps=${M3_BENCH_REPS:-2}
for ctx in "${contexts[@]}"; do
  for rep in $(seq 1 "$reps"); do
    for v in "$@"; do
      IFS='|' read -r label envs args <<< "$v"
      name=variants_${label}_${ctx}_$rep
      # shellcheck disable=SC2086  # ENV and ARGS are word lists
      step "$name" "${M3_BENCH_TIMEOUT:-240}" env $envs "$dir/decode_bench" --model "$ckpt" \
        --batch-sizes "${M3_BENCH_BATCHES:-1,8,32}" --context "$ctx" --iters "${M3_BENCH_ITERS:-20}" \
        --json "$out/$name.json" $args
    done
  done
  # One line per (variant, batch): the graph step of every repetition.
  for v in "$@"; do
    IFS='|' read -r label _ _ <<< "$v"
    python3 - "$out" "$label" "$ctx" "$reps" <<'EOF'
import json, sys, os
out, label, ctx, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
steps = {}
for r in range(1, reps + 1):
    p = os.path.join(out, f"variants_{label}_{ctx}_{r}.json")
    if not os.path.exists(p):
        continue
    for b in json.load(open(p)).get("batches", []):
        steps.setdefault(b.get("batch"), []).append(b.get("graph_step_ms"))
for batch, s in sorted(steps.items(), key=lambda kv: kv[0] or 0):
    print(f"{label:>12} ctx {ctx} B={batch}: graph step ms " + " / ".join(f"{x:.4f}" for x in s if x is not None))
EOF
  done
done
echo "gpu_decode_variants: overall status $status"
exit $status
