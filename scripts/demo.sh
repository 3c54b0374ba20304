#!/usr/bin/env bash
# The refitd demo, end to end: installs what is missing, builds, starts refitd
# on its embedded default model (a tiny Llama, on the GPU if there is one,
# else on the CPU) on a Unix socket in a temp dir, pushes a refit with
# refitctl, shows the version flip and a byte-for-byte verify, and stops the
# daemon with SIGTERM. Idempotent; fast when everything is built.
#
#   scripts/demo.sh              # DEVICE=cpu|cuda:0 to choose the device
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/build.sh

BUILD_DIR=${BUILD_DIR:-build}
BIN="$BUILD_DIR/bin"
work=$(mktemp -d "${TMPDIR:-/tmp}/refitd-demo.XXXXXX")
addr="unix:$work/refitd.sock"
log="$work/refitd.log"
pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

if [ -z "${DEVICE:-}" ]; then
  DEVICE=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    DEVICE=cuda:0
  fi
fi

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
ctl() { echo "\$ refitctl $*" >&2; "$BIN/refitctl" --addr "$addr" "$@"; }
json_version() { sed -n 's/^  "version": \([0-9][0-9]*\).*/\1/p' | head -n1; }

start_daemon() {
  "$BIN/refitd" --model=demo --device="$1" --listen="$addr" 2>"$log" &
  pid=$!
  for _ in $(seq 1 600); do
    if ! kill -0 "$pid" 2>/dev/null; then wait "$pid" || true; pid=""; return 1; fi
    if "$BIN/refitctl" --addr "$addr" --timeout 2s health >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "demo: refitd did not become ready; its log:" >&2
  cat "$log" >&2
  return 1
}

step "start refitd (--model demo, device $DEVICE, $addr)"
if ! start_daemon "$DEVICE"; then
  if [ "$DEVICE" != cpu ]; then
    echo "demo: refitd could not start on $DEVICE; falling back to the CPU" >&2
    tail -n 5 "$log" >&2 || true
    DEVICE=cpu
    start_daemon cpu || { cat "$log" >&2; exit 1; }
  else
    cat "$log" >&2
    exit 1
  fi
fi
ctl health

step "what is being served"
ctl status
before=$("$BIN/refitctl" --addr "$addr" status --json | json_version)

step "a trainer writes new weights (seed 2) and pushes them"
"$BIN/refit_make_fixture" --out "$work/weights" --seed 2 >/dev/null
ls -l "$work/weights"
ctl push "$work/weights"

step "the version flipped"
after=$("$BIN/refitctl" --addr "$addr" status --json | json_version)
echo "version $before -> $after"
ctl status
[ "$after" -eq $((before + 1)) ] || { echo "demo: the version did not flip" >&2; exit 1; }

step "verify: quantize the files locally and compare with the daemon's kernels"
ctl verify "$work/weights" | tail -n 3

step "stop refitd (SIGTERM)"
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=""
grep -E "shutting down|refitd stopped" "$log" || true
[ "$rc" -eq 0 ] || { echo "demo: refitd exited with $rc" >&2; exit 1; }
echo
echo "demo: OK"
