#!/usr/bin/env bash
# Stages an A/B run for the GPU machine (tools/gpu_ab.sh runs it there, in one device call):
# builds of one benchmark program under labels, and test binaries to run once after them, with
# the host libraries they need, into .dev/ab and the archive .dev/ab.tar.xz (git-ignored: carry
# the archive).
#   tools/gpu_ab_stage.sh LABEL=BINARY [LABEL=BINARY ...] [--parity BINARY ...] [--extra NAME=BINARY ...]
# Labels: letters, digits, '_' and '-'; the first one is the base the others are compared with.
# Extras go to .dev/ab/bin/NAME with their libraries but are not timed by gpu_ab.sh: the other
# programs a call's own script runs after it (decode_bench builds of both sides, m3serve for
# make-model).
# A base build of an older commit, e.g.:
#   git worktree add /tmp/base HEAD~1 && cmake -S /tmp/base -B /tmp/base/build -DCMAKE_BUILD_TYPE=Release \
#     && cmake --build /tmp/base/build -j2 --target msa_bench
#   tools/gpu_ab_stage.sh head=/tmp/base/build/msa_bench new=build/msa_bench \
#     --parity build/tests/kernels/cuda_msa/kernels_cuda_msa
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
final=$root/.dev/ab
stage=$root/.dev/ab.new  # moved over the last stage once complete: a bad argument leaves that one as it was
usage() { echo "usage: tools/gpu_ab_stage.sh LABEL=BINARY [LABEL=BINARY ...] [--parity BINARY ...] [--extra NAME=BINARY ...]" >&2; exit 2; }
(( $# > 0 )) || usage
rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/parity" "$stage/lib"
: > "$stage/labels"
while (( $# > 0 )); do
  if [[ $1 == --parity ]]; then
    (( $# > 1 )) || usage
    [[ -x $2 && -f $2 ]] || { echo "gpu_ab_stage: $2 is not an executable file" >&2; exit 2; }
    cp "$2" "$stage/parity/"
    shift 2
    continue
  fi
  extra=0
  if [[ $1 == --extra ]]; then
    (( $# > 1 )) || usage
    extra=1
    shift
  fi
  [[ $1 == *=* ]] || usage
  label=${1%%=*} bin=${1#*=}
  [[ $label =~ ^[A-Za-z0-9_-]+$ ]] || { echo "gpu_ab_stage: label '$label': letters, digits, _ and - only" >&2; exit 2; }
  [[ ! -e $stage/bin/$label ]] || { echo "gpu_ab_stage: label '$label' given twice" >&2; exit 2; }
  [[ -x $bin && -f $bin ]] || { echo "gpu_ab_stage: $bin is not an executable file" >&2; exit 2; }
  cp "$bin" "$stage/bin/$label"
  (( extra )) || echo "$label" >> "$stage/labels"
  shift
done
[[ -s $stage/labels ]] || usage
for f in "$stage"/bin/* "$stage"/parity/*; do
  [[ -f $f ]] && { strip --strip-debug "$f" 2>/dev/null || true; }  # scripts stay as they are
done
source "$root/tools/gpu_stage_libs.sh"
stage_host_libs "$stage/lib" "$stage"/bin/* "$stage"/parity/*
# xz with a 192 MiB window: the staged builds share most of their code, and a window spanning all of
# them packs each shared part once (two msa_bench, a test binary and two m3serve, 156 MB: 18.1 MB
# at -9's 64 MiB window, 13.0 MB with this one; tar's default -6 packs 26 MB of builds into 21 MB).
rm -rf "$final"
mv "$stage" "$final"
tar -C "$root/.dev" -cf - ab | xz -T1 --lzma2=preset=9e,dict=192MiB > "$root/.dev/ab.tar.xz"
# The device tool carries at most 64 MiB with the tracked tree.
echo "gpu_ab_stage: labels $(paste -sd' ' "$final/labels"); archive $(du -h "$root/.dev/ab.tar.xz" | cut -f1)" \
  "(carry .dev/ab.tar.xz; with the tree it must stay under 64 MiB)"
