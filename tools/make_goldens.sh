#!/usr/bin/env bash
# Runs on the GPU machine (device tool): the HF oracle over checkpoints made here by
# `m3serve make-model`, writing golden files under $OUT.
#   Here:   build/m3serve make-model --preset tiny --seed 0 --out .dev/goldens/tiny_bf16
#           build/m3serve make-model --preset tiny --seed 0 --mxfp8 --out .dev/goldens/tiny_mxfp8
#   There:  tools/make_goldens.sh .dev/goldens   (with carry [".dev"])
set -euo pipefail
root=${1:-.dev/goldens}
out=${OUT:-/tmp/goldens_out}
mkdir -p "$out"
prompts=tests/fixtures/goldens/prompts.json
greedy=$(python3 -c "import json;print(json.load(open('$prompts'))['greedy_tokens'])")
for dir in "$root"/*/; do
  name=$(basename "$dir")
  meta=$(cat "$dir/m3_make_model.txt")  # "preset seed mxfp8" written beside the checkpoint
  read -r preset seed mxfp8 <<<"$meta"
  echo "== $name ($preset seed $seed mxfp8 $mxfp8)"
  python3 tools/hf_oracle.py --model "$dir" --prompts "$prompts" --greedy-tokens "$greedy" \
    --out "$out/$name.safetensors" --spec-check \
    --meta m3_preset="$preset" --meta m3_seed="$seed" --meta m3_mxfp8="$mxfp8" 2>&1 | tee "$out/$name.log"
done
