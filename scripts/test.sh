#!/usr/bin/env bash
# Runs every test that needs no GPU (labels unit, model, e2e, fuzz, and the CPU side of kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${M3_BUILD_DIR:-build}"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${M3_TEST_JOBS:-2}" -LE gpu "$@"
