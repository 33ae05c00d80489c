#!/usr/bin/env bash
# Checks, without a GPU, that a refactor of device code left the machine code alone: compiles each
# given .cu file at REV (a git worktree of that commit, its headers included) and in the working
# tree with the backend's nvcc flags for sm_90a, and compares the SASS of every kernel
# (cuobjdump -sass, compared by tools/sass_compare.py: instructions and control words, without
# addresses, whitespace and the path-derived anonymous-namespace tags). Exit 0 when every kernel
# has a same-SASS counterpart at REV, 1 with the differing kernels otherwise. Where the SASS is
# the same, the GPU parity of REV carries over; where it differs, run the kernel tests on the GPU.
#   tools/sass_same.sh REV src/backend/cuda/moe_mxfp8.cu [more .cu files]
# Needs nvcc (the CUDA toolkit) and cuobjdump, which the toolkit on Debian may lack: then
# `pip install nvidia-cuda-cuobjdump` (its bin/ under site-packages/nvidia/cu13) and put it on PATH,
# or set CUOBJDUMP.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n 2,12p "$0" >&2; exit 2; }
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
status=0
for f in "$@"; do
  [[ -f $root/$f ]] || { echo "sass_same: $f not in the working tree" >&2; exit 2; }
  [[ -f $tmp/base/$f ]] || { echo "sass_same: $f not at $rev" >&2; exit 2; }
  name=$(basename "$f" .cu)
  "$nvcc" "${flags[@]}" -I"$tmp/base/src" -I"$tmp/base/include" -c "$tmp/base/$f" -o "$tmp/$name.base.o" &
  "$nvcc" "${flags[@]}" -I"$root/src" -I"$root/include" -c "$root/$f" -o "$tmp/$name.new.o"
  wait $!
  "$cuobjdump" -sass "$tmp/$name.base.o" > "$tmp/$name.base.sass"
  "$cuobjdump" -sass "$tmp/$name.new.o" > "$tmp/$name.new.sass"
  python3 "$root/tools/sass_compare.py" "$f" "$rev" "$tmp/$name.base.sass" "$tmp/$name.new.sass" || status=1
done
exit $status
