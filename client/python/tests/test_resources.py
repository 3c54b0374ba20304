"""A long-running refitd gives back what each local client took: after many
rounds of every local path (shared-memory pushes from new regions, private
tensors through a staging region, pinned reads, a coordinated engine
following a commit, a refused region reference, an abandoned refit), the
daemon holds the descriptors, mappings and threads it held after the first
rounds. A descriptor, mapping or thread kept per round shows up dozens of
times over."""

from __future__ import annotations

import os
import re
import time

from refit_client import OutOfRange, RefitClient, attach, shared_tensors
from refit_client import _shm

from conftest import load_state_dict, stepping

ROUNDS = 30


def held(pid: int) -> dict:
    with open(f"/proc/{pid}/maps") as maps:
        mappings = sum(1 for _ in maps)
    with open(f"/proc/{pid}/status") as status:
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1))
    return {
        "descriptors": len(os.listdir(f"/proc/{pid}/fd")),
        "mappings": mappings,
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "rss_kib": rss_kib,
    }


def one_round(address: str, seed: int, weights) -> None:
    sd = weights[seed]
    # A trainer with its weights in a new sealed memfd, and private tensors
    # through the client's staging region; both regions go with the client.
    with RefitClient(address, timeout=30) as c:
        c.push(shared_tensors(sd), lane="shm")
        c.push(weights[5 - seed], lane="shm")
        version = c.status().version
        for info in c.tensors()[:4]:
            c.read_raw(info.name, version=version)
    # A coordinated engine at its safe points while a push commits.
    engine = attach(address, coordinate=True, name="soak")
    try:
        with stepping(lambda: engine.safe_point(timeout=0.05)), \
                RefitClient(address, timeout=30) as c:
            c.push(sd, lane="grpc")
    finally:
        engine.close()
    with attach(address, coordinate=False):
        pass
    with RefitClient(address, timeout=30) as c:
        # A reference past its region: refused, the region released.
        staging = _shm.Staging(4096)
        try:
            lease = _shm.register(c._shm_lane()._stub, (), staging.fd, 4096, "small", address)
            name = "model.norm.weight"
            src = _shm._tensors.to_source(name, sd[name])
            try:
                with c.refit() as r:
                    r._send_region(src, lease, 4096 - 64)
                raise AssertionError("a reference past its region was taken")
            except OutOfRange:
                pass
            lease.release()
        finally:
            staging.close()
        # A refit the trainer gives up on halfway.
        try:
            with c.refit() as r:
                r.send(name, sd[name])
                raise InterruptedError
        except InterruptedError:
            pass


def test_many_rounds_of_local_clients_leave_nothing_behind_in_the_daemon(start_daemon, weights):
    daemon = start_daemon("--engine-quiesce-timeout=10s")
    pid = daemon.proc.pid
    tensors = {2: load_state_dict(weights(2)), 3: load_state_dict(weights(3))}
    # Pools and lazily started threads reach their size in the first rounds.
    for i in range(3):
        one_round(daemon.address, 2 + i % 2, tensors)
    time.sleep(0.5)
    before = held(pid)
    for i in range(ROUNDS):
        one_round(daemon.address, 2 + i % 2, tensors)

    # Leases end as their streams end, a moment after the clients close.
    deadline = time.monotonic() + 20
    while True:
        after = held(pid)
        settled = (
            # gRPC's thread pool may grow under load (each thread a stack
            # and its guard page); one leak per round would be 30 or more.
            after["descriptors"] <= before["descriptors"] + 4
            and after["mappings"] <= before["mappings"] + 20
            and after["threads"] <= before["threads"] + 8
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert settled, f"before {ROUNDS} rounds {before}, after {after}"
    # Heap growth from the allocator's own bookkeeping stays small; every
    # round pushes the 1.2 MiB demo model four times.
    assert after["rss_kib"] - before["rss_kib"] < 32 * 1024, (before, after)
    assert daemon.proc.poll() is None
    assert daemon.log.count("region released") >= 3 * (ROUNDS + 3)
