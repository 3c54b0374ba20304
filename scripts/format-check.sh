#!/usr/bin/env bash
# Checks that every tracked C++/CUDA source is formatted as .clang-format
# says. Prints the files that differ and how to fix them; exits 1 if any do.
#
#   scripts/format-check.sh          check only (what scripts/test.sh runs)
#   scripts/format-check.sh --fix    rewrite the files that differ in place
#
# Environment: CLANG_FORMAT (default clang-format), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

FIX=0
case "${1:-}" in
  --fix) FIX=1 ;;
  "") ;;
  -h | --help) sed -n '2,8p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--fix]" >&2; exit 2 ;;
esac

CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
JOBS=${JOBS:-2}
command -v "$CLANG_FORMAT" > /dev/null ||
  { echo "format-check: $CLANG_FORMAT not found (scripts/setup.sh installs it)" >&2; exit 2; }

# Tracked files only, and only those still on disk (a file deleted but not yet
# committed is not a formatting problem).
files=()
while IFS= read -r -d '' f; do
  [ -f "$f" ] && files+=("$f")
done < <(git ls-files -z '*.cc' '*.h' '*.cu' '*.cuh')
[ ${#files[@]} -gt 0 ] || { echo "format-check: no tracked sources" >&2; exit 2; }

# One clang-format per file: its exit status says whether that file differs.
# An error other than a difference (unreadable file, bad .clang-format) is
# reported as such rather than as a file to fix.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%s\0' "${files[@]}" |
  xargs -0 -P "$JOBS" -n 1 sh -c '
    if ! out=$("$0" --style=file --dry-run -Werror "$1" 2>&1); then
      case "$out" in
        *"code should be clang-formatted"*) printf "%s\n" "$1" ;;
        *) printf "ERROR %s: %s\n" "$1" "$out" >&2; printf "%s\n" "$1" ;;
      esac
    fi' "$CLANG_FORMAT" > "$work/differ" || true
mapfile -t differ < <(sort -u "$work/differ")

if [ ${#differ[@]} -eq 0 ]; then
  echo "format-check: ${#files[@]} files, all formatted ($("$CLANG_FORMAT" --version | sed 's/.*version //'))"
  exit 0
fi

if [ $FIX -eq 1 ]; then
  # clang-format does not always converge in one pass (code split by #ifdef
  # can move again on the second), so repeat until the check holds.
  for _ in 1 2 3; do
    "$CLANG_FORMAT" --style=file -i "${differ[@]}"
    "$CLANG_FORMAT" --style=file --dry-run -Werror "${differ[@]}" > /dev/null 2>&1 && break
  done
  printf 'format-check: reformatted %d of %d files:\n' "${#differ[@]}" "${#files[@]}"
  printf '  %s\n' "${differ[@]}"
  exit 0
fi

printf 'format-check: %d of %d files are not formatted as .clang-format says:\n' \
  "${#differ[@]}" "${#files[@]}"
printf '  %s\n' "${differ[@]}"
echo "To see the changes:  clang-format --style=file <file> | diff -u <file> -"
echo "To fix them:         scripts/format-check.sh --fix   (or clang-format -i --style=file <file>...)"
exit 1
