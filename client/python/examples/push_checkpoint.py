"""A trainer's end in a few lines: push a directory of safetensors to refitd.

On a unix: address push() takes the shared-memory lane by default (the
daemon reads the tensors in place, chunks carry references); elsewhere the
bytes go in the gRPC messages.

    .venv/bin/python client/python/examples/push_checkpoint.py unix:/tmp/refitd.sock /tmp/w2

For a daemon with --auth-tokens, REFIT_TOKEN_FILE names a trainer token's file.
"""

from __future__ import annotations

import os
import pathlib
import sys

from safetensors.torch import load_file

from refit_client import RefitClient


def main(address: str, directory: str) -> int:
    state_dict = {}
    for f in sorted(pathlib.Path(directory).glob("*.safetensors")):
        state_dict.update(load_file(str(f)))
    with RefitClient(address, token_file=os.environ.get("REFIT_TOKEN_FILE")) as client:
        result = client.push(state_dict, label=f"from {directory}")
        lane = "grpc" if client.shm_fallback_reason or not address.startswith("unix:") else "shm"
        print(f"pushed {len(state_dict)} tensors over the {lane} lane: version {result.version}, "
              f"fingerprint {result.fingerprint}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
