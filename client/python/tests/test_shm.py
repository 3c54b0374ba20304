"""push() over the shared-memory lane (Chunk.region) against a real refitd:
the same fingerprint as a gRPC push of the same checkpoint, no client copy of
tensors already in shared memory, the refusals (bad offsets, another
caller's region, TCP, a CUDA allocation the daemon cannot open), regions
released when the client goes, and a region truncated mid-refit failing
that refit while the daemon keeps serving. On a GPU (marked gpu): CUDA
tensors go by CUDA IPC handle with no client copy."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from refit_client import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    OutOfRange,
    PermissionDenied,
    RefitClient,
    RefitError,
    ResourceExhausted,
    Unavailable,
    shared_tensors,
)
from refit_client import _shm, _tensors

from conftest import load_state_dict


@pytest.fixture
def seed2(weights):
    return load_state_dict(weights(2))


def metrics(daemon) -> str:
    line = daemon.wait_for_line("metrics at /metrics")
    address = re.search(r"address=(\S+)", line).group(1)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def quantized_bytes(state_dict) -> int:
    """Bytes of the linear layers' weights, which the daemon quantizes."""
    return sum(
        t.numel() * t.element_size() for k, t in state_dict.items() if k.endswith("_proj.weight")
    )


def test_shm_push_commits_the_fingerprint_of_a_grpc_push(client, daemon, seed2):
    over_grpc = client.push(seed2, lane="grpc")
    assert over_grpc.bytes_read_in_place == 0
    client.push({k: v * 0 for k, v in seed2.items()}, lane="grpc", non_finite="vllm")
    result = client.push(seed2, lane="shm", label="shm")
    assert result.version == over_grpc.version + 2
    assert result.fingerprint == over_grpc.fingerprint
    # The daemon quantized the weights straight from the mapped region.
    assert result.bytes_read_in_place == quantized_bytes(seed2)
    # Not in shared memory: copied once into the sealed staging region,
    # which the daemon maps.
    lane = client._shm
    assert lane.last_copied_bytes == sum(t.numel() * t.element_size() for t in seed2.values())
    assert [r.access for r in lane.regions()] == ["mapped"]
    staging = daemon.wait_for_line("region registered", also="name=staging")
    assert "access=mapped" in staging
    assert "pinned=" not in staging  # a host store page-locks nothing
    # On a Unix socket the lane is the default.
    again = client.push(seed2)
    assert again.fingerprint == over_grpc.fingerprint
    assert client.shm_fallback_reason is None


def test_the_result_counts_the_weights_whose_scale_held_and_were_read_once(client, seed2):
    # One per-tensor scale per kernel weight (q/k/v and gate/up are fused).
    weights = sum(1 for t in client.tensors() if t.name.endswith(".weight_scale"))
    assert weights > 0
    # A scale is reused once it held over the group's last two refits (the
    # load counts as one): the first push has one refit behind it, the
    # second only where seed 2 gave a weight the load's scale, the third
    # for every weight.
    first = client.push(seed2, lane="shm")
    second = client.push(seed2, lane="grpc")
    third = client.push(seed2, lane="shm")
    assert first.scales_reused == 0
    assert second.scales_reused < weights
    assert third.scales_reused == weights
    # The bytes do not depend on it.
    assert third.fingerprint == first.fingerprint
    # Every scale changes: none is reused, and the next push of the same
    # weights still has only one refit of history behind it.
    halved = {k: v / 2 if v.is_floating_point() else v for k, v in seed2.items()}
    assert client.push(halved, lane="shm").scales_reused == 0
    assert client.push(halved, lane="shm").scales_reused == 0
    assert client.push(halved, lane="shm").scales_reused == weights


def test_auto_goes_over_grpc_when_the_staging_copy_exceeds_the_limit(daemon, seed2):
    with RefitClient(daemon.address, shm_staging_limit=1 << 10) as c:
        grpc_result = c.push(seed2)
        assert "more than shm_staging_limit 1024" in c.shm_fallback_reason
        assert c._shm.regions() == []
        # Tensors already shared need no staging: auto takes the lane.
        c.shm_fallback_reason = None
        c.push({k: v.clone().share_memory_() for k, v in seed2.items()})
        assert c.shm_fallback_reason is None
        assert {r.access for r in c._shm.regions()} == {"mapped"}
        # An explicit lane="shm" stages whatever it needs.
        assert c.push(seed2, lane="shm").fingerprint == grpc_result.fingerprint


def test_a_descriptor_socket_that_stays_busy_is_unavailable(monkeypatch):
    """The daemon serves a bounded number of descriptor-socket connections
    (and a few per process): a client that finds it busy, or has its
    connection reset, tries again until its timeout and then raises
    Unavailable with the daemon's answer, not a socket error."""
    from refit_client import _fdsocket

    calls = []

    def busy(path, ticket, timeout, fd):
        calls.append(ticket)
        return b"Etoo many attach connections from process 7 at once; retry\n", []

    monkeypatch.setattr(_fdsocket, "_exchange_once", busy)
    with pytest.raises(Unavailable) as e:
        _fdsocket.exchange("/run/refitd/x.sock.fd", "t", 0.2)
    assert "stayed busy for 0.2 s" in str(e.value)
    assert "from process 7" in str(e.value)
    assert len(calls) > 1

    def reset(path, ticket, timeout, fd):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(_fdsocket, "_exchange_once", reset)
    with pytest.raises(Unavailable) as e:
        _fdsocket.exchange("/run/refitd/x.sock.fd", "t", 0.05)
    assert "the connection was reset" in str(e.value)


def test_a_descriptor_socket_with_a_full_backlog_is_retried_until_it_answers(tmp_path):
    """Peers that connect and wait fill the socket's backlog; a connect then
    fails with EAGAIN at once. The client tries again, and is served once
    the backlog drains (Unavailable only after its timeout)."""
    from refit_client import _fdsocket

    path = str(tmp_path / "r.sock.fd")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    fillers = []
    while True:  # fill the backlog
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        fillers.append(c)
    assert fillers
    with pytest.raises(Unavailable) as e:
        _fdsocket.exchange(path, "t", 0.2)
    assert "backlog is full" in str(e.value)

    def serve() -> None:
        time.sleep(0.3)
        for c in fillers:
            c.close()
        while True:
            conn, _ = server.accept()
            with conn:
                if conn.recv(64) == b"t\n":
                    conn.sendall(b"K")
                    return

    thread = threading.Thread(target=serve)
    thread.start()
    reply, fds = _fdsocket.exchange(path, "t", 10.0)
    thread.join(10)
    server.close()
    assert (reply, fds) == (b"K", [])


def test_a_descriptor_the_socket_refused_fails_the_push_promptly_and_nothing_changes(
    client, daemon, seed2, monkeypatch
):
    """The descriptor socket answers with a refusal and the daemon keeps the
    registration waiting (as a daemon at its descriptor limit could): the
    push does not wait for ever, it raises with the socket's answer, and
    the served version stays."""
    import time

    from refit_client import _fdsocket

    monkeypatch.setattr(_fdsocket, "exchange", lambda *a, **k: (b"Ebusy, try later\n", []))
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as e:
        client.push(seed2, lane="shm")
    assert time.monotonic() - start < 20
    assert "the descriptor socket refused the region: Ebusy, try later" in str(e.value)
    assert client.status().version == 1
    monkeypatch.undo()
    assert client.push(seed2, lane="shm").version == 2


def test_a_lease_that_ended_is_registered_again(client, daemon, seed2):
    first = client.push(seed2, lane="shm")
    lease = client._shm.regions()[0]
    lease.release()  # as when the daemon restarted: the region is gone there
    daemon.wait_for_line("region released")
    again = client.push(seed2, lane="shm")
    assert again.fingerprint == first.fingerprint
    assert client._shm.regions()[0].region_id != lease.region_id


def test_a_region_truncated_under_a_push_is_registered_anew_by_the_next(client, daemon, seed2):
    """A shared storage whose file shrank while the daemon read it fails that
    push, and the daemon refuses the region from then on; once the trainer
    has its memory back, the next push registers it again and goes through."""
    expected = client.push(seed2, lane="grpc").fingerprint
    shared = {k: v.clone().share_memory_() for k, v in seed2.items()}
    assert client.push(shared, lane="shm").fingerprint == expected
    name = max(shared, key=lambda k: shared[k].numel())
    storage = shared[name].untyped_storage()
    fd, size = storage._get_shared_fd(), storage.nbytes()
    before = {r.region_id for r in client._shm.regions()}
    # Nothing here touches the storage's memory while its file is short.
    os.ftruncate(fd, 0)
    with pytest.raises(FailedPrecondition, match="was truncated while in use"):
        client.push(shared, lane="shm")
    os.ftruncate(fd, size)
    shared[name].copy_(seed2[name])
    assert client.push(shared, lane="shm").fingerprint == expected
    # Only the truncated storage's region was registered anew.
    assert len({r.region_id for r in client._shm.regions()} - before) == 1


def test_tensors_in_shared_memory_go_without_a_client_copy(client, daemon, seed2):
    expected = client.push(seed2, lane="grpc").fingerprint
    shared = {k: v.clone().share_memory_() for k, v in seed2.items()}
    result = client.push(shared, lane="shm")
    assert result.fingerprint == expected
    assert client._shm.last_copied_bytes == 0
    accesses = {r.access for r in client._shm.regions()}
    # torch's shm files cannot be sealed: mapped under the daemon's SIGBUS
    # guard, and the quantized weights read in place all the same.
    assert accesses == {"mapped"}
    assert result.bytes_read_in_place > 0
    # Registered once: a second push reuses the regions.
    count = len(client._shm.regions())
    client.push(shared, lane="shm")
    assert len(client._shm.regions()) == count


def test_a_storage_pushed_again_is_found_by_address_and_new_storages_by_descriptor(
    client, daemon, seed2, monkeypatch
):
    lookups = []
    real = _shm._shared_storage

    def counting(src):
        lookups.append(src.name)
        return real(src)

    monkeypatch.setattr(_shm, "_shared_storage", counting)
    shared = {k: v.clone().share_memory_() for k, v in seed2.items()}
    first = client.push(shared, lane="shm")
    assert sorted(lookups) == sorted(shared)
    # Pushed again (in place, as a trainer does): every storage is known by
    # its address, no descriptor or fstat is needed, and the new bytes go.
    lookups.clear()
    for t in shared.values():
        t.neg_()
    negated = client.push(shared, lane="shm")
    assert lookups == []
    assert negated.fingerprint != first.fingerprint
    assert client._shm.last_copied_bytes == 0
    # Storages made afresh are looked up, and the daemon reads their bytes,
    # not the old ones' (even where a new storage sits at an old one's
    # address). The old ones, dropped by the trainer, are not kept alive by
    # the client's cache: their registrations end with the next push.
    count = len(client._shm.regions())
    fresh = {k: v.clone().share_memory_() for k, v in seed2.items()}
    del shared, t
    assert client.push(fresh, lane="shm").fingerprint == first.fingerprint
    assert sorted(lookups) == sorted(fresh)
    assert len(client._shm.regions()) == count
    # A lease that ended is not trusted by address: registered again.
    lookups.clear()
    for lease in client._shm.regions():
        lease.release()
    assert client.push(fresh, lane="shm").fingerprint == first.fingerprint
    assert sorted(lookups) == sorted(fresh)


def test_shared_storages_beyond_the_daemons_region_limit_make_room_and_are_not_copied(
    start_daemon, seed2
):
    # Two trainers' worth of weights in shared memory, 21 storages each,
    # pushed in turn to a daemon that lets a caller hold 25 regions: each
    # push drops registrations the other one made (least recently used
    # first, never its own) instead of failing or copying.
    d = start_daemon("--max-regions-per-caller=25")
    with RefitClient(d.address, timeout=30) as client:
        sets = [
            {k: v.clone().share_memory_() for k, v in seed2.items()},
            {k: (v * 1.5).share_memory_() for k, v in seed2.items()},
        ]
        expected = [client.push(w, lane="grpc").fingerprint for w in sets]
        for round in range(4):
            which = round % 2
            result = client.push(sets[which], lane="shm")
            assert result.fingerprint == expected[which], round
            assert client._shm.last_copied_bytes == 0, round
            assert len(client._shm.regions()) <= 25
        # Every storage of the last push is still registered and reused.
        count = len(client._shm.regions())
        assert client.push(sets[1], lane="shm").fingerprint == expected[1]
        assert len(client._shm.regions()) == count
    assert d.proc.poll() is None


def test_one_push_in_more_shared_storages_than_the_limit_says_so_and_changes_nothing(
    start_daemon, seed2
):
    d = start_daemon("--max-regions-per-caller=10")
    with RefitClient(d.address, timeout=30) as client:
        before = client.status()
        shared = {k: v.clone().share_memory_() for k, v in seed2.items()}  # 21 storages
        with pytest.raises(ResourceExhausted) as info:
            client.push(shared, lane="shm")
        assert "--max-regions-per-caller 10" in info.value.message
        assert "shared_tensors()" in info.value.message
        after = client.status()
        assert (after.version, after.fingerprint) == (before.version, before.fingerprint)
        # One region for all of them goes through.
        assert client.push(shared_tensors(seed2), lane="shm").version == before.version + 1
    assert d.proc.poll() is None


def test_shared_tensors_are_one_sealed_mapped_region_and_go_without_any_copy(
    client, daemon, seed2
):
    expected = client.push(seed2, lane="grpc").fingerprint
    shared = shared_tensors(seed2)
    assert all(torch.equal(shared[k], v) for k, v in seed2.items())
    result = client.push(shared, lane="shm")
    assert result.fingerprint == expected
    assert client._shm.last_copied_bytes == 0
    assert [r.access for r in client._shm.regions()] == ["mapped"]
    assert result.bytes_read_in_place == quantized_bytes(seed2)
    # The trainer updates its weights in place; the next push sends them.
    for k, v in shared.items():
        v.mul_(0)
    zero = client.push(shared, lane="shm", non_finite="vllm")
    assert zero.fingerprint != expected
    assert len(client._shm.regions()) == 1


def test_shared_tensors_memory_lives_while_anything_shares_it(daemon, seed2):
    """Parameters made from shared_tensors() (the way to keep a trainer's
    weights there) outlive the returned dict: the memory stays mapped and
    registered, and a push sends their bytes, in place."""
    import gc

    with RefitClient(daemon.address) as c:
        expected = c.push({k: v.clone() for k, v in seed2.items()}, lane="grpc").fingerprint
    params = {
        k: torch.nn.Parameter(v, requires_grad=False) for k, v in shared_tensors(seed2).items()
    }
    gc.collect()  # the dict and its tensors are gone; the parameters share their memory
    with RefitClient(daemon.address) as c:  # a fresh client maps a staging region of its own
        result = c.push(params, lane="shm")
        assert c._shm.last_copied_bytes == 0
        assert [r.access for r in c._shm.regions()] == ["mapped"]
    assert result.fingerprint == expected
    assert all(torch.equal(params[k], v) for k, v in seed2.items())


def test_storages_shared_without_a_descriptor_are_copied_and_never_moved(
    client, seed2, tmp_path
):
    """Tensors in shared memory the lane cannot register as they are (the
    file_system sharing strategy, torch.from_file mappings) are copied: their
    storages stay where they are, so other processes sharing them keep
    seeing the trainer's updates."""
    import torch.multiprocessing as mp

    expected = client.push({k: v.clone() for k, v in seed2.items()}, lane="grpc").fingerprint
    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        shared = {k: v.clone().share_memory_() for k, v in seed2.items()}
    finally:
        mp.set_sharing_strategy(strategy)
    where = {k: v.untyped_storage().data_ptr() for k, v in shared.items()}
    assert client.push(shared, lane="auto").fingerprint == expected
    assert client._shm.last_copied_bytes > 0
    assert {k: v.untyped_storage().data_ptr() for k, v in shared.items()} == where

    path = tmp_path / "weights.bin"
    path.write_bytes(b"".join(v.contiguous().view(torch.uint8).numpy().tobytes()
                              for v in seed2.values()))
    mapped, offset = {}, 0
    whole = torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
    for k, v in seed2.items():
        n = v.numel() * v.element_size()
        mapped[k] = whole[offset : offset + n].view(v.dtype).view(v.shape)
        offset += n
    assert client.push(mapped, lane="auto").fingerprint == expected


def test_an_empty_private_tensor_has_a_staging_region_to_reference(client):
    lane = client._shm_lane()
    with lane.lock:
        try:
            (planned,) = lane.plan([_tensors.to_source("empty", torch.empty(0, dtype=torch.bfloat16))])
        finally:
            lane.end_push()
    src, lease, offset, copy = planned
    assert lease is not None and lease.alive() and copy and src.nbytes == 0


def test_a_generator_push_falls_back_to_grpc_with_every_tensor(daemon, seed2):
    """push(model.named_parameters()) on the auto lane: when the lane is
    refused (here its staging copy is over the limit) the gRPC push gets the
    same tensors, not an exhausted iterator."""
    with RefitClient(daemon.address, shm_staging_limit=1 << 10) as c:
        expected = c.push({k: v.clone() for k, v in seed2.items()}, lane="grpc").fingerprint
        result = c.push(((k, v) for k, v in seed2.items()))
        assert "more than shm_staging_limit 1024" in c.shm_fallback_reason
        assert result.fingerprint == expected


def test_pushes_of_the_same_shared_tensors_reuse_their_encoded_chunks(client, seed2):
    """A training loop pushes the same shared tensors at the same places
    every step: the client encodes their chunks once, and the daemon still
    reads the new bytes; chunks of another size are encoded anew."""
    shared = shared_tensors(seed2)
    assert client.push(shared, lane="shm").fingerprint == client.push(seed2, lane="grpc").fingerprint
    cache = client._shm.chunk_cache
    assert len(cache) == len(seed2)
    encoded = {key: id(chunks) for key, chunks in cache.items()}
    # The trainer updates its weights in place; the next push sends them
    # with the chunks encoded for the first one.
    for v in shared.values():
        v.mul_(0.5)
    halved = client.push(shared, lane="shm")
    assert {key: id(chunks) for key, chunks in cache.items()} == encoded
    expected = client.push({k: v.clone() for k, v in shared.items()}, lane="grpc").fingerprint
    assert halved.fingerprint == expected
    # Smaller chunks: encoded anew, the same bytes committed.
    assert client.push(shared, lane="shm", chunk_bytes=4096).fingerprint == expected
    assert len(cache) == 2 * len(seed2)
    assert all(len(cache[key]) == max(1, -(-key[3] // 4096)) for key in cache if key not in encoded)


def test_references_share_messages_and_each_copied_tensor_goes_before_the_next_copy(
    client, seed2
):
    """A message per 64 MiB referenced (a reference costs the same whatever
    its length); a tensor copied into staging is sent before the next copy
    starts, so the daemon ingests while the client copies."""
    total = sum(t.numel() * t.element_size() for t in seed2.values())
    shared_progress = []
    shared = client.push(shared_tensors(seed2), lane="shm", progress=shared_progress.append)
    assert client._shm.last_copied_bytes == 0
    assert shared_progress[-1].messages_sent == -(-total // (64 << 20))
    assert shared_progress[-1].tensors_done == len(seed2)
    copied_progress = []
    copied = client.push(seed2, lane="shm", progress=copied_progress.append)
    assert client._shm.last_copied_bytes == total
    assert copied_progress[-1].messages_sent == len(seed2)
    assert [p.tensors_done for p in copied_progress] == list(range(1, len(seed2) + 1))
    assert copied.fingerprint == shared.fingerprint


def test_moe_experts_are_read_in_place_from_shared_tensors(start_daemon, fixture_root):
    from conftest import MAKE_FIXTURE

    out = fixture_root / "qwen3_moe"
    if not out.exists():
        subprocess.run(
            [str(MAKE_FIXTURE), f"--out={out}", "--seed=4", "--arch=qwen3_moe"],
            check=True, capture_output=True, text=True,
        )
    weights = load_state_dict(out)
    daemon = start_daemon("--model=demo:qwen3_moe")
    with RefitClient(daemon.address, timeout=30) as c:
        expected = c.push(weights, lane="grpc").fingerprint
        result = c.push(shared_tensors(weights), lane="shm")
    assert result.fingerprint == expected
    # Every expert's gate/up/down and the attention projections; the
    # router and the norms are kept in bf16 and copied.
    assert result.bytes_read_in_place == quantized_bytes(weights)
    assert any(".experts." in k for k in weights)


def test_staging_pages_are_allocated_by_the_client_before_it_registers_them():
    """A GPU store's daemon page-locks a region at registration, before the
    client writes its staging, and declines one with pages nobody wrote (they
    would be allocated on its account): staging and shared_tensors() arenas
    are allocated whole, by the client, when they are made."""
    page = os.sysconf("SC_PAGESIZE")
    size = 3 * page + 5
    staging = _shm.Staging(size)
    try:
        st = os.fstat(staging.fd)
        assert st.st_size == size
        # Every page counted (what the daemon looks at first).
        assert st.st_blocks * 512 >= 4 * page
    finally:
        staging.close()


def test_offset_past_the_region_is_out_of_range_and_nothing_changes(client, daemon, seed2):
    before = client.status()
    lane = client._shm_lane()
    staging = _shm.Staging(4096)
    try:
        lease = _shm.register(lane._stub, (), staging.fd, 4096, "small", daemon.address)
        name = "model.norm.weight"
        src = _shm._tensors.to_source(name, seed2[name])
        with pytest.raises(OutOfRange) as info:
            with client.refit() as r:
                r._send_region(src, lease, 4096 - 64)
        assert name in info.value.message
        assert f'region "{lease.region_id}" offset {4096 - 64} length {src.nbytes}' in (
            info.value.message
        )
        assert "reaches past its size 4096" in info.value.message
        lease.release()
    finally:
        staging.close()
    after = client.status()
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)


def test_a_region_that_is_not_shared_memory_is_refused_and_nothing_changes(client, daemon):
    """A descriptor of a file that is not on tmpfs (here procfs; a FUSE or
    network file could make the daemon's reads wait without end) is
    INVALID_ARGUMENT at RegisterRegion, saying what to send."""
    before = client.status()
    lane = client._shm_lane()
    fd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        with pytest.raises(InvalidArgument) as info:
            _shm.register(lane._stub, (), fd, 1, "procfs file", daemon.address)
    finally:
        os.close(fd)
    assert "the descriptor is not shared memory" in info.value.message
    assert "send a memfd or a file in /dev/shm" in info.value.message
    after = client.status()
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)
    # The daemon goes on registering shared memory.
    staging = _shm.Staging(4096)
    try:
        _shm.register(lane._stub, (), staging.fd, 4096, "small", daemon.address).release()
    finally:
        staging.close()


def test_region_of_another_caller_is_permission_denied(start_daemon, tmp_path, seed2):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token trainer alice\nbob-token trainer bob\n")
    daemon = start_daemon(f"--auth-tokens={tokens}")
    with RefitClient(daemon.address, token="alice-token") as alice, RefitClient(
        daemon.address, token="bob-token"
    ) as bob:
        alice.push(seed2, lane="shm")
        lease = alice._shm.regions()[0]
        src = _shm._tensors.to_source("model.norm.weight", seed2["model.norm.weight"])
        with pytest.raises(PermissionDenied) as info:
            with bob.refit() as r:
                r._send_region(src, lease, 0)
        assert "belongs to another caller" in info.value.message


def test_shm_over_tcp_is_refused_and_auto_uses_grpc(start_daemon, seed2):
    daemon = start_daemon(tcp=True)
    with RefitClient(daemon.address) as c:
        with pytest.raises(FailedPrecondition) as info:
            c.push(seed2, lane="shm")
        assert "shared-memory regions need a local Unix socket" in info.value.message
        assert c.push(seed2).version == 2  # auto: gRPC on a TCP address
        with pytest.raises(InvalidArgument):
            c.push(seed2, lane="shm", streams=2)


def test_regions_are_released_when_the_client_closes_or_dies(start_daemon, seed2):
    daemon = start_daemon("--metrics-listen=127.0.0.1:0")
    with RefitClient(daemon.address) as c:
        c.push(seed2, lane="shm")
        assert "refitd_trainer_regions 1\n" in metrics(daemon)
    daemon.wait_for_line("region released")
    assert "refitd_trainer_regions 0\n" in metrics(daemon)

    # A trainer killed with SIGKILL: its lease ends with its connection.
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        from refit_client import RefitClient
        c = RefitClient({daemon.address!r})
        c.push({{"model.norm.weight": torch.ones(128, dtype=torch.bfloat16)}}, lane="shm",
               require_complete=False)
        print("pushed", flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        assert child.stdout.readline().strip() == "pushed"
        assert "refitd_trainer_regions 1\n" in metrics(daemon)
        child.kill()
        child.wait()
        _wait_for_releases(daemon, 2)  # the client's, then the child's
        assert "refitd_trainer_regions 0\n" in metrics(daemon)
    finally:
        if child.poll() is None:
            child.kill()


def _wait_for_releases(daemon, count: int, timeout: float = 30.0) -> None:
    with daemon._cv:
        daemon._cv.wait_for(
            lambda: sum("region released" in l for l in daemon._lines) >= count or daemon._ended,
            timeout,
        )
        got = sum("region released" in l for l in daemon._lines)
    assert got >= count, daemon.log


@pytest.mark.parametrize(
    "store", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]
)
def test_region_truncated_mid_refit_fails_cleanly_and_the_old_version_serves(
    store, request, seed2
):
    # On a GPU store the storage is page-locked and read by DMA, which does
    # not fault where the file shrank: the size check at Prepare catches it.
    if store == "cpu":
        daemon = request.getfixturevalue("daemon")
        client = request.getfixturevalue("client")
    else:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        daemon = request.getfixturevalue("start_daemon")(f"--device={store}")
        client = RefitClient(daemon.address, timeout=60)
        request.addfinalizer(client.close)
    before = client.status()
    shared = {k: v.clone().share_memory_() for k, v in seed2.items()}
    names = list(shared)
    victim = shared[names[-1]]
    fd, _ = victim.untyped_storage()._share_fd_cpu_()
    truncated = []

    def truncate_after_first_message(progress) -> None:
        if not truncated:
            os.ftruncate(fd, 0)  # the trainer's storage shrinks under the refit
            truncated.append(progress)

    with pytest.raises(FailedPrecondition) as info:
        client.push(shared, lane="shm", bucket_bytes=64 << 10, progress=truncate_after_first_message)
    assert truncated
    assert "truncated while in use" in info.value.message
    assert names[-1] in info.value.message
    after = client.status()
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)
    assert after.active_refit is None
    assert daemon.proc.poll() is None
    del victim, shared  # never touch the truncated storage's pages


def _register_cuda(client, handle: bytes, uuid: bytes):
    return _shm.register_cuda(
        _shm.rpb_grpc.RegionServiceStub(client._channel), client._metadata, handle, uuid, 1 << 20,
        "test", client.address,
    )


def test_a_cuda_region_the_daemon_cannot_open_is_refused_and_nothing_changes(
    client, daemon, seed2
):
    before = client.push(seed2, lane="grpc")
    # This daemon sees no GPU with that UUID (on a CPU-only host: none).
    # (A refitd built without CUDA cannot open one at all: Unimplemented.)
    with pytest.raises(RefitError) as info:
        _register_cuda(client, b"\x5a" * 64, b"\x11" * 16)
    assert "visible to refitd" in info.value.message or "built with CUDA" in info.value.message
    with pytest.raises(InvalidArgument) as info:
        _register_cuda(client, b"\x5a" * 63, b"\x11" * 16)
    assert "64 bytes (cudaIpcMemHandle_t), got 63" in info.value.message
    after = client.status()
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)
    assert daemon.proc.poll() is None


def test_a_daemon_that_cannot_open_cuda_tensors_gets_them_copied_from_then_on(
    client, daemon, seed2, monkeypatch
):
    expected = client.push(seed2, lane="grpc").fingerprint
    # The lane sees every tensor as a CUDA allocation (the seam where torch
    # is asked for its IPC handle); the daemon, with no such GPU, refuses.
    asked = []

    def fake_allocation(src, share):
        asked.append(src.name)
        return b"\x5a" * 64, b"\x11" * 16, 0, 0, src.nbytes

    monkeypatch.setattr(_shm, "_cuda_allocation", fake_allocation)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    result = client.push(seed2, lane="shm")
    assert result.fingerprint == expected
    reason = client.cuda_ipc_fallback_reason
    assert "visible to refitd" in reason or "built with CUDA" in reason
    assert client._shm.last_copied_bytes == sum(t.numel() * t.element_size() for t in seed2.values())
    assert client._shm._cuda_leases == []
    # Not asked again: the lane copies CUDA tensors for this daemon.
    asked.clear()
    assert client.push(seed2, lane="shm").fingerprint == expected
    assert asked == []


def test_the_ipc_handle_inside_torchs_shareable_handle_is_found():
    raw = bytes(range(64))
    # torch before 2.4: the cudaIpcMemHandle_t alone.
    assert _shm.cuda_ipc_mem_handle(raw) == raw
    # Later torch: a version byte, 'c' for a cudaMalloc block, then the handle.
    assert _shm.cuda_ipc_mem_handle(b"\x02c" + raw) == raw
    assert _shm.cuda_ipc_mem_handle(b"\x03c" + raw) == raw
    # An expandable segment has no cudaIpcMemHandle_t; nor has anything else.
    assert _shm.cuda_ipc_mem_handle(b"\x02e" + raw) is None
    assert _shm.cuda_ipc_mem_handle(b"\x02c" + raw[:63]) is None
    assert _shm.cuda_ipc_mem_handle(raw[:63]) is None
    assert _shm.cuda_ipc_mem_handle("c" * 66) is None


class _FakeShares:
    """torch's CUDA sharing, recorded, over CPU storages: each _share_cuda_()
    takes a new receiver reference (a counters file slot), as torch's does;
    the lane sees every tensor as a CUDA one."""

    def __init__(self, monkeypatch) -> None:
        self.shared: list = []  # storage data_ptr per _share_cuda_() call
        self.counters: list = []  # the references taken, in order
        self.released: list = []
        fakes = self

        def share_cuda(storage):
            fakes.shared.append(storage.data_ptr())
            counter = (b"/torch_refit_test_counters", len(fakes.counters))
            fakes.counters.append(counter)
            return (0, b"\x02c" + b"\x5a" * 64, storage.nbytes(), 0, *counter, None, False)

        def as_if_cuda(src, share):
            storage = src.tensor.untyped_storage()
            shared = share(storage)
            offset = shared.offset + src.tensor.data_ptr() - storage.data_ptr()
            return shared.handle, b"\x11" * 16, 0, offset, shared.offset + shared.size

        monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", share_cuda, raising=False)
        monkeypatch.setattr(_shm, "_cuda_allocation", as_if_cuda)
        monkeypatch.setattr(_shm, "_release_ipc_counter", self.released.append)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


class _FakeCall:
    def is_active(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


def test_each_cuda_storage_is_shared_once_and_its_reference_given_back_as_the_push_ends(
    client, monkeypatch
):
    """torch counts a reference for the receiver at each share, which refitd
    never gives back: the lane shares a storage once while it lives and gives
    back what the push's shares counted when the push ends, so that freed
    storages (a converted temporary) free their memory."""
    fakes = _FakeShares(monkeypatch)
    monkeypatch.setattr(
        _shm, "register_cuda",
        lambda stub, metadata, handle, uuid, size, name, address:
            _shm.Lease(_FakeCall(), "cuda-region", size, "cuda_ipc"),
    )
    lane = _shm.ShmLane(client._channel, client._metadata, client.address)
    weights = torch.arange(64, dtype=torch.bfloat16)
    bias = torch.ones(8, dtype=torch.bfloat16)
    sources = [
        _tensors.to_source("a", weights[:32]),
        _tensors.to_source("b", weights[32:]),  # the same storage
        _tensors.to_source("c", bias),
    ]
    plan = lane.plan(sources)
    assert [(lease.region_id, offset, copy) for _, lease, offset, copy in plan] == [
        ("cuda-region", 0, False), ("cuda-region", 64, False), ("cuda-region", 0, False)]
    assert fakes.shared == [weights.data_ptr(), bias.data_ptr()]
    assert fakes.released == []  # the daemon reads them while the push lasts
    lane.end_push()
    assert fakes.released == fakes.counters  # each once
    # Pushed again (parameters updated in place): not shared again, nothing
    # counted, nothing to give back.
    lane.plan(sources)
    lane.end_push()
    assert len(fakes.shared) == 2 and fakes.released == fakes.counters
    # A new storage at the next push is shared, and given back.
    temporary = _tensors.to_source("a", weights[:32].float(), "bf16")
    lane.plan([temporary])
    assert len(fakes.shared) == 3
    lane.end_push()
    assert fakes.released == fakes.counters and len(fakes.counters) == 3
    del plan, temporary, sources, weights, bias
    lane.plan([_tensors.to_source("d", torch.zeros(4, dtype=torch.bfloat16))])
    lane.end_push()
    assert len(lane._cuda_shares) == 1  # the freed storages' shares are dropped
    lane.close()


def test_a_failed_push_gives_back_the_references_its_cuda_shares_counted(
    client, daemon, seed2, monkeypatch
):
    before = client.status()
    fakes = _FakeShares(monkeypatch)
    # The chunks name a region the daemon never registered: the push fails
    # mid-way.
    monkeypatch.setattr(
        _shm, "register_cuda",
        lambda stub, metadata, handle, uuid, size, name, address:
            _shm.Lease(_FakeCall(), "r-never-registered", size, "cuda_ipc"),
    )
    with pytest.raises(RefitError) as info:
        client.push(seed2, lane="shm")
    assert "r-never-registered" in info.value.message
    assert len(fakes.counters) == len({t.untyped_storage().data_ptr() for t in seed2.values()})
    assert sorted(fakes.released) == sorted(fakes.counters)  # each once
    after = client.status()
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)


@pytest.mark.gpu
def test_pushed_cuda_temporaries_are_freed_and_parameters_shared_once(client, daemon, seed2):
    """Tensors converted (fp32 pushed as bf16) or made contiguous on the GPU
    for a push are freed once it ends, and parameters pushed again are not
    shared again."""
    import gc

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    expected = client.push(seed2, lane="grpc").fingerprint
    temporaries = [
        (k, v.cuda().t().contiguous().t() if v.dim() == 2 else v.float().cuda(), "bf16")
        for k, v in seed2.items()
    ]
    assert client.push(temporaries, lane="shm").fingerprint == expected
    assert client.cuda_ipc_fallback_reason is None and client._shm.last_copied_bytes == 0
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(4):
        assert client.push(temporaries, lane="shm").fingerprint == expected
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline
    # Parameters pushed again and again are shared once.
    share = torch.UntypedStorage._share_cuda_
    shares: list = []

    def counting(storage):
        shares.append(storage.data_ptr())
        return share(storage)

    params = {k: v.cuda() for k, v in seed2.items()}
    torch.UntypedStorage._share_cuda_ = counting
    try:
        for _ in range(3):
            assert client.push(params, lane="shm").fingerprint == expected
    finally:
        del torch.UntypedStorage._share_cuda_
    assert sorted(shares) == sorted({t.untyped_storage().data_ptr() for t in params.values()})


@pytest.mark.gpu
def test_cuda_tensors_go_by_ipc_handle_with_no_client_copy(client, daemon, seed2):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    expected = client.push(seed2, lane="grpc").fingerprint
    on_gpu = {k: v.to("cuda") for k, v in seed2.items()}
    result = client.push(on_gpu, lane="shm")
    assert result.fingerprint == expected
    assert client.cuda_ipc_fallback_reason is None
    assert client._shm.last_copied_bytes == 0
    assert "access=cuda_ipc" in daemon.wait_for_line("region registered")
    # The allocations were registered for that push only.
    assert client._shm._cuda_leases == []


@pytest.mark.gpu
def test_cuda_ipc_off_copies_cuda_tensors_into_host_staging(daemon, seed2):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with RefitClient(daemon.address, cuda_ipc=False) as c:
        expected = c.push(seed2, lane="grpc").fingerprint
        result = c.push({k: v.to("cuda") for k, v in seed2.items()}, lane="shm")
        assert result.fingerprint == expected
        assert c._shm.last_copied_bytes == sum(
            t.numel() * t.element_size() for t in seed2.values()
        )


@pytest.mark.gpu
def test_sealed_regions_go_to_a_gpu_store_by_dma_from_where_they_lie(start_daemon, seed2):
    # A daemon with a GPU store page-locks sealed regions, and its refits
    # copy them to the device straight from the trainer's memory: the same
    # bytes as the gRPC lane's.
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    d = start_daemon("--device=cuda:0", "--metrics-listen=127.0.0.1:0")
    with RefitClient(d.address, timeout=60) as c:
        zeros = {k: v * 0 for k, v in seed2.items()}
        expected = c.push(seed2, lane="grpc").fingerprint
        c.push(zeros, lane="grpc", non_finite="vllm")
        result = c.push(shared_tensors(seed2), lane="shm")
        assert result.fingerprint == expected
        assert c._shm.last_copied_bytes == 0
        assert "access=mapped" in d.wait_for_line("region registered", also="pinned=true")
        assert re.search(r"^refitd_trainer_region_pinned_bytes [1-9]", metrics(d), re.M)
        # Private tensors go through the client's sealed staging memfd:
        # pinned too (the client reserved its pages when it made it).
        c.push(zeros, lane="grpc", non_finite="vllm")
        assert c.push(seed2, lane="shm").fingerprint == expected
        staging = d.wait_for_line("region registered", also="name=staging")
        assert "pinned=true" in staging, staging
    # --pin-regions=false: the same bytes through the pinned staging pool.
    d = start_daemon("--device=cuda:0", "--pin-regions=false", "--metrics-listen=127.0.0.1:0")
    with RefitClient(d.address, timeout=60) as c:
        assert c.push(shared_tensors(seed2), lane="shm").fingerprint == expected
        assert "pinned=" not in d.wait_for_line("region registered")
        assert "refitd_trainer_region_pinned_bytes 0\n" in metrics(d)


@pytest.mark.gpu
def test_tensors_in_shared_memory_go_to_a_gpu_store_by_dma_from_where_they_lie(
    start_daemon, seed2
):
    # torch's share_memory_() files cannot be sealed; a GPU store's daemon
    # page-locks them all the same (a file that shrinks is caught at Prepare).
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    d = start_daemon("--device=cuda:0", "--metrics-listen=127.0.0.1:0")
    with RefitClient(d.address, timeout=60) as c:
        expected = c.push(seed2, lane="grpc").fingerprint
        c.push({k: v * 0 for k, v in seed2.items()}, lane="grpc", non_finite="vllm")
        shared = {k: v.clone().share_memory_() for k, v in seed2.items()}
        assert c.push(shared, lane="shm").fingerprint == expected
        assert c._shm.last_copied_bytes == 0
        assert "access=mapped" in d.wait_for_line("region registered", also="pinned=true")
        pinned = re.search(r"^refitd_trainer_region_pinned_bytes (\d+)", metrics(d), re.M)
        assert int(pinned.group(1)) >= quantized_bytes(seed2)


def test_a_host_store_pins_nothing(start_daemon, seed2):
    # Page-locking is for a GPU store's DMA; --pin-regions is accepted either way.
    for flags in ((), ("--pin-regions=true",)):
        d = start_daemon("--metrics-listen=127.0.0.1:0", *flags)
        with RefitClient(d.address, timeout=60) as c:
            c.push(shared_tensors(seed2), lane="shm")
            assert "pinned=" not in d.wait_for_line("region registered")
            assert "refitd_trainer_region_pinned_bytes 0\n" in metrics(d)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_parallel_copyto_copies_every_byte_once_into_its_place(threads):
    from refit_client._tensors import parallel_copyto

    n = (5 << 20) + 12345  # pieces that do not divide evenly
    src = np.random.default_rng(threads).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 64, dtype=np.uint8)
    parallel_copyto(dst[32 : 32 + n], src, threads=threads)
    assert np.array_equal(dst[32 : 32 + n], src)
    assert not dst[:32].any() and not dst[32 + n :].any()


def test_the_streaming_copy_module_is_built():
    # setup.sh installs the package with a C compiler at hand: the staging
    # copy must not have fallen back to numpy's (a slower copy, silently).
    import platform

    from refit_client import _ntcopy, _tensors

    assert _tensors.STREAMING_COPY
    assert _ntcopy.STREAMING == (1 if platform.machine() in ("x86_64", "AMD64") else 0)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, (256 << 10) - 1, 256 << 10, (1 << 20) + 77])
@pytest.mark.parametrize("dst_shift,src_shift", [(0, 0), (1, 0), (0, 3), (13, 63), (63, 1)])
def test_streaming_copy_copies_exact_bytes_at_any_alignment(n, dst_shift, src_shift):
    copy = pytest.importorskip("refit_client._ntcopy").copy

    rng = np.random.default_rng(n + 7 * dst_shift + src_shift)
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)
    dst = np.full(n + 128, 0xA5, dtype=np.uint8)
    copy(dst[dst_shift : dst_shift + n], src[src_shift : src_shift + n])
    assert np.array_equal(dst[dst_shift : dst_shift + n], src[src_shift : src_shift + n])
    # Nothing written outside the destination (the head and tail are
    # where a vector loop would overrun).
    assert (dst[:dst_shift] == 0xA5).all() and (dst[dst_shift + n :] == 0xA5).all()


def test_streaming_copy_refuses_bad_buffers_and_handles_overlap():
    copy = pytest.importorskip("refit_client._ntcopy").copy

    src = np.arange(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match="destination is 4095 bytes, source 4096"):
        copy(np.empty(4095, dtype=np.uint8), src)
    frozen = np.empty(4096, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises((TypeError, BufferError)):
        copy(frozen, src)
    with pytest.raises((TypeError, BufferError)):
        copy(np.empty(8192, dtype=np.uint8)[::2], src)  # not contiguous
    # Overlapping buffers (above the streaming threshold) copy as memmove.
    n = 1 << 20
    buf = np.random.default_rng(5).integers(0, 256, n + 100, dtype=np.uint8)
    want = buf[:n].copy()
    copy(buf[100 : 100 + n], buf[:n])
    assert np.array_equal(buf[100 : 100 + n], want)


def test_without_the_c_module_the_lane_copies_with_numpy(client, monkeypatch, seed2):
    # Where the package was installed without a C compiler: parallel_copyto
    # falls back to np.copyto, and private tensors still arrive intact.
    from refit_client import _tensors

    monkeypatch.setattr(_tensors, "_copy_bytes", np.copyto)
    n = (3 << 20) + 5
    src = np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    _tensors.parallel_copyto(dst, src, threads=3)
    assert np.array_equal(dst, src)
    over_grpc = client.push(seed2, lane="grpc")
    client.push({k: v * 0 for k, v in seed2.items()}, lane="grpc", non_finite="vllm")
    over_shm = client.push(seed2, lane="shm")
    assert client._shm.last_copied_bytes == sum(t.numel() * t.element_size() for t in seed2.values())
    assert over_shm.fingerprint == over_grpc.fingerprint
