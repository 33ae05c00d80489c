#!/usr/bin/env bash
# One device call (session 53, second): EAGLE-3 with the draft's passes chained on the device and
# the chained passes replayed as graphs. model_cuda's CudaEagle3 tests (outputs = plain decoding;
# the bundled draft's acceptance counts with graphs = eager), then spec_bench on the bundled
# m3-small with its trained draft (graph-replayed verification; the same acceptance as before).
#   M3_STAGE_TARGETS="spec_bench model_cuda" tools/gpu_stage.sh; tools/gpu_session53b.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step eagle3_tests 150 "$dir/model_cuda" --gtest_filter='CudaEagle3*'
grep -E "OK \]|FAIL|Failure|bundled draft|Expected|Which is" "$out/eagle3_tests.log" | head -12
step eagle3_small 150 "$dir/spec_bench" --tokenizer "$root/models/m3-small" \
  --corpus "$dir/data/pg1184-monte-cristo.txt" --device cuda --batch-sizes 1,8,32 --draft-lens 0,3 --output-len 64 \
  --eagle3 "$root/models/m3-small-eagle3" --spec-graphs 1 --json "$out/eagle3_small.json"
grep -E "batch" "$out/eagle3_small.log"
exit $status
