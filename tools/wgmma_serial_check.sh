#!/usr/bin/env bash
# Checks, without a GPU, that ptxas kept each kernel's wgmma pipeline asynchronous: compiles the
# given .cu files (default: every file under src/backend/cuda that issues wgmma) for sm_90a with the
# backend's flags and reports ptxas's "wgmma.mma_async instructions are serialized ..." messages
# (C7513 and its kin), with which ptxas puts a wait after every HGMMA. The fast dense prefill lost all
# its in-warpgroup overlap that way (docs/msa_kernels.md, thirty-sixth round); the message is an
# "info", so a normal build shows it once, among the compile lines.
#   tools/wgmma_serial_check.sh [FILE.cu ...]
# Exit 0 when no kernel is serialised, 1 (naming the kernels) otherwise.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x $nvcc ]] || { echo "wgmma_serial_check: nvcc not found (set NVCC)" >&2; exit 2; }
files=("$@")
if (( ${#files[@]} == 0 )); then
  mapfile -t files < <(cd "$root" && grep -l "wgmma" src/backend/cuda/*.cu)
fi
flags=(-O3 -DNDEBUG "--generate-code=arch=compute_90a,code=[compute_90a,sm_90a]" --expt-relaxed-constexpr -std=c++17)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for f in "${files[@]}"; do
  log=$tmp/$(basename "$f").log
  "$nvcc" "${flags[@]}" -I"$root/src" -I"$root/include" -c "$root/$f" -o "$tmp/x.o" > "$log" 2>&1 ||
    { echo "wgmma_serial_check: $f did not compile:" >&2; cat "$log" >&2; exit 2; }
  if grep -q "wgmma.mma_async instructions are serialized" "$log"; then
    status=1
    echo "$f: wgmma serialised in"
    grep "wgmma.mma_async instructions are serialized" "$log" | sed -E "s/.*in the function '([^']*)'.*/  \1/" | sort -u
  else
    echo "$f: asynchronous"
  fi
done
exit $status
