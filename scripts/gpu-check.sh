#!/usr/bin/env bash
# One-shot device check for refitd's GPU path (docs/gpu.md).
#
# Runs on a machine with an NVIDIA GPU, CUDA 13, CMake, ninja and PyTorch in
# its python3, but no internet and no Debian packages beyond the base system.
# The libraries the core build needs (Abseil, nlohmann-json, xxHash,
# GoogleTest, Google Benchmark, pkgconf) travel with the repository as .deb
# files in .deps/debs (git-ignored), fetched beforehand with --fetch on a
# machine that has apt. They are unpacked with `dpkg -x` into a private prefix
# (.deps/prefix), never over /. The build is core only (REFIT_BUILD_SERVER=OFF:
# core has no gRPC), against that machine's torch, with REFIT_WITH_CUDA=ON.
#
#   scripts/gpu-check.sh --fetch     download the .debs and the Python wheels
#                                    (needs apt and pip; run it here)
#   scripts/gpu-check.sh --bundle    pack the daemon built here (refitd, refitctl,
#                                    refit_make_fixture, stripped, with the shared
#                                    libraries the GPU machine lacks, and the
#                                    client's generated stubs) into .deps/daemon
#   scripts/gpu-check.sh --prepare   both: what to run here before a device run
#   scripts/gpu-check.sh --dry-run   unpack, configure, build the GPU targets and
#                                    run the gpu tests (they skip without a GPU);
#                                    the benchmarks are skipped
#   scripts/gpu-check.sh             all of it, plus the GPU benchmarks
#
# Carry .deps/debs, .deps/wheels and .deps/daemon (about 18 MiB) to the GPU
# machine.
# Part two, with the daemon bundle: the Python client's `gpu` tests (pytest
# -m gpu) against the bundled refitd, then (full mode) the attach and
# shared-memory-lane benchmarks with refitd's store on cuda:0, and the lane
# into a host store.
# Output: a table (printed last) and JSON in $OUT/gpu-check-results.json when
# $OUT is a directory, else ./gpu-check-results.json (the caller's directory);
# the ctest, pytest, benchmark and build logs beside it (gpu-check-*.log).
# Environment: PYTHON (a python with torch; default python3, then .venv),
# GPU_CHECK_BUILD_DIR (default build-gpu-check), JOBS (default nproc),
# GPU_CHECK_BENCH_ARGS (extra refit_gpu_bench flags, e.g. --quick),
# GPU_CHECK_DEPS (where .deps is; default the repository's),
# GPU_CHECK_CORE=0 (leave part one out), GPU_CHECK_DAEMON=0 (part two), GPU_CHECK_DAEMON_REPS (pushes per
# lane in the daemon benchmarks, default 3), GPU_CHECK_DAEMON_BENCHES (which:
# default "shm attach shm-host"), REFIT_BUILD_DIR (--bundle packs
# its bin/; default build), GPU_PYTHON_VERSION (--fetch: the GPU machine's
# python, default 3.12).
# Exit status: 0 when the build, every gpu test and every benchmark target
# pass; 1 when something is wrong (a build or test failure, a benchmark that
# failed or found other bytes than the CPU path, or, on a machine with a GPU,
# a gpu test that skipped itself: then refit's CUDA runtime did not see the
# device that torch sees; a stale daemon bundle or one built against another
# torch; in full mode, a missing bundle); 3 when
# everything is right but a speed target was missed (the table's MISS rows);
# 2 for usage errors.
set -euo pipefail

CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD
DEPS_DIR=${GPU_CHECK_DEPS:-$ROOT/.deps}
case "$DEPS_DIR" in /*) ;; *) DEPS_DIR=$CALLER_DIR/$DEPS_DIR ;; esac
DEBS_DIR=$DEPS_DIR/debs
PREFIX=$DEPS_DIR/prefix
BUILD_DIR=${GPU_CHECK_BUILD_DIR:-$ROOT/build-gpu-check}
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac
JOBS=${JOBS:-$(nproc)}
START=$(date +%s)

# Exactly what the core build needs beyond a base system, with the runtime
# libraries the -dev packages depend on. googletest (sources) is not needed:
# libgtest-dev/libgmock-dev carry the built static libraries.
PACKAGES=(
  libabsl-dev libabsl20220623
  libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian
  nlohmann-json3-dev
  libxxhash-dev libxxhash0
  pkgconf pkgconf-bin libpkgconf3
)

MODE=full
case "${1:-}" in
  --fetch) MODE=fetch ;;
  --bundle) MODE=bundle ;;
  --prepare) MODE=prepare ;;
  --dry-run) MODE=dry-run ;;
  "") ;;
  -h|--help) sed -n '2,50p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--fetch|--bundle|--prepare|--dry-run]" >&2; exit 2 ;;
esac

log() { printf '[gpu-check %3ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
die() { printf '[gpu-check] ERROR: %s\n' "$*" >&2; exit 1; }

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  RESULTS=$OUT/gpu-check-results.json
else
  RESULTS=$CALLER_DIR/gpu-check-results.json
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STEPS=$WORK/steps.tsv   # name <TAB> status <TAB> seconds <TAB> detail
: > "$STEPS"
step() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$STEPS"; }

# Part two's benchmarks, checked before anything runs.
DAEMON_BENCHES=${GPU_CHECK_DAEMON_BENCHES:-shm attach shm-host}
for name in $DAEMON_BENCHES; do
  case "$name" in
    shm|attach|shm-host) ;;
    *) echo "GPU_CHECK_DAEMON_BENCHES: unknown benchmark $name (shm, attach, shm-host)" >&2; exit 2 ;;
  esac
done

# Whether a library a binary loads comes with the machine rather than the
# bundle: glibc's, the C++ runtime's, and torch's with its CUDA libraries
# (the GPU machine's own python holds the same torch).
machine_library() {
  case "$1" in */site-packages/*) return 0 ;; esac
  case "$(basename "$1")" in
    libc.so*|libm.so*|libpthread.so*|librt.so*|libdl.so*|libutil.so*|libresolv.so*|ld-linux*) return 0 ;;
    libstdc++.so*|libgcc_s.so*) return 0 ;;
  esac
  return 1
}

# A hash of what refitd is built from (core/, server/, proto/, the CMake
# files): the bundle records it, part two compares it with the checkout's.
daemon_sources_hash() {
  (cd "$ROOT" && find core server proto cmake CMakeLists.txt -type f \
      \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.proto' \
         -o -name '*.cmake' -o -name CMakeLists.txt \) -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}

# ---------------------------------------------------------------- fetch ----
# Part two's Python packages the GPU machine's image may lack or hold in
# other versions: the versions the tests use here, for its python.
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}
WHEELS_DIR=$DEPS_DIR/wheels
BUNDLE_DIR=$DEPS_DIR/daemon
fetch() {
  command -v apt-get > /dev/null || die "--fetch needs apt-get (run it on the build machine)"
  mkdir -p "$DEBS_DIR"
  rm -f "$DEBS_DIR"/*.deb
  log "downloading ${#PACKAGES[@]} packages into ${DEBS_DIR#$ROOT/}"
  (cd "$DEBS_DIR" && apt-get download -q "${PACKAGES[@]}")
  (cd "$DEBS_DIR" && sha256sum ./*.deb > SHA256SUMS)
  log "fetched: $(ls "$DEBS_DIR"/*.deb | wc -l) debs, $(du -sh "$DEBS_DIR" | cut -f1)"

  local py=$ROOT/.venv/bin/python pins=() name version
  [ -x "$py" ] || die "--fetch needs the development venv (.venv: scripts/setup.sh)"
  for name in grpcio protobuf xxhash pytest; do
    version=$(sed -n "s/^$name==//p" "$ROOT/scripts/requirements.txt")
    [ -n "$version" ] || die "no $name pin in scripts/requirements.txt"
    pins+=("$name==$version")
  done
  # pytest's own needs, as installed here (the image has packaging and pygments).
  for name in pluggy iniconfig; do
    pins+=("$name==$("$py" -c "import importlib.metadata as m; print(m.version('$name'))")")
  done
  rm -rf "$WHEELS_DIR"
  mkdir -p "$WHEELS_DIR"
  log "downloading wheels for python $GPU_PYTHON_VERSION: ${pins[*]}"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS_DIR" "${pins[@]}"
  echo "$GPU_PYTHON_VERSION" > "$WHEELS_DIR/PYTHON_VERSION"
  (cd "$WHEELS_DIR" && sha256sum ./*.whl > SHA256SUMS)
  log "fetched: $(ls "$WHEELS_DIR"/*.whl | wc -l) wheels, $(du -sh "$WHEELS_DIR" | cut -f1)"
}

# --------------------------------------------------------------- bundle ----
# The daemon built here, for a GPU machine that cannot build it (no gRPC):
# the binaries stripped, every shared library they load that is neither
# glibc's, the C++ runtime's nor torch's (the GPU machine brings its own
# torch, the same version), and the client's generated gRPC stubs.
bundle() {
  local src=${REFIT_BUILD_DIR:-$ROOT/build} stage=$WORK/stage b lib
  case "$src" in /*) ;; *) src=$ROOT/$src ;; esac
  [ -f "$src/CMakeCache.txt" ] || die "no build in $src: scripts/build.sh first (or set REFIT_BUILD_DIR)"
  # The binaries as the checkout is now (quick when they are up to date).
  log "building refitd, refitctl and refit_make_fixture in ${src#$ROOT/}"
  cmake --build "$src" -j"$JOBS" --target refitd refitctl refit_make_fixture > "$WORK/bundle-build.log" 2>&1 ||
    { tail -30 "$WORK/bundle-build.log"; die "building the daemon failed"; }
  ldd "$src/bin/refitd" | grep -q 'libcudart' ||
    die "$src/bin/refitd was built without CUDA (REFIT_WITH_CUDA=OFF): a GPU store needs it"
  local venv_py=$ROOT/.venv/bin/python
  [ -x "$venv_py" ] || die "--bundle needs the development venv (.venv: scripts/setup.sh)"
  local stubs=$ROOT/client/python/refit_client/_proto
  [ -f "$stubs/refit_pb2.py" ] || die "no generated stubs in ${stubs#$ROOT/}: scripts/setup.sh first"
  mkdir -p "$stage/libexec" "$stage/lib" "$stage/proto"
  for b in refitd refitctl refit_make_fixture; do
    strip -o "$stage/libexec/$b" "$src/bin/$b"
  done
  # What the loader resolves here, less what the GPU machine has itself.
  for lib in $(for b in refitd refitctl refit_make_fixture; do ldd "$src/bin/$b"; done |
      awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u); do
    machine_library "$lib" || cp -L "$lib" "$stage/lib/"
  done
  cp "$stubs"/*.py "$stage/proto/"
  {
    echo "commit $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)$(
      git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "bundled $(date -u +%Y-%m-%dT%H:%M:%SZ) from ${src#$ROOT/}: $("$src/bin/refitd" --version 2>&1 | head -1)"
    echo "torch $("$venv_py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)"
    echo "sources $(daemon_sources_hash)"
  } > "$stage/BUNDLE"
  rm -rf "$BUNDLE_DIR"
  mkdir -p "$BUNDLE_DIR"
  # Python's tarfile: no xz binary needed here either.
  "$venv_py" -c '
import sys, tarfile
with tarfile.open(sys.argv[1], "w:xz", preset=3) as tar:
    tar.add(sys.argv[2], arcname=".")
' "$BUNDLE_DIR/daemon.tar.xz" "$stage"
  (cd "$BUNDLE_DIR" && sha256sum ./daemon.tar.xz > SHA256SUMS)
  log "bundled $(ls "$stage/lib" | wc -l) libraries with refitd, refitctl and refit_make_fixture:" \
    "${BUNDLE_DIR#$ROOT/}/daemon.tar.xz, $(du -sh "$BUNDLE_DIR/daemon.tar.xz" | cut -f1)" \
    "($(head -1 "$stage/BUNDLE"))"
}

case "$MODE" in
  fetch) fetch; exit 0 ;;
  bundle) bundle; exit 0 ;;
  prepare) fetch; bundle; exit 0 ;;
esac

# ---------------------------------------------------------------- torch ----
PY=""
for cand in ${PYTHON:-} python3 "$ROOT/.venv/bin/python3"; do
  if [ -n "$cand" ] && "$cand" -c 'import torch' > /dev/null 2>&1; then PY=$cand; break; fi
done
[ -n "$PY" ] || die "no python with torch (set PYTHON)"
# One import of torch for all it tells (each import takes seconds).
TORCH_INFO=$("$PY" -c '
import os, torch
gpu = torch.cuda.is_available()
print(torch.utils.cmake_prefix_path)
print(torch.__version__)
print(torch.version.cuda)
print(os.path.join(os.path.dirname(torch.__file__), "lib"))
print(1 if gpu else 0)
try:
    print(torch.cuda.get_device_name(0) if gpu else "")
except Exception:  # the name only labels the report
    print("")
' 2>/dev/null) || die "$PY: torch imports, but asking it about itself failed"
{ read -r TORCH_PREFIX; read -r TORCH_VERSION; read -r TORCH_CUDA; read -r TORCH_LIB
  read -r HAVE_GPU; read -r TORCH_GPU_NAME || true; } <<< "$TORCH_INFO"
log "torch $TORCH_VERSION (CUDA $TORCH_CUDA) from $TORCH_PREFIX"

# ------------------------------------------------------------------ gpu ----
GPU_NAME=""
if command -v nvidia-smi > /dev/null 2>&1; then
  GPU_NAME=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
fi
[ "$HAVE_GPU" = 1 ] || HAVE_GPU=0
if [ "$HAVE_GPU" = 1 ] && [ -z "$GPU_NAME" ]; then GPU_NAME=$TORCH_GPU_NAME; fi
log "GPU: ${GPU_NAME:-none}"

# ------------------------------------------------------ part one: core ----
# The CUDA kernels and core's gpu tests, built here against the carried
# libraries, and the kernels' benchmark. GPU_CHECK_CORE=0 leaves it out (to
# rerun part two alone).
ctest_rc=0
bench_rc=0
NVCC_VERSION=""
CORE_RAN=0
CALLER_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
# (The body is not indented: it holds a here-document.)
core_check() {
CORE_RAN=1
# --------------------------------------------------------------- unpack ----
[ -d "$DEBS_DIR" ] && ls "$DEBS_DIR"/*.deb > /dev/null 2>&1 ||
  die "no .debs in ${DEBS_DIR#$ROOT/}: run scripts/gpu-check.sh --fetch on a machine with apt first"
for p in "${PACKAGES[@]}"; do
  ls "$DEBS_DIR/${p}_"*.deb > /dev/null 2>&1 || die "missing ${p}_*.deb in ${DEBS_DIR#$ROOT/}; rerun --fetch"
done
if [ -f "$DEBS_DIR/SHA256SUMS" ]; then
  (cd "$DEBS_DIR" && sha256sum --quiet -c SHA256SUMS) || die "a .deb does not match SHA256SUMS"
fi

# Extracts a .deb's data archive without dpkg (python3 is always there on
# the GPU machine: torch needs it). .deb = ar archive holding data.tar.*.
extract_deb_python() {
  python3 - "$1" "$2" <<'EOF'
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
data = open(deb, 'rb').read()
assert data[:8] == b'!<arch>\n', deb
pos = 8
while pos < len(data):
    name = data[pos:pos + 16].decode().strip().rstrip('/')
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    pos += 60 + size + (size & 1)
    if name.startswith('data.tar'):
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            tar.extractall(dest)
        break
else:
    sys.exit('no data.tar in ' + deb)
EOF
}

t0=$(date +%s)
stamp=$PREFIX/.unpacked
want=$(cat "$DEBS_DIR"/SHA256SUMS 2>/dev/null || ls -l "$DEBS_DIR")
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  for deb in "$DEBS_DIR"/*.deb; do
    if command -v dpkg > /dev/null; then
      dpkg -x "$deb" "$PREFIX"
    else
      extract_deb_python "$deb" "$PREFIX"
    fi
  done
  printf '%s' "$want" > "$stamp"
  log "unpacked $(ls "$DEBS_DIR"/*.deb | wc -l) debs into ${PREFIX#$ROOT/} ($(du -sh "$PREFIX" | cut -f1))"
else
  log "prefix ${PREFIX#$ROOT/} is up to date"
fi
step unpack ok $(( $(date +%s) - t0 )) "${PREFIX#$ROOT/}"

ARCH=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
LIBDIR=$PREFIX/usr/lib/$ARCH
[ -d "$LIBDIR" ] || die "unexpected layout: $LIBDIR missing (debs for another architecture?)"
# The prefix's shared libraries (Abseil, xxHash, benchmark, libpkgconf) must
# be found by the freshly built binaries, also while the build runs them
# (gtest_discover_tests lists the tests of each test binary).
export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# pkgconf from the prefix, searching only the prefix; the sysroot rewrites
# the .pc files' /usr paths into the prefix.
export PKG_CONFIG_LIBDIR=$LIBDIR/pkgconfig:$PREFIX/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$PREFIX
unset PKG_CONFIG_PATH
PKGCONF=$PREFIX/usr/bin/pkgconf
"$PKGCONF" --exists libxxhash || die "the prefix's pkgconf cannot see libxxhash"

NVCC=${CUDACXX:-}
[ -n "$NVCC" ] || NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] || { [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc; }
[ -n "$NVCC" ] || die "nvcc not found (CUDA toolkit); set CUDACXX"
NVCC_VERSION=$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
log "nvcc $NVCC_VERSION ($NVCC)"

# ------------------------------------------------------------ configure ----
t0=$(date +%s)
mkdir -p "$BUILD_DIR"
if ! cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DREFIT_WITH_CUDA=ON -DREFIT_BUILD_SERVER=OFF -DREFIT_BUILD_TESTS=ON -DREFIT_BUILD_BENCH=OFF \
    -DREFIT_CUDA_WERROR=OFF \
    -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DCMAKE_PREFIX_PATH="$PREFIX/usr;$TORCH_PREFIX" \
    -DPKG_CONFIG_EXECUTABLE="$PKGCONF" \
    > "$WORK/configure.log" 2>&1; then
  tail -40 "$WORK/configure.log"
  die "configure failed (log above)"
fi
step configure ok $(( $(date +%s) - t0 )) "REFIT_WITH_CUDA=ON REFIT_BUILD_SERVER=OFF"

# Every dependency must come from the prefix, not from the machine: a
# config found elsewhere, or a header/library path outside the prefix,
# would make this check pass here and fail on the GPU machine.
cache=$BUILD_DIR/CMakeCache.txt
for var in absl_DIR GTest_DIR nlohmann_json_DIR; do
  val=$(sed -n "s/^$var:[A-Z]*=//p" "$cache")
  case "$val" in "$PREFIX"/*) ;; *) die "$var=$val is not in the private prefix" ;; esac
done
for var in XXHASH_INCLUDEDIR pkgcfg_lib_XXHASH_xxhash; do
  val=$(sed -n "s/^$var:[A-Z]*=//p" "$cache")
  case "$val" in "$PREFIX"/*) ;; *) die "xxHash: $var=$val is not in the private prefix" ;; esac
done
for lib in libabsl_status.so libxxhash.so; do
  outside=$(grep -o "[^ ]*${lib}[^ ]*" "$BUILD_DIR/build.ninja" | grep -v "^$PREFIX" | sort -u || true)
  [ -z "$outside" ] || die "links $lib from outside the prefix: $outside"
done
log "configured; Abseil, GTest, nlohmann-json and xxHash resolve in ${PREFIX#$ROOT/}"

# ---------------------------------------------------------------- build ----
TARGETS=(refit_cuda refit_gpu_bench)
for t in "$ROOT"/tests/*/*_gpu_test.cc; do
  [ -e "$t" ] || continue
  TARGETS+=("$(basename "$(dirname "$t")")_$(basename "$t" .cc)")
done
t0=$(date +%s)
log "building ${TARGETS[*]} (-j$JOBS)"
if ! cmake --build "$BUILD_DIR" -j"$JOBS" --target "${TARGETS[@]}" > "$WORK/build.log" 2>&1; then
  grep -E "error|FAILED" "$WORK/build.log" | head -30
  step build FAILED $(( $(date +%s) - t0 )) "see the errors above"
  die "build failed"
fi
step build ok $(( $(date +%s) - t0 )) "${#TARGETS[@]} targets, nvcc $NVCC_VERSION, sm_90 + PTX"
# The compile commands must use the prefix's headers (the machine may have
# none, or other versions).
grep -q -- "-isystem $PREFIX/usr/include" "$BUILD_DIR/compile_commands.json" ||
  die "no compile command uses the prefix's include directory"
log "built"

t0=$(date +%s)
# ctest -L gpu selects the gpu-labelled tests. If the label did not reach
# the discovered tests (a list-valued LABELS can get flattened on its way
# through gtest_discover_tests), select the same tests by their suites, as
# the gpu test binaries list them, so they still run under ctest.
SELECT=(-L gpu)
if [ "$(cd "$BUILD_DIR" && ctest -N -L gpu 2>/dev/null | sed -n 's/^Total Tests: //p')" = 0 ]; then
  suites=""
  for t in "${TARGETS[@]}"; do
    case "$t" in *_gpu_test) ;; *) continue ;; esac
    for s in $("$BUILD_DIR/tests/$t" --gtest_list_tests | sed -n 's/^\([A-Za-z0-9_]*\)\.$/\1/p'); do
      suites="$suites${suites:+|}$s"
    done
  done
  [ -n "$suites" ] || die "no gpu tests found"
  log "WARNING: no test carries the ctest label 'gpu'; selecting the gpu test suites by name"
  SELECT=(-R "^($suites)\\.")
fi
# JUnit output (CMake >= 3.21) gives exact counts; older ctest: the log.
JUNIT=()
ctest --help 2>/dev/null | grep -q -- --output-junit && JUNIT=(--output-junit "$WORK/ctest.xml")
ctest_rc=0
(cd "$BUILD_DIR" && timeout 300 ctest "${SELECT[@]}" -j4 --timeout 240 --output-on-failure \
  --no-tests=error ${JUNIT[@]+"${JUNIT[@]}"}) > "$WORK/ctest.log" 2>&1 || ctest_rc=$?
tail -15 "$WORK/ctest.log"
step "gpu tests" "$([ $ctest_rc -eq 0 ] && echo ok || echo FAILED)" $(( $(date +%s) - t0 )) \
  "$([ $HAVE_GPU -eq 1 ] && echo "on $GPU_NAME" || echo "no GPU: device tests skip themselves")"

BENCH_JSON=$WORK/bench.json
bench_rc=0
if [ "$MODE" = dry-run ]; then
  # Only proves that the binary loads and answers; nothing is measured.
  "$BUILD_DIR/bench/refit_gpu_bench" --quick --models_gib= --json "$WORK/bench-dry.json" \
    > "$WORK/bench.log" 2>&1 || bench_rc=$?
  log "dry run: GPU benchmark skipped (refit_gpu_bench rc=$bench_rc: $(tr -d "\n " < "$WORK/bench-dry.json" 2>/dev/null | head -c 200))"
  step "gpu benchmark" skipped 0 "dry run; refit_gpu_bench loads (rc=$bench_rc)"
elif [ $HAVE_GPU -eq 0 ]; then
  # A full run exists to exercise the GPU: without one it cannot pass.
  log "no usable GPU (torch.cuda.is_available() is false): benchmark not run"
  step "gpu benchmark" FAILED 0 "no usable GPU; use --dry-run on machines without one"
else
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout 300 "$BUILD_DIR/bench/refit_gpu_bench" --json "$BENCH_JSON" ${GPU_CHECK_BENCH_ARGS:-} \
    > "$WORK/bench.log" 2>&1 || bench_rc=$?
  cat "$WORK/bench.log"
  step "gpu benchmark" "$([ $bench_rc -eq 0 ] && echo ok || echo FAILED)" $(( $(date +%s) - t0 )) \
    "refit_gpu_bench rc=$bench_rc"
fi

}
if [ "${GPU_CHECK_CORE:-1}" = 1 ]; then
  core_check
else
  step "core" skipped 0 "GPU_CHECK_CORE=0"
fi

# ----------------------------------------------------- part two: daemon ----
# The Python client's gpu tests against the bundled refitd (built here with
# CUDA; the GPU machine has no gRPC to build it), then, in full mode, the
# daemon's own GPU benchmarks. Each bundled binary runs through a wrapper
# that points the loader at the bundle's libraries and this machine's torch.
daemon_rc=0
daemon_check() {
  local tar=$BUNDLE_DIR/daemon.tar.xz d=$WORK/daemon t0 torch_lib b site=$WORK/site
  # A problem of part two's own ends part two, not the run: part one's
  # results and the logs still come back.
  fail() {
    step "daemon gpu tests" FAILED $(( $(date +%s) - t0 )) "$1"
    daemon_rc=1
  }
  t0=$(date +%s)
  if [ "${GPU_CHECK_DAEMON:-1}" = 0 ]; then
    step "daemon gpu tests" skipped 0 "GPU_CHECK_DAEMON=0"
    return
  fi
  if [ ! -f "$tar" ]; then
    if [ "$MODE" = full ]; then
      fail "no daemon bundle: run scripts/gpu-check.sh --prepare on the build machine and carry .deps"
    else
      step "daemon gpu tests" skipped 0 "no daemon bundle (scripts/gpu-check.sh --bundle)"
    fi
    return
  fi
  case "$WORK" in *[[:space:]]*) fail "the work directory $WORK has whitespace in its path (set TMPDIR)"; return ;; esac
  (cd "$BUNDLE_DIR" && sha256sum --quiet -c SHA256SUMS) ||
    { fail "the daemon bundle does not match its SHA256SUMS"; return; }
  if [ -f "$WHEELS_DIR/SHA256SUMS" ]; then
    (cd "$WHEELS_DIR" && sha256sum --quiet -c SHA256SUMS) ||
      { fail "a carried wheel does not match SHA256SUMS"; return; }
  fi
  # Part one's prefix is not part two's business.
  export LD_LIBRARY_PATH=$CALLER_LD_LIBRARY_PATH
  [ -n "$LD_LIBRARY_PATH" ] || unset LD_LIBRARY_PATH
  mkdir -p "$d/bin"
  # Python's tarfile, which needs no xz binary (a minimal image may lack it).
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
    "$tar" "$d" || { fail "unpacking the daemon bundle failed"; return; }
  log "daemon bundle: $(head -1 "$d/BUNDLE")"
  # Built from this checkout's daemon sources, against this machine's torch
  # (refitd loads its libraries): otherwise the tests would check another
  # refitd, or fail to load one.
  local sources bundled_sources bundled_torch
  sources=$(daemon_sources_hash)
  bundled_sources=$(sed -n 's/^sources //p' "$d/BUNDLE")
  if [ "$bundled_sources" != "$sources" ]; then
    fail "stale bundle: its refitd was built from other sources (${bundled_sources:-unknown}) than this checkout's core/, server/, proto/ and CMake files ($sources); run scripts/gpu-check.sh --bundle again"
    return
  fi
  bundled_torch=$(sed -n 's/^torch //p' "$d/BUNDLE")
  if [ "$bundled_torch" != "$TORCH_VERSION" ]; then
    fail "the bundled refitd was built against torch ${bundled_torch:-unknown}, this machine's python has torch $TORCH_VERSION"
    return
  fi
  torch_lib=$TORCH_LIB
  for b in refitd refitctl refit_make_fixture; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s:%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
      "$d/lib" "$torch_lib" "$d/libexec/$b" > "$d/bin/$b"
    chmod +x "$d/bin/$b"
    # Every library from the bundle, torch, or glibc and the C++ runtime:
    # nothing missing, and nothing this machine happens to have elsewhere
    # (on the build machine that would hide a library the bundle lacks).
    local stray
    stray=$(LD_LIBRARY_PATH=$d/lib:$torch_lib ldd "$d/libexec/$b" | awk '
      /not found/ {print $1 " (not found)"; next}
      $2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib rest; do
        case "$lib" in "$d"/lib/*) continue ;; esac
        machine_library "$lib" || echo "$lib${rest:+ $rest}"
      done)
    if [ -n "$stray" ]; then
      echo "$stray" >&2
      fail "$b loads libraries from outside the bundle or none: $(echo "$stray" | tr '\n' ' ')"
      return
    fi
  done
  # The wrapper and the loader, once, before any test depends on them.
  "$d/bin/refitd" --version > "$WORK/refitd-version.log" 2>&1 ||
    { cat "$WORK/refitd-version.log"; fail "the bundled refitd does not start: $(tail -1 "$WORK/refitd-version.log")"; return; }
  # The wheels the tests use here, beside (not over) the image's packages:
  # unzipped (a wheel is a zip), which needs no pip.
  local py_version wheels_for
  py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  wheels_for=$(cat "$WHEELS_DIR/PYTHON_VERSION" 2>/dev/null || echo none)
  if [ "$wheels_for" = "$py_version" ]; then
    "$PY" -c 'import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])' "$site" "$WHEELS_DIR"/*.whl > "$WORK/pip.log" 2>&1 ||
      { cat "$WORK/pip.log"; fail "unpacking the carried wheels failed"; return; }
  else
    log "the carried wheels are for python $wheels_for, this one is $py_version: using its own packages"
  fi
  mkdir -p "$ROOT/client/python/refit_client/_proto"
  cp "$d"/proto/*.py "$ROOT/client/python/refit_client/_proto/"
  # The client's two optional C modules, for this python, where it has its
  # headers (without them the client copies with numpy and reads the arena
  # header with struct, which x86-64 keeps in order).
  local inc suffix built=""
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  if [ -f "$inc/Python.h" ] && command -v cc > /dev/null; then
    for b in _ntcopy _atomics; do
      # Built already for this python (an installed client): left as it is.
      [ -e "$ROOT/client/python/refit_client/$b$suffix" ] && { built="$built $b (there)"; continue; }
      cc -O2 -shared -fPIC -I"$inc" "$ROOT/client/python/refit_client/$b.c" \
        -o "$ROOT/client/python/refit_client/$b$suffix" 2>> "$WORK/pip.log" && built="$built $b"
    done
  fi
  log "client C modules built for $("$PY" -c 'import platform; print(platform.python_version())'):${built:- none (no Python.h or cc)}"
  export PYTHONPATH=$site:$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}
  local pytest_rc=0
  (REFIT_BUILD_DIR=$d timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs \
    --junitxml="$WORK/pytest.xml" "$ROOT/client/python/tests") > "$WORK/pytest.log" 2>&1 || pytest_rc=$?
  tail -15 "$WORK/pytest.log"
  # pytest exits 0 when every selected test passed or skipped.
  step "daemon gpu tests" "$([ $pytest_rc -eq 0 ] && echo ok || echo FAILED)" $(( $(date +%s) - t0 )) \
    "pytest -m gpu rc=$pytest_rc against refitd $(sed -n 's/^commit //p' "$d/BUNDLE" | cut -c1-12)"
  [ $pytest_rc -eq 0 ] || daemon_rc=1
  if [ "$MODE" != full ]; then
    step "daemon benchmarks" skipped 0 "dry run"
    return
  fi
  if [ "$HAVE_GPU" -eq 0 ]; then
    # A full run exists to exercise the GPU: without one it cannot pass.
    step "daemon benchmarks" FAILED 0 "no usable GPU; use --dry-run on machines without one"
    daemon_rc=1
    return
  fi
  # The benchmarks' 1.1 GiB checkpoint (scripts/bench.sh's shapes).
  t0=$(date +%s)
  local model=$WORK/model-l47 reps=${GPU_CHECK_DAEMON_REPS:-3} rc
  if ! "$d/bin/refit_make_fixture" --out "$model" --seed 1 --layers 47 --hidden 1024 \
      --intermediate 2816 --heads 8 --kv-heads 2 --vocab 8192 > "$WORK/fixture.log" 2>&1; then
    cat "$WORK/fixture.log"
    step "daemon benchmarks" FAILED $(( $(date +%s) - t0 )) "refit_make_fixture failed"
    daemon_rc=1
    return
  fi
  # shm: the trainer lane into a GPU store; attach: an engine attached to
  # it; shm-host: the trainer lane into a host store on this machine's cores.
  local name script device limit
  for name in $DAEMON_BENCHES; do
    case "$name" in
      shm) script=shm_bench.py device=cuda:0 limit=240 ;;
      attach) script=attach_bench.py device=cuda:0 limit=180 ;;
      shm-host) script=shm_bench.py device=cpu limit=240 ;;
    esac
    rc=0
    echo "== $name: $script --device=$device" >> "$WORK/daemon-bench.log"
    timeout "$limit" "$PY" "$ROOT/bench/python/$script" --model_dir="$model" --reps="$reps" \
      --device="$device" --refitd="$d/bin/refitd" > "$WORK/bench-$name.json" \
      2>> "$WORK/daemon-bench.log" || rc=$?
    step "daemon benchmark: $name" "$([ $rc -eq 0 ] && echo ok || echo FAILED)" \
      $(( $(date +%s) - t0 )) "bench/python/$script --device=$device --reps=$reps rc=$rc"
    [ $rc -eq 0 ] || daemon_rc=1
    t0=$(date +%s)
  done
  tail -25 "$WORK/daemon-bench.log"
}
daemon_check

# The full logs go beside the results (a failing test's output is in the
# ctest log only).
LOG_DIR=$(dirname "$RESULTS")
for f in ctest.log bench.log build.log pytest.log daemon-bench.log; do
  if [ -f "$WORK/$f" ]; then cp "$WORK/$f" "$LOG_DIR/gpu-check-$f"; fi
done

# --------------------------------------------------------------- report ----
python3 - "$WORK" "$RESULTS" "$MODE" "$START" "$TORCH_VERSION" "$TORCH_CUDA" "$NVCC_VERSION" \
    "$GPU_NAME" "$ctest_rc" "$bench_rc" "$HAVE_GPU" "$daemon_rc" "$CORE_RAN" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET
(work, results, mode, start, torch_v, torch_cuda, nvcc_v, gpu, ctest_rc, bench_rc,
 have_gpu, daemon_rc, core_ran) = sys.argv[1:]
core_ran = core_ran == '1'
have_gpu = have_gpu == '1'
# The one gpu-labelled test that skips where a device is present (it checks
# the CPU-only error path).
EXPECTED_SKIP_ON_GPU = 'a CUDA device is present'
steps = []
for line in open(os.path.join(work, 'steps.tsv')):
    name, status, secs, detail = (line.rstrip('\n').split('\t') + [''])[:4]
    steps.append({'step': name, 'status': status, 'seconds': int(secs), 'detail': detail})
tests = {'passed': 0, 'failed': 0, 'skipped': 0, 'failed_names': [], 'skipped_names': []}
try:
    if not core_ran:
        raise OSError('part one left out')
    for case in ET.parse(os.path.join(work, 'ctest.xml')).getroot().iter('testcase'):
        status = case.get('status', '')
        if case.find('failure') is not None or status == 'fail':
            tests['failed'] += 1
            tests['failed_names'].append(case.get('name'))
        elif case.find('skipped') is not None or status in ('notrun', 'disabled'):
            said = ' '.join(t for t in case.itertext())
            if have_gpu and EXPECTED_SKIP_ON_GPU in said:
                tests['passed'] += 1  # skipped as it should on a GPU machine
            else:
                tests['skipped'] += 1
                tests['skipped_names'].append(case.get('name'))
        else:
            tests['passed'] += 1
except (OSError, ET.ParseError):
    # No JUnit file: count from the log ("N% tests passed, F tests failed out of T").
    import re
    log = open(os.path.join(work, 'ctest.log'), errors='replace').read() if core_ran else ''

    m = re.search(r'(\d+) tests failed out of (\d+)', log)
    if m:
        skipped = len(re.findall(r'\(Skipped\)', log))
        tests['failed'] = int(m.group(1))
        tests['skipped'] = skipped
        tests['passed'] = int(m.group(2)) - tests['failed'] - skipped
        tests['failed_names'] = re.findall(r'- (\S+) \((?:Failed|Timeout|SEGFAULT|Subprocess aborted|Exception)', log)
    else:
        tests['error'] = 'no ctest results'
bench = None
try:
    bench = json.load(open(os.path.join(work, 'bench.json')))
except (OSError, ValueError):
    pass
problems = []
if int(ctest_rc) != 0:
    problems.append(f'ctest exit {ctest_rc}')
if int(bench_rc) != 0:
    problems.append(f'refit_gpu_bench exit {bench_rc}')
problems += [f"step {s['step']} failed" for s in steps if s['status'] == 'FAILED']
if core_ran and have_gpu and (tests['skipped'] > 0 or tests['passed'] == 0):
    # torch sees a GPU; a gpu test that skips itself did not (refit's CUDA
    # runtime or driver cannot reach it): nothing on the device was checked.
    problems.append(f"{tests['skipped']} gpu tests skipped and {tests['passed']} passed on a "
                    f"machine with a GPU: {' '.join(tests['skipped_names'][:5])}")
# Part two: the Python gpu tests against the bundled refitd (JUnit from
# pytest), and the daemon's benchmarks (bench_figures' JSON).
daemon = None
if os.path.exists(os.path.join(work, 'pytest.xml')):
    daemon = {'passed': 0, 'failed': 0, 'skipped': 0, 'failed_names': [],
              'skipped_names': [], 'benchmarks': {}}
    for case in ET.parse(os.path.join(work, 'pytest.xml')).getroot().iter('testcase'):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find('failure') is not None or case.find('error') is not None:
            daemon['failed'] += 1
            daemon['failed_names'].append(name)
        elif case.find('skipped') is not None:
            daemon['skipped'] += 1
            daemon['skipped_names'].append(f"{name} ({case.find('skipped').get('message', '')})")
        else:
            daemon['passed'] += 1
    for b in ('shm', 'attach', 'shm-host'):
        try:
            figures = json.load(open(os.path.join(work, f'bench-{b}.json')))['figures']
        except (OSError, ValueError, KeyError):
            continue
        daemon['benchmarks'][b] = [dict(f, bench=b) for f in figures]
        daemon.setdefault('runs', {})[b] = json.load(open(os.path.join(work, f'bench-{b}.json')))
    if int(daemon_rc) != 0:
        problems.append('part two (daemon gpu tests or benchmarks) failed')
    if have_gpu and (daemon['skipped'] > 0 or daemon['passed'] == 0):
        problems.append(f"{daemon['skipped']} daemon gpu tests skipped and {daemon['passed']} "
                        f"passed on a machine with a GPU: {' '.join(daemon['skipped_names'][:3])}")
elif int(daemon_rc) != 0:
    problems.append('part two (daemon gpu tests) failed')
daemon_figures = [f for fs in (daemon or {}).get('benchmarks', {}).values() for f in fs]
measured = bool(bench) and not bench.get('skipped')
if measured and not all(r.get('cpu_parity_first_tensor', True) for r in bench.get('refit', [])):
    problems.append('a GPU refit gave other bytes than the CPU path')
targets_met = ((not measured) or bool(bench.get('all_targets_met', False))) and \
    all(f.get('met') is not False for f in daemon_figures)
ok = not problems and targets_met
out = {
    'mode': mode, 'ok': ok, 'correct': not problems, 'targets_met': targets_met,
    'problems': problems, 'elapsed_s': int(time.time()) - int(start),
    'gpu': gpu or None, 'torch': torch_v, 'torch_cuda': torch_cuda, 'nvcc': nvcc_v,
    'steps': steps, 'gpu_tests': tests, 'benchmark': bench, 'daemon': daemon,
}
with open(results, 'w') as f:
    json.dump(out, f, indent=2)
    f.write('\n')

rows = []
for s in steps:
    rows.append((s['step'], s['status'], f"{s['seconds']} s", s['detail']))
if core_ran:
    unseen = have_gpu and (tests['skipped'] > 0 or tests['passed'] == 0)
    rows.append(('gpu tests (ctest -L gpu)', 'FAILED' if tests['failed'] or unseen else 'ok',
                 f"{tests['passed']} passed, {tests['skipped']} skipped, {tests['failed']} failed",
                 ' '.join((tests['failed_names'] + tests['skipped_names'])[:5])))
if bench and not bench.get('skipped'):
    for q in bench.get('quantize', []):
        cvt = '' if q.get('hardware_conversion', True) else ' (integer cvt)'
        rows.append((f"quantize {q['dtype']} {q['scheme']}{cvt}", 'ok' if q['pass'] else 'MISS',
                     f"{q['fraction_of_copy']:.2f} of copy",
                     f"{q['quantize_gbps']:.0f} vs {q['copy_gbps']:.0f} GB/s (target {q['target']})"))
    i = bench.get('ingest')
    if i:
        rows.append(('H2D ingest, pinned pool', 'ok' if i['pass'] else 'MISS',
                     f"{i['fraction_of_plain']:.2f} of plain",
                     f"{i['pool_gbps']:.1f} vs {i['plain_pinned_gbps']:.1f} GB/s (target >= 0.8)"))
    c = bench.get('commit')
    if c:
        rows.append(('commit (device copies + event)', 'ok' if c['pass'] else 'MISS',
                     f"{c['commit_over_plain']:.2f} x plain",
                     f"{c['commit_s']*1e3:.2f} vs {c['plain_copy_s']*1e3:.2f} ms (target <= 1.2); "
                     f"{c['copies']} copies one cudaMemcpyAsync each: "
                     f"{c.get('memcpy_each_s', float('nan'))*1e3:.2f} ms"))
    for r in bench.get('refit', []):
        gib = r['model_bytes_bf16'] / 2**30
        rows.append((f"refit e2e {gib:.0f} GiB bf16->fp8", 'ok' if r['cpu_parity_first_tensor'] else 'PARITY',
                     f"{r['total_s']:.2f} s, {r['gbps']:.1f} GB/s",
                     f"ingest only {r['ingest_only_gbps']:.1f} GB/s; commit {r['commit_s']*1e3:.1f} ms"))
elif bench:
    rows.append(('gpu benchmark', 'skipped', '', bench.get('skipped', '')))
if daemon is not None:
    unseen_d = have_gpu and (daemon['skipped'] > 0 or daemon['passed'] == 0)
    rows.append(('daemon gpu tests (pytest -m gpu)',
                 'FAILED' if daemon['failed'] or unseen_d else 'ok',
                 f"{daemon['passed']} passed, {daemon['skipped']} skipped, {daemon['failed']} failed",
                 ' '.join((daemon['failed_names'] + daemon['skipped_names'])[:3])))
for f in daemon_figures:
    if not f.get('target'):
        continue
    ratio = '' if f.get('ratio') is None else f"{f['ratio']:.2f}x"
    rows.append((f"[{f['bench']}] {f['name']}"[:100], 'MISS' if f.get('met') is False else 'ok', ratio,
                 f"target {f['target']}: {f['value']:.3g} vs {f['reference_value']:.3g} {f['unit']} "
                 f"({f['reference_name']})"))
rows = [(a, b, c, d if len(d) <= 120 else d[:117] + '...') for a, b, c, d in rows]
w = [max(len(str(r[k])) for r in rows + [('check', 'status', 'result', 'detail')]) for k in range(4)]
print()
print(f"gpu-check ({mode}) on {gpu or 'no GPU'}; torch {torch_v} (CUDA {torch_cuda}), nvcc {nvcc_v}; "
      f"{out['elapsed_s']} s; results: {results}")
header = ('check', 'status', 'result', 'detail')
print('  '.join(str(header[k]).ljust(w[k]) for k in range(4)))
print('  '.join('-' * w[k] for k in range(4)))
for r in rows:
    print('  '.join(str(r[k]).ljust(w[k]) for k in range(4)))
if problems:
    print('OVERALL: FAIL:', '; '.join(problems))
    sys.exit(1)
if not targets_met:
    print('OVERALL: CORRECT, but a speed target was missed (the MISS rows)')
    sys.exit(3)
print('OVERALL: PASS')
sys.exit(0)
EOF
