# Sourced by the staging scripts (gpu_stage.sh, gpu_ab_stage.sh): stage_host_libs DEST FILE...
# copies the host libraries the staged binaries link that a bare CUDA image lacks (OpenBLAS,
# gfortran, PCRE2, ...) into DEST; cuBLAS and the driver come from the GPU machine.
stage_host_libs() {
  local dest=$1 f
  shift
  for f in "$@"; do
    [[ -f $f ]] || continue
    ldd "$f" 2>/dev/null | awk '/=> \// {print $3}' | grep -E 'openblas|gfortran|quadmath|pcre2|libgomp|httplib|brotli' || true
  done | sort -u | while read -r lib; do cp -L "$lib" "$dest/"; done
}
