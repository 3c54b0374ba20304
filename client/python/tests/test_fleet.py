"""FleetClient against a real etcd and two refitd fleet members."""

import shutil
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

from conftest import stepping
from refit_client import FleetClient, RefitClient, RefitConflict, attach


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    if not shutil.which(binary):
        pytest.skip("no etcd binary (apt-get install etcd-server; scripts/setup.sh does)")
    client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [binary, "--name=t", f"--data-dir={tmp_path}/etcd", f"--listen-client-urls={client}",
         f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=t={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                if b"true" in r.read():
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "etcd did not become healthy"
        time.sleep(0.05)  # the next health check, bounded by the deadline
    yield client[len("http://"):]
    proc.kill()
    proc.wait()


def test_fleet_push_flips_every_member(etcd, start_daemon, weights):
    members = []
    for i in range(2):
        d = start_daemon("--fleet=py", f"--etcd={etcd}", f"--fleet-member=m{i}")
        d.wait_for_line("joined the fleet")
        members.append(d)
    fleet = FleetClient(etcd=etcd, fleet="py")
    before = fleet.status()
    assert before["fleet_version"] == 0 and len(before["members"]) == 2
    result = fleet.push(str(weights(3)), label="py fleet")
    assert result.fleet_version == 1
    assert all(m.committed for m in result.members), result.members
    assert len({m.fingerprint for m in result.members}) == 1
    for m in result.members:  # each member's commit: its end and its pause
        assert m.commit_unix_seconds > 0 and 0 < m.commit_seconds < 60, m
    ends = [m.commit_unix_seconds for m in result.members]
    assert result.flip_skew_seconds == pytest.approx(max(ends) - min(ends))
    for d in members:
        with RefitClient(d.address, timeout=30) as c:
            assert c.status().version == 2
    # The members' registrations catch up with the commit (their own loop).
    deadline = time.monotonic() + 10
    while not fleet.status()["consistent"]:
        assert time.monotonic() < deadline, fleet.status()
        time.sleep(0.05)  # bounded poll of etcd


def test_a_dead_first_etcd_endpoint_is_skipped_for_the_next(etcd, start_daemon, weights):
    # A cluster whose first member is down: the daemons (refitd's EtcdClient)
    # and FleetClient both move on to the next endpoint.
    endpoints = f"127.0.0.1:{_free_port()},{etcd}"
    members = []
    for i in range(2):
        d = start_daemon("--fleet=pydead", f"--etcd={endpoints}", f"--fleet-member=d{i}")
        d.wait_for_line("joined the fleet")
        members.append(d)
    fleet = FleetClient(etcd=endpoints, fleet="pydead")
    assert len(fleet.status()["members"]) == 2
    assert fleet._etcd.base == f"http://{etcd}"  # the live one answers from now on
    result = fleet.push(str(weights(3)))
    assert result.fleet_version == 1
    assert all(m.committed for m in result.members), result.members
    for d in members:
        with RefitClient(d.address, timeout=30) as c:
            assert c.status().version == 2


def test_every_etcd_endpoint_dead_is_unavailable_naming_each():
    from refit_client import Unavailable

    dead = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
    fleet = FleetClient(etcd=",".join(dead), fleet="nobody")
    with pytest.raises(Unavailable) as e:
        fleet.status()
    for endpoint in dead:
        assert f"etcd http://{endpoint}/v3/kv/range" in str(e.value)


def test_fleet_push_of_tensors_or_of_a_missing_path_is_refused_before_etcd(tmp_path):
    import torch
    from refit_client import RefitError

    # No etcd listens: each refusal comes before any call to it.
    fleet = FleetClient(etcd=f"127.0.0.1:{_free_port()}", fleet="nobody")
    with pytest.raises(TypeError, match="takes checkpoint paths .* not tensors"):
        fleet.push({"model.embed_tokens.weight": torch.zeros(4)})
    with pytest.raises(TypeError, match="got a Tensor"):
        fleet.push([torch.zeros(4)])
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(RefitError, match=f"no such checkpoint file or directory: {missing}"):
        fleet.push([str(missing)])


def test_a_member_whose_engine_quiesces_late_commits_the_decided_refit_when_it_does(
        etcd, start_daemon, weights):
    # The fleet decides commit while member m0's coordinated engine is busy
    # past --engine-quiesce-timeout: m0's refit stays PREPARED and m0 tries
    # the decided commit again until the engine answers, instead of dropping
    # the refit and staying behind the fleet. Its tries go on past the
    # fleet's prepared deadline (2 s) as they were, applying the decision it
    # read: no presumed abort, no asking etcd again.
    slow = start_daemon("--fleet=pyslow", f"--etcd={etcd}", "--fleet-member=m0",
                        "--engine-quiesce-timeout=300ms", "--prepared-timeout=60s",
                        "--fleet-prepared-timeout=2s")
    other = start_daemon("--fleet=pyslow", f"--etcd={etcd}", "--fleet-member=m1")
    for d in (slow, other):
        d.wait_for_line("joined the fleet")
    with attach(slow.address, name="busy") as engine:
        result = FleetClient(etcd=etcd, fleet="pyslow").push(str(weights(3)))
        by_member = {m.member_id: m for m in result.members}
        assert by_member["m1"].committed and not by_member["m0"].committed, result.members
        slow.wait_for_line("still prepared, trying again")
        with RefitClient(slow.address, timeout=30) as c:
            assert c.status().version == 1
            # Behind the fleet meanwhile: out of its Service.
            deadline = time.monotonic() + 10
            while c.health().ready != "NOT_SERVING":
                assert time.monotonic() < deadline, c.health()
                time.sleep(0.05)  # bounded poll of the member's readiness
            # Past the fleet's prepared deadline (tries of 300 ms each).
            while slow.log.count("still prepared, trying again") < 10:
                assert time.monotonic() < deadline + 20, slow.log
                time.sleep(0.1)  # bounded poll of the daemon's log
        # The engine reaches its safe points again: the next try commits.
        with stepping(lambda: engine.safe_point(timeout=0.05)):
            slow.wait_for_line("fleet decision commit: prepared refit committed")
    assert "fleet prepared deadline passed" not in slow.log
    with RefitClient(slow.address, timeout=30) as c, RefitClient(other.address, timeout=30) as o:
        assert c.status().version == 2
        assert c.status().fingerprint == o.status().fingerprint
        deadline = time.monotonic() + 10
        while c.health().ready != "SERVING":
            assert time.monotonic() < deadline, c.health()
            time.sleep(0.05)  # bounded poll of the member's readiness


def test_a_member_waiting_on_its_engine_keeps_its_fleet_registration(
        etcd, start_daemon, weights):
    # Each try of a decided commit waits up to --engine-quiesce-timeout for a
    # busy engine, try after try. The lease's keep-alives do not wait behind
    # them: the registration (lease TTL 2 s, shorter than one try) stays, on
    # the lease it was granted, the whole time.
    d = start_daemon("--fleet=pylease", f"--etcd={etcd}", "--fleet-member=m0",
                     "--fleet-lease-ttl=2s", "--engine-quiesce-timeout=3s",
                     "--prepared-timeout=60s", "--fleet-prepared-timeout=60s")
    d.wait_for_line("joined the fleet")
    fleet = FleetClient(etcd=etcd, fleet="pylease")
    key = "/refitd/fleet/pylease/members/m0"
    registered = fleet._etcd.get(key)
    assert registered is not None and registered.get("lease", "0") != "0", registered
    with attach(d.address, name="busy"):
        pushed = threading.Thread(target=lambda: fleet.push(str(weights(3))))
        pushed.start()
        try:
            d.wait_for_line("still prepared, trying again")
            # Two more tries (6 s): three lease TTLs without an answer from
            # the engine.
            deadline = time.monotonic() + 30
            while d.log.count("still prepared, trying again") < 3:
                assert time.monotonic() < deadline, d.log
                time.sleep(0.1)  # bounded poll of the daemon's log
            now = fleet._etcd.get(key)
            assert now is not None, "the member's registration expired"
            assert now["lease"] == registered["lease"]
            assert now["create_revision"] == registered["create_revision"]
            assert "lease expired" not in d.log
        finally:
            pushed.join()


def test_fleet_push_while_the_lock_is_held_is_a_conflict(etcd, start_daemon, weights):
    d = start_daemon("--fleet=py2", f"--etcd={etcd}", "--fleet-member=only")
    d.wait_for_line("joined the fleet")
    fleet = FleetClient(etcd=etcd, fleet="py2")
    fleet._etcd.put("/refitd/fleet/py2/lock", '{"fleet_refit_id": "other"}')
    with pytest.raises(RefitConflict, match="in progress"):
        fleet.push(str(weights(3)))


def test_old_decisions_are_deleted_keeping_the_newest(etcd, start_daemon, weights):
    d = start_daemon("--fleet=py3", f"--etcd={etcd}", "--fleet-member=only",
                     "--fleet-prepared-timeout=1s")
    d.wait_for_line("joined the fleet")
    fleet = FleetClient(etcd=etcd, fleet="py3", keep_decisions=1)
    for seed in (3, 4):
        fleet.push(str(weights(seed)))
    # Those younger than the prepared timeout stay whatever their number.
    assert len(fleet._etcd.get_prefix("/refitd/fleet/py3/decisions/")) >= 1
    # A decision goes only once it is older than every member's prepared
    # timeout (1 s): the condition is the keys' age, so time passes.
    time.sleep(1.2)
    result = fleet.push(str(weights(5)))
    kept = fleet._etcd.get_prefix("/refitd/fleet/py3/decisions/")
    assert len(kept) == 1
    assert kept[0]["key"] == _b64(f"/refitd/fleet/py3/decisions/{result.fleet_refit_id}")


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def _make_certificates(directory) -> None:
    """A CA, a certificate for 127.0.0.1 / localhost signed by it (etcd's and
    the members'), a client certificate, and an unrelated CA."""
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


@pytest.fixture
def tls_etcd(tmp_path):
    """A real etcd serving TLS with client certificates required; yields
    (https endpoint, certificate directory)."""
    import ssl

    binary = shutil.which("etcd") or "/usr/bin/etcd"
    if not shutil.which(binary):
        pytest.skip("no etcd binary (apt-get install etcd-server; scripts/setup.sh does)")
    certs = tmp_path / "certs"
    certs.mkdir()
    _make_certificates(certs)
    client, peer = f"https://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [binary, "--name=t", f"--data-dir={tmp_path}/etcd", f"--listen-client-urls={client}",
         f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=t={peer}",
         f"--cert-file={certs / 'server.pem'}", f"--key-file={certs / 'server.key'}",
         "--client-cert-auth", f"--trusted-ca-file={certs / 'ca.pem'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1, context=context) as r:
                if b"true" in r.read():
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "etcd did not become healthy"
        time.sleep(0.05)  # the next health check, bounded by the deadline
    yield client, certs
    proc.kill()
    proc.wait()


def test_fleet_push_over_tls_to_etcd_and_members(tls_etcd, start_daemon, weights):
    from refit_client import Tls, Unavailable

    endpoint, certs = tls_etcd
    etcd_flags = (f"--etcd={endpoint}", f"--etcd-ca={certs / 'ca.pem'}",
                  f"--etcd-cert={certs / 'client.pem'}", f"--etcd-key={certs / 'client.key'}")
    for i in range(2):
        d = start_daemon("--fleet=pytls", *etcd_flags, f"--fleet-member=t{i}",
                         f"--tls-cert={certs / 'server.pem'}", f"--tls-key={certs / 'server.key'}",
                         tcp=True)
        d.wait_for_line("joined the fleet")
    etcd_tls = Tls(ca_file=str(certs / "ca.pem"), cert_file=str(certs / "client.pem"),
                   key_file=str(certs / "client.key"))
    fleet = FleetClient(etcd=endpoint, fleet="pytls", tls=Tls(ca_file=str(certs / "ca.pem")),
                        etcd_tls=etcd_tls)
    result = fleet.push(str(weights(3)))
    assert result.fleet_version == 1
    assert all(m.committed for m in result.members), result.members
    # etcd's certificate is not signed by the given CA: Unavailable naming
    # the endpoint.
    wrong = FleetClient(etcd=endpoint, fleet="pytls",
                        etcd_tls=Tls(ca_file=str(certs / "other.pem"),
                                     cert_file=str(certs / "client.pem"),
                                     key_file=str(certs / "client.key")))
    with pytest.raises(Unavailable, match=endpoint.replace(".", r"\.")) as e:
        wrong.status()
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value)
    # The members' certificates are not signed by the given CA: nobody
    # prepared, RefitConflict naming each member's address.
    members = [m["address"] for m in fleet.status()["members"]]
    wrong_members = FleetClient(etcd=endpoint, fleet="pytls", etcd_tls=etcd_tls,
                                tls=Tls(ca_file=str(certs / "other.pem")), timeout=10)
    with pytest.raises(RefitConflict) as e:
        wrong_members.push(str(weights(4)))
    for address in members:
        assert address in str(e.value)
