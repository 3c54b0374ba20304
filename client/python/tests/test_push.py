"""Pushes from torch, numpy and iterators against a real refitd; every form
gives the fingerprint that `refitctl push` of the same files gives."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import refit_client
from refit_client import (
    ChecksumMismatch,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RefitClient,
    RefitConflict,
    StaleBaseVersion,
)

from conftest import load_state_dict, refitctl


@pytest.fixture
def seed2(weights):
    return load_state_dict(weights(2))


def refitctl_fingerprint(daemon, directory) -> str:
    """Pushes `directory` with refitctl and returns the new fingerprint."""
    push = refitctl(daemon.address, "push", str(directory))
    assert push.returncode == 0, push.stderr
    return RefitClient(daemon.address).status().fingerprint


def test_push_torch_state_dict_matches_refitctl_push(client, daemon, weights, seed2):
    progress = []
    result = client.push(seed2, label="py-step-1", progress=progress.append)
    assert result.state == "COMMITTED"
    assert result.version == 2
    assert result.refit_id
    assert result.kept_layers == ()
    assert result.partial_layers == ()
    assert result.timings.commit_seconds >= 0
    assert result.bytes_received == sum(t.numel() * t.element_size() for t in seed2.values())
    assert progress and progress[-1].tensors_total == len(seed2)
    assert progress[-1].bytes_sent == result.bytes_received
    status = client.status()
    assert (status.version, status.fingerprint) == (2, result.fingerprint)

    assert refitctl_fingerprint(daemon, weights(3)) != result.fingerprint
    # The same files through refitctl give the same kernels.
    assert refitctl_fingerprint(daemon, weights(2)) == result.fingerprint


def test_numpy_bf16_bits_from_an_iterator(client, daemon, weights, seed2):
    expected = refitctl_fingerprint(daemon, weights(2))
    refitctl_fingerprint(daemon, weights(3))

    def generate():  # never holds more than one tensor
        for name, t in seed2.items():
            yield name, t.view(torch.int16).numpy().view(np.uint16), "bf16"

    result = client.push(generate())
    assert result.fingerprint == expected
    assert result.version == 4

    refitctl_fingerprint(daemon, weights(3))
    helper = {name: refit_client.bf16(t.view(torch.int16).numpy()) for name, t in seed2.items()}
    assert client.push(helper).fingerprint == expected


def test_fp32_and_fp16_are_converted_by_the_daemon(client, daemon, weights, seed2):
    expected = refitctl_fingerprint(daemon, weights(2))
    refitctl_fingerprint(daemon, weights(3))
    # bf16 -> fp32 is exact, so the kernels are those of the bf16 push.
    as_fp32 = {name: t.float().numpy() for name, t in seed2.items()}
    assert client.push(as_fp32).fingerprint == expected

    as_fp16 = [(name, t.to(torch.float16)) for name, t in seed2.items()]
    result = client.push(as_fp16, label="fp16")
    assert result.version == 5
    norm = client.read("model.norm.weight", as_="torch")
    assert norm.dtype == torch.bfloat16
    assert torch.equal(norm, seed2["model.norm.weight"].to(torch.float16).to(torch.bfloat16))


def test_non_contiguous_views_and_tiny_chunks(client, daemon, weights, seed2):
    expected = refitctl_fingerprint(daemon, weights(2))
    refitctl_fingerprint(daemon, weights(3))
    views = {}
    for name, t in seed2.items():
        if t.dim() == 2:
            t = t.t().contiguous().t()  # same values, transposed strides
            assert not t.is_contiguous()
        views[name] = t
    # Odd sizes: chunks split tensors, buckets hold parts of several.
    result = client.push(views, chunk_bytes=3001, bucket_bytes=10007)
    assert result.fingerprint == expected


def test_refit_context_manager(client, seed2):
    v0 = client.status()
    with client.refit(label="incremental") as r:
        for name, t in seed2.items():
            r.send(name, t)
    assert r.result is not None and r.result.version == v0.version + 1


def test_refit_aborts_when_the_block_raises(client, seed2):
    v0 = client.status()
    with client.watch() as events:
        assert next(events).type == "SNAPSHOT"
        with pytest.raises(RuntimeError, match="trainer crashed"):
            with client.refit(label="doomed") as r:
                for i, (name, t) in enumerate(seed2.items()):
                    r.send(name, t)
                    if i == 5:
                        raise RuntimeError("trainer crashed")
        assert next(events).type == "STAGING_STARTED"
        aborted = next(events)
        assert aborted.type == "ABORTED"
    after = client.status()
    assert (after.version, after.fingerprint) == (v0.version, v0.fingerprint)
    assert after.active_refit is None
    # The group is free at once: the abort was confirmed before raising.
    assert client.push(seed2).version == v0.version + 1


def test_prepare_then_commit(client, daemon, weights, seed2):
    v0 = client.status()
    prepared = client.push(seed2, prepare=True)
    assert prepared.state == "PREPARED"
    assert prepared.version == v0.version
    status = client.status()
    assert status.version == v0.version
    assert status.active_refit is not None
    assert status.active_refit.state == "PREPARED"
    assert status.active_refit.refit_id == prepared.refit_id
    committed = client.commit(prepared.refit_id)
    assert committed.state == "COMMITTED"
    assert committed.version == v0.version + 1
    assert client.status().fingerprint == committed.fingerprint
    assert refitctl_fingerprint(daemon, weights(2)) == committed.fingerprint


def test_prepare_then_abort(client, seed2):
    v0 = client.status()
    prepared = client.push(seed2, prepare=True)
    aborted = client.abort(prepared.refit_id, reason="eval regressed")
    assert aborted.refit_id == prepared.refit_id
    assert aborted.version == v0.version
    after = client.status()
    assert (after.version, after.fingerprint, after.active_refit) == (
        v0.version,
        v0.fingerprint,
        None,
    )
    with pytest.raises(NotFound) as e:
        client.commit(prepared.refit_id)
    assert prepared.refit_id in e.value.message


def test_stale_base_version(client, seed2):
    live = client.status().version
    with pytest.raises(StaleBaseVersion) as e:
        client.push(seed2, base_version=live + 7)
    assert isinstance(e.value, RefitConflict)
    assert e.value.code.name == "ABORTED"
    assert "expects base version" in e.value.message
    assert client.status().version == live
    assert client.push(seed2, base_version=live).version == live + 1


def test_concurrent_push_conflicts(client, seed2):
    items = list(seed2.items())
    with client.watch() as events:
        assert next(events).type == "SNAPSHOT"
        with client.refit(label="first") as first:
            first.send(*items[0])
            started = next(events)
            assert started.type == "STAGING_STARTED"
            with pytest.raises(RefitConflict) as e:
                client.push(seed2, label="second")
            assert not isinstance(e.value, StaleBaseVersion)
            assert started.refit_id in e.value.message
            for name, t in items[1:]:
                first.send(name, t)
    assert first.result is not None and first.result.refit_id == started.refit_id


def test_concurrent_pushes_from_threads_one_wins(client, seed2):
    v0 = client.status().version
    outcomes = []
    barrier = threading.Barrier(2)

    def push():
        barrier.wait()
        try:
            outcomes.append(client.push(seed2).version)
        except RefitConflict as e:
            outcomes.append(e)

    threads = [threading.Thread(target=push) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    versions = sorted(o for o in outcomes if isinstance(o, int))
    # Either both ran one after the other, or one lost with ABORTED.
    assert versions in ([v0 + 1], [v0 + 1, v0 + 2])
    assert client.status().version == v0 + len(versions)


def test_daemon_errors_are_typed(client, seed2, monkeypatch):
    v0 = client.status()
    with pytest.raises(NotFound, match="model.layers.9.mlp.up_proj.weight"):
        client.push({"model.layers.9.mlp.up_proj.weight": seed2["model.layers.0.mlp.up_proj.weight"]})
    with pytest.raises(InvalidArgument):
        client.push({"model.norm.weight": torch.zeros(7, dtype=torch.bfloat16)})
    with pytest.raises(FailedPrecondition, match="model.layers.0"):
        client.push({"model.layers.0.self_attn.q_proj.weight": seed2["model.layers.0.self_attn.q_proj.weight"]})
    monkeypatch.setattr(refit_client._client.xxhash, "xxh3_64_intdigest", lambda data: 12345)
    with pytest.raises(ChecksumMismatch) as e:
        client.push(seed2, lane="grpc")  # checksums travel with the bytes
    assert e.value.code.name == "DATA_LOSS"
    assert client.status().fingerprint == v0.fingerprint


def test_local_errors_send_nothing(client):
    v0 = client.status().version
    with pytest.raises(InvalidArgument, match="bf16"):
        client.push({"model.norm.weight": np.zeros(128, dtype=np.uint16)})
    with pytest.raises(InvalidArgument, match="int64"):
        client.push({"model.norm.weight": torch.zeros(128, dtype=torch.int64)})
    with pytest.raises(InvalidArgument, match="no tensors"):
        client.push({})
    with pytest.raises(InvalidArgument, match="non_finite"):
        client.push({"x": np.zeros(1, np.float32)}, non_finite="maybe")
    assert client.status().version == v0
    assert client.status().active_refit is None


@pytest.mark.gpu
def test_push_from_cuda_tensors(client, daemon, weights, seed2):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    expected = refitctl_fingerprint(daemon, weights(2))
    refitctl_fingerprint(daemon, weights(3))
    on_gpu = {name: t.cuda() for name, t in seed2.items()}
    views = {n: (t.t().contiguous().t() if t.dim() == 2 else t) for n, t in on_gpu.items()}
    assert client.push(views, chunk_bytes=1 << 16).fingerprint == expected


def test_tqdm_progress_bar(client, seed2):
    import io

    from refit_client import TqdmProgress

    out = io.StringIO()
    bar = TqdmProgress(file=out, mininterval=0)
    result = client.push(seed2, progress=bar)
    assert result.version == 2
    total = sum(t.numel() * t.element_size() for t in seed2.values())
    assert bar.bar.n == total
    text = out.getvalue()
    assert "push" in text and f"{len(seed2)}/{len(seed2)} tensors" in text
    # The shortcut makes the same bar on stderr.
    assert client.push(seed2, progress="tqdm").version == 3


def test_push_of_part_of_the_model_is_refused_unless_asked_for(client, seed2):
    v0 = client.status()
    part = {k: v for k, v in seed2.items() if k.startswith("model.layers.0.")}
    with pytest.raises(FailedPrecondition, match=r"require_complete.*model\.embed_tokens\.weight"):
        client.push(part)
    assert client.status().fingerprint == v0.fingerprint
    result = client.push(part, require_complete=False)
    assert result.version == v0.version + 1
    assert "model.embed_tokens" in result.kept_layers
    assert not result.unchanged


def test_push_over_streams_matches_one_stream(client, daemon, weights, seed2):
    """streams=3 splits the tensors over three Push streams of one refit: one
    commit, the same kernels as refitctl push of the same files."""
    expected = refitctl_fingerprint(daemon, weights(2))
    refitctl_fingerprint(daemon, weights(3))
    before = client.status().version
    progress = []
    result = client.push(seed2, streams=3, refit_id="py-streams.1", progress=progress.append)
    assert result.state == "COMMITTED"
    assert result.refit_id == "py-streams.1"
    assert result.version == before + 1
    assert result.fingerprint == expected
    assert result.bytes_received == sum(t.numel() * t.element_size() for t in seed2.values())
    assert progress[-1].bytes_sent == result.bytes_received


def test_push_over_streams_refusals(client, seed2):
    with pytest.raises(InvalidArgument, match="streams must be at least 1"):
        client.push(seed2, streams=0)
    with pytest.raises(InvalidArgument, match="refit_id"):
        client.push(seed2, streams=2, refit_id="no spaces")
    # A stream that fails aborts the whole refit; the cause is raised.
    bad = dict(seed2)
    bad["no.such.tensor"] = torch.zeros(2, dtype=torch.bfloat16)
    before = client.status().version
    with pytest.raises(NotFound, match="no.such.tensor"):
        client.push(bad, streams=2)
    assert client.status().version == before
