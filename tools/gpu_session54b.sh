#!/usr/bin/env bash
# One device call (session 54, second): disaggregated prefill on the GPU with both connectors.
# model_cuda's CudaDisagg (exports through host memory and left in GPU memory, BF16 / FP8 index
# keys, an EAGLE-3 draft's pages: the consumer decodes exactly what a cold engine does), then the
# bundled m3-small served by a prefill and a decode process behind disagg-proxy, once with
# M3HttpConnector and once with M3CudaIpcConnector (CUDA IPC between the two processes):
# tools/disagg_timing.py checks the proxy's answers against the producer's own and times the
# decode server's first token with the prompt's blocks fetched against computing it.
#   M3_STAGE_TARGETS="model_cuda m3serve" tools/gpu_stage.sh; tools/gpu_session54b.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step disagg_tests 300 "$dir/model_cuda" --gtest_filter='CudaDisagg.*'
grep -E "OK \]|FAIL|Failure|Expected|Which is|device pages" "$out/disagg_tests.log" | head -16
for connector in M3HttpConnector M3CudaIpcConnector; do
  cfg_p="{\"kv_connector\": \"$connector\", \"kv_role\": \"kv_producer\"}"
  cfg_c="{\"kv_connector\": \"$connector\", \"kv_role\": \"kv_consumer\"}"
  "$dir/m3serve" serve "$root/models/m3-small" --port 18101 --kv-transfer-config "$cfg_p" > "$out/producer_$connector.log" 2>&1 &
  pp=$!
  "$dir/m3serve" serve "$root/models/m3-small" --port 18102 --kv-transfer-config "$cfg_c" > "$out/consumer_$connector.log" 2>&1 &
  pc=$!
  "$dir/m3serve" disagg-proxy --prefill http://127.0.0.1:18101 --decode http://127.0.0.1:18102 --port 18103 > "$out/proxy_$connector.log" 2>&1 &
  px=$!
  echo "== $connector"
  step "timing_$connector" 240 python3 "$root/tools/disagg_timing.py" --producer 18101 --consumer 18102 --proxy 18103 \
    --lengths 512,2048,4000 --json "$out/disagg_timing_$connector.json"
  cat "$out/timing_$connector.log"
  curl -s localhost:18102/metrics | grep -E '^m3:kv_transfer_(imported_blocks|failures)_total'
  kill $pp $pc $px 2>/dev/null
  wait $pp $pc $px 2>/dev/null
  grep -E "WARN|ERROR" "$out/consumer_$connector.log" | head -5
done
exit $status
