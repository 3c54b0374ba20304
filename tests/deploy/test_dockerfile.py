"""deploy/Dockerfile and .dockerignore, checked without Docker.

Docker cannot run here, so the runtime stage is checked for what makes a
container start: every shared library that refitd and refitctl load (ldd of
the real build) must be in the image, either copied from the build stage by
one of the stage's COPY --from=build lines and found on its LD_LIBRARY_PATH,
or owned by a Debian package the stage's apt-get installs (or that debian:12
has, or that those depend on). The lists come from the Dockerfile itself.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess

import pytest

from conftest import REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"
# Where the build stage's WORKDIR (/src) and BUILD_DIR=/src/build are here.
BUILD_STAGE_ROOT = "/src/"
# The CUDA driver is the host's: the NVIDIA Container Toolkit mounts it.
HOST_DRIVER_LIBS = {"libcuda.so.1", "libnvidia-ml.so.1"}


def instructions(text):
    """Dockerfile instructions as (KEYWORD, arguments), continuations joined."""
    out, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, rest = current.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def stages(text):
    """[(FROM arguments, [instructions])] per stage."""
    result = []
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            result.append((rest, []))
        elif result:
            result[-1][1].append((keyword, rest))
    return result


def apt_packages(run_args):
    """Packages named by `apt-get install` in a RUN line."""
    packages = []
    for command in re.split(r"&&|;", run_args):
        words = shlex.split(command)
        if "apt-get" in words and "install" in words:
            packages += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return packages


@pytest.fixture(scope="module")
def runtime_stage():
    all_stages = stages(DOCKERFILE.read_text())
    assert len(all_stages) >= 2, "deploy/Dockerfile should be multi-stage (build, runtime)"
    base, body = all_stages[-1]
    packages = [p for k, rest in body if k == "RUN" for p in apt_packages(rest)]
    copies = []
    for keyword, rest in body:
        if keyword != "COPY":
            continue
        words = shlex.split(rest)
        assert words[0] == "--from=build", f"runtime COPY not from the build stage: {rest}"
        *sources, dest = words[1:]
        copies += [(s, dest) for s in sources]
    env = {}
    for keyword, rest in body:
        if keyword == "ENV":
            name, _, value = rest.partition("=")
            env[name] = value
    return {"base": base, "packages": packages, "copies": copies, "env": env, "body": body}


def local_path(build_stage_path, build_dir):
    """The file here that a build-stage path is (a copy of)."""
    assert build_stage_path.startswith(BUILD_STAGE_ROOT), build_stage_path
    rel = build_stage_path[len(BUILD_STAGE_ROOT):]
    if rel == "build" or rel.startswith("build/"):
        return build_dir / rel[len("build/"):] if rel != "build" else build_dir
    return REPO / rel


def image_to_local(image_dir, copies, build_dir):
    """Maps a directory of the runtime image back to the build-stage source."""
    image_dir = image_dir.rstrip("/") + "/"
    for source, dest in copies:
        if source.endswith("/") and dest.rstrip("/") + "/" == image_dir:
            return local_path(source.rstrip("/"), build_dir)
    return None


_OWNERS = {}


def dpkg_owner(path):
    """Debian package owning `path` (tried as given, resolved, and /usr-merged)."""
    if not _OWNERS:
        for listing in pathlib.Path("/var/lib/dpkg/info").glob("*.list"):
            package = listing.name[:-len(".list")].split(":")[0]
            for line in listing.read_text(errors="replace").splitlines():
                _OWNERS.setdefault(line, package)
    candidates = [path, os.path.realpath(path)]
    for p in list(candidates):
        if p.startswith("/usr/lib/"):
            candidates.append(p[len("/usr"):])
        elif p.startswith("/lib/"):
            candidates.append("/usr" + p)
    for candidate in candidates:
        if candidate in _OWNERS:
            return _OWNERS[candidate]
    return None


def installed_packages():
    """{package: (essential_or_required, [dependencies])} of this Debian."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package}\t${Essential}\t${Priority}\t${Depends}, "
         "${Pre-Depends}\t${db:Status-Abbrev}\n"],
        check=True, capture_output=True, text=True).stdout
    packages = {}
    for line in out.splitlines():
        name, essential, priority, depends, status = line.split("\t")
        if not status.startswith("ii"):
            continue
        deps = []
        for alternative in depends.split(","):
            first = alternative.split("|")[0].strip()
            if first:
                deps.append(re.split(r"[\s(:]", first)[0])
        packages[name] = (essential == "yes" or priority == "required", deps)
    return packages


def closure(roots, packages):
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += packages.get(name, (False, []))[1]
    return seen


def ldd(binary, ld_library_path):
    env = dict(os.environ, LD_LIBRARY_PATH=ld_library_path)
    out = subprocess.run(["ldd", str(binary)], check=True, capture_output=True, text=True,
                         env=env).stdout
    libs = {}
    for line in out.splitlines():
        match = re.match(r"\s*(\S+) => (.+?)(?: \(0x[0-9a-f]+\))?$", line)
        if match:
            libs[match.group(1)] = match.group(2).strip()
    return libs


def test_runtime_stage_is_debian12_like_the_build(runtime_stage):
    assert runtime_stage["base"].split()[0] == "debian:12"
    os_release = pathlib.Path("/etc/os-release").read_text()
    if 'VERSION_ID="12"' not in os_release:
        pytest.skip("the library check maps libraries to Debian 12 packages")


def test_runtime_packages_exist_in_debian(runtime_stage):
    packages = installed_packages()
    missing = [p for p in runtime_stage["packages"] if p not in packages]
    assert not missing, (
        f"runtime apt packages not known to this Debian 12 (misspelt, or not installed "
        f"by scripts/setup.sh's -dev packages): {missing}")


def test_only_libtorch_shared_libraries_are_copied(runtime_stage):
    venv_sources = [s for s, _ in runtime_stage["copies"] if s.startswith("/src/.venv")]
    assert venv_sources, "no LibTorch libraries copied from the build stage"
    for source in venv_sources:
        assert re.fullmatch(r"/src/\.venv/lib/python3\.\d+/site-packages/(torch|nvidia/\w+)/lib/",
                            source), f"copies more than a library directory of the venv: {source}"


@pytest.mark.parametrize("binary", ["refitd", "refitctl"])
def test_runtime_stage_holds_every_library_the_binaries_load(runtime_stage, build_dir, binary):
    copies = runtime_stage["copies"]
    assert any(s == f"/src/build/bin/{binary}" for s, _ in copies), f"bin/{binary} not copied"
    image_path = runtime_stage["env"].get("LD_LIBRARY_PATH", "")
    local_dirs = []
    for image_dir in filter(None, image_path.split(":")):
        local = image_to_local(image_dir, copies, build_dir)
        assert local is not None, (
            f"LD_LIBRARY_PATH entry {image_dir} is not the destination of a COPY --from=build")
        assert local.is_dir(), f"{image_dir} would be a copy of {local}, which does not exist"
        local_dirs.append(str(local))

    packages = installed_packages()
    base = [name for name, (required, _) in packages.items() if required]
    allowed = closure(base + runtime_stage["packages"], packages)

    problems = []
    for soname, resolved in ldd(build_dir / "bin" / binary, ":".join(local_dirs)).items():
        if soname in HOST_DRIVER_LIBS:
            continue
        if resolved == "not found":
            problems.append(f"{soname}: not found anywhere")
            continue
        if any(resolved.startswith(d + "/") for d in local_dirs):
            continue
        owner = dpkg_owner(resolved)
        if owner is None:
            problems.append(f"{soname} => {resolved}: neither copied into the image (on its "
                            "LD_LIBRARY_PATH) nor from a Debian package")
        elif owner not in allowed:
            problems.append(f"{soname} => {resolved}: package {owner} is not installed by the "
                            "runtime stage's apt-get (nor a dependency of one)")
    assert not problems, f"bin/{binary} in the runtime image:\n  " + "\n  ".join(problems)


def test_cuda_build_is_the_default_when_manifests_use_a_gpu():
    text = DOCKERFILE.read_text()
    manifests = "".join(p.read_text() for p in (REPO / "deploy" / "kubernetes").glob("*.yaml"))
    if "--device=cuda" not in manifests:
        pytest.skip("no manifest runs on a GPU")
    assert re.search(r"^ARG REFIT_WITH_CUDA=ON$", text, re.M), "the image must build with CUDA"
    assert "scripts/cuda-toolkit.sh" in text and "-DREFIT_WITH_CUDA=${REFIT_WITH_CUDA}" in text


def dockerignore_patterns():
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            patterns.append(line)
    return patterns


def pattern_regex(pattern):
    """Docker's .dockerignore matching: root-relative, ** spans directories."""
    pattern = pattern.strip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def excluded(path, patterns):
    """Whether Docker leaves `path` (or a directory above it) out of the context."""
    parts = path.split("/")
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = pattern_regex(pattern[1:] if negate else pattern)
        if any(regex.match("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            result = not negate
    return result


def test_dockerignore_leaves_out_venv_and_build_trees():
    patterns = dockerignore_patterns()
    for path in [".venv/lib/python3.11/site-packages/torch/lib/libtorch.so", "build/CMakeCache.txt",
                 "build-k1/bin/refitd", ".deps/prefix/lib/x.so",
                 "client/python/refit_client/__pycache__/x.pyc", "bench/results/tmp/run.json"]:
        assert excluded(path, patterns), f".dockerignore sends {path} to the daemon"


def test_dockerignore_leaves_out_everything_git_ignores():
    patterns = dockerignore_patterns()
    for line in (REPO / ".gitignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        example = line.strip("/").replace("**", "x").replace("*", "x")
        paths = [example] if line.startswith("/") else [example, f"core/{example}"]
        for path in paths:
            assert excluded(path, patterns), (
                f".gitignore's {line!r} is not in .dockerignore ({path} would be sent)")


def test_dockerignore_keeps_every_tracked_source():
    patterns = dockerignore_patterns()
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], check=True,
                             capture_output=True, text=True).stdout.split()
    assert tracked
    dropped = [p for p in tracked if excluded(p, patterns)]
    assert not dropped, f".dockerignore leaves tracked files out of the build: {dropped[:10]}"


def test_the_images_default_arguments_start_refitd(build_dir, tmp_path):
    """refitd started with the image's CMD (its token file under a temp dir,
    free ports, gRPC and /metrics still on 0.0.0.0) loads the demo model and
    serves /metrics: the defaults pass refitd's own checks at start."""
    import queue
    import socket
    import threading
    import urllib.request

    cmd = [rest for keyword, rest in instructions(DOCKERFILE.read_text()) if keyword == "CMD"]
    assert len(cmd) == 1, cmd
    args = json.loads(cmd[0])
    tokens = tmp_path / "tokens"
    tokens.write_text("t operator ops\n")

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    grpc_port, metrics_port = free_port(), free_port()
    local = [a.replace("/etc/refitd/tokens", str(tokens))
             .replace("0.0.0.0:50051", f"0.0.0.0:{grpc_port}")
             .replace("0.0.0.0:9464", f"0.0.0.0:{metrics_port}") for a in args]
    assert "0.0.0.0:9464" in args and f"0.0.0.0:{metrics_port}" in local
    proc = subprocess.Popen([str(build_dir / "bin" / "refitd"), *local, "--device=cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stderr] + [lines.put(None)],
                     daemon=True).start()
    try:
        log = []
        while not any("first version loaded; ready" in l for l in log):
            try:
                line = lines.get(timeout=120)
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail("refitd did not serve version 1 with the image's arguments:\n"
                            + "".join(log))
            log.append(line)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert b"refitd_version" in r.read()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
