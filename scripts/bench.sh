#!/usr/bin/env bash
# Runs every benchmark of the project and reports each figure as a ratio against a
# reference measured in the same run (docs/benchmarks.md says what each one is).
#
#   scripts/bench.sh            full run (about 5 minutes on a 2-core machine)
#   BENCH_QUICK=1 scripts/bench.sh   smaller models and fewer repetitions (smoke test;
#                                    writes bench/results/tmp/quick/, not the committed results)
#
# Builds what it needs in build-bench/ (Release), makes the synthetic 1 GiB
# checkpoint once (bench/results/tmp/, ignored by git), runs
#   build-bench/bench/quantizer_bench   FP8 quantizer vs the LibTorch op chain vs memcpy
#   build-bench/bench/refit_core_bench  commit, assembler, scaling, memory (in process)
#   build-bench/bench/moe_bench         a MoE refit vs a dense one of the same size, peak staging
#   build-bench/bench/refit_e2e_bench   refitd + client vs bare gRPC / raw socket / tmpfs Reload
#   bench/python/push_bench.py          the Python client's Push vs refitctl push, same refitd
#   bench/python/durability_bench.py    --state-dir: restart from a snapshot vs a cold load,
#                                       commit pause with vs without
#   bench/python/shm_bench.py           the shared-memory lane (push(lane="shm")) vs the
#                                       gRPC Push and a memcpy of the same bytes; CPU per GiB
#   bench/python/attach_bench.py        an engine attached to the arena: attach + map, reading
#                                       the kernels, Committed after the copy, engine pause
#   bench/python/fleet_bench.py         a fleet refit of 4 daemons (real etcd) vs 4
#                                       independent pushes; flip skew p50/p99, against
#                                       the members' commit copy and for a one-layer
#                                       checkpoint (the protocol alone)
# and writes bench/results/latest.json, bench/results/latest.md (the table),
# bench/results/refit_time_vs_size.png and bench/results/throughput_per_phase.png,
# and puts the table into README.md between <!-- bench:begin --> and
# <!-- bench:end --> (BENCH_UPDATE_README=0 leaves README.md alone). The
# markdown table comes last on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BENCH_BUILD_DIR:-build-bench}
JOBS=${JOBS:-2}
RESULTS=bench/results
TMP=$RESULTS/tmp
PY=${BENCH_PYTHON:-$ROOT/.venv/bin/python}
QUICK=${BENCH_QUICK:-0}
mkdir -p "$TMP"
start=$(date +%s)
log() { echo "bench.sh [$(($(date +%s) - start))s] $*" >&2; }

if [ -x scripts/setup.sh ] && [ "${BENCH_SKIP_SETUP:-0}" != 1 ]; then
  scripts/setup.sh >&2
fi
if [ ! -x "$PY" ]; then PY=$(command -v python3); fi

# --- build ------------------------------------------------------------------
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >&2
fi
log "building in $BUILD_DIR"
cmake --build "$BUILD_DIR" -j"$JOBS" --target refitd refitctl refit_make_fixture quantizer_bench \
  refit_core_bench refit_e2e_bench refit_bench_sink moe_bench >&2

# --- the 1 GiB checkpoint (same shapes as refit_core_bench's models) ---------
if [ "$QUICK" = 1 ]; then
  # A smoke test: its results go to bench/results/tmp/quick, README.md is left alone.
  MODEL_LAYERS=4; SIZES=64,256; REPS=2; E2E_REPS=2; QMIN=0.2
  RESULTS=$TMP/quick; mkdir -p "$RESULTS"; export BENCH_UPDATE_README=0
else
  MODEL_LAYERS=47; SIZES=256,1024,4096; REPS=3; E2E_REPS=${BENCH_E2E_REPS:-7}; QMIN=0.5
fi
MODEL_ARGS="--layers $MODEL_LAYERS --hidden 1024 --intermediate 2816 --heads 8 --kv-heads 2 --vocab 8192"
MODEL_DIR=$TMP/model-l$MODEL_LAYERS
if [ ! -f "$MODEL_DIR/.complete" ] || [ "$(cat "$MODEL_DIR/.complete")" != "$MODEL_ARGS" ]; then
  log "writing the synthetic checkpoint $MODEL_DIR"
  rm -rf "$MODEL_DIR"
  # shellcheck disable=SC2086
  "$BUILD_DIR/bin/refit_make_fixture" --out "$MODEL_DIR" --seed 1 $MODEL_ARGS >&2
  echo "$MODEL_ARGS" > "$MODEL_DIR/.complete"
fi

# --- runs -------------------------------------------------------------------
status=0
log "quantizer_bench"
rm -f "$TMP/quantizer.json"
# Its console reporter prints a table and ratios; the JSON goes to a file.
"$BUILD_DIR/bench/quantizer_bench" --benchmark_out="$TMP/quantizer.json" \
  --benchmark_out_format=json --benchmark_filter='^BM_(Ours|TorchOps|Memcpy)/' \
  --benchmark_min_time="$QMIN" > "$TMP/quantizer.txt" 2>&1 \
  || { log "quantizer_bench failed (see $TMP/quantizer.txt)"; status=1; }

log "refit_core_bench (sizes $SIZES MiB)"
"$BUILD_DIR/bench/refit_core_bench" --sizes="$SIZES" --reps="$REPS" \
  > "$TMP/core.json" 2> "$TMP/core.log" || { log "refit_core_bench failed (see $TMP/core.log)"; status=1; }

log "moe_bench (a mixture-of-experts refit vs a dense one of the same size)"
"$BUILD_DIR/bench/moe_bench" --size_mib="$([ "$QUICK" = 1 ] && echo 256 || echo 1024)" --reps="$REPS" \
  > "$TMP/moe.json" 2> "$TMP/moe.log" || { log "moe_bench failed (see $TMP/moe.log)"; status=1; }

log "refit_e2e_bench ($MODEL_DIR, $E2E_REPS repetitions)"
SHM_DIR=/dev/shm/refit-bench-$$
WORK_DIR=/tmp/refit-bench-$$
trap 'rm -rf "$SHM_DIR" "$WORK_DIR"' EXIT
"$BUILD_DIR/bench/refit_e2e_bench" --model_dir="$MODEL_DIR" --reps="$E2E_REPS" \
  --refitd="$BUILD_DIR/bin/refitd" --sink="$BUILD_DIR/bench/refit_bench_sink" \
  --shm_dir="$SHM_DIR" --workdir="$WORK_DIR" \
  > "$TMP/e2e.json" 2> "$TMP/e2e.log" || { log "refit_e2e_bench failed (see $TMP/e2e.log)"; status=1; }

log "push_bench.py (Python client vs refitctl push, $E2E_REPS repetitions)"
rm -f "$TMP/python.json"
"$PY" bench/python/push_bench.py --model_dir="$MODEL_DIR" --reps="$E2E_REPS" \
  --refitd="$BUILD_DIR/bin/refitd" --refitctl="$BUILD_DIR/bin/refitctl" \
  --e2e_bench="$BUILD_DIR/bench/refit_e2e_bench" --workdir="$WORK_DIR/python" --breakdown \
  > "$TMP/python.json" 2> "$TMP/python.log" \
  || { log "push_bench.py failed (see $TMP/python.log)"; status=1; }

log "durability_bench.py (--state-dir: restart from a snapshot, commit pause; $E2E_REPS repetitions)"
rm -f "$TMP/durability.json"
"$PY" bench/python/durability_bench.py --model_dir="$MODEL_DIR" --reps="$E2E_REPS" \
  --refitd="$BUILD_DIR/bin/refitd" --refitctl="$BUILD_DIR/bin/refitctl" \
  --workdir="$WORK_DIR/durability" > "$TMP/durability.json" 2> "$TMP/durability.log" \
  || { log "durability_bench.py failed (see $TMP/durability.log)"; status=1; }
log "shm_bench.py (the shared-memory lane vs gRPC Push and memcpy; $E2E_REPS repetitions)"
rm -f "$TMP/shm.json"
"$PY" bench/python/shm_bench.py --model_dir="$MODEL_DIR" --reps="$E2E_REPS" \
  --refitd="$BUILD_DIR/bin/refitd" --workdir="$WORK_DIR/shm" > "$TMP/shm.json" 2> "$TMP/shm.log" \
  || { log "shm_bench.py failed (see $TMP/shm.log)"; status=1; }
log "attach_bench.py (an engine attached to the arena: attach + map, reads, Committed, pause; $E2E_REPS repetitions)"
rm -f "$TMP/attach.json"
"$PY" bench/python/attach_bench.py --model_dir="$MODEL_DIR" --reps="$E2E_REPS" \
  --refitd="$BUILD_DIR/bin/refitd" > "$TMP/attach.json" 2> "$TMP/attach.log" \
  || { log "attach_bench.py failed (see $TMP/attach.log)"; status=1; }
# A one-layer checkpoint whose commit copy is well under 1 ms: the flip skew of
# a fleet refit of it is the protocol's alone.
SMALL_ARGS="--layers 1 --hidden 256 --intermediate 512 --heads 4 --kv-heads 1 --vocab 1024"
SMALL_DIR=$TMP/model-small
if [ ! -f "$SMALL_DIR/.complete" ] || [ "$(cat "$SMALL_DIR/.complete")" != "$SMALL_ARGS" ]; then
  rm -rf "$SMALL_DIR"
  # shellcheck disable=SC2086
  "$BUILD_DIR/bin/refit_make_fixture" --out "$SMALL_DIR" --seed 1 $SMALL_ARGS >&2
  echo "$SMALL_ARGS" > "$SMALL_DIR/.complete"
fi
log "fleet_bench.py (a fleet refit of 4 daemons vs 4 independent pushes; $((E2E_REPS * 3)) repetitions; the small checkpoint's skew)"
rm -f "$TMP/fleet.json"
"$PY" bench/python/fleet_bench.py --model_dir="$MODEL_DIR" --reps="$((E2E_REPS * 3))" \
  --small_model_dir="$SMALL_DIR" \
  --refitd="$BUILD_DIR/bin/refitd" --refitctl="$BUILD_DIR/bin/refitctl" \
  --workdir="$WORK_DIR/fleet" > "$TMP/fleet.json" 2> "$TMP/fleet.log" \
  || { log "fleet_bench.py failed (see $TMP/fleet.log)"; status=1; }
cp "$WORK_DIR"/*.log "$WORK_DIR"/python/*.log "$TMP/" 2>/dev/null || true
mkdir -p "$TMP/durability" && cp "$WORK_DIR"/durability/*.log "$TMP/durability/" 2>/dev/null || true

# --- report -----------------------------------------------------------------
if ! "$PY" -c 'import matplotlib' 2>/dev/null; then
  log "installing matplotlib into the venv (plots only)"
  "$PY" -m pip install -q 'matplotlib==3.11.2' >&2 || log "matplotlib unavailable: no PNGs"
fi
log "writing $RESULTS/latest.json"
"$PY" - "$TMP" "$RESULTS" "$(($(date +%s) - start))" <<'EOF'
import json, os, platform, subprocess, sys, datetime

tmp, results, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3])

def load(name):
    try:
        with open(os.path.join(tmp, name)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"bench.sh: no {name}: {e}", file=sys.stderr)
        return None

def machine():
    info = {"cpu_model": "", "cores": os.cpu_count(), "memory_gib": None,
            "kernel": platform.release(), "os": ""}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
        for line in open("/etc/os-release"):
            if line.startswith("PRETTY_NAME"):
                info["os"] = line.split("=", 1)[1].strip().strip('"')
        flags = open("/proc/cpuinfo").read()
        info["isa"] = [x for x in ("avx512f", "avx2", "sse2") if f" {x}" in flags]
        info["load_average_at_end"] = list(os.getloadavg())
        # Share of time some task waited for a CPU (PSI): how busy the
        # machine was with other work while the figures were taken.
        for line in open("/proc/pressure/cpu"):
            if line.startswith("some"):
                info["cpu_pressure_some_avg300_percent"] = float(line.split()[3].split("=")[1])
    except OSError:
        pass
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info

def fig(name, value, unit, ref_name, ref_value, ratio, target, met, note=""):
    d = {"name": name, "value": value, "unit": unit, "reference_name": ref_name,
         "reference_value": ref_value, "ratio": ratio, "target": target, "met": met}
    if note:
        d["note"] = note
    return d

figures, series = [], {}

# 1. quantizer (quantizer_bench's Google Benchmark JSON, read as it is).
q = load("quantizer.json")
if q:
    runs = {b["name"]: b for b in q.get("benchmarks", []) if b.get("run_type") == "iteration"}
    schemes = {"0": "per-tensor", "1": "per-channel", "2": "block 128x128"}
    quant_series = []
    for name, b in runs.items():
        parts = name.split("/")
        if parts[0] != "BM_Ours":
            continue
        scheme, threads = parts[1], parts[2]
        torch = runs.get(f"BM_TorchOps/{scheme}/{threads}/real_time")
        memcpy = runs.get(f"BM_Memcpy/{threads}/real_time")
        if torch:
            r = torch["real_time"] / b["real_time"]
            figures.append(fig(f"FP8 quantize bf16 256 MiB, {schemes[scheme]}, {threads} threads",
                               b["real_time"], b["time_unit"], "LibTorch op chain, same math",
                               torch["real_time"], r, ">= 2 (speedup)", r >= 2,
                               "ratio = reference time / our time"))
        if memcpy:
            r = b["bytes_per_second"] / memcpy["bytes_per_second"]
            figures.append(fig(f"FP8 quantize effective bandwidth, {schemes[scheme]}, {threads} threads",
                               b["bytes_per_second"] / 1e9, "GB/s", "memcpy (read + write)",
                               memcpy["bytes_per_second"] / 1e9, r, ">= 0.5", r >= 0.5))
        quant_series.append({"scheme": schemes[scheme], "threads": int(threads),
                             "ours_gbps": b["bytes_per_second"] / 1e9,
                             "torch_gbps": torch["bytes_per_second"] / 1e9 if torch else None,
                             "memcpy_gbps": memcpy["bytes_per_second"] / 1e9 if memcpy else None})
    series["quantizer"] = quant_series

# Each benchmark's figures, and its series under its own key.
loaded = {}
for key, name in [("core", "core.json"), ("moe", "moe.json"), ("e2e", "e2e.json"),
                  ("python", "python.json"), ("durability", "durability.json"),
                  ("shm", "shm.json"), ("attach", "attach.json"), ("fleet", "fleet.json")]:
    loaded[key] = load(name)
    if loaded[key]:
        figures += loaded[key]["figures"]
        series[key] = loaded[key]["series"]
core, e2e = loaded["core"], loaded["e2e"]

out = {"machine": machine(),
       "generated_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
       "elapsed_seconds": elapsed,
       "figures": figures, "series": series}
with open(os.path.join(results, "latest.json"), "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")

# Plots.
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None
if plt is not None and core and "scaling" in core["series"]:
    import statistics
    fig_, ax = plt.subplots(figsize=(6.8, 4.4))
    variants = [("scaling", "in-process refit, default options", "tab:blue"),
                ("scaling_budget_2_layers", "in-process refit, staging budget 2 x largest layer",
                 "tab:orange")]
    xmax = 0
    for key, label, color in variants:
        pts = core["series"].get(key)
        if not pts:
            continue
        xs = [p["gib"] for p in pts]
        xmax = max(xmax, max(xs))
        for p in pts:
            ax.scatter([p["gib"]] * len(p["total_s"]), p["total_s"], color=color, alpha=0.35, s=14)
        ax.plot(xs, [p["median_total_s"] for p in pts], "o-", color=color, label=label + " (median)")
        mid = pts[len(pts) // 2]
        slope = mid["median_total_s"] / mid["gib"]
        ax.plot([0, max(xs)], [0, slope * max(xs)], ":", color=color, alpha=0.7,
                label=f"linear through the {mid['label']} point")
    if e2e:
        s = e2e["series"]
        gib = s["bytes"] / 2**30
        ax.scatter([gib], [statistics.median(s["seconds"]["push"])], marker="s", color="tab:red",
                   label="Push via refitd (median)", zorder=3)
        ax.scatter([gib], [statistics.median(s["seconds"]["reload"])], marker="^",
                   color="tab:green", label="tmpfs write + Reload (median)", zorder=3)
    ax.set_xlabel("model size (GiB of bf16 checkpoint)")
    ax.set_ylabel("refit time (s)")
    ax.set_title("Refit time vs model size (FP8 per-tensor, CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig_.tight_layout()
    fig_.savefig(os.path.join(results, "refit_time_vs_size.png"), dpi=110)
    plt.close(fig_)

if plt is not None:
    bars = []  # (label, GB/s, kind)
    for qs in series.get("quantizer", []):
        if qs["scheme"] == "per-tensor" and qs["threads"] == max(x["threads"] for x in series["quantizer"]):
            bars.append(("memcpy (read+write)", qs["memcpy_gbps"], "ref"))
            bars.append(("FP8 quantize, ours", qs["ours_gbps"], "ours"))
            if qs["torch_gbps"]:
                bars.append(("FP8 quantize, LibTorch ops", qs["torch_gbps"], "ref"))
    if core:
        a = core["series"].get("assembler")
        if a:
            bars.append(("memcpy of chunks", a["memcpy_gbps"], "ref"))
            bars.append(("assemble (none)", a["none_gbps"], "ours"))
            bars.append(("assemble + FP8", a["fp8_gbps"], "ours"))
        c = core["series"].get("commit")
        if c:
            bars.append(("memcpy of kernels", c["memcpy_gbps"], "ref"))
            bars.append(("commit", c["pause_gbps"], "ours"))
    if e2e:
        s = e2e["series"]
        g = s["gbps"]
        bars.append(("raw Unix socket", g["raw"], "ref"))
        bars.append(("bare gRPC stream", g["bare"], "ref"))
        bars.append(("Push, ingest only", g["ingest"], "ours"))
        bars.append(("Push, full refit", g["push"], "ours"))
        if "push_tight" in g:
            bars.append(("Push, full refit, budget 2 layers", g["push_tight"], "ours"))
        bars.append(("tmpfs write + Reload", g["reload"], "ref"))
        ph = s.get("push_phases") or []
        if ph:
            import statistics
            rec = statistics.median(p["receive_s"] for p in ph)
            qua = statistics.median(p["quantize_s"] for p in ph)
            com = statistics.median(p["commit_s"] for p in ph)
            bars.append(("refitd receive phase", s["bytes"] / rec / 1e9, "ours"))
            bars.append(("refitd quantize phase", s["bytes"] / qua / 1e9, "ours"))
            bars.append(("refitd commit phase (kernel B)", s["kernel_bytes"] / com / 1e9, "ours"))
    if bars:
        fig_, ax = plt.subplots(figsize=(7.5, 0.32 * len(bars) + 1.4))
        labels = [b[0] for b in bars][::-1]
        vals = [b[1] for b in bars][::-1]
        colors = ["tab:blue" if b[2] == "ours" else "tab:gray" for b in bars][::-1]
        ax.barh(labels, vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
        ax.set_xlabel("GB/s (blue: refitd, gray: reference)")
        ax.set_title("Throughput per phase")
        ax.grid(axis="x", alpha=0.3)
        fig_.tight_layout()
        fig_.savefig(os.path.join(results, "throughput_per_phase.png"), dpi=110)
        plt.close(fig_)

# The table, last.
def fmt(x):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)

m = out["machine"]
lines = [f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}"
         f" (load average at end {', '.join(f'{x:.1f}' for x in m.get('load_average_at_end', []))};"
         f" CPU pressure {m.get('cpu_pressure_some_avg300_percent', '?')}% over 5 min);"
         f" {out['generated_utc']}, commit {m.get('commit', '?')}.",
         "",
         "| figure | value | reference | ratio | target | met |",
         "|---|---|---|---|---|---|"]
for f in figures:
    met = {True: "yes", False: "**no**", None: "-"}[f["met"]]
    lines.append(f"| {f['name']} | {fmt(f['value'])} {f['unit']} | {f['reference_name']}: "
                 f"{fmt(f['reference_value'])} | {fmt(f['ratio'])} | {f['target'] or '-'} | {met} |")
table = "\n".join(lines) + "\n"
with open(os.path.join(results, "latest.md"), "w") as f:
    f.write(table)
# The README's Performance section shows the same table, between markers.
begin, end_ = "<!-- bench:begin -->", "<!-- bench:end -->"
try:
    readme = open("README.md").read()
    if begin in readme and end_ in readme and os.environ.get("BENCH_UPDATE_README", "1") == "1":
        head, rest = readme.split(begin, 1)
        _, tail = rest.split(end_, 1)
        with open("README.md", "w") as f:
            f.write(head + begin + "\n" + table + end_ + tail)
except OSError:
    pass
print("\n" + table)
EOF
log "done in $(($(date +%s) - start)) s"
exit $status
