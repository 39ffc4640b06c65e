"""Generates the gRPC stubs from protos/ when the package is built or installed (also editable)."""
from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self):
        from ddtree_serve.proto.generate import generate_stubs  # stdlib + grpc_tools only

        generate_stubs(force=True)
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
