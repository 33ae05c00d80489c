#!/usr/bin/env bash
# The A/B run staged by tools/gpu_ab_stage.sh, on the GPU machine, in one device call:
#   1. every staged parity binary, once (first: a wrong kernel's timings mean nothing, and the
#      call may end before the timings do);
#   2. AB_REPS (default 3) repetitions, each running every label's binary once with AB_ARGS in the
#      staged order (alternating, so that the machine's drifts fall on every label alike), each
#      writing $OUT/<label>.<rep>.json (the benchmarks' --json);
#   3. tools/bench_ab.py over those files: per row and metric (AB_METRICS, default the *_us
#      fields) each label's range and its median's change against the first label
#      -> $OUT/ab_summary.txt, $OUT/ab_summary.json;
#   4. every per-run file (<label>.<rep>.json and .log, parity_*.log) packed into
#      $OUT/ab_runs.tar.xz: the device tool returns at most 8 files from $OUT, and the run files
#      alone would crowd the summary out (AB_PACK=0 leaves them loose).
#   AB_ARGS="--no-decode --prefill 8192,32768 --index-dtypes bf16 --no-baseline" tools/gpu_ab.sh
# Exit status: nonzero if any run or parity binary failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[[ -d $root/.dev/ab || ! -f $root/.dev/ab.tar.xz ]] || tar -C "$root/.dev" -xJf "$root/.dev/ab.tar.xz"
export M3_GPU_DIR=$root/.dev/ab
source "$(dirname "$0")/gpu_env.sh"
[[ -s $dir/labels ]] || { echo "gpu_ab: no labels in $dir (run tools/gpu_ab_stage.sh here)" >&2; exit 2; }
reps=${AB_REPS:-3}
runs=()  # every per-run file's name in $out (packed at the end)
for p in "$dir"/parity/*; do
  [[ -x $p ]] || continue
  name=$(basename "$p")
  step "parity_$name" "${AB_PARITY_TIMEOUT:-300}" "$p"
  runs+=("parity_$name.log")
  grep -E "^\[  (PASSED|FAILED)|FAILED|Failure" "$out/parity_$name.log" | head -5
done
# Read after the parity runs: a parity wrapper script may drop its label from the file (a kernel
# that failed or hung is not timed).
mapfile -t labels < "$dir/labels"
files=()
for rep in $(seq 1 "$reps"); do
  for l in "${labels[@]}"; do
    runs+=("$l.$rep.json" "$l.$rep.log")
    # shellcheck disable=SC2086
    if step "$l.$rep" "${AB_TIMEOUT:-300}" "$dir/bin/$l" ${AB_ARGS:-} --json "$out/$l.$rep.json"; then
      files+=("$out/$l.$rep.json")
    else
      tail -n 3 "$out/$l.$rep.log" | sed "s/^/gpu_ab: $l.$rep: /"  # why, in the call's own output
    fi
  done
done
if (( ${#files[@]} > 0 )); then
  python3 "$root/tools/bench_ab.py" --base "${labels[0]}" --metrics "${AB_METRICS:-_us\$}" \
    --json "$out/ab_summary.json" "${files[@]}" > "$out/ab_summary.txt" || status=1
  cat "$out/ab_summary.txt"
fi
if [[ ${AB_PACK:-1} == 1 ]]; then
  present=()
  for f in "${runs[@]}"; do [[ -f $out/$f ]] && present+=("$f"); done  # a failed run wrote no JSON
  runs=("${present[@]}")
  if (( ${#runs[@]} > 0 )) && tar -C "$out" -cJf "$out/ab_runs.tar.xz" "${runs[@]}"; then
    (cd "$out" && rm -f "${runs[@]}")
    echo "gpu_ab: ${#runs[@]} run files packed into ab_runs.tar.xz"
  fi
fi
echo "gpu_ab: overall status $status"
exit "$status"
