#!/usr/bin/env bash
# Dense decode over several clusters per row group (MsaAttnPlan::stripes) on the GPU machine, in
# one device call, from one staged build (tools/gpu_stage.sh). The stripes are on by default (two
# CTAs per SM); "off" runs with M3_MSA_STRIPE_CTAS=0, "on" with the engine's default, or
# M3_MSA_STRIPE_CTAS=$M3_STRIPE_ON where that is set: the same binary.
#   1. kernels_cuda_msa on the dense decode cases (stripes at TP1 / TP4, in the fixed buffer and the
#      pool, deep stages, short contexts): bit for bit with the wgmma dense kernel, within 2e-3 of
#      the CPU reference;
#   2. msa_bench --dense: the attention alone at 32K / 128K, B = 1, 2, 4, off / on alternating
#      M3_STRIPE_REPS times (default 2) -> msa_off_N.json / msa_on_N.json;
#   3. with M3_BENCH_LAYERS > 0 (default 2: a dense-attention layer and an MSA + MoE layer),
#      decode_bench's step at M3_BENCH_CONTEXTS (default 131072), B = M3_BENCH_BATCHES (default
#      1,2), off / on alternating M3_BENCH_REPS times (default 1); M3_ON_ENV="VAR=1 ..." adds
#      environment to "on" (another switch measured in the same runs);
#   4. with M3_STRIPE_FULL=1, every kernels_cuda_msa case and kernels_cuda_parity.
# Results go to $OUT. Exit status: nonzero if any step failed.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
M3_MSA_CASES=tp1_decode_dense_stripes,tp1_decode_dense_stripes_two,tp4_decode_dense_stripes_128k,tp1_decode_dense_stripes_pool,tp1_decode_long_dense,tp1_decode_short_dense \
  step msa_parity 200 "$dir/kernels_cuda_msa"
sed -n '/^case /,/^wrote/p' "$out/msa_parity.log"
grep -E "FAILED|Failure|no stripes" "$out/msa_parity.log" | head -20
# knob_env off|on: the environment of that side in $kenv.
knob_env() {
  if [[ $1 == on ]]; then kenv=(${M3_STRIPE_ON:+M3_MSA_STRIPE_CTAS=$M3_STRIPE_ON}); else kenv=(M3_MSA_STRIPE_CTAS=0); fi
}
for rep in $(seq 1 "${M3_STRIPE_REPS:-2}"); do
  for knob in off on; do
    knob_env "$knob"
    step "msa_${knob}_$rep" 200 env "${kenv[@]}" "$dir/msa_bench" --contexts 32768,131072 \
      --batches "${M3_STRIPE_BATCHES:-1,2,4}" --index-dtypes bf16 --dense --no-baseline --no-layouts --prefill none \
      --iters "${M3_STRIPE_ITERS:-20}" --json "$out/msa_${knob}_$rep.json"
    grep -E "dense attention|stripes|clusters of" "$out/msa_${knob}_$rep.log" | sed "s/^/$knob #$rep: /" | head -12
  done
done
layers=${M3_BENCH_LAYERS:-2}
if [[ $layers -gt 0 ]]; then
  layers_ckpt "$layers"
  IFS=',' read -r -a contexts <<< "${M3_BENCH_CONTEXTS:-131072}"
  for ctx in "${contexts[@]}"; do
    for rep in $(seq 1 "${M3_BENCH_REPS:-1}"); do
      for knob in off on; do
        knob_env "$knob"
        on_env=()
        [[ $knob == on ]] && read -r -a on_env <<< "${M3_ON_ENV:-}"
        name=decode_${knob}_${ctx}_$rep
        step "$name" 240 env "${kenv[@]}" "${on_env[@]}" "$dir/decode_bench" --model "$ckpt" \
          --batch-sizes "${M3_BENCH_BATCHES:-1,2}" --context "$ctx" --iters "${M3_BENCH_ITERS:-10}" \
          --json "$out/$name.json"
        grep -E "graph step|roofline|^  [0-9]" "$out/$name.log" | sed "s/^/$knob $ctx #$rep: /" | head -16
      done
    done
  done
fi
if [[ ${M3_STRIPE_FULL:-0} == 1 ]]; then
  step kernels_cuda_msa 240 "$dir/kernels_cuda_msa"
  sed -n '/^case /,/^wrote/p' "$out/kernels_cuda_msa.log" | tail -45
  step kernels_cuda_parity 240 "$dir/kernels_cuda_parity"
  grep -E "^(attention|indexer)|FAILED|Failure" "$out/kernels_cuda_parity.log" | head -20
fi
echo "gpu_dense_stripes: overall status $status"
exit $status
