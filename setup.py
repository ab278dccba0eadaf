"""Build steps that pyproject.toml cannot say: the EPP's ext_proc messages are generated from
``gateway/epp/proto/ext_proc.proto`` with grpcio-tools (a build requirement), so a wheel, an
sdist build and an editable install each carry code made by the protobuf they are built with;
and the compiled parts of the request path (``protocol/_kvhash.c``) are built with the
machine's C compiler. They are optional: without a compiler the install still works, slower,
and the programs say so at start (``protocol.native``)."""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup
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


NATIVE = [Extension("protocol._kvhash", ["protocol/_kvhash.c"], optional=True,
                    extra_compile_args=["-O3"])]

setup(cmdclass={"build_py": BuildPy}, ext_modules=NATIVE)
