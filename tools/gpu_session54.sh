#!/usr/bin/env bash
# One device call (session 54): disaggregated prefill on the GPU. model_cuda's CudaDisagg test
# (a CUDA engine's exported pages, through the wire format, decode in a second CUDA engine exactly
# like a cold one: BF16 / FP8 index keys, an EAGLE-3 draft's pages) and CudaEngine (nothing else
# moved); then two m3serve servers on the GPU (kv_producer, kv_consumer) and disagg-proxy with the
# bundled m3-small: outputs through the proxy against the producer's own, and the decode server's
# time for a prompt with its blocks fetched against computing it (tools/disagg_timing.py).
#   M3_STAGE_TARGETS="model_cuda m3serve" tools/gpu_stage.sh; tools/gpu_session54.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
step disagg_tests 300 "$dir/model_cuda" --gtest_filter='CudaDisagg.*:Small/CudaEngine.*-*mxfp8*'
grep -E "OK \]|FAIL|Failure|Expected|Which is" "$out/disagg_tests.log" | head -16
cfg_p='{"kv_role": "kv_producer"}'
cfg_c='{"kv_role": "kv_consumer"}'
"$dir/m3serve" serve "$root/models/m3-small" --port 18101 --kv-transfer-config "$cfg_p" > "$out/producer.log" 2>&1 &
pp=$!
"$dir/m3serve" serve "$root/models/m3-small" --port 18102 --kv-transfer-config "$cfg_c" > "$out/consumer.log" 2>&1 &
pc=$!
"$dir/m3serve" disagg-proxy --prefill http://127.0.0.1:18101 --decode http://127.0.0.1:18102 --port 18103 > "$out/proxy.log" 2>&1 &
px=$!
step disagg_timing 240 python3 "$root/tools/disagg_timing.py" --producer 18101 --consumer 18102 --proxy 18103 \
  --lengths 512,2048,4000 --json "$out/disagg_timing.json"
cat "$out/disagg_timing.log"
kill $pp $pc $px 2>/dev/null
wait 2>/dev/null
grep -E "disaggregated prefill|model " "$out/producer.log" "$out/consumer.log" | head -4
exit $status
