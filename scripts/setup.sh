#!/usr/bin/env bash
# Installs everything m3serve needs on Debian 12 (apt packages, pip test tools) and builds it.
# Idempotent: re-running only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(build-essential cmake ccache pkg-config python3 python3-pip
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev libopenblas-dev libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Python tools used by tests (goldens readers, tokenizer/template cross-checks, OpenAI SDK).
PIP_PACKAGES=(numpy safetensors tokenizers jinja2 openai)
if ! python3 -c "import numpy, safetensors, tokenizers, jinja2, openai" 2>/dev/null; then
  echo "setup: installing pip packages: ${PIP_PACKAGES[*]}"
  python3 -m pip install -q "${PIP_PACKAGES[@]}" 2>/dev/null || \
    python3 -m pip install -q --break-system-packages "${PIP_PACKAGES[@]}"
fi

BUILD_DIR="${M3_BUILD_DIR:-build}"
JOBS="${M3_JOBS:-$(nproc)}"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="${M3_BUILD_TYPE:-Release}" ${M3_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "setup: built $BUILD_DIR/m3serve"
