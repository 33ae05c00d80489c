#!/usr/bin/env bash
# Everything the GPU machine checks, in one device call (binaries staged by tools/gpu_stage.sh
# into .dev/gpu.tar.xz and carried there; unpacked here):
#   0. tools/wgmma_probe: wgmma m64nNk16 chains give mma.sync m16n8k16 chains' bits;
#   1. kernel parity: every CUDA entry vs the CPU reference over a shape sweep (table), and
#      the tuned MSA entries (tests/kernels/cuda_msa);
#      and the MXFP8 MoE paths (tests/kernels/cuda_moe, M3_MOE_QUICK: up to 4096 tokens;
#      M3_CHECK_MOE=0 skips it, tools/moe_bench.sh runs the whole sweep);
#   2. the sample op on the GPU vs the CPU reference, and inside a CUDA graph;
#   3. the model on the GPU: HF goldens (tiny, trained small; MXFP8 native and as BF16) and
#      the CUDA engine vs the CPU engine (greedy equality, graphs == eager, batch invariance);
#   4. a decode step of `m3serve generate --device cuda --trace-dispatch` (the dispatch trace),
#      and `m3serve serve --device cuda` answering a chat completion;
#   5. decode_bench on an m3-layers:N MXFP8 checkpoint made on the machine (M3_BENCH_LAYERS,
#      default 4; 0 skips), batches M3_BENCH_BATCHES (default 1,8,32,128).
#   6. with M3_MSA_BENCH=1, the MSA kernel benchmark (tools/msa_bench; MSA_BENCH_ARGS).
# Results go to $OUT (logs, JSON). Exit status: nonzero if any check failed. M3_CHECK_PARITY=0
# skips step 0 and the parity table of step 1.
#   M3_SANITIZE=1  also run the kernel parity test under compute-sanitizer memcheck.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

# The batch-invariant wgmma kernels give the mma.sync kernels' bits only if this holds here.
# M3_CHECK_PARITY=0 skips both (a call that just ran them, e.g. tools/gpu_lm_head.sh).
if [[ ${M3_CHECK_PARITY:-1} == 1 ]]; then
  step wgmma_identity_probe 60 "$dir/wgmma_identity_probe" && tail -2 "$out/wgmma_identity_probe.log"
  step kernels_cuda_parity 240 "$dir/kernels_cuda_parity"
  sed -n '/^op /,/^wrote/p' "$out/kernels_cuda_parity.log"
  grep -E "FAILED|Failure|error" "$out/kernels_cuda_parity.log" | head -20
fi
step kernels_cuda_msa 240 "$dir/kernels_cuda_msa"
sed -n '/^case /,/^wrote/p' "$out/kernels_cuda_msa.log" | tail -40
grep -E "FAILED|Failure" "$out/kernels_cuda_msa.log" | head -20
if [[ ${M3_CHECK_MOE:-1} == 1 ]]; then
  M3_MOE_QUICK=1 step kernels_cuda_moe 180 "$dir/kernels_cuda_moe"
  sed -n '/^check /,/^wrote/p' "$out/kernels_cuda_moe.log" | tail -30
  grep -E "FAILED|Failure" "$out/kernels_cuda_moe.log" | head -20
fi
step kernels_cuda_sampling 120 "$dir/kernels_cuda_sampling"
grep -E "^\s*(rows|[0-9]+x)|FAILED|Failure" "$out/kernels_cuda_sampling.log" | head -30
step model_cuda 400 "$dir/model_cuda"
grep -E "prompt [0-9]|steps,|FAILED|Failure|diverge" "$out/model_cuda.log" | head -60

# One decode step's dispatch trace (first use of each op/entry/shape class, with the reason).
step generate_trace 120 "$dir/m3serve" generate --model "$root/models/m3-small-mxfp8" --device cuda --trace-dispatch \
  --print-steps --prompt "The old house on the hill" --max-tokens 8 --temperature 0
grep -E "dispatch:|graph|tok/s|loaded" "$out/generate_trace.log" | head -60

# The OpenAI server on the GPU: one chat completion, then the kernel table.
if [[ -x $dir/m3serve ]]; then
"$dir/m3serve" serve "$root/models/m3-small" --device cuda --host 127.0.0.1 --port 18123 > "$out/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 1 60); do curl -sf 127.0.0.1:18123/health > /dev/null 2>&1 && break; sleep 0.5; done
curl -sS 127.0.0.1:18123/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Tell me about the sea."}],"max_tokens":24,"temperature":0}' \
  > "$out/serve_chat.json" 2>&1
curl -sS 127.0.0.1:18123/debug/kernels > "$out/serve_kernels.json" 2>&1
kill "$serve_pid" 2>/dev/null
wait "$serve_pid" 2>/dev/null
if grep -q '"content"' "$out/serve_chat.json"; then
  echo "gpu: serve chat ok: $(head -c 400 "$out/serve_chat.json")"
else
  echo "gpu: serve chat FAILED: $(head -c 400 "$out/serve_chat.json")"
  head -c 2000 "$out/serve.log"
  status=1
fi
fi

if [[ ${M3_SANITIZE:-0} == 1 ]]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [[ -n $cs ]] && step memcheck 200 "$cs" --tool memcheck --leak-check no "$dir/kernels_cuda_parity" &&
    grep -E "ERROR SUMMARY" "$out/memcheck.log" | tail -1
fi

layers=${M3_BENCH_LAYERS:-4}
if [[ $layers -gt 0 ]]; then
  layers_ckpt "$layers"
  tail -3 "$out/make_model.log" 2>/dev/null
  # The engine on it: a decode step's kernels (graph replays count the captured selections).
  step generate_m3_layers 180 "$dir/m3serve" generate --model "$ckpt" --device cuda --trace-dispatch --print-steps \
    --prompt-ids 1,200,3000,45,77,9,123,4567,8,901 --max-tokens 4 --temperature 0 --max-num-seqs 8 \
    --max-num-batched-tokens 256 --max-model-len 4096
  grep -E "^step|kernels:|loaded|tok/s" "$out/generate_m3_layers.log" | head -20
  step decode_bench "${M3_BENCH_TIMEOUT:-300}" "$dir/decode_bench" --model "$ckpt" \
    --batch-sizes "${M3_BENCH_BATCHES:-1,8,32,128}" --context "${M3_BENCH_CONTEXT:-4096}" --json "$out/decode_bench.json"
  cat "$out/decode_bench.log"
fi
if [[ ${M3_MSA_BENCH:-0} == 1 ]]; then
  step msa_bench "${MSA_BENCH_TIMEOUT:-300}" "$dir/msa_bench" --json "$out/msa_bench.json" ${MSA_BENCH_ARGS:-}
  cat "$out/msa_bench.log"
fi
echo "gpu_check: overall status $status"
exit $status
