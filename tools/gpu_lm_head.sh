#!/usr/bin/env bash
# On the GPU machine, one call: whether BF16 weights (the LM head) should take the wgmma kernel
# (MmaLinearRule::wgmma_bf16, docs/linear_kernels.md "BF16 weights on the wgmma kernel").
# The wgmma identity probe (bf16 chains give the mma.sync bits), kernels_cuda_parity (its
# linear_invariance forces the BF16 wgmma kernel on every BF16 case), then linear_bench on the LM
# head with each kernel forced over decode and prefill row counts.
# Stage first (here): M3_STAGE_TARGETS="wgmma_identity_probe kernels_cuda_parity linear_bench" tools/gpu_stage.sh
#   tools/gpu_lm_head.sh   (LM_ROWS overrides the rows)
# Then, if wgmma_ov wins: set wgmma_bf16 = true, stage decode_bench with the current one as base
# (M3_STAGE_BASE) and time the step: M3_BENCH_BATCHES=64,128,256 M3_BENCH_CONTEXTS=4096 tools/gpu_decode_compare.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
rows=${LM_ROWS:-1,32,48,64,96,128,192,256,512,1024}
step probe 60 "$dir/wgmma_identity_probe"
tail -2 "$out/probe.log"
step kernels_cuda_parity 240 "$dir/kernels_cuda_parity"
python3 - "$out/cuda_parity.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
print("parity failures:", [r["op"] for r in rows if not r["pass"]] or "none")
for r in rows:
    if r["op"].startswith("linear"):
        print(f'{r["op"]}: {r["cases"]} cases, max_rel {r["max_rel_err"]:.3g}, pass {r["pass"]}')
PY
step lm_head 200 "$dir/linear_bench" --rows "$rows" --rowdot-max 0 --iters 5 --shapes lm_head \
  --variants wgmma_ov,narrow,wide --json "$out/lm_head.json"
grep -E "^lm_head" "$out/lm_head.log"
exit $status
