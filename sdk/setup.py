"""Only here so that building agentmw-sdk also generates the gRPC stubs (agentmw.v1).

The package's sources are the repository's ``agentmw/`` (one copy, shared with the host's editable
install; pyproject.toml maps it with package-dir ".."). A PEP 517 build runs this file without the
repository on sys.path, and finds the packages before anything is generated; so the generator is
loaded by path, and agentmw.v1 is added to the packages once it exists (else a wheel built from a
fresh clone would lack the stubs).
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent.parent  # the repository: protos/ and agentmw/
STUBS = "agentmw.v1"


def _generate() -> None:
    spec = importlib.util.spec_from_file_location("_agentmw_protogen", ROOT / "agentmw" / "protogen.py")
    assert spec is not None and spec.loader is not None
    protogen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(protogen)
    protogen.generate(ROOT)


class BuildWithStubs(build_py):
    def run(self) -> None:
        _generate()
        if self.packages is not None and STUBS not in self.packages:
            self.packages.append(STUBS)
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
