"""deploy/systemd/refitd@.service: systemd's own checks, and the unit's
command line run for real.

systemd does not run as PID 1 here, so `systemctl start` cannot be tried;
what can run does: `systemd-analyze verify` (the unit loads, every setting is
known), `systemd-analyze security --offline` (the exposure score), and the
ExecStart line expanded the way systemd expands it (Environment= defaults,
specifiers) and started with a notification socket, a credentials directory
and the unit's UMask, as systemd would start it: it must send READY=1 once
it serves, create a socket its group can connect to, and STOPPING=1 and exit
0 on SIGTERM.
"""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time

import pytest

from conftest import REPO, make_tls_secret

UNIT = REPO / "deploy" / "systemd" / "refitd@.service"
SECURITY_THRESHOLD = 3.0


def systemd_analyze():
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail("systemd-analyze is missing: scripts/setup.sh installs Debian's systemd")
    return path


def unit_settings(text):
    """{section: [(key, value)]}, continuation lines joined."""
    sections, section, pending = {}, None, ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            sections.setdefault(section, [])
            continue
        key, _, value = line.partition("=")
        sections[section].append((key.strip(), value.strip()))
    return sections


def expand_specifiers(value, specifiers):
    return re.sub(r"%(.)", lambda m: "%" if m.group(1) == "%" else specifiers[m.group(1)], value)


def exec_argv(settings, specifiers, extra_env=None):
    """ExecStart as systemd runs it: specifiers, Environment= (later wins),
    then ${VAR} substituted in place and a lone $VAR split into words."""
    service = settings["Service"]
    env = {}
    for key, value in service:
        if key == "Environment":
            for assignment in shlex.split(expand_specifiers(value, specifiers)):
                name, _, val = assignment.partition("=")
                env[name] = val
    env.update(extra_env or {})
    (exec_start,) = [v for k, v in service if k == "ExecStart"]
    argv = []
    for word in shlex.split(expand_specifiers(exec_start, specifiers)):
        lone = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if lone:
            argv += env.get(lone.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""),
                               word))
    return argv, env


@pytest.fixture
def unit_dir(tmp_path, build_dir):
    """The unit as refitd@0.service, ExecStart pointing at this build."""
    text = UNIT.read_text().replace("/usr/local/bin/refitd", str(build_dir / "bin" / "refitd"))
    (tmp_path / "refitd@.service").write_text(text)
    (tmp_path / "refitd@0.service").symlink_to("refitd@.service")
    return tmp_path


def test_systemd_analyze_verify_is_clean(unit_dir):
    result = subprocess.run([systemd_analyze(), "verify", str(unit_dir / "refitd@0.service")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_security_exposure_is_ok(unit_dir):
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", "--no-pager",
         str(unit_dir / "refitd@0.service")], capture_output=True, text=True, timeout=120)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", result.stdout)
    assert match, result.stdout + result.stderr
    score = float(match.group(1))
    assert score <= SECURITY_THRESHOLD, (
        f"systemd-analyze security rates the unit {score} {match.group(2)}:\n{result.stdout}")


def test_starts_without_any_settings_file(repo):
    settings = unit_settings(UNIT.read_text())
    service = settings["Service"]
    env_files = [v for k, v in service if k == "EnvironmentFile"]
    assert env_files and all(v.startswith("-") for v in env_files), (
        f"every EnvironmentFile must be optional ('-'): {env_files}")
    argv, env = exec_argv(settings, {"i": "0", "t": "/run", "d": "/run/credentials/refitd@0"})
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", dict(service)["ExecStart"]))
    assert used <= set(env), f"ExecStart uses variables without a default: {used - set(env)}"
    assert "%i" not in dict(service)["ExecStart"], (
        "the instance name must not double as rank or GPU (REFITD_TP_RANK, REFITD_DEVICE)")


def test_unit_settings_match_the_deploy_contract():
    settings = unit_settings(UNIT.read_text())
    unit, service = dict(settings["Unit"]), settings["Service"]
    values = {}
    for key, value in service:
        values.setdefault(key, []).append(value)
    assert "network-online.target" in unit.get("Wants", "")
    assert values["Type"] == ["notify"]
    assert any(v.startswith("tokens:") for v in values["LoadCredential"])
    assert values["RuntimeDirectory"] == ["refitd/%i"], "one runtime directory per instance"
    assert values["UMask"] == ["0007"]


def test_flags_are_refitd_flags(refitd_flags):
    argv, _ = exec_argv(unit_settings(UNIT.read_text()), {"i": "0", "t": "/run", "d": "/c"})
    for arg in argv[1:]:
        name = arg[2:].split("=")[0]
        assert name in refitd_flags, f"unit passes {arg}, refitd has no --{name}"


def receive(sock, proc, log, timeout):
    """The next notification; fails early if refitd exits instead."""
    deadline = time.monotonic() + timeout
    sock.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            return sock.recv(4096).decode()
        except TimeoutError:
            if proc.poll() is not None:
                pytest.fail(f"refitd exited {proc.returncode} without notifying:\n"
                            f"{log.read_text()}")
    pytest.fail(f"no notification within {timeout}s:\n{log.read_text()}")


def unit_instance(tmp_path, build_dir):
    """Instance 0's command line and environment as systemd would run it,
    with its runtime directory and tokens credential under tmp_path: (argv,
    env, settings, run_dir, credentials dir)."""
    run_dir = tmp_path / "run"
    (run_dir / "refitd" / "0").mkdir(parents=True, mode=0o750)
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "tokens").write_text("test-operator operator ops\n")
    settings = unit_settings(UNIT.read_text())
    argv, env = exec_argv(settings, {"i": "0", "t": str(run_dir), "d": str(creds)})
    argv[0] = str(build_dir / "bin" / "refitd")
    return argv, env, settings, run_dir, creds


def test_exec_start_runs_notifies_and_stops(tmp_path, build_dir):
    """The unit's command line with its defaults, started as systemd would."""
    argv, env, settings, run_dir, creds = unit_instance(tmp_path, build_dir)
    umask = int(dict(settings["Service"])["UMask"], 8)

    notify_path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(notify_path)
        child_env = dict(os.environ, **env, NOTIFY_SOCKET=notify_path,
                         CREDENTIALS_DIRECTORY=str(creds))
        log = tmp_path / "refitd.log"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(argv, env=child_env, stdout=log_file, stderr=log_file,
                                    preexec_fn=lambda: os.umask(umask))
        try:
            ready = receive(notify, proc, log, 120)
            assert "READY=1" in ready.split("\n"), ready
            sock_path = run_dir / "refitd" / "0" / "refitd.sock"
            mode = sock_path.stat().st_mode & 0o777
            assert mode & 0o060 == 0o060 and mode & 0o007 == 0, (
                f"{sock_path} is {oct(mode)}: the group must connect, others must not")
            health = subprocess.run(
                [str(build_dir / "bin" / "refitctl"), f"--addr=unix:{sock_path}",
                 "--timeout=10s", "health"], capture_output=True, text=True, timeout=60)
            assert health.returncode == 0, health.stdout + health.stderr
            status = subprocess.run(
                [str(build_dir / "bin" / "refitctl"), f"--addr=unix:{sock_path}",
                 "--timeout=10s", "status"], capture_output=True, text=True, timeout=60)
            assert status.returncode == 4, (
                "the tokens credential should be in force: " + status.stdout + status.stderr)
            proc.send_signal(signal.SIGTERM)
            stopping = receive(notify, proc, log, 60)
            assert "STOPPING=1" in stopping.split("\n"), stopping
            assert proc.wait(timeout=60) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("tls", [None, "tls", "mtls"], ids=["plaintext", "tls", "mutual-tls"])
def test_watchdog_pings_only_while_the_listener_accepts(tmp_path, build_dir, tls):
    """WatchdogSec=: refitd pings while its listener accepts new connections.
    A local peer that exhausts its descriptors gets the connections refitd has
    no room for closed at once, and the pings go on meanwhile; once the peer
    lets go, a fresh connection is answered. With TLS the
    probe greets the listener with a ClientHello, which the server answers
    without logging anything, also when it asks clients for a certificate
    (mutual TLS)."""
    import resource

    argv, env, settings, run_dir, creds = unit_instance(tmp_path, build_dir)
    ctl_tls = []
    if tls:
        certs = tmp_path / "tls"
        make_tls_secret(certs, client=tls == "mtls")
        argv += [f"--tls-cert={certs}/tls.crt", f"--tls-key={certs}/tls.key"]
        ctl_tls = [f"--tls-ca={certs}/ca.crt", "--tls-server-name=localhost"]
        if tls == "mtls":
            argv.append(f"--tls-client-ca={certs}/ca.crt")
            ctl_tls += [f"--tls-cert={certs}/client.crt", f"--tls-key={certs}/client.key"]
    watchdog = dict(settings["Service"])["WatchdogSec"]
    assert watchdog.endswith("s") and int(watchdog[:-1]) >= 10, watchdog
    sock_path = run_dir / "refitd" / "0" / "refitd.sock"

    def few_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    notify_path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(notify_path)
        # A 600 ms watchdog: a probe and a ping every 200 ms.
        child_env = dict(os.environ, **env, NOTIFY_SOCKET=notify_path,
                         CREDENTIALS_DIRECTORY=str(creds), WATCHDOG_USEC="600000")
        log = tmp_path / "refitd.log"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(argv, env=child_env, stdout=log_file, stderr=log_file,
                                    preexec_fn=few_descriptors)

        def pings_within(seconds):
            deadline = time.monotonic() + seconds
            count = 0
            notify.settimeout(0.05)
            while time.monotonic() < deadline:
                try:
                    count += notify.recv(4096).decode() == "WATCHDOG=1"
                except TimeoutError:
                    pass
            return count

        try:
            assert "READY=1" in receive(notify, proc, log, 120).split("\n")
            assert pings_within(1.0) >= 3, log.read_text()
            # Every listener is probed, TLS or not, and a probe leaves no
            # trace in the log (a plaintext greeting to a TLS listener is
            # logged as a failed handshake).
            assert "while every listener accepts connections" in log.read_text()
            assert "Handshake failed" not in log.read_text(), log.read_text()
            # More connections than the daemon has descriptors, held, then let go.
            flood = []
            for _ in range(300):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(str(sock_path))
                except (BlockingIOError, ConnectionRefusedError, OSError):
                    s.close()
                    break
                flood.append(s)
            time.sleep(1.0)
            # Out of descriptors, the listeners still answer (they close what
            # they have no room for) and the watchdog still probes them (with
            # the descriptor it keeps for that): the pings go on.
            assert "closing new connections at once" in log.read_text(), log.read_text()
            pings_within(0.3)
            assert pings_within(1.2) >= 3, log.read_text()
            for s in flood:
                s.close()
            time.sleep(1.0)
            assert proc.poll() is None, log.read_text()
            answers = subprocess.run(
                [str(build_dir / "bin" / "refitctl"), f"--addr=unix:{sock_path}", *ctl_tls,
                 "--timeout=2s", "health", "--live"], capture_output=True, text=True,
                timeout=60).returncode == 0
            pings_within(0.3)  # a round already under way
            pings = pings_within(1.2)
            assert answers, log.read_text()
            assert pings >= 3, log.read_text()
        finally:
            proc.kill()
            proc.wait()
