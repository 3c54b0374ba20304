#!/usr/bin/env python3
"""durability_bench: what --state-dir costs and what it buys, same model, one run.

1. Restart. refitd --model DIR (a cold load: read the bf16/fp16 safetensors,
   quantize to FP8, commit) against refitd --model DIR --state-dir S where S
   holds a snapshot of the same model (read the FP8 kernel bytes, verify their
   XXH3, restore). Interleaved, `--reps` of each; every start is a fresh
   process on a Unix socket, timed from exec to the "; ready" log line, and
   its load phase alone from the daemon's own log timestamps ("loading the
   first version" / "looking for a snapshot" to "; ready"). Both read files
   the page cache holds (the checkpoint was just written or read; the
   snapshot was just written).
2. Commit pause. One refitd with --state-dir and one without, the same
   checkpoint pushed `--reps` times to each (refitctl push, alternating); the
   pause is the daemon's "committed ... pause_us=" (readers held off), and the
   whole push is timed too. With --state-dir every commit is followed by a
   snapshot on the writer thread, overlapping the next push.

Prints {"figures": [...], "series": {...}} on stdout, the format
scripts/bench.sh merges into bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence
from bench_figures import figure


def log(msg: str) -> None:
    print(f"durability_bench: {msg}", file=sys.stderr, flush=True)


class Daemon:
    """A refitd child whose stderr is read as it is written."""

    def __init__(self, args: List[str], log_path: pathlib.Path) -> None:
        self.lines: List[str] = []
        self.cv = threading.Condition()
        self.log = open(log_path, "w")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.write(line)
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()
        with self.cv:
            self.lines.append("<exit>")
            self.cv.notify_all()

    def wait_line(self, *parts: str, after: int = 0, timeout: float = 600) -> tuple:
        """(index, line, seconds since start) of the first line with every part."""
        deadline = time.monotonic() + timeout
        with self.cv:
            i = after
            while True:
                while i < len(self.lines):
                    line = self.lines[i]
                    if line == "<exit>":
                        raise RuntimeError(f"refitd exited; see {self.log.name}")
                    if all(p in line for p in parts):
                        return i, line, time.monotonic() - self.start
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line with {parts} in {self.log.name}")
                self.cv.wait(left)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=10)
        self.log.close()


def stamp(line: str) -> float:
    t = line.split(" ", 1)[0].rstrip("Z")
    return datetime.datetime.fromisoformat(t).timestamp()


def start_to_ready(refitd: str, model: str, socket: str, flags: List[str],
                   log_path: pathlib.Path, phase_start: str) -> dict:
    d = Daemon([refitd, "--model", model, "--listen", "unix:" + socket, *flags], log_path)
    try:
        _, begin, _ = d.wait_line(phase_start)
        _, ready, wall = d.wait_line("; ready")
        return {"wall_s": wall, "load_s": stamp(ready) - stamp(begin)}
    finally:
        d.stop()


def push(refitctl: str, socket: str, model: str) -> float:
    t0 = time.monotonic()
    r = subprocess.run([refitctl, "--addr", "unix:" + socket, "--timeout", "600s", "push", model],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"refitctl push failed: {r.stderr}")
    return time.monotonic() - t0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model_dir", required=True)
    p.add_argument("--refitd", required=True)
    p.add_argument("--refitctl", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quant", default="per-tensor")
    a = p.parse_args(argv)
    work = pathlib.Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--quant", a.quant]
    state = work / "state"
    shutil.rmtree(state, ignore_errors=True)

    # A snapshot of the model: one start with --state-dir, which loads the
    # model and snapshots it, stopped once the snapshot is on disk.
    log(f"seeding {state}")
    d = Daemon([a.refitd, "--model", a.model_dir, "--listen", f"unix:{work}/seed.sock",
                "--state-dir", str(state), *common], work / "seed.log")
    try:
        d.wait_line("snapshot written", " version=1 ")
    finally:
        d.stop()
    snapshot_bytes = sum(f.stat().st_size for f in state.glob("snapshot-*.refit"))
    model_bytes = sum(f.stat().st_size for f in pathlib.Path(a.model_dir).glob("*.safetensors"))

    cold, warm = [], []
    for i in range(a.reps):
        order = [("cold", cold), ("snapshot", warm)]
        if i % 2:
            order.reverse()
        for kind, out in order:
            if kind == "cold":
                r = start_to_ready(a.refitd, a.model_dir, f"{work}/cold.sock", common,
                                   work / f"cold-{i}.log", "loading the first version")
            else:
                r = start_to_ready(a.refitd, a.model_dir, f"{work}/snap.sock",
                                   [*common, "--state-dir", str(state)],
                                   work / f"snapshot-{i}.log", "looking for a snapshot")
            out.append(r)
            log(f"rep {i} {kind}: ready after {r['wall_s']:.3f} s (load {r['load_s']:.3f} s)")

    # Commit pause with and without --state-dir.
    pause_state = work / "pause-state"
    shutil.rmtree(pause_state, ignore_errors=True)
    with_state = Daemon([a.refitd, "--model", a.model_dir, "--listen", f"unix:{work}/with.sock",
                         "--state-dir", str(pause_state), *common], work / "pause-with.log")
    without = Daemon([a.refitd, "--model", a.model_dir, "--listen", f"unix:{work}/without.sock",
                      *common], work / "pause-without.log")
    pauses = {"with": [], "without": []}
    push_s = {"with": [], "without": []}
    try:
        marks = {}
        for name, d in (("with", with_state), ("without", without)):
            idx, _, _ = d.wait_line("; ready")
            marks[name] = idx + 1
        for i in range(a.reps):
            order = [("with", with_state, "with.sock"), ("without", without, "without.sock")]
            if i % 2:
                order.reverse()
            for name, d, sock in order:
                push_s[name].append(push(a.refitctl, f"{work}/{sock}", a.model_dir))
                idx, line, _ = d.wait_line(" committed", "pause_us=", after=marks[name])
                marks[name] = idx + 1
                pauses[name].append(int(re.search(r"pause_us=(\d+)", line).group(1)) / 1e6)
            log(f"rep {i}: pause with {pauses['with'][-1] * 1e3:.2f} ms, "
                f"without {pauses['without'][-1] * 1e3:.2f} ms")
        # The last snapshot, for its duration.
        _, written, _ = with_state.wait_line("snapshot written", f" version={a.reps + 1} ")
        snapshot_ms = int(re.search(r"total_ms=(\d+)", written).group(1))
        copy_ms = int(re.search(r"copy_ms=(\d+)", written).group(1))
    finally:
        with_state.stop()
        without.stop()

    med = statistics.median
    cold_wall, warm_wall = med(r["wall_s"] for r in cold), med(r["wall_s"] for r in warm)
    cold_load, warm_load = med(r["load_s"] for r in cold), med(r["load_s"] for r in warm)
    pw, pwo = med(pauses["with"]), med(pauses["without"])
    figures = [
        figure("refitd start to ready, restart from a --state-dir snapshot", warm_wall, "s",
               "cold start loading the same model from safetensors", cold_wall, "<= 0.7",
               met=warm_wall / cold_wall <= 0.7,
               note=f"medians of {a.reps}, interleaved; process start included; snapshot "
               f"{snapshot_bytes / 2**20:.0f} MiB vs checkpoint {model_bytes / 2**20:.0f} MiB"),
        figure("load phase alone, snapshot restore (read + verify + restore)", warm_load, "s",
               "cold load (read + quantize + commit)", cold_load, "<= 0.7",
               met=warm_load / cold_load <= 0.7, note="from the daemon's log timestamps"),
        figure("commit pause with --state-dir", pw, "s", "commit pause without --state-dir", pwo,
               "<= 1.1", met=pw / pwo <= 1.1 if pwo else False,
               note=f"medians of {a.reps} pushes each, alternating; the snapshot of a version "
               f"takes {snapshot_ms} ms after its commit ({copy_ms} ms of it copying under the "
               f"reader lock)"),
        figure("push (refitctl, whole) with --state-dir", med(push_s["with"]), "s",
               "push without --state-dir", med(push_s["without"]), "", met=True,
               note="includes the version record's fsyncs before the commit"),
    ]
    series = {"restart": {"cold": cold, "snapshot": warm, "snapshot_bytes": snapshot_bytes,
                          "model_bytes": model_bytes},
              "pause_s": pauses, "push_s": push_s,
              "snapshot_total_ms": snapshot_ms, "snapshot_copy_ms": copy_ms}
    json.dump({"figures": figures, "series": series}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
