"""scripts/gpu-check.sh's daemon part, as far as a machine without a GPU takes it.

`--bundle` packs the build's refitd, refitctl and refit_make_fixture with the
shared libraries they load (what a GPU machine without gRPC needs to run
them); a `--dry-run` of part two (GPU_CHECK_CORE=0) unpacks that bundle, checks
that every binary loads only from it, torch, glibc or the C++ runtime, and
runs the Python client's `gpu` tests against it (they skip without a GPU).
Each test works in a directory of its own (GPU_CHECK_DEPS), never in the
repository's .deps.
"""

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

SCRIPT_TIMEOUT = 600


def _gpu_check(repo, *args, **env):
    full_env = dict(os.environ, PYTHON=sys.executable, JOBS="2")
    full_env.update({k: str(v) for k, v in env.items()})
    return subprocess.run([str(repo / "scripts" / "gpu-check.sh"), *args], env=full_env,
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT)


@pytest.fixture(scope="module")
def bundle(repo, build_dir, tmp_path_factory):
    refitd = build_dir / "bin" / "refitd"
    ldd = subprocess.run(["ldd", str(refitd)], capture_output=True, text=True, check=True).stdout
    if "libcudart" not in ldd:
        pytest.skip("refitd was built without CUDA (no nvcc): there is no GPU daemon to bundle")
    deps = tmp_path_factory.mktemp("deps")
    r = _gpu_check(repo, "--bundle", GPU_CHECK_DEPS=deps, REFIT_BUILD_DIR=build_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    return deps


def _copy_bundle(bundle, dest):
    shutil.copytree(bundle / "daemon", dest / "daemon")
    return dest


def _reseal(deps):
    """Rewrites SHA256SUMS after a test changed the bundle on purpose."""
    tar = deps / "daemon" / "daemon.tar.xz"
    digest = hashlib.sha256(tar.read_bytes()).hexdigest()
    (deps / "daemon" / "SHA256SUMS").write_text(f"{digest}  ./daemon.tar.xz\n")


def _results(out):
    return json.loads((out / "gpu-check-results.json").read_text())


def test_the_bundle_holds_the_daemon_its_libraries_and_the_client_stubs(bundle, build_dir):
    with tarfile.open(bundle / "daemon" / "daemon.tar.xz") as tar:
        names = set(tar.getnames())
        stamp = tar.extractfile("./BUNDLE").read().decode()
    for binary in ("refitd", "refitctl", "refit_make_fixture"):
        assert f"./libexec/{binary}" in names
    libs = {pathlib.PurePath(n).name for n in names if n.startswith("./lib/")}
    # gRPC and Abseil travel; glibc, the C++ runtime and torch do not.
    assert any(n.startswith("libgrpc++.so") for n in libs), libs
    assert any(n.startswith("libabsl_") for n in libs), libs
    for absent in ("libc.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libtorch_cpu.so", "libc10.so"):
        assert absent not in libs
    assert "./proto/refit_pb2.py" in names and "./proto/engine_pb2_grpc.py" in names
    version = subprocess.run([str(build_dir / "bin" / "refitd"), "--version"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version in stamp, stamp


def test_part_two_runs_the_python_gpu_tests_against_the_bundled_daemon(repo, bundle, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = _gpu_check(repo, "--dry-run", GPU_CHECK_CORE=0, GPU_CHECK_DEPS=bundle, OUT=out)
    assert r.returncode == 0, r.stdout + r.stderr
    results = _results(out)
    assert results["ok"] and not results["problems"], results
    daemon = results["daemon"]
    assert daemon["failed"] == 0
    # Every gpu-marked test of the client ran (here: skipped for want of a device).
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(repo / "client" / "python" / "tests")],
        capture_output=True, text=True, cwd=tmp_path)
    count = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    assert count > 0
    assert daemon["passed"] + daemon["skipped"] == count, (daemon, collected.stdout)
    import torch

    if not torch.cuda.is_available():
        assert all("no CUDA device" in name for name in daemon["skipped_names"]), daemon
    assert (out / "gpu-check-pytest.log").is_file()
    steps = {s["step"]: s for s in results["steps"]}
    assert steps["core"]["status"] == "skipped"
    assert steps["daemon gpu tests"]["status"] == "ok"


def test_a_library_missing_from_the_bundle_fails_part_two_naming_it(repo, bundle, tmp_path):
    deps = _copy_bundle(bundle, tmp_path / "deps")
    work = tmp_path / "unpacked"
    tar_path = deps / "daemon" / "daemon.tar.xz"
    with tarfile.open(tar_path) as tar:
        tar.extractall(work, filter="tar")
    (missing,) = [p for p in (work / "lib").iterdir() if p.name.startswith("libgrpc++.so")]
    missing.unlink()
    with tarfile.open(tar_path, "w:xz", preset=0) as tar:
        tar.add(work, arcname=".")
    _reseal(deps)
    out = tmp_path / "out"
    out.mkdir()
    r = _gpu_check(repo, "--dry-run", GPU_CHECK_CORE=0, GPU_CHECK_DEPS=deps, OUT=out)
    assert r.returncode == 1, r.stdout + r.stderr
    results = _results(out)
    step = next(s for s in results["steps"] if s["step"] == "daemon gpu tests")
    assert step["status"] == "FAILED"
    # On this machine the system's copy would load; the check names it all the same.
    assert "outside the bundle" in step["detail"] and "libgrpc++" in step["detail"], step
    assert results["daemon"] is None  # no test ran against an incomplete bundle


def _part_two_failure(repo, deps, tmp_path):
    """Runs part two's dry run; returns its step's detail (it must fail)."""
    out = tmp_path / "out"
    out.mkdir()
    r = _gpu_check(repo, "--dry-run", GPU_CHECK_CORE=0, GPU_CHECK_DEPS=deps, OUT=out)
    assert r.returncode == 1, r.stdout + r.stderr
    # Part two's own failure ends part two, not the run: the results come back.
    step = next(s for s in _results(out)["steps"] if s["step"] == "daemon gpu tests")
    assert step["status"] == "FAILED", step
    return step["detail"]


def test_a_bundle_that_does_not_match_its_checksum_is_refused(repo, bundle, tmp_path):
    deps = _copy_bundle(bundle, tmp_path / "deps")
    with open(deps / "daemon" / "daemon.tar.xz", "ab") as f:
        f.write(b"\0")
    detail = _part_two_failure(repo, deps, tmp_path)
    assert "the daemon bundle does not match its SHA256SUMS" in detail


def _rewrite_stamp(deps, tmp_path, edit):
    work = tmp_path / "unpacked"
    tar_path = deps / "daemon" / "daemon.tar.xz"
    with tarfile.open(tar_path) as tar:
        tar.extractall(work, filter="tar")
    stamp = work / "BUNDLE"
    stamp.write_text(edit(stamp.read_text()))
    with tarfile.open(tar_path, "w:xz", preset=0) as tar:
        tar.add(work, arcname=".")
    _reseal(deps)


def test_a_bundle_built_from_other_sources_is_refused_as_stale(repo, bundle, tmp_path):
    deps = _copy_bundle(bundle, tmp_path / "deps")
    _rewrite_stamp(deps, tmp_path,
                   lambda text: re.sub(r"^sources \S+$", "sources 0123456789abcdef", text, flags=re.M))
    detail = _part_two_failure(repo, deps, tmp_path)
    assert "stale bundle" in detail and "0123456789abcdef" in detail, detail


def test_a_bundle_built_against_another_torch_is_refused(repo, bundle, tmp_path):
    deps = _copy_bundle(bundle, tmp_path / "deps")
    _rewrite_stamp(deps, tmp_path,
                   lambda text: re.sub(r"^torch \S+$", "torch 1.0.0", text, flags=re.M))
    detail = _part_two_failure(repo, deps, tmp_path)
    assert "built against torch 1.0.0" in detail, detail


def _failed_full_run_step(repo, deps, tmp_path, name):
    """Runs part two alone in full mode, which must fail; returns step `name`."""
    out = tmp_path / "out"
    out.mkdir()
    r = _gpu_check(repo, GPU_CHECK_CORE=0, GPU_CHECK_DEPS=deps, OUT=out)
    assert r.returncode == 1, r.stdout + r.stderr
    return next(s for s in _results(out)["steps"] if s["step"] == name)


def test_a_full_run_without_a_bundle_fails_and_says_how_to_make_one(repo, tmp_path):
    empty = tmp_path / "deps"
    empty.mkdir()
    step = _failed_full_run_step(repo, empty, tmp_path, "daemon gpu tests")
    assert step["status"] == "FAILED" and "--prepare" in step["detail"], step


def test_part_two_alone_in_full_mode_without_a_gpu_does_not_pass(repo, bundle, tmp_path):
    """A full run exists to exercise the GPU: where torch sees none, the
    daemon's benchmarks fail instead of being skipped."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the full run would measure it")
    step = _failed_full_run_step(repo, bundle, tmp_path, "daemon benchmarks")
    assert step["status"] == "FAILED" and "no usable GPU" in step["detail"], step


def test_an_unknown_benchmark_is_a_usage_error_before_anything_runs(repo, tmp_path):
    r = _gpu_check(repo, "--dry-run", GPU_CHECK_DAEMON_BENCHES="shm warp", OUT=tmp_path)
    assert r.returncode == 2
    assert "unknown benchmark warp" in r.stderr
    assert not (tmp_path / "gpu-check-results.json").exists()
