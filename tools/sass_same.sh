#!/usr/bin/env bash
# Checks, without a GPU, that a refactor of device code left the machine code alone: compiles each
# given .cu file at REV (a git worktree of that commit, its headers included) and in the working
# tree with the backend's nvcc flags for sm_90a, and compares the SASS of every kernel
# (cuobjdump -sass; file names and the mangled anonymous-namespace tags removed). Exit 0 when all
# are the same instruction for instruction, 1 with a diff excerpt otherwise. Where the SASS is the
# same, the GPU parity of REV carries over; where it differs, run the kernel tests on the GPU.
#   tools/sass_same.sh REV src/backend/cuda/moe_mxfp8.cu [more .cu files]
# Needs nvcc (the CUDA toolkit) and cuobjdump, which the toolkit on Debian may lack: then
# `pip install nvidia-cuda-cuobjdump` (its bin/ under site-packages/nvidia/cu13) and put it on PATH,
# or set CUOBJDUMP.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n 2,11p "$0" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
rev=$1
shift
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || true)}
if [[ -z $cuobjdump ]]; then
  for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
    [[ -x $d/nvidia/cu13/bin/cuobjdump ]] && cuobjdump=$d/nvidia/cu13/bin/cuobjdump && break
  done
fi
[[ -x $nvcc ]] || { echo "sass_same: nvcc not found (set NVCC)" >&2; exit 2; }
[[ -n $cuobjdump ]] || { echo "sass_same: cuobjdump not found: pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$root" worktree add --detach "$tmp/base" "$rev" >/dev/null 2>&1
flags=(-O3 -DNDEBUG "--generate-code=arch=compute_90a,code=[compute_90a,sm_90a]" --expt-relaxed-constexpr -std=c++17)
# The kernels' SASS only: drop headers, file identifiers, addresses' comments, and the hash of the
# anonymous namespace that nvcc derives from the file's path.
sass() {
  "$cuobjdump" -sass "$1" | grep -v -e '^\s*$' -e 'identifier =' -e '^Fatbin' -e 'code for sm_' -e '^\s*arch =' \
    -e 'code version' -e 'host =' -e 'compile_size' -e 'producer =' |
    sed -E 's/_GLOBAL__N__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+/_GLOBAL__N_/g; s@/\*[0-9a-f]{4,}\*/@@g'
}
status=0
for f in "$@"; do
  [[ -f $root/$f ]] || { echo "sass_same: $f not in the working tree" >&2; exit 2; }
  [[ -f $tmp/base/$f ]] || { echo "sass_same: $f not at $rev" >&2; exit 2; }
  name=$(basename "$f" .cu)
  "$nvcc" "${flags[@]}" -I"$tmp/base/src" -I"$tmp/base/include" -c "$tmp/base/$f" -o "$tmp/$name.base.o" &
  "$nvcc" "${flags[@]}" -I"$root/src" -I"$root/include" -c "$root/$f" -o "$tmp/$name.new.o"
  wait $!
  sass "$tmp/$name.base.o" > "$tmp/$name.base.sass"
  sass "$tmp/$name.new.o" > "$tmp/$name.new.sass"
  kernels=$(grep -c 'Function :' "$tmp/$name.new.sass" || true)
  lines=$(wc -l < "$tmp/$name.new.sass")
  if cmp -s "$tmp/$name.base.sass" "$tmp/$name.new.sass"; then
    echo "sass_same: $f: same SASS as $rev ($kernels kernels, $lines lines)"
  else
    echo "sass_same: $f: SASS differs from $rev ($kernels kernels):"
    diff "$tmp/$name.base.sass" "$tmp/$name.new.sass" | head -40
    status=1
  fi
done
exit $status
