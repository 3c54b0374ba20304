"""Pinned reads against a real refitd, from `refitctl read --at-version` and
from RefitClient.read / read_raw(version=...): the live version reads,
another is ABORTED (exit 5, RefitConflict) naming both versions."""

from __future__ import annotations

import grpc
import pytest

from refit_client import RefitConflict

from conftest import load_state_dict, refitctl

NAME = "model.layers.0.mlp.down_proj.weight"


def test_read_at_the_live_version(daemon, tmp_path):
    out = tmp_path / "t.bin"
    read = refitctl(daemon.address, "read", NAME, "--at-version", "1", "--out", str(out))
    assert read.returncode == 0, read.stderr
    assert out.stat().st_size == 128 * 352


def test_read_at_another_version_is_a_conflict(daemon):
    read = refitctl(daemon.address, "read", NAME, "--at-version", "7", "--out", "/dev/null")
    assert read.returncode == 5, read.stderr
    assert "pinned to version 7 but version 1 is live" in read.stderr


def test_a_read_pinned_to_the_served_version_reads_it(client):
    live = client.status().version
    info, version, data = client.read_raw(NAME, version=live)
    assert version == live and info.name == NAME
    assert data == client.read_raw(NAME)[2]
    assert client.read(NAME, version=live).tobytes() == data


@pytest.mark.parametrize("pinned", [7, 0])
def test_a_read_pinned_to_a_version_not_served_is_a_conflict(client, pinned):
    for read in (client.read_raw, client.read):
        with pytest.raises(RefitConflict) as e:
            read(NAME, version=pinned)
        assert e.value.code == grpc.StatusCode.ABORTED
        assert f"pinned to version {pinned} but version 1 is live" in e.value.message


def test_reads_pinned_to_one_version_fail_once_another_is_committed(client, weights):
    """Several tensors read pinned to one version: a commit between them
    fails the later reads, never mixing versions."""
    names = [t.name for t in client.tensors()]
    pinned = client.status().version
    first = client.read_raw(names[0], version=pinned)
    assert first[1] == pinned
    client.push(load_state_dict(weights(2)))
    with pytest.raises(RefitConflict) as e:
        client.read_raw(names[1], version=pinned)
    assert f"pinned to version {pinned} but version {pinned + 1} is live" in e.value.message


def test_a_read_pinned_to_a_fingerprint_reads_only_that_content(client):
    """A version number alone names a version of one daemon's life; the
    fingerprint names the weights."""
    status = client.status()
    _, version, data = client.read_raw(NAME, version=status.version, fingerprint=status.fingerprint)
    assert version == status.version and data == client.read_raw(NAME)[2]
    for read in (client.read_raw, client.read):
        with pytest.raises(RefitConflict) as e:
            read(NAME, fingerprint="0123456789abcdef")
        assert (f'pinned to fingerprint "0123456789abcdef" but version {status.version} '
                f"(fingerprint {status.fingerprint}) is live") in e.value.message


def test_an_unpinned_read_a_commit_cuts_is_read_again(client):
    """A read a commit cuts (the daemon ends it ABORTED) is read again when
    unpinned, up to READ_ATTEMPTS times in all; pinned, it is a conflict at
    once. The cut is simulated at the client's one-read seam; the daemon's
    side is tested in C++ (RefitLimitsTest.ReadTensorAcrossACommitIsAborted)."""
    from refit_client.errors import error_for

    calls = []
    real = client._read_once
    cuts = [2]

    def cut(request, deadline):
        calls.append(request.HasField("version"))
        if cuts[0] > 0:
            cuts[0] -= 1
            raise error_for(grpc.StatusCode.ABORTED, "version 2 was committed while version 1 "
                            "was being read")
        return real(request, deadline)

    client._read_once = cut
    _, version, data = client.read_raw(NAME)
    assert calls == [False, False, False]
    assert version == 1 and data == real(pb_request(NAME), None)[2]
    calls.clear()
    cuts[0] = 100
    with pytest.raises(RefitConflict):
        client.read_raw(NAME)
    assert len(calls) == client.READ_ATTEMPTS
    calls.clear()
    cuts[0] = 1
    with pytest.raises(RefitConflict):
        client.read_raw(NAME, version=1)
    assert calls == [True]


def pb_request(name):
    from refit_client._proto import refit_pb2

    return refit_pb2.ReadTensorRequest(name=name)


def test_a_fingerprint_pin_a_daemon_does_not_answer_is_refused(client):
    """A daemon that does not know the pin serves whatever is live: the
    client checks the fingerprint that comes back. The older daemon is
    simulated at the stub (the pin dropped, no fingerprint answered)."""
    from refit_client import FailedPrecondition
    from refit_client._proto import refit_pb2

    real = client._stub.ReadTensor

    def older_daemon(request, **kwargs):
        request = refit_pb2.ReadTensorRequest.FromString(request.SerializeToString())
        request.ClearField("fingerprint")
        for m in real(request, **kwargs):
            m.fingerprint = ""
            yield m

    client._stub.ReadTensor = older_daemon
    with pytest.raises(FailedPrecondition) as e:
        client.read_raw(NAME, fingerprint=client.status().fingerprint)
    assert "does not answer fingerprint pins" in e.value.message
    assert client.read_raw(NAME)[1] == client.status().version  # unpinned: as before
