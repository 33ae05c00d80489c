#!/usr/bin/env bash
# The A/B run staged by tools/gpu_ab_stage.sh, on the GPU machine, in one device call:
#   1. every staged parity binary, once (first: a wrong kernel's timings mean nothing, and the
#      call may end before the timings do);
#   2. AB_REPS (default 3) repetitions, each running every label's binary once with AB_ARGS in the
#      staged order (alternating, so that the machine's drifts fall on every label alike), each
#      writing $OUT/<label>.<rep>.json (the benchmarks' --json);
#   3. tools/bench_ab.py over those files: per row and metric (AB_METRICS, default the *_us
#      fields) each label's range and its median's change against the first label
#      -> $OUT/ab_summary.txt, $OUT/ab_summary.json.
#   AB_ARGS="--no-decode --prefill 8192,32768 --index-dtypes bf16 --no-baseline" tools/gpu_ab.sh
# Exit status: nonzero if any run or parity binary failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[[ -d $root/.dev/ab || ! -f $root/.dev/ab.tar.xz ]] || tar -C "$root/.dev" -xJf "$root/.dev/ab.tar.xz"
export M3_GPU_DIR=$root/.dev/ab
source "$(dirname "$0")/gpu_env.sh"
[[ -s $dir/labels ]] || { echo "gpu_ab: no labels in $dir (run tools/gpu_ab_stage.sh here)" >&2; exit 2; }
reps=${AB_REPS:-3}
for p in "$dir"/parity/*; do
  [[ -x $p ]] || continue
  name=$(basename "$p")
  step "parity_$name" "${AB_PARITY_TIMEOUT:-300}" "$p"
  grep -E "^\[  (PASSED|FAILED)|FAILED|Failure" "$out/parity_$name.log" | head -5
done
# Read after the parity runs: a parity wrapper script may drop its label from the file (a kernel
# that failed or hung is not timed).
mapfile -t labels < "$dir/labels"
files=()
for rep in $(seq 1 "$reps"); do
  for l in "${labels[@]}"; do
    # shellcheck disable=SC2086
    step "$l.$rep" "${AB_TIMEOUT:-300}" "$dir/bin/$l" ${AB_ARGS:-} --json "$out/$l.$rep.json" &&
      files+=("$out/$l.$rep.json")
  done
done
if (( ${#files[@]} > 0 )); then
  python3 "$root/tools/bench_ab.py" --base "${labels[0]}" --metrics "${AB_METRICS:-_us\$}" \
    --json "$out/ab_summary.json" "${files[@]}" > "$out/ab_summary.txt" || status=1
  cat "$out/ab_summary.txt"
fi
echo "gpu_ab: overall status $status"
exit "$status"
