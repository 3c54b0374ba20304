#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS, starting from its committed corpus.
#
#   scripts/fuzz.sh TARGET SECONDS [LIBFUZZER_ARGS...]
#   scripts/fuzz.sh --list
#
# TARGET: safetensors_header | model_config | name_mapper | refit_session |
# push_message (fuzz/<TARGET>_fuzz.cc). Builds (once, then incrementally) a
# clang build with -DREFIT_FUZZ=ON in $FUZZ_BUILD_DIR (default build-fuzz;
# build-fuzz-server for push_message, which needs the server): everything
# under AddressSanitizer + UndefinedBehaviorSanitizer with coverage, CUDA
# off, the server off unless the target needs it. New inputs go to
# $FUZZ_BUILD_DIR/corpus/TARGET (the committed corpus in fuzz/corpus/TARGET
# is only read; minimize new finds with -merge=1 before committing them),
# crashes to fuzz/crashers/TARGET/.
# Exit status: libFuzzer's (0: no crash, leak or sanitizer report).
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(safetensors_header model_config name_mapper refit_session push_message)
case "${1:-}" in
  --list) printf '%s\n' "${targets[@]}"; exit 0 ;;
  "" | -h | --help) sed -n '2,17p' "$0"; exit 2 ;;
esac
target=$1
seconds=${2:?usage: scripts/fuzz.sh TARGET SECONDS}
shift 2
[ -f "fuzz/${target}_fuzz.cc" ] || { echo "fuzz.sh: no target '$target' (--list)" >&2; exit 2; }
server=OFF
[ "$target" = push_message ] && server=ON
dir=${FUZZ_BUILD_DIR:-build-fuzz$([ "$server" = ON ] && echo -server)}
JOBS=${JOBS:-2}
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# clang 14 does not know GCC's "prefer-vector-width" target attribute of the
# AVX-512 quantizer kernels; it ignores it (same code, a hint less).
warn="-Wno-error=ignored-attributes"
if [ ! -f "$dir/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DREFIT_FUZZ=ON -DREFIT_BUILD_TESTS=OFF -DREFIT_BUILD_SERVER=$server -DREFIT_BUILD_BENCH=OFF \
    -DREFIT_WITH_CUDA=OFF -DCMAKE_CXX_FLAGS="$san -fsanitize=fuzzer-no-link $warn" \
    -DCMAKE_EXE_LINKER_FLAGS="$san"
fi
cmake --build "$dir" -j"$JOBS" --target "fuzz_$target"
mkdir -p "$dir/corpus/$target" "fuzz/crashers/$target"
# Leaks are checked at the end of every input; UBSan's reports are fatal.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
exec "$dir/fuzz/fuzz_$target" -max_total_time="$seconds" -print_final_stats=1 \
  -timeout=10 -rss_limit_mb=4096 -artifact_prefix="fuzz/crashers/$target/" "$@" \
  "$dir/corpus/$target" "fuzz/corpus/$target"
