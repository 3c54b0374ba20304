#!/usr/bin/env python3
"""push_bench: the Python client's Push against the C++ client's, same daemon,
same bytes, interleaved in one run.

Starts one refitd (--quant per-tensor, as refit_e2e_bench's refitd A) on a
Unix socket, loads the checkpoint directory (made by refit_make_fixture) into
this process, and runs, in a rotating order, every repetition:

  cpp_fixed  the C++ client library's RefitClient::Push of the same tensors
           held in the memory of a long-lived `refit_e2e_bench
           --serve_pushes_to` child (its defaults: 32 MiB buckets and chunks,
           XXH3 checksums), with glibc's mmap threshold fixed at 32 MiB
           (GLIBC_TUNABLES, FIXED_MALLOC below): its fastest configuration
           here, the reference of the headline figure
  cpp_mem  the same child with glibc's default (dynamic) thresholds: its
           32 MiB message buffers are then mapped and unmapped per message
           and page-faulted in again (~390k faults per push of 1 GiB)
  cpp_mem_b4  the same C++ pusher with 4 MiB buckets and chunks, the
           Python client's default sizes (the like-for-like messages)
  cpp      `refitctl push DIR`, timed whole: process start, reading the
           page-cached files (mmap), the push, the commit
  py       RefitClient.push of the same tensors held in this process's
           memory (a trainer's weights), refit_client's defaults but for
           the lane: every Python push here is lane="grpc" (on this Unix
           socket the default would be the shared-memory lane, which
           shm_bench.py measures)
  py_mmap  the same from np.memmap views of the same files (what refitctl
           reads)
  py_c4_b16  as py with 4 MiB chunks in 16 MiB buckets (the package's
           default before it was measured here)
  py_32    as py with the C++ client's sizes: 32 MiB chunks and buckets
  py_wire  a prototype, not the package: the same messages encoded by hand
           (wire_messages below) and sent with no serializer, default sizes
  py_cC_bB any other chunk / bucket size in MiB, py_wire_32 the prototype at
           32 MiB (not in the default list)

and reports medians as ratios against cpp_mem and cpp, plus CPU seconds per
GiB of the sender (this process: getrusage(RUSAGE_SELF), every thread; the
children: their own getrusage / RUSAGE_CHILDREN) and of refitd
(/proc/PID/stat). With --breakdown it also times, without sending, the
Python client's steps per byte (copy out of the array, XXH3, the protobuf
field, serialization).

Prints {"figures": [...], "series": {...}} on stdout, the format
scripts/bench.sh merges into bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import refit_client
from refit_client import _client as rc_client  # defaults, for the figure names
from refit_client import _tensors
from refit_client._proto import refit_pb2 as pb
from bench_figures import figure

# The C++ pusher's glibc settings for cpp_fixed: buffers of up to 32 MiB come
# from the heap and stay there, whatever the process's allocation history.
FIXED_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
MIB = float(1 << 20)
GIB = float(1 << 30)
READY_LINE = "first version loaded; ready"
_DTYPES = {"BF16": (np.uint16, "bf16"), "F16": (np.float16, "fp16"), "F32": (np.float32, "fp32")}


def log(msg: str) -> None:
    print(f"push_bench: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the model

def safetensors_files(model_dir: pathlib.Path) -> List[pathlib.Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"push_bench: no *.safetensors under {model_dir}")
    return files


def load_model(model_dir: pathlib.Path, in_memory: bool) -> List[Tuple[str, np.ndarray, str]]:
    """(name, array, dtype) for every tensor, in file order: np.memmap views
    of the files, or (in_memory) copies in this process's anonymous memory,
    pre-faulted."""
    out = []
    for path in safetensors_files(model_dir):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        base = 8 + n
        for name, t in header.items():
            if name == "__metadata__":
                continue
            np_dtype, dtype = _DTYPES[t["dtype"]]
            begin, end = t["data_offsets"]
            arr = mm[base + begin : base + end].view(np_dtype).reshape(t["shape"])
            if in_memory:
                arr = np.array(arr, copy=True)
            out.append((name, arr, dtype))
    return out


def model_bytes(tensors: Sequence[Tuple[str, np.ndarray, str]]) -> int:
    return sum(int(a.nbytes) for _, a, _ in tensors)


# ------------------------------------------------------------------- refitd

class Daemon:
    """refitd as a child; its stderr goes to a log file that a thread also
    scans, so startup is waited on as an event (the ready line)."""

    def __init__(self, args: List[str], log_path: pathlib.Path) -> None:
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._log_path = log_path
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        with open(self._log_path, "w") as out:
            for line in self.proc.stderr:
                out.write(line)
                out.flush()
                if READY_LINE in line:
                    self._ready.set()
        self._ended.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or self._ended.is_set():
            raise SystemExit(f"push_bench: refitd not ready within {timeout}s; see {self._log_path}")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # utime and stime: fields 14 and 15 of stat, 12 and 13 after the name.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def self_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


# -------------------------------------------------------------------- runs

def run_cpp(refitctl: str, address: str, model_dir: pathlib.Path) -> Tuple[float, float, dict]:
    """`refitctl push DIR`, timed whole: (wall seconds, its CPU seconds, its
    JSON result). Its CPU is the growth of RUSAGE_CHILDREN over the call
    (refitd, the other child, is not reaped until the end)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([refitctl, f"--addr={address}", "--json", "push", str(model_dir),
                           "--label=push_bench refitctl"],
                          stdin=subprocess.DEVNULL, capture_output=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"push_bench: refitctl push exited {proc.returncode}: "
                         f"{proc.stderr.decode()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(proc.stdout)


class CppPusher:
    """refit_e2e_bench --serve_pushes_to: pushes its in-memory copy of the
    model once per line written to it and answers a JSON line."""

    def __init__(self, binary: str, model_dir: pathlib.Path, address: str,
                 chunk_bytes: Optional[int] = None, tunables: Optional[str] = None) -> None:
        args = [binary, f"--model_dir={model_dir}", f"--serve_pushes_to={address}"]
        if chunk_bytes is not None:
            args.append(f"--chunk_bytes={chunk_bytes}")
        env = dict(os.environ)
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        self.proc = subprocess.Popen(args, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.bytes = int(self._answer()["bytes"])  # the model is loaded

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"push_bench: {self.proc.args[0]} exited {self.proc.wait()}")
        return json.loads(line)

    def push(self) -> Tuple[float, float, dict]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("push\n")
        self.proc.stdin.flush()
        a = self._answer()
        return float(a["seconds"]), float(a["cpu_seconds"]), a

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_py(client: refit_client.RefitClient, tensors, **options) -> Tuple[float, float, object]:
    options.setdefault("lane", "grpc")  # the gRPC client, like the C++ one
    c0 = self_cpu()
    t0 = time.monotonic()
    result = client.push(tensors, label="push_bench python", **options)
    wall = time.monotonic() - t0
    return wall, self_cpu() - c0, result


# ------------------------------------------- hand-encoded wire prototype

def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_PB_DTYPES = {"bf16": pb.DTYPE_BF16, "fp16": pb.DTYPE_F16, "fp32": pb.DTYPE_F32}


def wire_messages(tensors, chunk_bytes: int, bucket_bytes: int, checksums: bool = True):
    """PushRequest{chunks} messages as wire bytes, encoded by hand: each is
    one b"".join of small headers and memoryviews of the arrays, so the
    tensor bytes are copied once (into the message) instead of
    tobytes() + the protobuf field + upb's serialization. The same messages
    RefitClient.push sends (field numbers of refit.proto's Chunk, Chunks,
    PushRequest)."""
    import xxhash

    parts: List[object] = []
    payload = 0
    fill = 0

    def message() -> bytes:
        return b"".join([b"\x12", _varint(payload), *parts])

    for name, arr, dtype in tensors:
        flat = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        item = arr.itemsize
        shape = b"".join(_varint(int(d)) for d in arr.shape)
        head = (b"\x0a" + _varint(len(name.encode())) + name.encode()
                + b"\x10" + _varint(_PB_DTYPES[dtype])
                + b"\x1a" + _varint(len(shape)) + shape)
        cap = max(chunk_bytes // item, 1) * item
        off, nbytes = 0, flat.nbytes
        while True:
            n = min(nbytes - off, cap, max(bucket_bytes - fill, item))
            n -= n % item
            data = flat[off:off + n]
            prefix = head + (b"\x20" + _varint(off) if off else b"") + b"\x2a" + _varint(n)
            tail = b"\x30" + _varint(xxhash.xxh3_64_intdigest(data)) if checksums else b""
            size = len(prefix) + n + len(tail)
            parts += [b"\x0a" + _varint(size), prefix, data, tail]
            payload += 1 + len(_varint(size)) + size
            fill += n
            off += n
            if fill >= bucket_bytes:
                yield message()
                parts, payload, fill = [], 0, 0
            if off >= nbytes:
                break
    if parts:
        yield message()


def run_wire(client: refit_client.RefitClient, tensors, chunk_bytes: int,
             bucket_bytes: int) -> Tuple[float, float, object]:
    """A Push whose requests are wire_messages(), sent on the client's
    channel with no serializer (grpcio passes bytes through). Messages are
    made in gRPC's request-consuming thread, one ahead of the send."""
    push = client._channel.stream_unary("/refit.v1.RefitService/Push",
                                        request_serializer=None,
                                        response_deserializer=pb.PushResponse.FromString)
    options = rc_client._options(False, None, "push_bench wire", "reject", False)
    begin = pb.PushRequest(begin=pb.Begin(model_group="", options=options)).SerializeToString()
    end = pb.PushRequest(end=pb.End()).SerializeToString()

    def requests():
        yield begin
        yield from wire_messages(tensors, chunk_bytes, bucket_bytes)
        yield end

    c0 = self_cpu()
    t0 = time.monotonic()
    response = push(requests(), metadata=client._metadata)
    wall = time.monotonic() - t0
    if response.result.state != pb.REFIT_STATE_COMMITTED:
        raise SystemExit(f"push_bench: wire push ended {response.result.state}")
    return wall, self_cpu() - c0, response


# --------------------------------------------------------------- breakdown

def breakdown(tensors, chunk_bytes: int, bucket_bytes: int, reps: int) -> Dict[str, float]:
    """Seconds per GiB of each step the client does per message, measured
    alone (no gRPC), over the whole model: what a send costs before gRPC."""
    import xxhash

    steps = {"copy_out_tobytes": 0.0, "xxh3": 0.0, "proto_field_assign": 0.0,
             "serialize": 0.0}
    total = 0
    runs: Dict[str, List[float]] = {k: [] for k in steps}
    for _ in range(reps):
        acc = dict.fromkeys(steps, 0.0)
        total = 0
        bucket = pb.PushRequest()
        fill = 0
        for name, arr, dtype in tensors:
            src = _tensors.to_source(name, arr, dtype)
            off = 0
            while off < src.nbytes:
                n = min(src.nbytes - off, chunk_bytes, max(bucket_bytes - fill, src.itemsize))
                t = time.perf_counter()
                data = src.read(off, n)
                t1 = time.perf_counter()
                h = xxhash.xxh3_64_intdigest(data)
                t2 = time.perf_counter()
                c = bucket.chunks.chunks.add()
                c.tensor_name = name
                c.byte_offset = off
                c.data = data
                c.xxh3 = h
                t3 = time.perf_counter()
                acc["copy_out_tobytes"] += t1 - t
                acc["xxh3"] += t2 - t1
                acc["proto_field_assign"] += t3 - t2
                off += n
                fill += n
                if fill >= bucket_bytes:
                    t = time.perf_counter()
                    wire = bucket.SerializeToString()
                    acc["serialize"] += time.perf_counter() - t
                    total += len(wire)
                    bucket, fill = pb.PushRequest(), 0
        if fill:
            t = time.perf_counter()
            total += len(bucket.SerializeToString())
            acc["serialize"] += time.perf_counter() - t
        gib = model_bytes(tensors) / GIB
        for k in steps:
            runs[k].append(acc[k] / gib)
    return {k: statistics.median(v) for k, v in runs.items()}


# -------------------------------------------------------------------- main

def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", required=True, type=pathlib.Path)
    p.add_argument("--refitd", default="build-bench/bin/refitd")
    p.add_argument("--refitctl", default="build-bench/bin/refitctl")
    p.add_argument("--e2e_bench", default="build-bench/bench/refit_e2e_bench",
                   help="refit_e2e_bench, the C++ client library's pusher (--serve_pushes_to)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workdir", type=pathlib.Path, default=None,
                   help="socket and refitd log (default: a fresh dir under /tmp)")
    p.add_argument("--variants", default="cpp_fixed,cpp_mem,cpp_mem_b4,cpp,py,py_mmap,py_c4_b16,py_32,py_wire")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the client's per-message steps without gRPC")
    p.add_argument("--startup_timeout_s", type=float, default=180.0)
    a = p.parse_args(argv)

    workdir = a.workdir or pathlib.Path(tempfile.mkdtemp(prefix="refit-pybench-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    sock = workdir / "refitd.sock"
    address = f"unix:{sock}"
    daemon = Daemon([a.refitd, f"--model={a.model_dir}", f"--listen={address}",
                     "--quant=per-tensor", f"--max-chunk-bytes={64 << 20}"],
                    workdir / "refitd-py.log")
    pushers: List[CppPusher] = []
    try:
        log(f"loading {a.model_dir}")
        in_memory = load_model(a.model_dir, in_memory=True)
        mapped = load_model(a.model_dir, in_memory=False)
        nbytes = model_bytes(in_memory)
        gib = nbytes / GIB
        daemon.wait_ready(a.startup_timeout_s)
        order = [v for v in a.variants.split(",") if v]
        pushers.append(CppPusher(a.e2e_bench, a.model_dir, address, tunables=FIXED_MALLOC))
        pushers.append(CppPusher(a.e2e_bench, a.model_dir, address))
        if "cpp_mem_b4" in order:
            pushers.append(CppPusher(a.e2e_bench, a.model_dir, address, 4 << 20))
        for pusher in pushers:
            if pusher.bytes != nbytes:
                raise SystemExit(f"push_bench: a C++ pusher holds {pusher.bytes} bytes, "
                                 f"not {nbytes}")
        client = refit_client.RefitClient(address, timeout=60.0)
        client.wait_until_ready(timeout=a.startup_timeout_s)

        big = 32 << 20
        runners = {
            "cpp_fixed": pushers[0].push,
            "cpp_mem": pushers[1].push,
            "cpp_mem_b4": pushers[-1].push,
            "cpp": lambda: run_cpp(a.refitctl, address, a.model_dir),
            "py": lambda: run_py(client, in_memory),
            "py_mmap": lambda: run_py(client, mapped),
            "py_32": lambda: run_py(client, in_memory, chunk_bytes=big, bucket_bytes=big),
            "py_wire": lambda: run_wire(client, in_memory, rc_client.DEFAULT_CHUNK_BYTES,
                                        rc_client.DEFAULT_BUCKET_BYTES),
            "py_wire_32": lambda: run_wire(client, in_memory, big, big),
        }
        for k in order:  # py_cC_bB: chunks of C MiB, buckets of B MiB (the tuning runs)
            m = re.fullmatch(r"py_c(\d+)_b(\d+)", k)
            if m:
                runners[k] = (lambda c, b: lambda: run_py(client, in_memory, chunk_bytes=c << 20,
                                                          bucket_bytes=b << 20))(
                    int(m.group(1)), int(m.group(2)))
            elif k not in runners:
                raise SystemExit(f"push_bench: unknown variant {k}")
        if not {"cpp_fixed", "cpp_mem", "cpp"} <= set(order):
            raise SystemExit("push_bench: the cpp_fixed, cpp_mem and cpp references are required")
        log(f"{nbytes} bytes, {len(in_memory)} tensors, {a.reps} repetitions of {order}")
        for k in order:  # warm-up, unmeasured: connections, first-touch in refitd
            runners[k]()
        wall: Dict[str, List[float]] = {k: [] for k in order}
        cpu: Dict[str, List[float]] = {k: [] for k in order}
        rcpu: Dict[str, List[float]] = {k: [] for k in order}
        cpp_elapsed: List[float] = []
        for r in range(a.reps):
            for i in range(len(order)):
                k = order[(i + r) % len(order)]
                d0 = daemon.cpu_seconds()
                w, c, result = runners[k]()
                rcpu[k].append(daemon.cpu_seconds() - d0)
                wall[k].append(w)
                cpu[k].append(c)
                if k == "cpp":
                    cpp_elapsed.append(float(result.get("elapsed_seconds", 0.0)))
            log(f"repetition {r + 1} done")
        bd = None
        if a.breakdown:
            log("breakdown (no gRPC)")
            bd = {"defaults": breakdown(in_memory, rc_client.DEFAULT_CHUNK_BYTES,
                                        rc_client.DEFAULT_BUCKET_BYTES, 3),
                  "c4_b16": breakdown(in_memory, 4 << 20, 16 << 20, 3),
                  "32mib": breakdown(in_memory, big, big, 3)}
    finally:
        for pusher in pushers:
            pusher.stop()
        daemon.stop()

    med = {k: statistics.median(v) for k, v in wall.items()}
    gbps = {k: nbytes / med[k] / 1e9 for k in med}
    cpu_gib = {k: statistics.median(v) / gib for k, v in cpu.items()}
    rcpu_gib = {k: statistics.median(v) / gib for k, v in rcpu.items()}
    size = f"{round(nbytes / MIB)} MiB bf16"
    ref_fixed = ("C++ client library Push of the same tensors from memory (32 MiB buckets), "
                 "glibc mmap threshold fixed, same refitd")
    ref_mem = ("C++ client library Push of the same tensors from memory (32 MiB buckets), "
               "default glibc, same refitd")
    ref_ctl = "refitctl push of the same files, timed whole"
    defaults = (f"{rc_client.DEFAULT_CHUNK_BYTES >> 20} MiB chunks, "
                f"{rc_client.DEFAULT_BUCKET_BYTES >> 20} MiB buckets")

    def cpu_note(k: str, ref: str = "cpp_fixed") -> str:
        return (f"CPU s/GiB: sender {cpu_gib[k]}, receiver {rcpu_gib[k]}; {ref}: sender "
                f"{cpu_gib[ref]}, receiver {rcpu_gib[ref]}")

    figures = []
    if "py" in gbps:
        figures.append(figure(
            f"Python client push, full refit (FP8 per-tensor, commit, checksums; {defaults}), "
            f"from memory, {size}", gbps["py"], "GB/s", ref_fixed, gbps["cpp_fixed"], ">= 0.8",
            cpu_note("py")))
        figures.append(figure(
            f"Python client push ({defaults}), from memory, {size}", gbps["py"], "GB/s",
            ref_mem, gbps["cpp_mem"], "", cpu_note("py", "cpp_mem")))
        figures.append(figure(
            f"Python client push ({defaults}), from memory, {size}", gbps["py"], "GB/s",
            ref_ctl, gbps["cpp"], "", cpu_note("py", "cpp") + "; refitctl's own elapsed_seconds "
            f"median {statistics.median(cpp_elapsed)} s"))
    if "cpp_mem_b4" in gbps:
        figures.append(figure(
            f"Python client push ({defaults}), from memory, {size}", gbps["py"], "GB/s",
            "C++ client library Push from memory with the same 4 MiB chunks and buckets",
            gbps["cpp_mem_b4"], "", cpu_note("py", "cpp_mem_b4")))
    if "py_mmap" in gbps:
        figures.append(figure(
            f"Python client push from np.memmap of the same files ({defaults}), {size}",
            gbps["py_mmap"], "GB/s", ref_ctl, gbps["cpp"], "", cpu_note("py_mmap", "cpp")))
    if "py_c4_b16" in gbps:
        figures.append(figure(
            f"Python client push with 4 MiB chunks in 16 MiB buckets, from memory, {size}",
            gbps["py_c4_b16"], "GB/s", f"the same client, defaults ({defaults})", gbps["py"], "",
            cpu_note("py_c4_b16", "py")))
    if "py_32" in gbps:
        figures.append(figure(
            f"Python client push with 32 MiB chunks and buckets, from memory, {size}",
            gbps["py_32"], "GB/s", ref_fixed, gbps["cpp_fixed"], "", cpu_note("py_32")))
    for k, sizes in (("py_wire", defaults), ("py_wire_32", "32 MiB chunks and buckets")):
        if k in gbps:
            figures.append(figure(
                f"prototype: Python push with hand-encoded messages, no protobuf serializer "
                f"({sizes}), from memory, {size}", gbps[k], "GB/s", ref_fixed, gbps["cpp_fixed"],
                "", cpu_note(k)))
    if "py" in cpu_gib:
        figures.append(figure(
            f"sender CPU per GiB, Python client push ({defaults})", cpu_gib["py"], "CPU s/GiB",
            "C++ client library Push from memory, glibc mmap threshold fixed",
            cpu_gib["cpp_fixed"], "",
            "user + system time of the sending process over the call, all its threads; "
            f"C++ with default glibc: {cpu_gib['cpp_mem']}; refitctl push: {cpu_gib['cpp']}"))
    series = {"bytes": nbytes, "order": order, "seconds": wall, "gbps": gbps,
              "sender_cpu_s": cpu, "sender_cpu_s_per_gib": cpu_gib,
              "receiver_cpu_s_per_gib": rcpu_gib, "refitctl_elapsed_s": cpp_elapsed,
              "python": sys.version.split()[0],
              "protobuf_impl": __import__("google.protobuf.internal.api_implementation",
                                          fromlist=["Type"]).Type(),
              "grpcio": __import__("grpc").__version__}
    if bd is not None:
        series["client_steps_s_per_gib"] = bd
    json.dump({"figures": figures, "series": series}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
