#!/usr/bin/env bash
# The core and server tests under a sanitizer, in a build directory of their
# own (GCC, CUDA off: the GPU tests skip anyway and nvcc code is not
# instrumented).
#
#   scripts/sanitize.sh asan [CTEST_ARGS...]   AddressSanitizer + UndefinedBehaviorSanitizer
#   scripts/sanitize.sh tsan [CTEST_ARGS...]   ThreadSanitizer, the concurrency tests
#
# asan builds and runs every test labelled core or server (ctest -L).
# tsan builds and runs the tests that exercise threads of our own: the layer
# worker, the shard store and refit session (readers against commits, Abort
# from another thread) and the whole server (reactors, Watch, shutdown).
# TSan only sees synchronization done by instrumented code. refitd locks with
# absl::Mutex, whose Lock/Unlock live in libabsl_synchronization: Debian's
# copy is not built with TSan, so every guarded field would be reported as a
# race. Unless CMAKE_PREFIX_PATH is set, tsan therefore first builds
# Debian's abseil source package of the installed version with
# -fsanitize=thread into .cache/absl-tsan/ (once, ~5 min on 2 cores; `apt-get source`
# needs a deb-src entry) and runs everything against it. It then checks that
# the abseil CMake finds is instrumented (a counter locked by two threads
# must pass clean) and stops with exit 2 naming the problem when not. What remains
# uninstrumented then (LibTorch, gRPC, protobuf) is listed in
# scripts/tsan.supp, by library, with the reason.
# Any report fails the test that printed it (halt_on_error, exitcode), so
# the run is non-zero on any report.
#
# Environment: SAN_BUILD_DIR (default build-asan / build-tsan), JOBS (default 2),
# SAN_TARGETS (only these test executables, e.g. "core_shard_store_test").
# Exit status: 0 clean; non-zero on a build failure or any failed test; 2
# for a usage error or (tsan) an uninstrumented abseil.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
  asan | tsan) shift ;;
  -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
  *) sed -n '2,30p' "$0" >&2; exit 2 ;;
esac
JOBS=${JOBS:-2}
dir=${SAN_BUILD_DIR:-build-$mode}
root=$PWD

if [ "$mode" = asan ]; then
  flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  # Only the test directories: core tests (LibTorch) and server tests (gRPC).
  tests=(tests/core/*_test.cc tests/server/*_test.cc)
  labels='^(core|server)$'
else
  # -Wno-error=tsan: GCC warns that TSan does not model atomic_thread_fence,
  # which abseil's flags headers use (refitd's main.cc includes them), so
  # that refitd itself builds too (SAN_TARGETS="refitd refitctl").
  flags="-fsanitize=thread -fno-omit-frame-pointer -Wno-error=tsan"
  tests=(tests/core/layer_worker_test.cc tests/core/shard_store_test.cc
    tests/core/refit_session_test.cc tests/server/*_test.cc)
  labels='^(core|server)$'
fi
# Only these targets are built: the others' tests are then "NOT_BUILT"
# placeholders without labels, which -L leaves out.
targets=()
for t in "${tests[@]}"; do
  sub=$(basename "$(dirname "$t")")
  name=$(basename "$t" .cc)
  case "$name" in *_gpu_test) continue ;; esac
  targets+=("${sub}_${name}")
done
# SAN_TARGETS (space-separated, e.g. "core_shard_store_test
# server_refit_service_test") builds and runs only those.
[ -n "${SAN_TARGETS:-}" ] && read -r -a targets <<< "$SAN_TARGETS"

if [ "$mode" = tsan ] && [ -z "${CMAKE_PREFIX_PATH:-}" ]; then
  # An abseil built with TSan, ABI-identical to Debian's (gRPC links
  # Debian's libabsl_*.so.VERSION by soname): Debian's own source package of
  # the installed version (its patches set the soname and ABSL_OPTION_* in
  # options.h), configured as debian/rules does for the shared build.
  # Built once into .cache/absl-tsan/; later runs only check the stamp.
  ver=$(dpkg-query -W -f='${Version}' libabsl-dev)
  prefix=$root/.cache/absl-tsan
  if [ "$(cat "$prefix/.stamp" 2> /dev/null)" != "$ver" ]; then
    src=$root/.cache/absl-tsan-src
    mkdir -p "$src"
    srcdir=$(find "$src" -mindepth 1 -maxdepth 1 -type d -name 'abseil-*' | head -1)
    if [ -z "$srcdir" ]; then
      (cd "$src" && apt-get source -qq "abseil=$ver") || {
        echo "sanitize.sh tsan: 'apt-get source abseil=$ver' failed: add a deb-src entry for" \
          "the mirror in /etc/apt/sources.list.d/ and run apt-get update (or point" \
          "CMAKE_PREFIX_PATH at an abseil $ver built with -fsanitize=thread)" >&2
        exit 2
      }
      srcdir=$(find "$src" -mindepth 1 -maxdepth 1 -type d -name 'abseil-*' | head -1)
    fi
    rm -rf "$src/build" "$prefix"
    cmake -S "$srcdir" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF \
      -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib \
      -DCMAKE_C_FLAGS="$flags -g1" -DCMAKE_CXX_FLAGS="$flags -g1" \
      -DCMAKE_SHARED_LINKER_FLAGS="$flags"
    cmake --build "$src/build" -j"$JOBS"
    cmake --install "$src/build" > /dev/null
    echo "$ver" > "$prefix/.stamp"
  fi
  export CMAKE_PREFIX_PATH=$prefix
  # gRPC's libraries load abseil by soname: this makes every abseil in the
  # process the instrumented one.
  export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

if [ "$mode" = tsan ]; then
  probe=$(mktemp -d)
  trap 'rm -rf "$probe"' EXIT
  cat > "$probe/probe.cc" << 'END'
#include <thread>
#include "absl/synchronization/mutex.h"
absl::Mutex mu;
int counter = 0;
int main() {
  auto add = [] { for (int i = 0; i < 1000; ++i) { absl::MutexLock lock(&mu); ++counter; } };
  std::thread a(add), b(add);
  a.join();
  b.join();
  return counter == 2000 ? 0 : 1;
}
END
  cat > "$probe/CMakeLists.txt" << 'END'
cmake_minimum_required(VERSION 3.22)
project(probe CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(absl REQUIRED)
add_executable(probe probe.cc)
target_link_libraries(probe absl::synchronization)
END
  { cmake -S "$probe" -B "$probe/b" -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" &&
    cmake --build "$probe/b"; } > "$probe/log" 2>&1 ||
    { cat "$probe/log" >&2; echo "sanitize.sh tsan: could not build the abseil probe" >&2; exit 2; }
  if ! TSAN_OPTIONS="exitcode=66" "$probe/b/probe" > "$probe/out" 2>&1; then
    lib=$(grep -o '[^ ]*libabsl_synchronization[^ ]*' "$probe/b/CMakeFiles/probe.dir/link.txt" |
      head -1)
    echo "sanitize.sh tsan: the abseil CMake found (${lib:-?}) is not built with ThreadSanitizer:" \
      "TSan reports a race on a counter locked with absl::Mutex (below), so it would report" \
      "every field refitd guards. Set CMAKE_PREFIX_PATH to an abseil built with" \
      "-fsanitize=thread." >&2
    head -12 "$probe/out" >&2
    exit 2
  fi
fi

t0=$(date +%s)
if [ ! -f "$dir/build.ninja" ]; then
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DREFIT_WITH_CUDA=OFF \
    -DREFIT_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags"
fi
cmake --build "$dir" -j"$JOBS" --target "${targets[@]}"
t1=$(date +%s)

if [ "$mode" = asan ]; then
  # LeakSanitizer stops the process's threads with ptrace at exit. Where
  # ptrace is forbidden (some container runtimes' seccomp profiles, or
  # kernel.yama.ptrace_scope=3), every test would fail with "LeakSanitizer
  # has encountered a fatal error" whatever the code does. A probe that
  # leaks nothing tells the two apart: if it fails that way, leak checking is
  # switched off (said loudly) and the address and UB checks still run.
  detect_leaks=1
  lprobe=$(mktemp -d)
  printf 'int main() { return 0; }\n' > "$lprobe/p.cc"
  if c++ -fsanitize=address "$lprobe/p.cc" -o "$lprobe/p" 2> "$lprobe/log"; then
    if ! ASAN_OPTIONS=detect_leaks=1 "$lprobe/p" > "$lprobe/out" 2>&1 &&
      grep -q 'LeakSanitizer has encountered a fatal error' "$lprobe/out"; then
      detect_leaks=0
      echo "sanitize.sh asan: LeakSanitizer cannot run here (it needs ptrace; see below);" \
        "leak checking is OFF for this run, address and undefined-behaviour checks stay on" >&2
      head -5 "$lprobe/out" >&2
    fi
  fi
  rm -rf "$lprobe"
  # Leak checking stays on where it can run; LibTorch's and gRPC's process-lifetime singletons
  # are reachable at exit, so they do not count as leaks.
  # allocator_may_return_null: an impossible allocation fails as in a plain build
  # (the tests check that it becomes RESOURCE_EXHAUSTED) instead of aborting.
  export ASAN_OPTIONS="allocator_may_return_null=1:abort_on_error=0:halt_on_error=1:exitcode=66:detect_leaks=$detect_leaks:strict_init_order=1:detect_stack_use_after_return=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=66"
  export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"
else
  # allocator_may_return_null: as for asan, an impossible allocation fails
  # (the staging tests check RESOURCE_EXHAUSTED) instead of aborting.
  export TSAN_OPTIONS="allocator_may_return_null=1:halt_on_error=1:exitcode=66:second_deadlock_stack=1:suppressions=$root/scripts/tsan.supp:print_suppressions=0"
fi
rc=0
# One job at a time under TSan: its runtime is memory-hungry and the
# concurrency tests want the cores to themselves.
ctest_jobs=$JOBS
[ "$mode" = tsan ] && ctest_jobs=1
ctest --test-dir "$dir" --output-on-failure -j"$ctest_jobs" --timeout 900 -L "$labels" "$@" ||
  rc=$?
t2=$(date +%s)
echo "sanitize.sh $mode: build $((t1 - t0))s, tests $((t2 - t1))s, exit $rc"
exit $rc
