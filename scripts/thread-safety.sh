#!/usr/bin/env bash
# Clang's thread-safety analysis over core/ and server/. GCC ignores
# ABSL_GUARDED_BY and friends, so without this nothing checks that a guarded
# field is only touched under its mutex.
#
# Every core/ (core/cuda's .cc files included; nvcc's .cu files are not C++
# clang can parse as is) and server/ translation unit in
# $BUILD_DIR/compile_commands.json is parsed by clang++ with the build's
# -std, -I, -isystem, -D/-U, -include and -pthread, plus -fsyntax-only and
# -Wthread-safety as errors; every other warning is off, and GCC-only flags
# are dropped. Needs a configured build (scripts/build.sh); generated headers
# (the protobuf/gRPC stubs) must exist, so build first.
#
#   scripts/thread-safety.sh [FILTER]   FILTER: only sources whose path contains it
#
# Environment: BUILD_DIR (default build), CLANGXX (default clang++), JOBS
# (default 2).
# Exit status: 0 clean; 1 thread-safety diagnostics (listed, file:line);
# 2 clang could not parse a translation unit, or usage/setup errors.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
CLANGXX=${CLANGXX:-clang++}
JOBS=${JOBS:-2}
DB=$BUILD_DIR/compile_commands.json
case "${1:-}" in -h | --help) sed -n '2,20p' "$0"; exit 0 ;; esac
command -v "$CLANGXX" > /dev/null ||
  { echo "thread-safety: $CLANGXX not found (scripts/setup.sh installs clang)" >&2; exit 2; }
[ -f "$DB" ] || { echo "thread-safety: no $DB; run scripts/build.sh first" >&2; exit 2; }

exec python3 - "$DB" "$CLANGXX" "$JOBS" "$PWD" "${1:-}" <<'EOF'
import concurrent.futures, json, os, re, shlex, subprocess, sys, time

db_path, clangxx, jobs, root, filt = sys.argv[1:]
start = time.time()
root = os.path.realpath(root)
DIRS = ('core/', 'server/')

# Flags that change what the code means; everything else (optimisation,
# warnings, -fPIC, output files, GCC-only options) is dropped.
WITH_VALUE = ('-I', '-isystem', '-iquote', '-D', '-U', '-include')
ANALYSIS = ['-fsyntax-only', '-Wno-everything', '-Wthread-safety', '-Werror=thread-safety',
            '-fcolor-diagnostics' if sys.stdout.isatty() else '-fno-color-diagnostics']

def clang_args(entry):
    args = entry.get('arguments') or shlex.split(entry['command'])
    out = []
    i = 1
    while i < len(args):
        a = args[i]
        if a in WITH_VALUE and i + 1 < len(args):
            out += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith(('-std=', '-pthread')) or any(
                a.startswith(f) and len(a) > len(f) for f in ('-I', '-D', '-U')):
            out.append(a)
        elif a.startswith('-isystem') and len(a) > len('-isystem'):
            out.append(a)
        i += 1
    return out

units = []
for e in json.load(open(db_path)):
    path = os.path.realpath(os.path.join(e['directory'], e['file']))
    rel = os.path.relpath(path, root)
    if not rel.startswith(DIRS) or not rel.endswith('.cc') or filt not in rel:
        continue
    units.append((rel, e['directory'], [clangxx] + clang_args(e) + ANALYSIS + [path]))
units.sort()
if not units:
    sys.exit(f'thread-safety: no core/ or server/ sources{" matching " + filt if filt else ""} '
             f'in {db_path}')

# clang's diagnostic lines: "file:line:col: error: message [-Werror,-Wthread-safety-analysis]".
DIAG = re.compile(r'^(?P<file>[^:\s][^:]*):(?P<line>\d+):(?P<col>\d+): (?P<kind>error|warning): '
                  r'(?P<msg>.*?)(?: \[(?P<flag>[^\]]+)\])?$')

def run(unit):
    rel, cwd, cmd = unit
    t0 = time.time()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return rel, p.returncode, p.stderr, time.time() - t0

findings = {}   # (file, line, msg) -> first unit that reported it
parse_errors = []
print(f'thread-safety: {len(units)} translation units of core/ and server/, '
      f'{jobs} at a time, {clangxx}', flush=True)
with concurrent.futures.ThreadPoolExecutor(max_workers=int(jobs)) as pool:
    for rel, rc, err, secs in pool.map(run, units):
        ts, other = [], []
        for line in err.splitlines():
            m = DIAG.match(re.sub(r'\x1b\[[0-9;]*m', '', line))
            if not m:
                continue
            f = os.path.relpath(os.path.realpath(os.path.join(root, m['file'])), root)
            if 'thread-safety' in (m['flag'] or ''):
                key = (f, int(m['line']), m['msg'])
                ts.append(key)
                findings.setdefault(key, (rel, m['flag'], m['col']))
            elif m['kind'] == 'error':
                other.append(f'{f}:{m["line"]}:{m["col"]}: {m["msg"]}')
        if rc != 0 and not ts and not other:
            other.append(err.strip().splitlines()[-1] if err.strip() else f'clang exit {rc}')
        status = 'ok' if rc == 0 else (f'{len(ts)} thread-safety' if ts else '') + \
            (', ' if ts and other else '') + (f'{len(other)} other errors' if other else '')
        print(f'  {rel:<45} {secs:5.1f} s  {status}', flush=True)
        if other:
            parse_errors.append((rel, other, err))

def source_line(f, n):
    try:
        with open(os.path.join(root, f)) as fh:
            return fh.read().splitlines()[n - 1].strip()
    except (OSError, IndexError):
        return ''

elapsed = time.time() - start
if findings:
    print(f'\nthread-safety: {len(findings)} diagnostics:')
    for (f, line, msg), (unit, flag, col) in sorted(findings.items()):
        print(f'{f}:{line}:{col}: {msg} [{flag}]')
        print(f'    {source_line(f, line)}')
for rel, other, err in parse_errors:
    print(f'\nthread-safety: clang could not compile {rel}, so it was not analysed (the '
          f'source does not build as it is, or clang rejects a flag or header GCC accepts):')
    print('\n'.join('  ' + o for o in other[:10]))
summary = (f'{len(units)} translation units, {len(findings)} thread-safety diagnostics, '
           f'{len(parse_errors)} units clang could not parse, {elapsed:.0f} s')
if findings or parse_errors:
    print(f'\nthread-safety: FAILED: {summary}')
    if findings:
        print('Fix: take the mutex (absl::MutexLock) where the field is touched, or annotate the '
              'function ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) so its callers must hold it.')
    sys.exit(2 if parse_errors else 1)
print(f'thread-safety: ok: {summary}')
EOF
