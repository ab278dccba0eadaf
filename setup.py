"""Build step that pyproject.toml cannot say: the EPP's ext_proc messages are generated from
``gateway/epp/proto/ext_proc.proto`` with grpcio-tools (a build requirement), so a wheel, an
sdist build and an editable install each carry code made by the protobuf they are built with."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTOS = ("gateway/epp/proto/ext_proc.proto",)


def generate_protos(root: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in PROTOS:
        args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}",
                f"--pyi_out={root}", str(root / proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPy(build_py):
    def run(self) -> None:
        generate_protos(Path(__file__).resolve().parent)
        super().run()


setup(cmdclass={"build_py": BuildPy})
