"""deploy/kubernetes/*.yaml: valid against a recent Kubernetes' schemas
(kubernetes-validate's bundled, offline ones, strict: unknown fields fail),
and probing, addressing and ports as docs/deploy.md describes them."""

import socket
import subprocess

import pytest
import yaml

from conftest import REPO, make_tls_secret

K8S_VERSION = "1.37.0"
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
READINESS_SERVICE = "refit.v1.RefitService"


def documents(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def workloads(path):
    return [d for d in documents(path) if d["kind"] in ("StatefulSet", "DaemonSet", "Deployment")]


def refitd_container(workload):
    (container,) = [c for c in workload["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "refitd"]
    return container


@pytest.fixture
def no_network(monkeypatch):
    """Schemas must come from the package: any connection attempt fails."""
    def refuse(*args, **kwargs):
        raise AssertionError("kubernetes-validate tried to reach the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_there_are_statefulset_and_daemonset_forms():
    kinds = {d["kind"] for path in MANIFESTS for d in documents(path)}
    assert {"StatefulSet", "DaemonSet", "Service", "Secret"} <= kinds, kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_for_recent_kubernetes(path, no_network):
    import kubernetes_validate

    for document in documents(path):
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_validator_rejects_an_unknown_field(no_network):
    import kubernetes_validate

    (workload, *_) = workloads(REPO / "deploy" / "kubernetes" / "refitd.yaml")
    refitd_container(workload)["startupProbes"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workload, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_startup_and_readiness_wait_for_a_served_version(path):
    for workload in workloads(path):
        container = refitd_container(workload)
        for probe in ("startupProbe", "readinessProbe"):
            spec = container[probe]
            if "grpc" in spec:
                assert spec["grpc"].get("service") == READINESS_SERVICE, (
                    f"{probe} checks {spec['grpc'].get('service')!r}: \"\" is SERVING as soon "
                    "as the port binds, before the model is loaded")
            else:
                # refitctl health passes only when the readiness service is SERVING.
                command = spec["exec"]["command"]
                assert command[0].endswith("refitctl") and command[-1] == "health", command
                args = refitd_container(workload)["args"]
                if any(a.startswith("--tls-cert") for a in args):
                    assert any(c.startswith("--tls-ca=") for c in command), (
                        f"{probe} talks plaintext to a TLS port")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_liveness_asks_the_grpc_server_not_the_kernel(path):
    """A TCP connect succeeds into the listen backlog even when the gRPC
    server stopped accepting (gRPC 1.51 does after EMFILE): liveness must be
    a gRPC call, and one that does not wait for the model to load."""
    for workload in workloads(path):
        spec = refitd_container(workload)["livenessProbe"]
        assert "tcpSocket" not in spec, spec
        command = spec["exec"]["command"]
        assert command[0].endswith("refitctl") and command[-2:] == ["health", "--live"], command


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_tokens_never_travel_in_plaintext(path):
    for workload in workloads(path):
        args = refitd_container(workload)["args"]
        remote = any(a.startswith("--listen=") and "0.0.0.0" in a for a in args)
        if remote and any(a.startswith("--auth-tokens") for a in args):
            assert any(a.startswith("--tls-cert=") for a in args), (
                f"{workload['metadata']['name']}: bearer tokens on a plaintext port")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_metrics_and_grpc_are_separate_services(path):
    for service in (d for d in documents(path) if d["kind"] == "Service"):
        names = {p["name"] for p in service["spec"]["ports"]}
        if service["spec"].get("clusterIP") == "None":
            assert names == {"grpc"}, f"headless {service['metadata']['name']}: {names}"


def test_statefulset_has_a_headless_service_for_pod_dns():
    docs = documents(REPO / "deploy" / "kubernetes" / "refitd.yaml")
    (statefulset,) = [d for d in docs if d["kind"] == "StatefulSet"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    governing = services[statefulset["spec"]["serviceName"]]
    assert governing["spec"]["clusterIP"] == "None"
    assert governing["spec"].get("publishNotReadyAddresses") is True


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_args_are_refitd_flags(path, refitd_flags):
    for workload in workloads(path):
        for arg in refitd_container(workload)["args"]:
            name = arg[2:].split("=")[0]
            assert name in refitd_flags, f"{path.name} passes {arg}, refitd has no --{name}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_etcd(directory):
    """A real etcd on loopback for the fleet flags (Debian's etcd-server,
    which scripts/setup.sh installs); returns (process, "127.0.0.1:PORT")."""
    import shutil
    import time
    import urllib.request

    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [etcd, "--name=t", f"--data-dir={directory}", f"--listen-client-urls={client}",
         f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=t={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                if b"true" in r.read():
                    return proc, client.removeprefix("http://")
        except OSError:
            time.sleep(0.1)  # the next health check, bounded by the deadline
    proc.kill()
    pytest.fail("etcd did not become healthy within 30 s")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_probes_pass_against_refitd_started_with_the_manifest(path, tmp_path, build_dir):
    """refitd started with the workload's own arguments (on loopback, the demo
    model on the CPU, the mounts under a temp dir): once it logs that version 1
    is served, the startup and readiness commands exit 0, and the same health
    check without the CA (plaintext) does not get through."""
    import queue
    import threading

    for workload in workloads(path):
        container = refitd_container(workload)
        root = tmp_path / workload["metadata"]["name"]
        make_tls_secret(root / "etc/refitd/tls")
        (root / "etc/refitd/tokens").mkdir(parents=True)
        (root / "etc/refitd/tokens/tokens").write_text("t operator ops\n")
        (root / "models").mkdir()
        (root / "run/refitd").mkdir(parents=True)
        port = free_port()

        def local(value):
            for prefix in ("/etc/refitd/", "/models", "/run/refitd/"):
                value = value.replace(prefix, str(root) + prefix)
            # /metrics stays beyond loopback (on a free port), where refitd
            # serves it only when the manifest says so.
            return value.replace("0.0.0.0:50051", f"127.0.0.1:{port}").replace(
                "0.0.0.0:9464", "0.0.0.0:0").replace("127.0.0.1:50051", f"127.0.0.1:{port}")

        etcd = None
        if any(a.startswith("--fleet=") for a in container["args"]):
            etcd, etcd_endpoint = start_etcd(root / "etcd")
        env = {"TP_RANK": "0", "POD_NAME": "refitd-0", "POD_NAMESPACE": "default",
               "NODE_NAME": "node-0", "POD_IP": "127.0.0.1"}
        if etcd is not None:
            env["ETCD_ENDPOINTS"] = etcd_endpoint
        args = []
        for arg in container["args"]:
            name = arg.split("=")[0]
            if name == "--model":
                arg = "--model=demo"
            elif name == "--device":
                arg = "--device=cpu"
            for var, value in env.items():
                arg = arg.replace(f"$({var})", value)
            assert "$(" not in arg, f"{path.name}: {arg} names a variable the test does not set"
            args.append(local(arg))
        # A fleet member is ready once it has joined its fleet.
        served = "joined the fleet" if etcd is not None else "first version loaded; ready"
        proc = subprocess.Popen([str(build_dir / "bin" / "refitd"), *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in proc.stderr], daemon=True).start()
        try:
            log = []
            while not any(served in l for l in log):
                try:
                    log.append(lines.get(timeout=120))
                except queue.Empty:
                    pytest.fail("refitd never served version 1:\n" + "".join(log))
                assert proc.poll() is None or not lines.empty(), "".join(log)
            for probe in ("livenessProbe", "startupProbe", "readinessProbe"):
                command = [local(c) for c in container[probe]["exec"]["command"]]
                command[0] = str(build_dir / "bin" / "refitctl")
                result = subprocess.run(command, capture_output=True, text=True, timeout=60)
                assert result.returncode == 0, f"{probe}: {command}\n{result.stdout}{result.stderr}"
            plaintext = [c for c in command if not c.startswith(("--tls-ca", "--tls-server-name"))]
            result = subprocess.run(plaintext, capture_output=True, text=True, timeout=60)
            assert result.returncode == 7, f"plaintext health check got through: {result.stdout}"
        finally:
            proc.terminate()
            try:
                assert proc.wait(timeout=60) == 0
            finally:
                if etcd is not None:
                    etcd.kill()
                    etcd.wait()
