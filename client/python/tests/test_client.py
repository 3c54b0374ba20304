"""Read-only calls, health, auth, reachability and reload against a real refitd."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from refit_client import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RefitClient,
    Unavailable,
)

from conftest import REPO, load_state_dict


def test_status_and_health(client):
    status = client.status()
    assert status.version == 1
    assert status.ready
    assert len(status.fingerprint) == 16
    assert status.model.architecture == "LlamaForCausalLM"
    assert status.model.num_layers == 2
    assert status.active_refit is None
    health = client.health()
    assert (health.live, health.ready, health.serving) == ("SERVING", "SERVING", True)


def test_tensors_in_both_layouts(client):
    checkpoint = {t.name: t for t in client.tensors(layout="checkpoint")}
    embed = checkpoint["model.embed_tokens.weight"]
    assert (embed.dtype, embed.shape, embed.nbytes) == ("bf16", (1000, 128), 256000)
    assert checkpoint["model.layers.0.self_attn.rotary_emb.inv_freq"].optional
    kernel = {t.name: t for t in client.tensors()}
    qkv = kernel["model.layers.0.self_attn.qkv_proj.weight"]
    assert (qkv.dtype, qkv.shape) == ("fp8_e4m3", (256, 128))
    assert qkv.layer
    with pytest.raises(InvalidArgument, match="layout"):
        client.tensors(layout="fused")


def test_read_kernels_as_numpy_and_torch(client, weights):
    client.push(load_state_dict(weights(2)))
    norm = client.read("model.norm.weight")
    assert norm.dtype == np.uint16 and norm.shape == (128,)  # bf16 bits
    qkv = client.read("model.layers.0.self_attn.qkv_proj.weight", as_="torch")
    assert qkv.dtype == torch.float8_e4m3fn and tuple(qkv.shape) == (256, 128)
    scale = client.read("model.layers.0.self_attn.qkv_proj.weight_scale", as_="torch")
    assert scale.dtype == torch.float32 and scale.item() > 0
    info, version, data = client.read_raw("model.norm.weight")
    assert (info.nbytes, version, len(data)) == (256, 2, 256)
    with pytest.raises(NotFound, match="model.no_such.weight"):
        client.read("model.no_such.weight")


def test_watch_sees_a_commit(client, weights):
    with client.watch() as events:
        snapshot = next(events)
        assert (snapshot.type, snapshot.version) == ("SNAPSHOT", 1)
        result = client.push(load_state_dict(weights(2)), label="watched")
        seen = [next(events) for _ in range(3)]
    assert [e.type for e in seen] == ["STAGING_STARTED", "PREPARED", "COMMITTED"]
    assert seen[-1].refit_id == result.refit_id
    assert (seen[-1].version, seen[-1].fingerprint) == (2, result.fingerprint)


def _token_files(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "tokens").write_text(
        "# token role name\ntok-trainer trainer alice\ntok-reader reader bob\n"
    )
    (tmp_path / "trainer.token").write_text("tok-trainer\n")
    return tmp_path / "tokens"


def test_tokens(start_daemon, tmp_path, weights):
    daemon = start_daemon(f"--auth-tokens={_token_files(tmp_path)}")
    seed2 = load_state_dict(weights(2))
    with RefitClient(daemon.address, token="not-a-token") as wrong:
        with pytest.raises(PermissionDenied) as e:
            wrong.status()
        assert e.value.code.name == "UNAUTHENTICATED"
        with pytest.raises(PermissionDenied):
            wrong.push(seed2)
        assert wrong.health().serving  # health needs no token
    with RefitClient(daemon.address) as anonymous:
        with pytest.raises(PermissionDenied) as e:
            anonymous.status()
        assert e.value.code.name == "UNAUTHENTICATED"
    with RefitClient(daemon.address, token="tok-reader") as reader:
        assert reader.status().version == 1
        with pytest.raises(PermissionDenied) as e:
            reader.push(seed2)
        assert e.value.code.name == "PERMISSION_DENIED"
    with RefitClient(daemon.address, token_file=str(tmp_path / "trainer.token")) as trainer:
        assert trainer.push(seed2).version == 2


def test_unreachable_daemon_is_unavailable():
    missing = tempfile.mkdtemp(prefix="rfp-", dir="/tmp") + "/absent.sock"
    with RefitClient(f"unix:{missing}", timeout=1.0) as c:
        with pytest.raises(Unavailable) as e:
            c.push({"model.norm.weight": np.zeros(128, np.float32)})
        assert missing in e.value.message
        with pytest.raises(Unavailable) as e:
            c.status()
        assert "unreachable" in e.value.message and missing in e.value.message
        with pytest.raises(DeadlineExceeded, match="not ready"):
            c.wait_until_ready(timeout=0.5)


def test_wait_until_ready_while_the_daemon_starts(start_daemon):
    daemon = start_daemon(wait=False)
    socket = daemon.args[2].split("=", 1)[1]
    with RefitClient(socket) as c:
        assert c.wait_until_ready(timeout=60).serving
        assert c.status().version == 1
    daemon.wait_for_line("first version loaded; ready", timeout=1)


def test_tcp_listener(start_daemon):
    daemon = start_daemon(tcp=True)
    assert daemon.address.startswith("127.0.0.1:")
    with RefitClient(daemon.address) as c:
        assert c.status().version == 1


def test_reload(start_daemon, weights):
    root = weights(2).parent
    daemon = start_daemon(f"--reload-root={root}")
    progress = []
    with RefitClient(daemon.address) as c:
        result = c.reload(str(weights(2)), progress.append)
        assert (result.state, result.version) == ("COMMITTED", 2)
        assert progress and progress[-1].elements_loaded > 0
        assert c.push(load_state_dict(weights(2))).fingerprint == result.fingerprint
        with pytest.raises(PermissionDenied):
            c.reload("/etc")


def test_example_short_run(daemon):
    example = REPO / "client" / "python" / "examples" / "train_and_refit.py"
    run = subprocess.run(
        [sys.executable, str(example), f"--addr={daemon.address}", "--steps=2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every kernel matches" in run.stdout


def _make_certificates(directory: pathlib.Path) -> None:
    """A test CA, a server certificate for 127.0.0.1 / localhost signed by it,
    a client certificate, and an unrelated CA, made with openssl."""
    script = """
set -e
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=refit-test-ca -keyout ca.key -out ca.pem
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext
openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key -out server.csr
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \\
  -extfile server.ext -out server.pem
openssl req -newkey rsa:2048 -nodes -subj /CN=trainer -keyout client.key -out client.csr
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out client.pem
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=other-ca -keyout other.key -out other.pem
"""
    subprocess.run(["/bin/sh", "-c", script], cwd=directory, check=True, capture_output=True)


def test_tls_with_a_test_ca(start_daemon, tmp_path, weights):
    from refit_client import Tls

    certs = tmp_path / "certs"
    certs.mkdir()
    _make_certificates(certs)
    daemon = start_daemon(
        f"--tls-cert={certs / 'server.pem'}", f"--tls-key={certs / 'server.key'}", tcp=True
    )
    with RefitClient(daemon.address, tls=Tls(ca_file=str(certs / "ca.pem"))) as c:
        assert c.status().version == 1
        result = c.push(load_state_dict(weights(2)))
        assert result.version == 2
    # A CA that did not sign the daemon's certificate: the handshake fails,
    # and the read-only call gives up at its deadline.
    with RefitClient(
        daemon.address, tls=Tls(ca_file=str(certs / "other.pem")), timeout=3
    ) as c:
        with pytest.raises((Unavailable, DeadlineExceeded)):
            c.status()
    # A missing CA file is named.
    with pytest.raises(NotFound, match="no-such-ca.pem"):
        RefitClient(daemon.address, tls=Tls(ca_file=str(certs / "no-such-ca.pem")))


def test_mutual_tls_needs_a_client_certificate(start_daemon, tmp_path):
    from refit_client import Tls

    certs = tmp_path / "certs"
    certs.mkdir()
    _make_certificates(certs)
    daemon = start_daemon(
        f"--tls-cert={certs / 'server.pem'}",
        f"--tls-key={certs / 'server.key'}",
        f"--tls-client-ca={certs / 'ca.pem'}",
        tcp=True,
    )
    with RefitClient(daemon.address, tls=Tls(ca_file=str(certs / "ca.pem")), timeout=3) as c:
        with pytest.raises((Unavailable, DeadlineExceeded)):
            c.status()
    tls = Tls(
        ca_file=str(certs / "ca.pem"),
        cert_file=str(certs / "client.pem"),
        key_file=str(certs / "client.key"),
    )
    with RefitClient(daemon.address, tls=tls) as c:
        assert c.status().version == 1


def test_a_unix_path_too_long_for_a_socket_address_is_refused_naming_it():
    # 108 bytes: one more than sockaddr_un holds; gRPC's own error would only
    # say "the target uri is not valid".
    for address in ("unix:/" + "d" * 107, "unix:///" + "d" * 107):
        with pytest.raises(InvalidArgument, match="its socket path is 108 bytes"):
            RefitClient(address)
    RefitClient("unix:/" + "d" * 106).close()  # fits: refused only when called
