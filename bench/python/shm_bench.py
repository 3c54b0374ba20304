#!/usr/bin/env python3
"""shm_bench: the shared-memory trainer lane (push(..., lane="shm"),
Chunk.region) against references measured in the same run.

Starts one refitd on a Unix socket serving --model_dir (host memory, FP8
per-tensor) and times, interleaved over --reps repetitions (medians), a full
refit (FP8, commit) of the whole checkpoint pushed by the Python client:

  shm_copy    lane="shm" from ordinary (private) tensors: each is copied once
              into the client's sealed staging memfd, which refitd maps and
              ingests in place
  shm_shared  lane="shm" from tensors already in shared memory
              (share_memory_()): no client copy; torch's /dev/shm files cannot
              be sealed, so refitd maps them under its SIGBUS guard and reads
              them in place
  shm_arena   lane="shm" from refit_client.shared_tensors() (a trainer that
              keeps its weights in the client's sealed memfd): no copy on
              either side but refitd's own staging
  grpc        lane="grpc": the same bytes carried in the Push messages
              (XXH3 per chunk, as push() does by default)
  memcpy      one memcpy of a buffer of the checkpoint's size (numpy copyto,
              one thread), right after every timed push: each lane's ratio
              is against the memcpys beside its own pushes (the machine's
              memory bandwidth drifts during a run)

With --device=cuda:N refitd keeps the kernels on that GPU (it quantizes
there), and one more lane is timed:

  shm_cuda    lane="shm" from CUDA tensors of the client: handed over by CUDA
              IPC handle, read device to device

and, for each lane, the CPU seconds per GiB refitd spent (utime + stime
from /proc) and the client spent (process_time): on a shared machine the
wall-clock ratios follow the load, the CPU per GiB does not.

Pushes alternate the checkpoint and a copy scaled by 0.75, so every commit
changes the bytes and every per-tensor FP8 scale: the daemon's scale hints
(a weight whose scale held over its last two refits is converted during its
amax pass) never apply to these lanes. After them, one more lane:

  shm_same_scales  shared_tensors() of the checkpoint and of its negation,
              alternating: every byte changes, no scale does (a training
              step that moves no weight's largest magnitude, which is what
              most RL steps do to most weights): the scale hints apply, and
              each weight is read once by the quantizer instead of twice Prints {"figures": [...], "series": {...}} on stdout (the
format scripts/bench.sh merges) and the figures on stderr.

    .venv/bin/python bench/python/shm_bench.py --model_dir DIR \\
        --refitd build/bin/refitd --reps 5
    .venv/bin/python bench/python/shm_bench.py --quick     # the 119 MiB model, 2 reps
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from refit_client import RefitClient, shared_tensors  # noqa: E402
from bench_figures import figure  # noqa: E402


def start_refitd(refitd: str, model_dir: str, sock: str, log_path: str,
                 device: str, flags: Sequence[str] = ()) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen([refitd, f"--model={model_dir}", f"--listen=unix:{sock}",
                             f"--device={device}", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None

    def drain() -> None:
        for line in proc.stderr:
            log.write(line)

    for line in proc.stderr:
        log.write(line)
        if "first version loaded; ready" in line:
            threading.Thread(target=drain, daemon=True).start()
            return proc
    raise RuntimeError(f"refitd exited before it was ready (see {log_path})")


def process_cpu(pid: int) -> float:
    """utime + stime of `pid`, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(model_dir: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for f in sorted(pathlib.Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", default="")
    parser.add_argument("--refitd", default=str(REPO / "build" / "bin" / "refitd"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="2 repetitions; the 119 MiB model when --model_dir is not given")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--device", default="cpu", help="refitd's --device (cpu or cuda:N)")
    parser.add_argument("--daemon_flag", action="append", default=[],
                        help="an extra refitd flag, e.g. --daemon_flag=--host-threads=8 (repeatable)")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 2)
        if not args.model_dir:
            args.model_dir = str(REPO / "bench" / "results" / "tmp" / "model-l4")
    if not args.model_dir:
        args.model_dir = str(REPO / "bench" / "results" / "tmp" / "model-l47")

    work = args.workdir or tempfile.mkdtemp(prefix="rfm-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    sock = f"/tmp/rfm-{os.getpid()}.sock"
    address = f"unix:{sock}"
    weights = load(args.model_dir)
    perturbed = {k: (v * 0.75 if v.is_floating_point() else v) for k, v in weights.items()}
    negated = {k: (-v if v.is_floating_point() else v) for k, v in weights.items()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    shared = [{k: v.clone().share_memory_() for k, v in w.items()} for w in (weights, perturbed)]
    private = [weights, perturbed]
    arenas = [shared_tensors(w) for w in (weights, perturbed)]
    same_scales = [arenas[0], shared_tensors(negated)]
    del negated
    on_gpu = args.device.startswith("cuda")
    cuda = [{k: v.to(args.device) for k, v in w.items()} for w in (weights, perturbed)] if on_gpu else []
    kinds = ("shm_copy", "grpc", "shm_shared", "shm_arena") + (("shm_cuda",) if on_gpu else ())

    series: Dict[str, List[float]] = {k: [] for k in (
        "shm_copy_s", "shm_shared_s", "shm_arena_s", "shm_cuda_s", "grpc_s", "memcpy_s",
        "shm_copy_receive_s", "grpc_receive_s", "shm_copy_daemon_cpu_s",
        "shm_shared_daemon_cpu_s", "shm_arena_daemon_cpu_s", "grpc_daemon_cpu_s",
        "shm_copy_client_cpu_s", "shm_shared_client_cpu_s", "shm_arena_client_cpu_s",
        "grpc_client_cpu_s", "shm_cuda_daemon_cpu_s", "shm_cuda_client_cpu_s",
        "shm_same_scales_s", "shm_same_scales_daemon_cpu_s", "memcpy_same_scales_s")}
    scales_reused: List[int] = []
    proc = start_refitd(args.refitd, args.model_dir, sock, f"{work}/refitd-shm.log", args.device,
                        args.daemon_flag)
    first_register_s = 0.0
    try:
        client = RefitClient(address, timeout=600)
        # Warm-up: registers the staging region and the shared storages (once
        # per client; later pushes reuse them) and faults every page in.
        start = time.perf_counter()
        client.push(shared[1], lane="shm")
        first_register_s = time.perf_counter() - start
        client.push(shared[0], lane="shm")
        client.push(private[1], lane="shm")
        client.push(arenas[1], lane="shm")
        client.push(arenas[0], lane="shm")
        client.push(private[0], lane="grpc")
        if on_gpu:
            client.push(cuda[1], lane="shm")
        src = np.ones(total, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        k = 0
        for rep in range(args.reps):
            # The lane order rotates every repetition, so that no lane
            # always runs right after the same other one (and every lane
            # pushes both weight sets).
            for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
                w = {"shm_shared": shared, "shm_arena": arenas, "shm_cuda": cuda}.get(kind, private)[k % 2]
                k += 1
                daemon_cpu = process_cpu(proc.pid)
                client_cpu = time.process_time()
                start = time.perf_counter()
                r = client.push(w, lane="grpc" if kind == "grpc" else "shm")
                series[f"{kind}_s"].append(time.perf_counter() - start)
                series[f"{kind}_daemon_cpu_s"].append(process_cpu(proc.pid) - daemon_cpu)
                series[f"{kind}_client_cpu_s"].append(time.process_time() - client_cpu)
                for phase in ("receive", "quantize", "finalize", "commit"):
                    series.setdefault(f"{kind}_{phase}_phase_s", []).append(
                        getattr(r.timings, f"{phase}_seconds"))
                if kind == "shm_copy":
                    series["shm_copy_receive_s"].append(r.timings.receive_seconds)
                if kind == "grpc":
                    series["grpc_receive_s"].append(r.timings.receive_seconds)
                # The reference, right after each push: the machine's memory
                # bandwidth drifts, so every lane is compared with memcpys
                # taken beside its own pushes.
                start = time.perf_counter()
                np.copyto(dst, src)
                series.setdefault(f"{kind}_memcpy_s", []).append(time.perf_counter() - start)
                series["memcpy_s"].append(series[f"{kind}_memcpy_s"][-1])
        # The same-scales lane, in a block of its own (interleaved with the
        # lanes above, whose scales change every push, no hint would hold):
        # two pushes make every scale stable, then each push is timed.
        for w in same_scales:
            client.push(w, lane="shm")
        for rep in range(2 * args.reps):
            daemon_cpu = process_cpu(proc.pid)
            start = time.perf_counter()
            r = client.push(same_scales[rep % 2], lane="shm")
            scales_reused.append(r.scales_reused)
            series["shm_same_scales_s"].append(time.perf_counter() - start)
            series["shm_same_scales_daemon_cpu_s"].append(process_cpu(proc.pid) - daemon_cpu)
            start = time.perf_counter()
            np.copyto(dst, src)
            series["memcpy_same_scales_s"].append(time.perf_counter() - start)
        copied_shared = client._shm.last_copied_bytes if client._shm else -1
        cuda_fallback = client.cuda_ipc_fallback_reason
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        try:
            os.unlink(sock)
        except OSError:
            pass

    med = {k: statistics.median(v) if v else 0.0 for k, v in series.items()}
    mib = total / (1 << 20)
    gib = total / (1 << 30)

    def gbps(seconds: float) -> float:
        return total / seconds / 1e9 if seconds else 0.0

    # Each lane's reference: the memcpys taken right after its own pushes.
    MEMCPY = "memcpy of the same bytes (one thread), right after each push"
    label = f"{mib:.0f} MiB bf16" + (f", store on {args.device}" if on_gpu else "")
    figures = [
        figure(f"shm lane push, full refit (FP8 per-tensor, commit), private tensors, {label}",
               gbps(med["shm_copy_s"]), "GB/s", "gRPC Push of the same tensors (Python client)",
               gbps(med["grpc_s"]), ">= 3",
               "one client copy into a sealed memfd, mapped by refitd"),
        figure(f"shm lane push, full refit (FP8 per-tensor, commit), private tensors, {label}",
               gbps(med["shm_copy_s"]), "GB/s", MEMCPY,
               gbps(med["shm_copy_memcpy_s"]), ">= 0.5"),
        figure(f"shm lane push, full refit, tensors in shared memory (share_memory_), {label}",
               gbps(med["shm_shared_s"]), "GB/s", "gRPC Push of the same tensors (Python client)",
               gbps(med["grpc_s"]), ">= 3",
               f"no client copy ({copied_shared} bytes copied); refitd maps them under its "
               "SIGBUS guard"),
        figure(f"shm lane push, full refit, tensors in shared memory (share_memory_), {label}",
               gbps(med["shm_shared_s"]), "GB/s", MEMCPY,
               gbps(med["shm_shared_memcpy_s"]), ">= 0.5"),
        figure(f"shm lane push, full refit, tensors from shared_tensors() (sealed memfd), {label}",
               gbps(med["shm_arena_s"]), "GB/s", "gRPC Push of the same tensors (Python client)",
               gbps(med["grpc_s"]), ">= 3", "no client copy; refitd maps the memfd"),
        figure(f"shm lane push, full refit, tensors from shared_tensors() (sealed memfd), {label}",
               gbps(med["shm_arena_s"]), "GB/s", MEMCPY,
               gbps(med["shm_arena_memcpy_s"]), ">= 0.5"),
    ]
    if on_gpu:
        figures += [
            figure(f"shm lane push, full refit into {args.device}, CUDA tensors by IPC handle, {label}",
                   gbps(med["shm_cuda_s"]), "GB/s", "gRPC Push of the same tensors (Python client)",
                   gbps(med["grpc_s"]), ">= 3",
                   f"device to device; fallback reason: {cuda_fallback}"),
            figure(f"shm lane push, full refit into {args.device}, CUDA tensors by IPC handle, {label}",
                   gbps(med["shm_cuda_s"]), "GB/s", MEMCPY,
                   gbps(med["shm_cuda_memcpy_s"]), ">= 0.5"),
        ]
    figures += [
        figure(f"shm lane push, full refit, shared_tensors(), every scale as in the push before, {label}",
               gbps(med["shm_same_scales_s"]), "GB/s", MEMCPY,
               gbps(med["memcpy_same_scales_s"]), ">= 0.5",
               f"weights read once by the quantizer per push: {min(scales_reused, default=0)}-"
               f"{max(scales_reused, default=0)}"
               + ("" if not on_gpu else " (the host quantizer's hints; a GPU store quantizes on the device)")),
        figure(f"shm lane push, full refit, shared_tensors(), every scale as in the push before, {label}",
               gbps(med["shm_same_scales_s"]), "GB/s", "gRPC Push of the same tensors (Python client)",
               gbps(med["grpc_s"]), ">= 3"),
        figure("refitd CPU per GiB, shm lane push (shared_tensors(), every scale as the push before)",
               med["shm_same_scales_daemon_cpu_s"] / gib, "CPU s/GiB",
               "refitd CPU per GiB, shm lane push (shared_tensors(), every scale changed)",
               med["shm_arena_daemon_cpu_s"] / gib, ""),
        figure("refitd CPU per GiB, shm lane push (shared_tensors(), mapped)",
               med["shm_arena_daemon_cpu_s"] / gib, "CPU s/GiB", "refitd CPU per GiB, gRPC Push",
               med["grpc_daemon_cpu_s"] / gib, ""),
        figure("refitd CPU per GiB, shm lane push (private tensors, mapped staging region)",
               med["shm_copy_daemon_cpu_s"] / gib, "CPU s/GiB", "refitd CPU per GiB, gRPC Push",
               med["grpc_daemon_cpu_s"] / gib, ""),
        figure("refitd CPU per GiB, shm lane push (tensors in shared memory, guarded mapping)",
               med["shm_shared_daemon_cpu_s"] / gib, "CPU s/GiB", "refitd CPU per GiB, gRPC Push",
               med["grpc_daemon_cpu_s"] / gib, ""),
        figure("client CPU per GiB, shm lane push (private tensors: one copy)",
               med["shm_copy_client_cpu_s"] / gib, "CPU s/GiB", "client CPU per GiB, gRPC Push",
               med["grpc_client_cpu_s"] / gib, ""),
        figure("client CPU per GiB, shm lane push (tensors in shared memory)",
               med["shm_shared_client_cpu_s"] / gib, "CPU s/GiB", "client CPU per GiB, gRPC Push",
               med["grpc_client_cpu_s"] / gib, ""),
        figure("first shm push of a client (registers every shared storage and the staging region)",
               first_register_s, "s", "a later shm push of the same tensors",
               med["shm_shared_s"], ""),
    ]
    for f in figures:
        ratio = "n/a" if f["ratio"] is None else f"{f['ratio']:.3f}"
        print(f"{f['name']}: {f['value']:.3f} {f['unit']} vs {f['reference_name']} "
              f"{f['reference_value']:.3f} -> {ratio} (target {f['target']}, met {f['met']})",
              file=sys.stderr)
    print(json.dumps({"figures": figures, "series": series, "bytes": total,
                      "load": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
