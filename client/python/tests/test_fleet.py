"""FleetClient against a real etcd and two refitd fleet members."""

import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from refit_client import FleetClient, RefitClient, RefitConflict


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
    for d in members:
        with RefitClient(d.address, timeout=30) as c:
            assert c.status().version == 2
    # The members' registrations catch up with the commit (their own loop).
    deadline = time.monotonic() + 10
    while not fleet.status()["consistent"]:
        assert time.monotonic() < deadline, fleet.status()
        time.sleep(0.05)  # bounded poll of etcd


def test_fleet_push_while_the_lock_is_held_is_a_conflict(etcd, start_daemon, weights):
    d = start_daemon("--fleet=py2", f"--etcd={etcd}", "--fleet-member=only")
    d.wait_for_line("joined the fleet")
    fleet = FleetClient(etcd=etcd, fleet="py2")
    fleet._etcd.put("/refitd/fleet/py2/lock", '{"fleet_refit_id": "other"}')
    with pytest.raises(RefitConflict, match="in progress"):
        fleet.push(str(weights(3)))
