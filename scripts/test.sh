#!/usr/bin/env bash
# The one test command (what CI runs), in this order:
#   1. setup          installs what is missing (scripts/setup.sh)
#   2. build          everything, with CUDA when nvcc is there (scripts/build.sh)
#   3. format         clang-format check of the tracked sources (scripts/format-check.sh)
#   4. thread safety  clang -Wthread-safety over core/ and server/ (scripts/thread-safety.sh)
#   5. tests          ctest; GPU tests (label "gpu") skip themselves without a GPU
#   6. python         pytest of the Python client (client/python/tests) against
#                     real refitd processes from $BUILD_DIR; its CUDA test skips
#                     without a GPU
#   7. deploy         pytest of tests/deploy: deploy/Dockerfile's library closure
#                     (ldd of $BUILD_DIR's binaries), the Kubernetes manifests
#                     against bundled schemas, systemd-analyze of the unit and
#                     its command line run as systemd would, and
#                     scripts/gpu-check.sh's daemon bundle (part two, dry run)
# A failed setup or build stops the run; a failed format or thread-safety check
# does not stop the tests, but fails the run. Extra arguments go to ctest.
# Environment: BUILD_DIR (default build), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
export BUILD_DIR=${BUILD_DIR:-build}

steps=()
failed=0
run_step() {
  local name=$1 t0 rc=0
  shift
  printf '\n== test.sh: %s\n' "$name"
  t0=$(date +%s)
  "$@" || rc=$?
  steps+=("$(printf '%-14s %-6s %4ss' "$name" "$([ $rc -eq 0 ] && echo ok || echo FAILED)" \
    $(($(date +%s) - t0)))")
  [ $rc -eq 0 ] || failed=1
  return $rc
}
summary() {
  printf '\n== test.sh summary (%s)\n' "$BUILD_DIR"
  printf '  %s\n' "${steps[@]}"
  # The runners' own closing lines, so neither scrolls out of sight.
  # (ctest.log's first such line: a rerun's own comes after it.)
  local f pick
  for f in ctest pytest deploy; do
    pick=tail
    [ $f = ctest ] && pick=head
    [ -f "$BUILD_DIR/$f.log" ] && printf '  %-7s %s\n' "$f:" \
      "$(grep -E '(tests passed|[0-9]+ (passed|failed)|no tests ran)' "$BUILD_DIR/$f.log" | $pick -1)"
  done
  f="$BUILD_DIR/ctest-rerun.log"
  [ -f "$f" ] && printf '  %-7s %s\n' "rerun:" \
    "$(head -1 "$f"); run again alone: $(grep -E 'tests passed' "$f" | tail -1)"
  return 0
}
# Runs a test runner with its output also kept in $BUILD_DIR/NAME.log.
logged() {
  local name=$1
  shift
  "$@" 2>&1 | tee "$BUILD_DIR/$name.log"
  return "${PIPESTATUS[0]}"
}

rm -f "$BUILD_DIR/ctest.log" "$BUILD_DIR/pytest.log" "$BUILD_DIR/deploy.log"
run_step setup scripts/setup.sh || { summary; exit 1; }
run_step build scripts/build.sh || { summary; exit 1; }
run_step format scripts/format-check.sh || true
run_step thread-safety scripts/thread-safety.sh || true
# A few failed tests (at most 3) are run once more, alone. A test that then
# passes still shows in the summary and in $BUILD_DIR/ctest-rerun.log, with
# the failed run's output kept in ctest.log; more failures than that, or a
# test that fails twice, fail the step. Every test binary prints a stack trace
# when it crashes (tests/testing/test_main.cc).
run_ctest() {
  local rc=0 list="$BUILD_DIR/Testing/Temporary/LastTestsFailed.log"
  rm -f "$list"
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 --timeout 300 "$@" || rc=$?
  [ $rc -ne 0 ] || return 0
  [ -s "$list" ] && [ "$(wc -l < "$list")" -le 3 ] || return $rc
  printf 'failed: %s\n' "$(cut -d: -f2- "$list" | paste -sd' ')" > "$BUILD_DIR/ctest-rerun.log"
  printf '\n== test.sh: running once more, alone: %s\n' "$(cut -d: -f2- "$list" | paste -sd' ')"
  ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 300 --rerun-failed "$@" \
    2>&1 | tee -a "$BUILD_DIR/ctest-rerun.log"
  return "${PIPESTATUS[0]}"
}
rm -f "$BUILD_DIR/ctest-rerun.log"
run_step tests logged ctest run_ctest "$@" || true
# pytest exits 5 when it collected no test. That is a failure here too: the
# suite always has tests, so none collected means they were lost.
run_step python logged pytest env REFIT_BUILD_DIR="$BUILD_DIR" .venv/bin/python -m pytest client/python/tests -q \
  -p no:cacheprovider || true
run_step deploy logged deploy env REFIT_BUILD_DIR="$BUILD_DIR" .venv/bin/python -m pytest tests/deploy \
  -q -p no:cacheprovider || true
summary
exit $failed
