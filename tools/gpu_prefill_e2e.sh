#!/usr/bin/env bash
# Prefill end to end, before/after, on the GPU machine: staged m3serve builds ($dir/e2e/m3serve_<label>,
# labels in $dir/e2e/labels, the first one the baseline) each run `m3serve generate` on one
# random-id prompt per length in E2E_LENGTHS (default 8192,32768), on the same m3-layers:N MXFP8
# checkpoint made here (E2E_LAYERS, default 2: layer 0 with M3's dense attention and dense MLP, layer
# 1 MSA + MoE; m3-layers:1 has no dense layer),
# without batch invariance, the whole prompt in one step; labels alternate over E2E_REPS (default 2)
# repetitions. The first step's time (the prefill: its launches, synchronised at the sampling) is
# read from --print-steps (eager: no graphs are captured for the two decode steps); the first
# repetition also logs the dispatch trace.
#   -> $OUT/e2e_<label>_<len>_<rep>.log, $OUT/prefill_e2e.json, a table on stdout.
# Stage: copy the builds into .dev/ab/e2e/ (with tools/gpu_ab_stage.sh's libraries in .dev/ab/lib).
#   E2E_LENGTHS=8192,32768 E2E_REPS=2 M3_GPU_DIR=.dev/ab tools/gpu_prefill_e2e.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
e2e=$dir/e2e
[[ -s $e2e/labels ]] || { echo "gpu_prefill_e2e: no labels in $e2e" >&2; exit 2; }
mapfile -t labels < "$e2e/labels"
preset=${E2E_PRESET:-m3-layers:${E2E_LAYERS:-2}}  # E2E_PRESET=tiny tries the script on a CPU
ckpt=${TMPDIR:-/tmp}/${preset/:/-}-mxfp8
[[ -f $ckpt/config.json ]] || step make_model 300 "$e2e/m3serve_${labels[0]}" make-model --preset "$preset" \
  --mxfp8 --seed 0 --out "$ckpt" || exit 1
IFS=',' read -r -a lengths <<< "${E2E_LENGTHS:-8192,32768}"
for len in "${lengths[@]}"; do
  python3 -c "import json, random, sys; c = json.load(open(sys.argv[1])); v = c.get('text_config', c)['vocab_size']; r = random.Random($len);
print(','.join(str(r.randrange(v // 100, v - v // 100)) for _ in range($len)))" "$ckpt/config.json" > "$out/prompt_$len.txt"
done
# One untimed run first: the first timed build must not pay the GPU's clock ramp from idle (in the
# fifty-eighth session's single repetition the first of two identical layers ran 8 % slower).
run_args=(--model "$ckpt" --max-tokens 2 --ignore-eos --print-steps --no-batch-invariant --enforce-eager)
step e2e_warmup "${E2E_TIMEOUT:-240}" "$e2e/m3serve_${labels[0]}" generate "${run_args[@]}" \
  --prompt-file "$out/prompt_${lengths[0]}.txt" --max-num-batched-tokens "${lengths[0]}" --max-model-len $((lengths[0] + 64))
for rep in $(seq 1 "${E2E_REPS:-2}"); do
  for len in "${lengths[@]}"; do
    for l in "${labels[@]}"; do
      trace=()
      [[ $rep == 1 ]] && trace=(--trace-dispatch)
      step "e2e_${l}_${len}_$rep" "${E2E_TIMEOUT:-240}" "$e2e/m3serve_$l" generate "${run_args[@]}" \
        --prompt-file "$out/prompt_$len.txt" --max-num-batched-tokens "$len" --max-model-len $((len + 64)) "${trace[@]}"
    done
  done
done
python3 - "$out" "${labels[@]}" <<'EOF'
import glob, json, os, re, statistics, sys
out, labels = sys.argv[1], sys.argv[2:]
runs = {}
for path in glob.glob(os.path.join(out, "e2e_*.log")):
    m = re.match(r"e2e_(.+)_(\d+)_(\d+)\.log$", os.path.basename(path))
    step = re.search(r"^step 1: prefill (\d+) .*, ([0-9.]+) ms$", open(path).read(), re.M)
    if m and step:
        runs.setdefault(m.group(2), {}).setdefault(m.group(1), []).append(float(step.group(2)))
table = {}
for length in sorted(runs, key=int):
    base = statistics.median(runs[length][labels[0]]) if labels[0] in runs[length] else None
    cells = []
    for l in labels:
        v = runs[length].get(l, [])
        if not v:
            cells.append(f"{l}: -")
            continue
        med = statistics.median(v)
        change = f" {100 * (med / base - 1):+.1f} %" if base and l != labels[0] else ""
        cells.append(f"{l}: {min(v):.1f}-{max(v):.1f} ms{change}")
        table.setdefault(length, {})[l] = {"prefill_ms": v, "median_ms": med}
    print(f"prefill of {length} tokens | " + " | ".join(cells))
json.dump(table, open(os.path.join(out, "prefill_e2e.json"), "w"), indent=1)
EOF
for l in "${labels[@]}"; do
  echo "== $l: attention entries in the dispatch trace"
  grep -ho "dispatch: attention[a-z_]* -> [^]]*]" "$out"/e2e_"${l}"_*_1.log | sort | uniq -c
done
echo "gpu_prefill_e2e: overall status $status"
exit $status
