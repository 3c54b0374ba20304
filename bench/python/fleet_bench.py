#!/usr/bin/env python3
"""fleet_bench: a fleet refit of 4 daemons against 4 independent pushes, one run.

A real etcd (Debian's etcd-server) and `--members` refitd processes on Unix
sockets, all in a fleet. Interleaved, `--reps` of each:
  - fleet: `refitctl fleet push DIR` (prepare on every member in parallel,
    the decision CAS-written once in etcd, commit on every member);
  - independent: `refitctl push DIR` to every member at once, uncoordinated
    (the same bytes, the same parallelism, one-phase commits).
Throughput = members x checkpoint bytes / wall time of the whole command(s);
the figure is fleet / independent (target >= 0.9). Flip skew (the time
between the first and the last member's commit, from `fleet push --json`)
p50 and p99 over the fleet refits (target <= 10 ms on loopback).

What the skew is made of: `fleet push --json` gives each member's commit
end (its last_commit_unix_seconds) and its commit pause (the copy into the
live kernels, RefitResult.timings.commit_seconds), so its commit began at
end - pause. The spread of those beginnings is the protocol's share (the
decision reaching every member through its etcd watch or the coordinator's
Commit); the rest is the copies. With --small_model_dir (a checkpoint of a
layer or two whose commit copy is well under 1 ms) a second fleet of as
many daemons serves it and --small_reps fleet pushes of it, interleaved
with the above, give the skew of the protocol alone.

With --tp N (N > 1) the members are tensor-parallel ranks (member i is rank
i % N of tp size N) and a second fleet of as many tp=1 daemons runs beside
them: each member of both receives the whole checkpoint (a daemon accepts
chunks of whole-shape tensors only, and Prepare refuses a tensor received in
part, so a rank cannot be sent only its slices). Interleaved with the above,
a fleet push to the tp=1 fleet is the reference of a fleet push to the tp=N
fleet: what sending every rank the whole checkpoint costs it beyond what it
keeps. The bytes a rank keeps are estimated from the members' FP8 kernel
bytes (their registrations) against the tp=1 members'.

Prints {"figures": [...], "series": {...}} on stdout, the format
scripts/bench.sh merges into bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import List, Optional, Sequence
from bench_figures import figure


def log(msg: str) -> None:
    print(f"fleet_bench: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)  # the next check, bounded by the deadline
    raise RuntimeError(f"timed out waiting for {what}")


def percentile(values: List[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model_dir", required=True, help="checkpoint to serve and push")
    p.add_argument("--refitd", required=True)
    p.add_argument("--refitctl", required=True)
    p.add_argument("--etcd", default=shutil.which("etcd") or "/usr/bin/etcd")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--workdir", default="")
    p.add_argument("--small_model_dir", default="",
                   help="a tiny checkpoint (1-2 layers): a second fleet measures the protocol's skew")
    p.add_argument("--small_reps", type=int, default=0, help="fleet pushes of it (0: 2 x --reps)")
    p.add_argument("--tp", type=int, default=1,
                   help="members are ranks of this tp size; > 1 adds a tp=1 reference fleet")
    a = p.parse_args(argv)
    small_reps = a.small_reps or 2 * a.reps
    if a.tp < 1 or a.members % a.tp:
        p.error("--members must be a multiple of --tp")

    work = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="fleet-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_bytes = sum(f.stat().st_size for f in pathlib.Path(a.model_dir).glob("*.safetensors"))
    client = f"http://127.0.0.1:{free_port()}"
    peer = f"http://127.0.0.1:{free_port()}"
    procs = []
    etcd_log = open(work / "etcd.log", "w")
    procs.append(subprocess.Popen(
        [a.etcd, "--name=bench", f"--data-dir={work}/etcd", f"--listen-client-urls={client}",
         f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=bench={peer}"],
        stdout=etcd_log, stderr=etcd_log))

    def etcd_healthy() -> bool:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                return b"true" in r.read()
        except OSError:
            return False

    endpoint = client.removeprefix("http://")
    fleet = ["--etcd", endpoint, "--fleet", "bench"]
    fleet_tp1 = ["--etcd", endpoint, "--fleet", "bench-tp1"]
    fleet_small = ["--etcd", endpoint, "--fleet", "bench-small"]

    def kernel_bytes(name: str) -> List[int]:
        import base64
        prefix = f"/refitd/fleet/{name}/members/"
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                           "range_end": base64.b64encode(end.encode()).decode()}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                client + "/v3/kv/range", data=body,
                headers={"Content-Type": "application/json"}), timeout=5) as r:
            kvs = json.loads(r.read()).get("kvs", [])
        return [json.loads(base64.b64decode(kv["value"]))["layout"]["kernel_bytes"] for kv in kvs]

    fleet_tp1_s: List[float] = []
    # Per fleet refit: the spread of the members' commit beginnings (end -
    # pause) and the members' commit pauses.
    big = {"start_skew_s": [], "pause_median_s": [], "pause_max_s": []}
    small = {"start_skew_s": [], "pause_median_s": [], "pause_max_s": []}

    def record(out, into) -> None:
        ms = [m for m in out["members"] if m.get("committed") and m.get("commit_unix_seconds")]
        pauses = [m.get("commit_seconds", 0.0) for m in ms]
        starts = [m["commit_unix_seconds"] - m.get("commit_seconds", 0.0) for m in ms]
        into["start_skew_s"].append(max(starts) - min(starts) if starts else 0.0)
        into["pause_median_s"].append(statistics.median(pauses) if pauses else 0.0)
        into["pause_max_s"].append(max(pauses) if pauses else 0.0)

    fleet_tpn_prepare_s: List[float] = []
    fleet_tp1_prepare_s: List[float] = []
    try:
        wait_for(etcd_healthy, "etcd")
        sockets = []
        names = [f"m{i}" for i in range(a.members)]
        if a.tp > 1:
            names += [f"r{i}" for i in range(a.members)]
        if a.small_model_dir:
            names += [f"s{i}" for i in range(a.members)]
        for i, name in enumerate(names):
            sock = f"unix:{work}/{name}.sock"
            logf = open(work / f"{name}.log", "w")
            tp = {"m": [f"--tp-size={a.tp}", f"--tp-rank={i % a.tp}", "--fleet=bench"],
                  "r": ["--fleet=bench-tp1"], "s": ["--fleet=bench-small"]}[name[0]]
            model = a.small_model_dir if name.startswith("s") else a.model_dir
            if name.startswith("m"):
                sockets.append(sock)
            procs.append(subprocess.Popen(
                [a.refitd, f"--model={model}", f"--listen={sock}", *tp,
                 f"--etcd={endpoint}", f"--fleet-member={name}"],
                stdout=subprocess.DEVNULL, stderr=logf))
        for name in names:
            wait_for(lambda name=name: "joined the fleet" in (work / f"{name}.log").read_text(),
                     f"member {name} to join")
        fleet_s, independent_s, skews = [], [], []
        small_skews: List[float] = []
        small_s: List[float] = []
        small_reps_done = 0

        def small_pushes(n: int) -> None:
            for _ in range(n):
                t0 = time.perf_counter()
                r = subprocess.run([a.refitctl, "fleet", "push", a.small_model_dir, *fleet_small,
                                    "--json"], capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    raise RuntimeError(f"fleet push (small) failed: {r.stdout}{r.stderr}")
                out = json.loads(r.stdout)
                small_s.append(time.perf_counter() - t0)
                small_skews.append(out["flip_skew_seconds"])
                record(out, small)

        for rep in range(a.reps):
            if a.small_model_dir:
                # Spread over the reps: the same load as the runs beside them.
                n = small_reps * (rep + 1) // a.reps - small_reps_done
                small_pushes(n)
                small_reps_done += n
            if a.tp > 1:
                t0 = time.perf_counter()
                r = subprocess.run([a.refitctl, "fleet", "push", a.model_dir, *fleet_tp1, "--json"],
                                   capture_output=True, text=True, timeout=600)
                fleet_tp1_s.append(time.perf_counter() - t0)
                if r.returncode != 0:
                    raise RuntimeError(f"fleet push (tp=1) failed: {r.stdout}{r.stderr}")
                fleet_tp1_prepare_s.append(json.loads(r.stdout)["prepare_seconds"])
            t0 = time.perf_counter()
            r = subprocess.run([a.refitctl, "fleet", "push", a.model_dir, *fleet, "--json"],
                               capture_output=True, text=True, timeout=600)
            fleet_s.append(time.perf_counter() - t0)
            if r.returncode != 0:
                raise RuntimeError(f"fleet push failed: {r.stdout}{r.stderr}")
            skews.append(json.loads(r.stdout)["flip_skew_seconds"])
            fleet_tpn_prepare_s.append(json.loads(r.stdout)["prepare_seconds"])
            record(json.loads(r.stdout), big)
            t0 = time.perf_counter()
            pushes = [subprocess.Popen([a.refitctl, f"--addr={s}", "push", a.model_dir],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True) for s in sockets]
            for q in pushes:
                _, err = q.communicate(timeout=600)
                if q.returncode != 0:
                    raise RuntimeError(f"push failed: {err}")
            independent_s.append(time.perf_counter() - t0)
            log(f"rep {rep}: fleet {fleet_s[-1]:.3f} s (skew {skews[-1] * 1e3:.2f} ms, commit "
                f"starts {big['start_skew_s'][-1] * 1e3:.2f} ms apart, copies "
                f"{big['pause_max_s'][-1] * 1e3:.2f} ms at most), "
                f"independent {independent_s[-1]:.3f} s" +
                (f", tp=1 fleet {fleet_tp1_s[-1]:.3f} s" if a.tp > 1 else "") +
                (f", small fleet skew {small_skews[-1] * 1e3:.2f} ms"
                 if a.small_model_dir and small_skews else ""))
        if a.tp > 1:
            kept = statistics.mean(kernel_bytes("bench")) / statistics.mean(kernel_bytes("bench-tp1"))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    total = a.members * model_bytes
    fleet_tp, indep_tp = total / med(fleet_s), total / med(independent_s)
    p50, p99 = percentile(skews, 0.5), percentile(skews, 0.99)
    load = os.getloadavg()[0]
    figures = [
        figure(f"fleet refit of {a.members} daemons (refitctl fleet push), throughput", fleet_tp / 2**20,
               "MiB/s", f"{a.members} independent pushes of the same bytes", indep_tp / 2**20,
               ">= 0.9", met=fleet_tp / indep_tp >= 0.9,
               note=f"medians of {a.reps}, interleaved; {model_bytes / 2**20:.1f} MiB checkpoint "
               f"per member; loopback Unix sockets; load {load:.1f}"),
        figure("fleet flip skew p50 (first to last member's commit)", p50 * 1e3, "ms",
               "target", 10.0, "<= 10 ms", met=p50 <= 0.010, note=f"{a.reps} fleet refits"),
        figure("fleet flip skew p99", p99 * 1e3, "ms", "target", 10.0, "<= 10 ms",
               met=p99 <= 0.010, note=f"{a.reps} fleet refits"),
    ]
    series = {"fleet_s": fleet_s, "independent_s": independent_s, "flip_skew_s": skews,
              "commit_start_skew_s": big["start_skew_s"],
              "commit_pause_median_s": big["pause_median_s"],
              "commit_pause_max_s": big["pause_max_s"],
              "members": a.members, "model_bytes": model_bytes}
    pause = statistics.median(big["pause_median_s"])
    figures += [
        figure("fleet flip skew p50 against the members' commit copy", p50 * 1e3, "ms",
               "members' commit pause (the copy), median", pause * 1e3, "report",
               note=f"{a.reps} fleet refits; the slowest member's copy, median "
               f"{statistics.median(big['pause_max_s']) * 1e3:.2f} ms"),
        figure("fleet commit start skew p50 (first to last member's commit beginning)",
               percentile(big["start_skew_s"], 0.5) * 1e3, "ms",
               "fleet flip skew p50 (commit ends)", p50 * 1e3, "report",
               note=f"p99 {percentile(big['start_skew_s'], 0.99) * 1e3:.2f} ms; the decision reaching "
               f"the members, without their copies; {a.reps} fleet refits"),
    ]
    if a.small_model_dir:
        small_bytes = sum(f.stat().st_size
                          for f in pathlib.Path(a.small_model_dir).glob("*.safetensors"))
        sp50, sp99 = percentile(small_skews, 0.5), percentile(small_skews, 0.99)
        note = (f"{len(small_skews)} fleet refits of a {small_bytes / 2**20:.2f} MiB checkpoint, "
                f"members' commit pause median "
                f"{statistics.median(small['pause_median_s']) * 1e3:.3f} ms, max "
                f"{max(small['pause_max_s']) * 1e3:.3f} ms; load {load:.1f}")
        figures += [
            figure("fleet flip skew p50, small checkpoint: protocol only", sp50 * 1e3, "ms",
                   "target", 10.0, "<= 10 ms", met=sp50 <= 0.010, note=note),
            figure("fleet flip skew p99, small checkpoint: protocol only", sp99 * 1e3, "ms",
                   "target", 10.0, "<= 10 ms", met=sp99 <= 0.010, note=note),
        ]
        series.update({"small_model_bytes": small_bytes, "small_flip_skew_s": small_skews,
                       "small_fleet_s": small_s,
                       "small_commit_start_skew_s": small["start_skew_s"],
                       "small_commit_pause_median_s": small["pause_median_s"],
                       "small_commit_pause_max_s": small["pause_max_s"]})
    if a.tp > 1:
        figures.append(figure(
            f"fleet refit of {a.members} tp={a.tp} ranks, whole checkpoint to each, time",
            med(fleet_s), "s", f"fleet refit of {a.members} tp=1 daemons (the same bytes each)",
            med(fleet_tp1_s), "report",
            note=f"medians of {a.reps}, interleaved; each member is sent "
            f"{model_bytes / 2**20:.1f} MiB "
            f"and keeps ~{kept * 100:.0f}% of it (~{kept * model_bytes / 2**20:.1f} MiB, from its "
            f"FP8 kernel bytes); prepare {med(fleet_tpn_prepare_s):.3f} s vs "
            f"{med(fleet_tp1_prepare_s):.3f} s; load {load:.1f}"))
        series.update({"tp": a.tp, "fleet_tp1_s": fleet_tp1_s, "kept_fraction": kept,
                       "fleet_tpn_prepare_s": fleet_tpn_prepare_s,
                       "fleet_tp1_prepare_s": fleet_tp1_prepare_s})
    json.dump({"figures": figures, "series": series}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
