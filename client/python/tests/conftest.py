"""Fixtures of the refit_client tests: real refitd processes.

The binaries come from $REFIT_BUILD_DIR/bin (default: build/bin of the
repository). A daemon listens on a Unix socket in a short temp dir (or on
127.0.0.1:0, the port read back from its log); tests wait on its log lines
(`address=... refitd listening`, `first version loaded; ready`), never sleep.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
BUILD_DIR = pathlib.Path(os.environ.get("REFIT_BUILD_DIR") or REPO / "build")
REFITD = BUILD_DIR / "bin" / "refitd"
REFITCTL = BUILD_DIR / "bin" / "refitctl"
MAKE_FIXTURE = BUILD_DIR / "bin" / "refit_make_fixture"
READY_LINE = "first version loaded; ready"
# Limits that only matter when something hangs.
START_LIMIT = 60.0


def _require(binary: pathlib.Path) -> str:
    if not binary.is_file():
        pytest.fail(f"{binary} not found: build refitd first (scripts/build.sh) or set REFIT_BUILD_DIR")
    return str(binary)


class Daemon:
    """A refitd child process whose stderr is read by a thread, so tests can
    wait for a log line as an event."""

    def __init__(self, args: Sequence[str], workdir: pathlib.Path, tcp: bool = False) -> None:
        self.workdir = workdir
        if tcp:
            listen = "127.0.0.1:0"
        else:
            # Unix socket paths are limited to ~108 bytes: a short dir of its own.
            self._sock_dir = tempfile.mkdtemp(prefix="rfp-", dir="/tmp")
            listen = f"unix:{self._sock_dir}/refitd.sock"
        # --group names each group's model itself (refitd refuses --model with it).
        model = [] if any(a.startswith("--group") for a in args) else ["--model=demo"]
        self.args = [_require(REFITD), *model, f"--listen={listen}", *args]
        self._cv = threading.Condition()
        self._lines: List[str] = []
        self._ended = False
        self.log_path = workdir / "refitd.err"
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.address: Optional[str] = None

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stderr:
                log.write(line)
                log.flush()
                with self._cv:
                    self._lines.append(line)
                    self._cv.notify_all()
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    @property
    def log(self) -> str:
        with self._cv:
            return "".join(self._lines)

    def wait_for_line(self, text: str, timeout: float = START_LIMIT, *, also: str = "") -> str:
        """The first log line containing `text` (and `also`, if given); fails
        the test if the daemon exits or `timeout` passes first."""
        def found() -> Optional[str]:
            return next((line for line in self._lines if text in line and also in line), None)

        with self._cv:
            self._cv.wait_for(lambda: found() is not None or self._ended, timeout)
            line = found()
        if line is None:
            pytest.fail(f"refitd never logged {text!r}; its log:\n{self.log}")
        return line

    def wait_started(self) -> "Daemon":
        line = self.wait_for_line("refitd listening")
        match = re.search(r"address=(\S+)", line)
        assert match, line
        self.address = match.group(1)
        self.wait_for_line(READY_LINE)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        if hasattr(self, "_sock_dir"):
            shutil.rmtree(self._sock_dir, ignore_errors=True)


@pytest.fixture
def start_daemon(tmp_path):
    """start_daemon(*flags, tcp=False, wait=True) -> a running Daemon."""
    daemons: List[Daemon] = []

    def start(*args: str, tcp: bool = False, wait: bool = True) -> Daemon:
        d = Daemon(args, tmp_path, tcp=tcp)
        daemons.append(d)
        return d.wait_started() if wait else d

    yield start
    for d in daemons:
        d.stop()


@pytest.fixture
def daemon(start_daemon) -> Daemon:
    return start_daemon()


@pytest.fixture
def client(daemon):
    from refit_client import RefitClient

    with RefitClient(daemon.address, timeout=30) as c:
        yield c


_FIXTURES: Dict[int, pathlib.Path] = {}


@pytest.fixture(scope="session")
def fixture_root(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture
def weights(fixture_root):
    """weights(seed) -> directory of the demo model's safetensors for `seed`
    (refit_make_fixture), written once per session."""

    def make(seed: int) -> pathlib.Path:
        if seed not in _FIXTURES:
            out = fixture_root / f"seed{seed}"
            subprocess.run(
                [_require(MAKE_FIXTURE), f"--out={out}", f"--seed={seed}"],
                check=True,
                capture_output=True,
                text=True,
            )
            _FIXTURES[seed] = out
        return _FIXTURES[seed]

    return make


def load_state_dict(directory: pathlib.Path):
    """Every tensor of the safetensors files in `directory`, as torch tensors."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@contextlib.contextmanager
def stepping(step, pause: float = 0.0):
    """An engine's one thread calling `step()` between its forward steps
    (each `pause` seconds) until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            step()
            if pause:
                time.sleep(pause)  # the forward step

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def refitctl(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_require(REFITCTL), f"--addr={address}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
