"""Only here so that building the package also generates the gRPC stubs (agentmw.v1)."""

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStubs(build_py):
    def run(self) -> None:
        from agent_host.protogen import generate

        generate()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
