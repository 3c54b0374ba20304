#!/usr/bin/env bash
# Configures (once) and builds refitd into build/. Extra arguments go to cmake
# at configure time, e.g. scripts/build.sh -DREFIT_WITH_CUDA=ON.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja "$@"
fi
cmake --build "$BUILD_DIR" -j"$JOBS"
