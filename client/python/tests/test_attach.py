"""Engine attach against real refitd processes: the manifest and the
read-only mapping, the refusals (TCP, a layout mismatch), coordinated commits
in every branch (acked, never acked for a one-phase push and for a PREPARED
refit, released by a disconnect), and the tiny engine following a refit bit
for bit."""

from __future__ import annotations

import itertools
import os
import pathlib
import socket
import struct
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from refit_client import (
    LAYOUT_FIELDS,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RefitClient,
    RefitConflict,
    RefitError,
    attach,
)
from refit_client import _attach as _attach_module
from refit_client._proto import engine_pb2 as epb
from refit_client._proto import engine_pb2_grpc as epb_grpc
from refit_client._proto import refit_pb2 as pb
from refit_client._proto import refit_pb2_grpc as pb_grpc

from conftest import load_state_dict, stepping

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import tiny_engine  # noqa: E402

# Generous: only reached when something hangs.
LIMIT = 60.0


def first_events(engine, n: int):
    """The engine's first `n` events (waits for them, bounded)."""
    return list(itertools.islice(engine.events(timeout=LIMIT), n))


def engines_of(address: str):
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.RefitServiceStub(channel).GetStatus(pb.GetStatusRequest()).engines)


def test_attach_maps_every_kernel_zero_copy_and_read_only(daemon, client):
    with attach(daemon.address, coordinate=False, name="probe") as engine:
        names = [t.name for t in client.tensors()]
        assert sorted(engine.tensors) == sorted(names)
        assert engine.version == 1
        assert engine.fingerprint == client.status().fingerprint
        assert engine.layout["architecture"] == "LlamaForCausalLM"
        assert (engine.layout["tp_rank"], engine.layout["tp_size"]) == (0, 1)
        assert engine.layout["quantization"] == "per-tensor"
        assert engine.layout_fingerprint
        for name in ("model.layers.0.self_attn.qkv_proj.weight", "lm_head.weight",
                     "model.layers.1.mlp.down_proj.weight_scale"):
            t = engine.tensors[name]
            assert t.data_ptr() % 256 == 0
            got = t.contiguous().view(torch.uint8).numpy().tobytes()
            assert got == client.read_raw(name)[2], name
        assert engine.tensors["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
        seq, version = engine.header()
        assert seq % 2 == 0 and version == 1
        with pytest.raises(TypeError):
            engine._map[0:1] = b"x"  # the mapping is read-only
        (listed,) = engines_of(daemon.address)
        assert listed.engine_id == engine.engine_id
        assert listed.coordinated is False
        assert listed.pid > 0 and listed.version == 1


def test_status_lists_the_attached_engines_until_they_detach(daemon, client):
    from refit_client.types import EngineInfo

    assert client.status().engines == ()
    start = time.time()
    with attach(daemon.address, name="listed") as engine, \
            attach(daemon.address, coordinate=False) as watcher:
        listed = client.status().engines
        assert all(isinstance(e, EngineInfo) for e in listed)
        assert sorted(e.engine_id for e in listed) == sorted(
            [engine.engine_id, watcher.engine_id])
        (info,) = [e for e in listed if e.engine_id == engine.engine_id]
        assert (info.pid, info.uid) == (os.getpid(), os.getuid())
        assert info.name == "listed"
        assert info.coordinated is True and info.version == 1
        assert start - 1 <= info.attached_unix_seconds <= time.time() + 1
        assert [e.coordinated for e in listed if e.engine_id == watcher.engine_id] == [False]
        assert client.statuses()[0].engines == listed
        watcher.close()
        daemon.wait_for_line("engine detached")
        assert [e.engine_id for e in client.status().engines] == [engine.engine_id]
    with daemon._cv:
        daemon._cv.wait_for(
            lambda: sum("engine detached" in line for line in daemon._lines) >= 2, LIMIT)
    assert client.status().engines == ()


def test_attach_over_tcp_is_failed_precondition(start_daemon):
    d = start_daemon(tcp=True)
    with grpc.insecure_channel(d.address) as channel:
        call = epb_grpc.EngineServiceStub(channel).Attach(
            iter([epb.EngineMessage(attach=epb.AttachRequest())]), timeout=LIMIT
        )
        with pytest.raises(grpc.RpcError) as e:
            next(call)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "attach needs a local Unix socket" in e.value.details()


def test_layout_mismatch_names_the_fields(daemon):
    with pytest.raises(FailedPrecondition) as e:
        attach(daemon.address, expect={"tp_size": 2, "architecture": "Qwen2ForCausalLM"})
    assert "tp_size (engine expects 2, daemon serves 1)" in str(e.value)
    assert "architecture" in str(e.value)
    assert "quantization" not in str(e.value)
    # A value of another type than the field's is the caller's mistake,
    # told before anything is asked.
    with pytest.raises(InvalidArgument) as bad:
        attach(daemon.address, expect={"tp_size": "1"})
    assert "expect['tp_size'] is '1', a str; the layout's tp_size is a int" in str(bad.value)
    assert engines_of(daemon.address) == []
    # The engine's own values, as engine.layout gives them, match.
    with attach(daemon.address, coordinate=False) as engine:
        layout = dict(engine.layout)
    assert set(layout) == set(LAYOUT_FIELDS)
    with attach(daemon.address, coordinate=False, expect=layout) as engine:
        assert engine.layout == layout


def _fill_descriptor_socket(path: str):
    """As many silent connections as the daemon serves at once from one
    process (it drops each a second after it came), and proof that this
    process has no more: one more is refused at once."""
    silent = []
    for _ in range(4):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        silent.append(s)
    time.sleep(0.1)  # every one accepted (the daemon counts them as it accepts)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(LIMIT)
        probe.connect(path)
        answer = probe.recv(128)
        assert answer.startswith(f"Etoo many attach connections from process {os.getpid()}".encode())
    return silent


def test_a_full_descriptor_socket_delays_an_attach_and_a_region_but_fails_neither(
    daemon, client, weights
):
    """Peers that connect to the descriptor socket and send nothing hold a
    connection each for a second at most; an engine's attach and a trainer's
    region registration that find every connection they may hold taken
    retry until one is free, and succeed."""
    path = daemon.address[len("unix:"):] + ".fd"
    silent = _fill_descriptor_socket(path)
    try:
        with attach(daemon.address, coordinate=False) as engine:
            assert engine.version == 1
            for s in silent:
                s.close()
            silent = _fill_descriptor_socket(path)
            result = RefitClient(daemon.address).push(load_state_dict(weights(2)), lane="shm")
            assert result.version == 2
            assert first_events(engine, 1)[0].version == 2
    finally:
        for s in silent:
            s.close()


def test_uncoordinated_engine_is_told_of_commits_without_being_asked(daemon, client, weights):
    with attach(daemon.address, coordinate=False) as engine:
        result = client.push(load_state_dict(weights(2)))
        events = first_events(engine, 1)
        assert [(e.kind, e.version, e.fingerprint) for e in events] == [
            ("committed", 2, result.fingerprint)
        ]
        assert engine.version == 2
        assert engine.header()[1] == 2


def test_each_committed_is_delivered_once_in_order_with_the_arena_header(daemon, client, weights):
    delivered = []
    with attach(daemon.address, coordinate=False) as engine:
        engine.on_event(delivered.append)
        results = [client.push(load_state_dict(weights(seed))) for seed in (2, 3, 2)]
        for r in results:
            assert r.refit_id
        events = first_events(engine, 3)
        # The stream's copies of what the header delivered (or the other way
        # round) have had time to arrive: none is delivered twice.
        assert list(engine.events(timeout=1.0)) == []
        assert [(e.kind, e.version, e.refit_id, e.fingerprint) for e in events] == [
            ("committed", r.version, r.refit_id, r.fingerprint) for r in results
        ]
        assert all(e.via in ("arena", "stream") for e in events)
        assert [e.version for e in delivered] == [r.version for r in results]
        # The header holds the whole event of the latest commit.
        last = results[-1]
        assert engine.arena_commit() == (last.version, last.refit_id, last.fingerprint)
        assert (engine.version, engine.fingerprint) == (last.version, last.fingerprint)


def test_committed_arrives_from_the_arena_header_without_the_stream(
    daemon, client, weights, monkeypatch
):
    # The reader thread holds back the Attach stream until released: the
    # only way Committed can arrive meanwhile is the header and its futex.
    from refit_client import _attach

    release = threading.Event()
    read_events = _attach.AttachedEngine._read_events

    def held_reader(self):
        release.wait(LIMIT)
        read_events(self)

    monkeypatch.setattr(_attach.AttachedEngine, "_read_events", held_reader)
    with attach(daemon.address, coordinate=False) as engine:
        result = client.push(load_state_dict(weights(2)))
        (event,) = first_events(engine, 1)
        assert (event.kind, event.via) == ("committed", "arena")
        assert (event.version, event.refit_id, event.fingerprint) == (
            result.version, result.refit_id, result.fingerprint)
        assert engine.version == result.version
        release.set()
        # The stream's Committed of that version is not delivered again: the
        # next event is the next commit's.
        second = client.push(load_state_dict(weights(3)))
        (event,) = first_events(engine, 1)
        assert (event.kind, event.version, event.refit_id) == (
            "committed", second.version, second.refit_id)
        assert list(engine.events(timeout=1.0)) == []


def test_one_phase_push_with_an_engine_that_never_acks_is_aborted_naming_it(start_daemon, weights):
    d = start_daemon("--engine-quiesce-timeout=300ms")
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address, name="stuck") as engine:
        with pytest.raises(RefitConflict) as e:
            client.push(load_state_dict(weights(2)))
        assert e.value.code == grpc.StatusCode.ABORTED
        assert f'engine "{engine.engine_id}"' in str(e.value)
        assert "did not quiesce within 300ms (--engine-quiesce-timeout)" in str(e.value)
        assert client.status().version == 1
        kinds = [ev.kind for ev in first_events(engine, 2)]
        assert kinds == ["commit_pending", "aborted"]
        assert engine.version == 1
        assert engine.closed is None  # the lease holds


def test_an_idle_engine_acks_from_its_callback_and_follows_every_commit(daemon, client, weights):
    """An engine with nothing to run acks each commit_pending from its
    on_event callback (on the thread that delivers events): the ack goes,
    the commit happens, and the engine goes on receiving events and acking
    the next commits."""
    with attach(daemon.address, name="idle") as engine:
        returned = []

        def on_event(event) -> None:
            if event.kind == "commit_pending":
                returned.append(engine.safe_point())

        engine.on_event(on_event)
        results = [client.push(load_state_dict(weights(seed))) for seed in (2, 3)]
        assert [r.version for r in results] == [2, 3]
        kinds = [(e.kind, e.version) for e in first_events(engine, 4)]
        assert kinds == [("commit_pending", 2), ("committed", 2),
                         ("commit_pending", 3), ("committed", 3)]
        assert returned == [False, False]  # acked, did not wait
        assert (engine.version, engine.fingerprint) == (3, results[-1].fingerprint)
        # A safe point of the engine's own, now that nothing is pending.
        assert engine.safe_point() is False


def test_a_callback_that_raises_is_logged_and_the_events_go_on(daemon, client, weights, caplog):
    # The exception would end the thread that reads the stream: later
    # commits would go unnoticed and a safe point would wait for an event
    # no one delivers.
    with attach(daemon.address, name="raises") as engine:
        def on_event(event) -> None:
            raise RuntimeError(f"bad callback on {event.kind}")

        engine.on_event(on_event)
        with stepping(lambda: engine.safe_point(timeout=10), pause=0.001):
            results = [client.push(load_state_dict(weights(seed))) for seed in (2, 3)]
        assert [r.version for r in results] == [2, 3]
        assert engine.closed is None
        assert [v for v, _ in engine.pauses] == [2, 3]
        assert engine.consistent(lambda: engine.version) == 3
    assert "an on_event callback raised on commit_pending" in caplog.text
    assert "bad callback on commit_pending" in caplog.text


def test_an_engine_attaching_mid_commit_holds_at_its_first_safe_point(start_daemon, weights):
    """A coordinated engine that attaches while a commit waits for another
    engine's ack comes back from attach() with that commit pending: its
    first safe point acks and holds until the copy is done, and the commit
    waits for both acks."""
    d = start_daemon("--engine-quiesce-timeout=60s")
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address, name="first") as first:
        pushed = {}
        pusher = threading.Thread(
            target=lambda: pushed.update(r=client.push(load_state_dict(weights(2)))))
        pusher.start()
        assert [e.kind for e in first_events(first, 1)] == ["commit_pending"]
        with attach(d.address, name="second") as second:
            assert second.version == 1
            assert second._pending is not None and second._pending[1] == 2  # from the manifest
            first_acked = threading.Thread(target=first.safe_point)
            first_acked.start()
            time.sleep(0.3)
            assert client.status().version == 1  # waits for the second engine too
            assert second.safe_point(timeout=LIMIT) is True
            first_acked.join(LIMIT)
            pusher.join(LIMIT)
            assert pushed["r"].version == 2
            assert second.version == 2 and second.pauses[-1][0] == 2


def test_attach_waits_for_a_daemon_still_loading_its_first_version(monkeypatch):
    """Before its first version the daemon refuses attach (UNAVAILABLE,
    "serves no version yet": the arena holds no weights yet); attach() asks
    again until its timeout. Other refusals are raised at once."""
    from refit_client import Unavailable

    calls = []
    loading = Unavailable('UNAVAILABLE: model group "target" serves no version yet (its first '
                          "load is under way): attach once refitd is ready")

    def engine(*args):
        assert args[-1] == 5.0  # the caller's timeout, for the error to name
        calls.append(args[-2])  # the timeout left
        if len(calls) < 3:
            raise loading
        return "attached"

    monkeypatch.setattr(_attach_module, "AttachedEngine", engine)
    assert attach("unix:/nowhere.sock", timeout=5.0) == "attached"
    assert len(calls) == 3 and calls[0] > calls[1] > calls[2] > 0

    calls.clear()
    monkeypatch.setattr(_attach_module, "AttachedEngine",
                        lambda *args: (calls.append(1), (_ for _ in ()).throw(loading))[1])
    start = time.monotonic()
    with pytest.raises(Unavailable, match="serves no version yet"):
        attach("unix:/nowhere.sock", timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 5 and len(calls) > 1

    calls.clear()
    stopping = Unavailable("UNAVAILABLE: refitd is shutting down")
    monkeypatch.setattr(_attach_module, "AttachedEngine",
                        lambda *args: (calls.append(1), (_ for _ in ()).throw(stopping))[1])
    with pytest.raises(Unavailable, match="shutting down"):
        attach("unix:/nowhere.sock", timeout=5.0)
    assert len(calls) == 1


def test_attach_to_no_daemon_gives_up_after_its_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as e:
        attach(f"unix:{tmp_path}/nobody.sock", timeout=1.0)
    assert time.monotonic() - start < 10.0
    assert "no answer from unix:" in str(e.value) and "within 1 s" in str(e.value)


def test_prepared_refit_stays_prepared_until_the_engine_goes(start_daemon, weights):
    d = start_daemon("--engine-quiesce-timeout=300ms")
    with RefitClient(d.address, timeout=LIMIT) as client:
        engine = attach(d.address, name="stuck")
        prepared = client.push(load_state_dict(weights(2)), prepare=True)
        assert prepared.state == "PREPARED"
        with pytest.raises(DeadlineExceeded) as e:
            client.commit(prepared.refit_id)
        assert "stays PREPARED" in str(e.value)
        assert engine.engine_id in str(e.value)
        status = client.status()
        assert status.version == 1
        assert status.active_refit is not None and status.active_refit.refit_id == prepared.refit_id
        # An engine that goes away is released and never blocks a commit.
        engine.close()
        d.wait_for_line("engine detached")
        committed = client.commit(prepared.refit_id)
        assert committed.version == 2
        assert engines_of(d.address) == []


def test_an_abort_ends_a_commit_that_waits_for_engines(start_daemon, weights):
    # The engine never reaches a safe point: only the Abort ends the wait,
    # long before --engine-quiesce-timeout.
    d = start_daemon("--engine-quiesce-timeout=60s")
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address, name="slow") as engine:
        prepared = client.push(load_state_dict(weights(2)), prepare=True)
        outcome: list = []

        def commit() -> None:
            try:
                outcome.append(client.commit(prepared.refit_id))
            except RefitError as e:
                outcome.append(e)

        committer = threading.Thread(target=commit)
        committer.start()
        events = engine.events(timeout=LIMIT)
        # The engine is asked: the Commit holds the refit and waits.
        assert next(events).kind == "commit_pending"
        with RefitClient(d.address, timeout=LIMIT) as operator:
            # A second Commit is refused while the first holds the refit.
            with pytest.raises(FailedPrecondition) as e:
                operator.commit(prepared.refit_id)
            assert f'refit "{prepared.refit_id}" is being committed' in str(e.value)
            assert "until that Commit returns" in str(e.value)
            started = time.monotonic()
            aborted = operator.abort(prepared.refit_id, reason="engine stuck")
            assert time.monotonic() - started < 10
        assert aborted.refit_id == prepared.refit_id and aborted.version == 1
        committer.join(LIMIT)
        assert not committer.is_alive()
        # The Commit returns ABORTED with the operator's reason; nothing
        # was copied, and the engine told of the commit is told it is off.
        (error,) = outcome
        assert isinstance(error, RefitConflict), error
        assert "Abort by" in str(error) and "engine stuck" in str(error), error
        event = next(events)
        assert event.kind == "aborted" and "engine stuck" in event.reason, event
        status = client.status()
        assert status.version == 1 and status.active_refit is None
        assert engine.version == 1
        with pytest.raises(NotFound):
            client.abort(prepared.refit_id)
        assert d.wait_for_line("aborted while its Commit waited for attached engines")
        # The group takes the next refit, and the engine that held the
        # commit up still follows (it acks this time).
        loop_stop = threading.Event()

        def serve() -> None:
            while not loop_stop.is_set():
                engine.safe_point(timeout=0.05)

        loop = threading.Thread(target=serve)
        loop.start()
        try:
            assert client.push(load_state_dict(weights(3))).version == 2
        finally:
            loop_stop.set()
            loop.join(LIMIT)
        assert engine.version == 2


@pytest.mark.parametrize("futex", [True, False], ids=["futex", "event"])
def test_a_safe_point_resumes_once_the_copy_ended_and_the_header_says_when(
        start_daemon, weights, futex):
    d = start_daemon()
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address, name="timed") as engine:
        if not futex:
            engine._futex = None  # where it is unavailable: wait for the Committed event
        version, loaded_at = engine.committed_at()
        assert version == 1 and loaded_at > 0
        resumed = threading.Event()
        stop = threading.Event()
        times: list = []
        seen: list = []

        def serve() -> None:
            while not stop.is_set() and engine.closed is None:
                if engine.safe_point(timeout=LIMIT):
                    times.append(time.time())
                    seen.append(engine.version)  # Committed delivered before the return
                    resumed.set()
                time.sleep(0.001)  # a forward step

        loop = threading.Thread(target=serve)
        loop.start()
        try:
            before = time.time()
            result = client.push(load_state_dict(weights(2)))
            after = time.time()
            assert resumed.wait(LIMIT)
        finally:
            stop.set()
            loop.join(LIMIT)
        version, copied_at = engine.committed_at()
        assert version == 2 == result.version
        assert before <= copied_at <= after
        assert times[0] >= copied_at  # never before the copy ended
        assert [v for v, _ in engine.pauses] == [2]
        events = first_events(engine, 2)
        assert [(e.kind, e.version) for e in events] == [("commit_pending", 2), ("committed", 2)]
        # With the futex the safe point itself delivers Committed from the
        # header as it wakes, unless the stream's message got in first (on a
        # loaded machine the reader thread can run before the woken safe
        # point; test_committed_arrives_from_the_arena_header_without_the_stream
        # checks the header path with the reader held); without the futex,
        # the stream's message ends the pause.
        assert events[1].via in (("arena", "stream") if futex else ("stream",))
        assert events[1].refit_id == result.refit_id
        assert seen == [2]
        assert engine.version == 2 and engine.fingerprint == result.fingerprint


def test_a_safe_point_sleeping_for_a_commit_that_is_aborted_resumes(start_daemon, weights):
    d = start_daemon("--engine-quiesce-timeout=300ms")
    with RefitClient(d.address, timeout=LIMIT) as client, \
            attach(d.address, name="ready") as ready, attach(d.address, name="stuck"):
        paused: list = []

        def serve() -> None:
            while not paused and ready.closed is None:
                if ready.safe_point(timeout=LIMIT):
                    paused.append(ready.header())
                time.sleep(0.001)

        header = ready.header()
        loop = threading.Thread(target=serve)
        loop.start()
        with pytest.raises(RefitConflict) as e:
            client.push(load_state_dict(weights(2)))
        loop.join(LIMIT)
        assert not loop.is_alive()
        assert "did not quiesce" in str(e.value)
        assert paused == [header]  # resumed on the old version: nothing was copied
        kinds = [ev.kind for ev in first_events(ready, 2)]
        assert kinds == ["commit_pending", "aborted"]
        assert ready.version == 1


def test_a_push_whose_trainer_dies_during_the_engine_wait_is_aborted_then(start_daemon, weights):
    """The trainer process dies while the commit waits for an engine's ack:
    the refit aborts then (not after the quiesce timeout, committed with no
    one to hear of it), the engine hears of it once, and the next push
    commits."""
    d = start_daemon("--engine-quiesce-timeout=60s")
    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "push_checkpoint.py"
    with attach(d.address, name="slow") as engine:
        trainer = subprocess.Popen([sys.executable, str(example), d.address, str(weights(2))],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert [ev.kind for ev in first_events(engine, 1)] == ["commit_pending"]
            killed = time.monotonic()
            trainer.kill()
        finally:
            trainer.kill()
            trainer.wait(LIMIT)
        aborted = first_events(engine, 1)
        assert [ev.kind for ev in aborted] == ["aborted"]
        assert time.monotonic() - killed < 30
        assert "cancelled" in aborted[0].reason
        assert engine.safe_point() is False  # nothing pending any more
        with RefitClient(d.address, timeout=LIMIT) as client:
            assert client.status().version == 1
            engine.on_event(lambda ev: ev.kind == "commit_pending" and engine.safe_point())
            assert client.push(load_state_dict(weights(3))).version == 2
        assert [ev.kind for ev in first_events(engine, 2)] == ["commit_pending", "committed"]


def test_tiny_engine_follows_a_refit_bit_for_bit_without_reattaching(start_daemon, weights):
    shape = tiny_engine.Shape(2, 4, 2, 32, 1000)
    prompt = [1, 2, 3, 4]
    served = start_daemon()
    engine = attach(served.address, name="tiny")
    ptrs = {name: t.data_ptr() for name, t in engine.tensors.items()}
    before = tiny_engine.forward(engine.tensors, shape, prompt).clone()
    tiny_engine.generate(engine, shape, prompt, 3)
    assert engine.pauses == []

    # The engine generates in a loop, a safe point before every step, while
    # the trainer pushes; the commit lands between two steps.
    stop = threading.Event()
    after: list = []

    def run() -> None:
        tokens = list(prompt)
        while engine.version < 2 and not stop.is_set():
            engine.safe_point(timeout=LIMIT)
            if engine.version >= 2:
                break
            tokens.append(int(tiny_engine.forward(engine.tensors, shape, tokens).argmax()))
            del tokens[len(prompt) + 8 :]
        after.append(tiny_engine.forward(engine.tensors, shape, prompt))

    loop = threading.Thread(target=run)
    loop.start()
    try:
        with RefitClient(served.address, timeout=LIMIT) as client:
            result = client.push(load_state_dict(weights(2)))
    except BaseException:
        stop.set()
        raise
    finally:
        loop.join(LIMIT)
    assert not loop.is_alive()
    assert result.version == 2 and engine.version == 2
    assert engine.fingerprint == result.fingerprint

    fresh = start_daemon(f"--model={weights(2)}")
    with attach(fresh.address, coordinate=False) as reference:
        assert reference.fingerprint == result.fingerprint
        expected = tiny_engine.forward(reference.tensors, shape, prompt)
    (logits,) = after
    assert torch.equal(logits, expected)  # bit for bit
    assert not torch.equal(logits, before)
    # Same storage, same lease.
    assert {name: t.data_ptr() for name, t in engine.tensors.items()} == ptrs
    (listed,) = engines_of(served.address)
    assert listed.engine_id == engine.engine_id and listed.version == 2
    # Paused once, for that commit only.
    assert [version for version, _ in engine.pauses] == [2]
    kinds = [(e.kind, e.version) for e in first_events(engine, 2)]
    assert kinds == [("commit_pending", 2), ("committed", 2)]
    engine.close()


ENGINE_PROCESS = """
import sys, time
from refit_client import attach
engine = attach(sys.argv[1], name="doomed")
engine.on_event(lambda e: print(e.kind, flush=True))
print(engine.engine_id, flush=True)
time.sleep(3600)  # never reaches a safe point
"""


def test_an_engine_process_that_dies_during_a_commit_is_released_and_the_commit_goes_on(
        start_daemon, weights):
    import subprocess

    # A timeout far beyond the test: the commit must go on because the lease
    # ended, not because the wait ran out.
    d = start_daemon("--engine-quiesce-timeout=600s")
    child = subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS, d.address],
                             stdout=subprocess.PIPE, text=True)
    outcome: list = []
    try:
        engine_id = child.stdout.readline().strip()
        assert engine_id.startswith("e-"), engine_id
        with RefitClient(d.address, timeout=LIMIT) as client:
            pusher = threading.Thread(
                target=lambda: outcome.append(client.push(load_state_dict(weights(2)))))
            pusher.start()
            # The commit is waiting for this engine's ack when it dies.
            assert child.stdout.readline().strip() == "commit_pending"
            assert client.status().version == 1
            child.kill()
            child.wait(timeout=LIMIT)
            pusher.join(LIMIT)
        assert not pusher.is_alive()
        (result,) = outcome
        assert result.version == 2
        d.wait_for_line("engine detached")
        assert engines_of(d.address) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.gpu
def test_attach_to_a_gpu_store_gives_cuda_tensors_over_the_ipc_handle(start_daemon, weights):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    d = start_daemon("--device=cuda:0")
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address) as engine:
        name = "model.layers.0.self_attn.qkv_proj.weight"
        _follows_a_commit_in_place(client, engine, weights, name)
    assert not engine.read_only_device  # CUDA IPC maps read-write


def _follows_a_commit_in_place(client, engine, weights, name: str) -> None:
    """The engine's CUDA tensor `name` holds the live bytes, before and after
    a push it follows from safe_point(), at the same address."""
    t = engine.tensors[name]
    assert t.is_cuda and t.dtype == torch.float8_e4m3fn
    ptr = t.data_ptr()
    assert t.view(torch.uint8).cpu().numpy().tobytes() == client.read_raw(name)[2]

    def serve() -> None:
        while engine.version < 2 and engine.closed is None:
            engine.safe_point(timeout=LIMIT)

    loop = threading.Thread(target=serve)
    loop.start()
    client.push(load_state_dict(weights(2)))
    loop.join(LIMIT)
    assert engine.version == 2 and t.data_ptr() == ptr
    torch.cuda.synchronize()
    assert t.view(torch.uint8).cpu().numpy().tobytes() == client.read_raw(name)[2]


@pytest.mark.gpu
def test_a_vmm_gpu_arena_is_mapped_read_only_and_a_write_faults_in_the_engine_alone(
    start_daemon, weights, tmp_path
):
    """--cuda-arena=vmm: the kernels' allocation comes as a descriptor and is
    mapped with read-only access. The engine reads the live bytes and follows
    a commit in place; an engine process that writes to a kernel fails there,
    and the daemon keeps serving the bytes it committed."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    d = start_daemon("--device=cuda:0", "--cuda-arena=vmm")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address) as engine:
        assert engine.read_only_device
        _follows_a_commit_in_place(client, engine, weights, name)
        t = engine.tensors[name]
        before = client.status().fingerprint
        writer = tmp_path / "writer.py"
        writer.write_text(
            "import sys, torch\n"
            "from refit_client import attach\n"
            f"e = attach({d.address!r}, coordinate=False)\n"
            f"w = e.tensors[{name!r}].view(torch.uint8)\n"
            "print('attached', flush=True)\n"
            "try:\n"
            "    w.add_(1)\n"
            "    torch.cuda.synchronize()\n"
            "except Exception as err:  # the device's fault, as torch raises it\n"
            "    print('write failed:', err, flush=True)\n"
            "    sys.exit(3)\n"
            "print('write went through')\n"
        )
        # The client's directory ahead of what the test runs with (the
        # packages it imports may come from PYTHONPATH too).
        path = [str(pathlib.Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        run = subprocess.run(
            [sys.executable, str(writer)],
            capture_output=True,
            text=True,
            timeout=LIMIT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)},
        )
        # It attached, then its write faulted (an exception, or the process
        # killed by the fault): not an import or attach failure.
        assert "attached" in run.stdout, run.stdout + run.stderr
        assert "write went through" not in run.stdout, run.stdout + run.stderr
        assert "write failed" in run.stdout or run.returncode < 0, run.stdout + run.stderr
        assert client.status().fingerprint == before
        assert t.view(torch.uint8).cpu().numpy().tobytes() == client.read_raw(name)[2]


def test_every_descriptor_the_daemon_hands_arrives_in_order(tmp_path):
    """The descriptor socket may hand several (the memfd, then a GPU arena's
    allocation): all arrive, in order; a refusal is PermissionDenied with the
    daemon's reason."""
    path = str(tmp_path / "fd.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(2)
    server.settimeout(LIMIT)
    files = [os.memfd_create(f"fd{i}") for i in range(2)]
    for i, fd in enumerate(files):
        os.write(fd, f"region {i}".encode())

    def serve() -> None:
        for answer in ("K", "E"):
            conn, _ = server.accept()
            with conn:
                assert conn.recv(64).endswith(b"\n")
                if answer == "K":
                    socket.send_fds(conn, [b"K"], files)
                else:
                    conn.sendall(b"Eunknown attach ticket\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        got = _attach_module._receive_fds(path, "t1", LIMIT)
        assert len(got) == 2
        assert [os.pread(fd, 16, 0) for fd in got] == [b"region 0", b"region 1"]
        for fd in got:
            os.close(fd)
        with pytest.raises(PermissionDenied, match="unknown attach ticket"):
            _attach_module._receive_fds(path, "t2", LIMIT)
    finally:
        thread.join(LIMIT)
        server.close()
        for fd in files:
            os.close(fd)


def _record_acks(engine, order: list) -> None:
    """Adds ("quiesced", version) to `order` as the engine queues each ack."""
    put = engine._requests.put

    def recording_put(item, *args, **kwargs):
        if item is not None and item.WhichOneof("kind") == "quiesced":
            order.append(("quiesced", item.quiesced.version))
        put(item, *args, **kwargs)

    engine._requests.put = recording_put


@pytest.mark.parametrize("where", ["engine_thread", "callback"])
def test_a_safe_point_acks_only_once_the_devices_queued_work_has_run(
        start_daemon, weights, where):
    """The ack lets the daemon overwrite the arena, so a safe point first
    waits for the work queued on the arena's devices (kernels of the last
    forward step may still read it), from the engine's thread and from an
    on_event callback alike. The seam stands in for the device: it takes its
    time, and the daemon must not have copied meanwhile."""
    d = start_daemon("--engine-quiesce-timeout=60s")
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address, name="seam") as engine:
        order: list = []
        _record_acks(engine, order)

        def sync_devices() -> None:
            time.sleep(0.3)  # a forward step's kernels finishing
            order.append(("synced", engine.header()[1]))

        engine._sync_devices = sync_devices
        returned: list = []
        if where == "callback":
            engine.on_event(
                lambda e: returned.append(engine.safe_point()) if e.kind == "commit_pending"
                else None)
        pushed = {}
        pusher = threading.Thread(
            target=lambda: pushed.update(r=client.push(load_state_dict(weights(2)))))
        pusher.start()
        if where == "engine_thread":
            assert first_events(engine, 1)[0].kind == "commit_pending"
            returned.append(engine.safe_point(timeout=LIMIT))
        pusher.join(LIMIT)
        assert pushed["r"].version == 2
        # Synchronized while version 1 was still in the arena, then acked.
        assert order == [("synced", 1), ("quiesced", 2)]
        assert returned == [where == "engine_thread"]


def test_a_host_store_safe_point_makes_no_cuda_call(start_daemon, weights, monkeypatch):
    """torch.cuda may be unavailable (or not initialised) in a CPU engine:
    the safe point of a host store leaves it alone."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("torch.cuda called for a host store")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    monkeypatch.setattr(torch.cuda, "init", no_cuda)
    d = start_daemon("--engine-quiesce-timeout=60s")
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address, name="cpu") as engine:
        assert engine._cuda_devices == () and engine._device_mappings == []
        pusher = threading.Thread(target=lambda: client.push(load_state_dict(weights(2))))
        pusher.start()
        assert first_events(engine, 1)[0].kind == "commit_pending"
        assert engine.safe_point(timeout=LIMIT) is True
        pusher.join(LIMIT)
        assert engine.version == 2


def test_a_device_mapping_is_undone_once_with_the_last_reference_to_it():
    """The finalizer seam of a CUDA arena's mapping: whatever holds it (a
    tensor's storage holds its _DevicePointer) keeps it mapped; once the
    last holder is gone it is unmapped, once."""
    import gc

    unmapped = []
    mapping = _attach_module._DeviceMapping(0x1000, lambda: unmapped.append(0x1000))
    pointer = _attach_module._DevicePointer(mapping, 64)
    assert pointer.__cuda_array_interface__["data"] == (0x1000, False)
    del mapping
    gc.collect()
    assert unmapped == []  # the pointer (a storage, in torch) still holds it
    del pointer
    gc.collect()
    assert unmapped == [0x1000]


class _FakeRuntime(_attach_module._CudaIpc):
    """The IPC handle cache over a recorded runtime: no CUDA."""

    def __init__(self) -> None:
        self.calls: list = []
        self.next_ptr = 0x10000

    def _open(self, handle, device):
        self.next_ptr += 0x1000
        self.calls.append(("open", handle[:1], device, self.next_ptr))
        return self.next_ptr

    def _close(self, ptr, device):
        self.calls.append(("close", ptr, device))


def test_an_ipc_handle_is_shared_while_any_tensor_maps_it_then_closed_and_forgotten(
        monkeypatch):
    import gc

    monkeypatch.setattr(_attach_module._CudaIpc, "_opened", {})
    runtime = _FakeRuntime()
    a = runtime.open(b"a" * 64, 0)
    again = runtime.open(b"a" * 64, 0)  # a second attach to the same arena
    assert again is a
    b = runtime.open(b"b" * 64, 0)  # a restarted daemon's arena
    assert [c[0] for c in runtime.calls] == ["open", "open"]
    del again
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["open", "open"]  # `a` still maps it
    a_ptr = a.ptr
    del a
    gc.collect()
    assert runtime.calls[2:] == [("close", a_ptr, 0)]
    assert list(_attach_module._CudaIpc._opened) == [(b"b" * 64, 0)]
    # Opened anew when attached again.
    reopened = runtime.open(b"a" * 64, 0)
    assert reopened.ptr != a_ptr and runtime.calls[3][0] == "open"
    del b, reopened
    gc.collect()
    assert [c[0] for c in runtime.calls[4:]] == ["close", "close"]
    assert _attach_module._CudaIpc._opened == {}


def test_an_ipc_handle_whose_mapping_died_unclosed_is_closed_before_it_is_opened_again(
        monkeypatch):
    """The mapping's last reference is gone but its finalizer has not run
    (it waits for the lock): the next open closes it first, and the
    finalizer then does nothing."""
    monkeypatch.setattr(_attach_module._CudaIpc, "_opened", {})
    runtime = _FakeRuntime()
    mapping = runtime.open(b"a" * 64, 0)
    ptr = mapping.ptr
    mapping.released.detach()  # its finalizer, held back
    key = (b"a" * 64, 0)
    opened = _attach_module._CudaIpc._opened[key][1]
    del mapping
    fresh = runtime.open(b"a" * 64, 0)
    assert runtime.calls[1:] == [("close", ptr, 0), ("open", b"a", 0, fresh.ptr)]
    runtime._release(opened)  # the held-back finalizer
    assert len(runtime.calls) == 3
    assert _attach_module._CudaIpc._opened[key][1] is not opened


def test_an_ipc_handle_whose_close_failed_stays_known_and_is_closed_before_it_is_opened_again(
        monkeypatch):
    """A close that raises leaves the handle open: it stays in the cache, so
    the next open of the same handle closes it first instead of opening it a
    second time (which CUDA refuses)."""
    from refit_client import RefitError

    monkeypatch.setattr(_attach_module._CudaIpc, "_opened", {})
    runtime = _FakeRuntime()
    fail = [True]
    close = runtime._close

    def flaky_close(ptr, device):
        if fail[0]:
            fail[0] = False
            raise RefitError("attach: cudaIpcCloseMemHandle failed (CUDA error 1)")
        close(ptr, device)

    runtime._close = flaky_close
    mapping = runtime.open(b"a" * 64, 0)
    ptr = mapping.ptr
    key = (b"a" * 64, 0)
    opened = _attach_module._CudaIpc._opened[key][1]
    mapping.released.detach()
    with pytest.raises(RefitError):
        runtime._release(opened)  # the finalizer's close fails
    assert not opened.closed and _attach_module._CudaIpc._opened[key][1] is opened
    del mapping
    fresh = runtime.open(b"a" * 64, 0)
    assert runtime.calls[1:] == [("close", ptr, 0), ("open", b"a", 0, fresh.ptr)]
    assert opened.closed


@pytest.mark.gpu
def test_a_safe_point_acks_after_the_kernels_reading_the_arena_have_run(start_daemon, weights):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    d = start_daemon("--device=cuda:0", "--engine-quiesce-timeout=60s")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    with RefitClient(d.address, timeout=LIMIT) as client, attach(d.address) as engine:
        assert engine._cuda_devices == (0,)
        stream = torch.cuda.current_stream(0)
        idle_at_ack: list = []
        put = engine._requests.put

        def recording_put(item, *args, **kwargs):
            if item is not None and item.WhichOneof("kind") == "quiesced":
                idle_at_ack.append(stream.query())
            put(item, *args, **kwargs)

        engine._requests.put = recording_put
        pusher = threading.Thread(target=lambda: client.push(load_state_dict(weights(2))))
        pusher.start()
        assert first_events(engine, 1)[0].kind == "commit_pending"
        before = client.read_raw(name)[2]
        # A forward step still running when the safe point is called: a long
        # kernel, then one that reads the arena.
        torch.cuda._sleep(2_000_000_000)
        read = engine.tensors[name].view(torch.uint8).clone()
        assert not stream.query()
        assert engine.safe_point(timeout=LIMIT) is True
        pusher.join(LIMIT)
        assert idle_at_ack == [True]
        assert read.cpu().numpy().tobytes() == before  # read all of version 1
        assert engine.version == 2


@pytest.mark.gpu
@pytest.mark.parametrize("arena", ["ipc", "vmm"])
def test_a_cuda_arena_is_unmapped_with_its_last_tensor_and_reattaching_after_a_restart_works(
        start_daemon, arena):
    import gc

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    d = start_daemon("--device=cuda:0", f"--cuda-arena={arena}")
    gc.collect()
    opened_before = set(_attach_module._CudaIpc._opened)
    engine = attach(d.address, coordinate=False)
    (mapping,) = engine._device_mappings
    opened = set(_attach_module._CudaIpc._opened) - opened_before
    assert len(opened) == (1 if arena == "ipc" else 0)
    weight = engine.tensors[name]
    assert weight.is_contiguous()
    kept = weight[1:]  # a view outlives the engine
    row = weight.shape[1] * weight.element_size()
    engine.close()
    del engine, weight
    gc.collect()
    assert mapping() is not None  # the view still reads it
    with RefitClient(d.address, timeout=LIMIT) as client:
        expected = client.read_raw(name)[2]
    assert kept.view(torch.uint8).cpu().numpy().tobytes() == expected[row:]
    del kept
    gc.collect()
    assert mapping() is None
    assert not opened & set(_attach_module._CudaIpc._opened)  # closed and forgotten
    # The daemon restarts: the engine attaches to its new arena.
    d.stop()
    d = start_daemon("--device=cuda:0", f"--cuda-arena={arena}")
    with RefitClient(d.address, timeout=LIMIT) as client, \
            attach(d.address, coordinate=False) as engine:
        got = engine.tensors[name].view(torch.uint8).cpu().numpy().tobytes()
        assert got == client.read_raw(name)[2]


def test_a_cuda_region_is_found_by_its_device_uuid_not_the_daemons_ordinal():
    """The daemon's cuda:1 is this process's cuda:0 when CUDA_VISIBLE_DEVICES
    differs; a GPU this process cannot see is a FailedPrecondition naming it.
    torch.cuda is replaced at the seam (no GPU here)."""
    import types

    from refit_client import FailedPrecondition
    from refit_client._attach import _local_cuda_device
    from refit_client._proto import engine_pb2 as epb

    uuids = [bytes([0xA0 + i] * 16) for i in range(2)]
    cuda = types.SimpleNamespace(
        device_count=lambda: len(uuids),
        get_device_properties=lambda i: types.SimpleNamespace(
            uuid=types.SimpleNamespace(bytes=uuids[i])),
    )
    region = epb.ArenaRegion(kind=epb.ArenaRegion.KIND_CUDA_VMM, cuda_device=1,
                             cuda_device_uuid=uuids[0])
    assert _local_cuda_device(region, cuda) == 0
    region.cuda_device_uuid = uuids[1]
    assert _local_cuda_device(region, cuda) == 1
    region.cuda_device_uuid = bytes([0xEE] * 16)
    with pytest.raises(FailedPrecondition) as e:
        _local_cuda_device(region, cuda)
    assert "the arena's GPU (UUID " + "ee" * 16 + ", the daemon's cuda:1) is not visible" in str(e.value)
    assert ("a0" * 16) in str(e.value) and ("a1" * 16) in str(e.value)
    # A daemon that sends no UUID: its ordinal, as before.
    assert _local_cuda_device(epb.ArenaRegion(cuda_device=3), cuda) == 3


def test_an_arena_header_that_disagrees_with_the_manifest_is_refused():
    """Format, data offset, data size and layout hash are checked against the
    manifest before the memory is trusted."""
    import struct as _struct

    from refit_client import FailedPrecondition
    from refit_client._attach import _check_header
    from refit_client._proto import engine_pb2 as epb

    a = epb.Attached()
    a.layout.fingerprint = "cb4d2b65eccb4b83"
    host = a.regions.add(kind=epb.ArenaRegion.KIND_HOST_MEMFD, bytes=4096 + 512, data_offset=4096)

    def header(fmt=1, data_offset=4096, data_bytes=512, layout_hash=0xCB4D2B65ECCB4B83):
        h = bytearray(4096)
        h[:8] = b"REFITAR1"
        _struct.pack_into("<IIQQQ", h, 8, fmt, 4096, data_offset, data_bytes, layout_hash)
        return bytes(h)

    _check_header(header(), a)  # all agree
    for bad, says in [(header(fmt=2), "format 2; this client reads format 1"),
                      (header(data_offset=8192), "puts the data at 8192, the manifest at 4096"),
                      (header(data_bytes=513), "513 bytes of data at 4096, past"),
                      (header(layout_hash=1), "layout hash 0000000000000001 is not the manifest")]:
        with pytest.raises(FailedPrecondition) as e:
            _check_header(bad, a)
        assert says in str(e.value)
    # A device arena: the memfd holds only the header, the data is elsewhere.
    host.bytes = 4096
    a.regions.add(kind=epb.ArenaRegion.KIND_CUDA_VMM, bytes=512)
    _check_header(header(), a)


def test_an_unmap_due_during_a_graph_capture_waits_for_the_next_safe_point_or_attach(monkeypatch):
    """The device sync an unmap starts with would invalidate a CUDA graph
    being captured on the thread that dropped the last tensor: the unmap is
    deferred, and done once no capture is on. torch.cuda's capture state is
    replaced at the seam (no GPU here)."""
    import gc

    capturing = [True]
    monkeypatch.setattr(_attach_module, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(_attach_module, "_deferred_unmaps", __import__("collections").deque())
    unmapped = []
    mapping = _attach_module._DeviceMapping(0x1000, lambda: unmapped.append(0x1000))
    del mapping
    gc.collect()
    assert unmapped == [] and len(_attach_module._deferred_unmaps) == 1
    _attach_module._drain_deferred_unmaps()  # still capturing: nothing yet
    assert unmapped == []
    capturing[0] = False
    _attach_module._drain_deferred_unmaps()
    assert unmapped == [0x1000] and not _attach_module._deferred_unmaps
    # Not capturing: unmapped at once, as before.
    mapping = _attach_module._DeviceMapping(0x2000, lambda: unmapped.append(0x2000))
    del mapping
    gc.collect()
    assert unmapped == [0x1000, 0x2000]


def test_an_unmap_that_fails_in_its_finalizer_is_tried_again_at_the_next_safe_point(monkeypatch):
    """A finalizer runs on whichever thread drops the last tensor; while
    another thread captures a CUDA graph (global mode), CUDA refuses the
    device sync and the unmap there. The unmap is tried again at the next
    safe point, attach or close, up to three times in all, then given up with
    a warning."""
    import gc

    monkeypatch.setattr(_attach_module, "_capturing", lambda: False)
    monkeypatch.setattr(_attach_module, "_deferred_unmaps", __import__("collections").deque())
    refusals = [1]
    unmapped = []

    def unmap() -> None:
        if refusals[0] > 0:
            refusals[0] -= 1
            raise RuntimeError("operation not permitted when stream is capturing")
        unmapped.append(0x1000)

    mapping = _attach_module._DeviceMapping(0x1000, unmap)
    del mapping
    gc.collect()
    assert unmapped == [] and len(_attach_module._deferred_unmaps) == 1
    _attach_module._drain_deferred_unmaps()
    assert unmapped == [0x1000] and not _attach_module._deferred_unmaps

    # One that never succeeds: tried three times, then a warning; a drain
    # tries each deferred unmap once (no spinning on one that keeps failing).
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("cuMemUnmap failed")

    mapping = _attach_module._DeviceMapping(0x2000, broken)
    del mapping
    gc.collect()
    assert len(calls) == 1
    _attach_module._drain_deferred_unmaps()
    assert len(calls) == 2 and len(_attach_module._deferred_unmaps) == 1
    with pytest.warns(RuntimeWarning, match="failed 3 times, the last: cuMemUnmap failed"):
        _attach_module._drain_deferred_unmaps()
    assert len(calls) == 3 and not _attach_module._deferred_unmaps
    _attach_module._drain_deferred_unmaps()
    assert len(calls) == 3


def test_the_ordered_header_reads_module_is_built():
    # setup.sh installs the package with a C compiler at hand: the header's
    # seqlock reads must not have fallen back to struct's (unordered on
    # AArch64), silently.
    from refit_client import _atomics

    assert _attach_module.ORDERED_HEADER_READS
    assert _attach_module._load_acquire is _atomics.load_acquire


def test_load_acquire_reads_whole_little_endian_words_and_refuses_bad_offsets(tmp_path):
    load_acquire = pytest.importorskip("refit_client._atomics").load_acquire
    import mmap

    words = [0, 1, 0xFF, 0x100, 2**63 + 5, 2**64 - 1, 0x0123456789ABCDEF]
    path = tmp_path / "header"
    path.write_bytes(struct.pack(f"<{len(words)}Q", *words))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        # A read-only shared mapping, as an engine maps the arena.
        assert [load_acquire(m, 8 * i) for i in range(len(words))] == words
        n = len(m)
        with pytest.raises(IndexError, match=f"offset {n - 7} is outside a {n}-byte buffer"):
            load_acquire(m, n - 7)
        with pytest.raises(IndexError, match="offset -8 is outside"):
            load_acquire(m, -8)
        with pytest.raises(ValueError, match="offset 4 is not 8-byte aligned"):
            load_acquire(m, 4)
    with pytest.raises(IndexError, match="outside a 4-byte buffer"):
        load_acquire(b"\0" * 4, 0)
    with pytest.raises(TypeError):
        load_acquire("not a buffer", 0)


def test_without_ordered_header_reads_attach_warns_off_x86(daemon, client, weights, monkeypatch):
    # Built without a C compiler, on a machine that reorders loads: the engine
    # is told, and still reads the header (with struct) correctly.
    monkeypatch.setattr(_attach_module, "ORDERED_HEADER_READS", False)
    monkeypatch.setattr(
        _attach_module, "_load_acquire", lambda buf, off: struct.unpack_from("<Q", buf, off)[0]
    )
    pushed = client.push(load_state_dict(weights(2)))
    with pytest.warns(RuntimeWarning, match="seqlock reads are not ordered"):
        engine = attach(daemon.address, coordinate=False)
    with engine:
        assert engine.arena_commit() == (pushed.version, pushed.refit_id, pushed.fingerprint)
        assert engine.committed_at()[0] == pushed.version
