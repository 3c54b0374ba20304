#!/usr/bin/env bash
# Makes a CUDA 13.0 toolkit that CMake and nvcc accept out of NVIDIA's PyPI
# wheels, for a machine without one (deploy/Dockerfile's build stage):
# installs scripts/cuda-requirements.txt (nvcc, its front end and headers)
# into the virtual environment, next to the runtime and math libraries the
# torch wheel already brought (all of them land in site-packages/nvidia/cu13),
# adds the layout a toolkit has (targets/x86_64-linux, lib64, the unversioned
# lib*.so link names find_library looks for) and links PREFIX to it.
#
#   scripts/cuda-toolkit.sh [PREFIX]      (default /usr/local/cuda)
#
# Environment: VENV (default .venv, as scripts/setup.sh makes it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${1:-/usr/local/cuda}
VENV=${VENV:-.venv}
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r scripts/cuda-requirements.txt
cu13=$("$VENV/bin/python" -c 'import os, nvidia; print(os.path.join(nvidia.__path__[0], "cu13"))')
[ -x "$cu13/bin/nvcc" ] || { echo "cuda-toolkit: no nvcc in $cu13" >&2; exit 1; }
mkdir -p "$cu13/targets/x86_64-linux"
ln -sfn ../../include "$cu13/targets/x86_64-linux/include"
ln -sfn ../../lib "$cu13/targets/x86_64-linux/lib"
ln -sfn lib "$cu13/lib64"
for lib in "$cu13"/lib/lib*.so.*; do
  name=$(basename "$lib")
  link="$cu13/lib/${name%%.so.*}.so"
  [ -e "$link" ] || ln -s "$name" "$link"
done
ln -sfn "$(cd "$cu13" && pwd)" "$PREFIX"
echo "cuda-toolkit: $PREFIX -> $cu13 ($("$PREFIX/bin/nvcc" --version | tail -1))"
