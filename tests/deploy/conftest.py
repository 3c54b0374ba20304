"""Shared fixtures of the deploy checks: the repository and the build dir.

The checks read the deploy files (deploy/Dockerfile, .dockerignore,
deploy/kubernetes/*.yaml, deploy/systemd/*) and test them against a real
build: $REFIT_BUILD_DIR (default build/) must hold bin/refitd and
bin/refitctl, as scripts/test.sh leaves it.
"""

import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo():
    return REPO


@pytest.fixture(scope="session")
def build_dir():
    path = pathlib.Path(os.environ.get("REFIT_BUILD_DIR", REPO / "build"))
    if not path.is_absolute():
        path = REPO / path
    for binary in ("refitd", "refitctl"):
        assert (path / "bin" / binary).is_file(), (
            f"{path}/bin/{binary} is missing: build first (scripts/build.sh), "
            "or point REFIT_BUILD_DIR at a build")
    return path


@pytest.fixture(scope="session")
def refitd_flags(build_dir):
    """The flag names refitd --help lists (without the leading dashes)."""
    import re
    import subprocess

    out = subprocess.run([str(build_dir / "bin" / "refitd"), "--help"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return set(re.findall(r"^  --([a-z0-9-]+) \(default", out, re.M))


def make_tls_secret(directory, client=False):
    """A CA and a server certificate for localhost, as the refitd-tls Secret holds them;
    with `client`, a client certificate of that CA too (client.crt, client.key)."""
    directory.mkdir(parents=True)
    script = """
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=refitd-test-ca -keyout ca.key -out ca.crt
openssl req -newkey rsa:2048 -nodes -subj /CN=refitd -keyout tls.key -out tls.csr
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -out tls.crt \\
  -extfile <(printf 'subjectAltName=DNS:localhost')
"""
    if client:
        script += """
openssl req -newkey rsa:2048 -nodes -subj /CN=operator -keyout client.key -out client.csr
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -out client.crt
"""
    subprocess.run(["bash", "-c", script], cwd=directory, check=True, capture_output=True,
                   timeout=120)
