#!/usr/bin/env bash
# The one test command: installs what is missing, builds, runs every test.
# GPU tests (CTest label "gpu") skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
BUILD_DIR=${BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 --timeout 300 "$@"
