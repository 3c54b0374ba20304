"""Build hook of refit-client: generates the gRPC stubs at build time, and
builds the optional C module that copies with streaming stores.

`build_py` (which both `pip install` and editable installs run) calls
grpc_tools.protoc on proto/refit/v1/refit.proto, engine.proto and region.proto into
refit_client/_proto/,
before the package's files are collected. The proto is found at
$REFIT_PROTO_DIR or ../../proto (this directory inside the refitd tree).
"""

import os
import pathlib

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


def generate_stubs() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    proto_root = pathlib.Path(os.environ.get("REFIT_PROTO_DIR", HERE.parent.parent / "proto"))
    out = HERE / "refit_client" / "_proto"
    out.mkdir(exist_ok=True)
    # refit.proto (RefitService), engine.proto (EngineService: attach) and
    # region.proto (RegionService: the shared-memory lane).
    for name in ("refit", "engine", "region"):
        source = proto_root / "refit" / "v1" / f"{name}.proto"
        if not source.is_file():
            raise RuntimeError(f"refit-client: {source} not found (set REFIT_PROTO_DIR)")
        # The virtual include path makes protoc name the file
        # refit_client/_proto/NAME.proto, so the generated gRPC module imports
        # its messages as refit_client._proto.NAME_pb2 (a package-absolute path).
        args = [
            "grpc_tools.protoc",
            f"--proto_path=refit_client/_proto={source.parent}",
            f"--python_out={HERE}",
            f"--pyi_out={HERE}",
            f"--grpc_python_out={HERE}",
            f"refit_client/_proto/{name}.proto",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"refit-client: protoc failed on {source}")
    (out / "__init__.py").write_text('"""Generated from proto/refit/v1/*.proto at build time."""\n')


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(
    cmdclass={"build_py": BuildPyWithStubs},
    # The staging copy with streaming stores (refit_client/_ntcopy.c) and
    # the arena header's ordered loads (refit_client/_atomics.c). Optional:
    # without a C compiler the package installs without them, copies with
    # numpy and reads the header with struct.
    ext_modules=[
        Extension("refit_client._ntcopy", ["refit_client/_ntcopy.c"], optional=True),
        Extension("refit_client._atomics", ["refit_client/_atomics.c"], optional=True),
    ],
)
