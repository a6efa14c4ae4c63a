"""Generate the Python stubs of protos/agentmw/v1 into the package agentmw.v1 (`make protos`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(root: Path = ROOT) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    proto_dir = root / "protos"
    sources = sorted((proto_dir / "agentmw" / "v1").glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={root}",
        f"--pyi_out={root}",
        f"--grpc_python_out={root}",
        *map(str, sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (root / "agentmw" / "v1" / "__init__.py").touch()
    return sources


if __name__ == "__main__":
    done = generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print(f"generated agentmw/v1 stubs from {len(done)} proto files")
