#!/usr/bin/env bash
# Installs everything refitd needs to build and test: Debian packages and the
# pinned torch wheel (LibTorch) in a project-local virtual environment.
# Idempotent; a second run on a ready machine takes a second or two.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libxxhash-dev libcpp-httplib-dev libssl-dev openssl
  # scripts/format-check.sh and scripts/thread-safety.sh. Debian 12's clang
  # (14) parses GCC 12's libstdc++ headers; clang-14 depends on
  # libstdc++-12-dev, the same headers the build's g++ uses.
  clang clang-format
  # tests/deploy: systemd-analyze verify / security of deploy/systemd.
  systemd
  # The fleet tests run a real etcd (tests/testing/etcd_process.h).
  etcd-server
  # Headers for refit_client's C modules (client/python/refit_client/*.c)
  # when the venv is made from Debian's python3.
  python3-dev
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
VENV=.venv
want_torch=$(sed -n 's/^torch==//p' scripts/requirements.txt)
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.requirements.sha"
req_sha=$(sha256sum scripts/requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$req_sha" ] || \
   ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$want_torch' else 1)" 2>/dev/null; then
  echo "setup: installing Python requirements (torch==$want_torch) into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r scripts/requirements.txt
  echo "$req_sha" > "$stamp"
fi
# The Python client, editable; its gRPC stubs are generated from the proto at
# install time, and its C modules (_ntcopy.c, _atomics.c) built, so a change of
# the proto, of those modules or of the package's build files reinstalls it.
client_stamp="$VENV/.refit-client.sha"
client_sha=$(cat client/python/pyproject.toml client/python/setup.py \
  client/python/refit_client/_ntcopy.c client/python/refit_client/_atomics.c \
  proto/refit/v1/refit.proto proto/refit/v1/engine.proto proto/refit/v1/region.proto |
  sha256sum | cut -d' ' -f1)
if [ "$(cat "$client_stamp" 2>/dev/null)" != "$client_sha" ] || \
   ! "$VENV/bin/python" -c "import refit_client._proto.refit_pb2, refit_client._proto.engine_pb2, refit_client._proto.region_pb2" \
     2>/dev/null; then
  echo "setup: installing the Python client (client/python, editable) into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
    --no-deps -e client/python
  echo "$client_sha" > "$client_stamp"
fi
echo "setup: ready (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
