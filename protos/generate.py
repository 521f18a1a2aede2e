"""Regenerate the Python stubs of every protos/*.proto: `python -m protos.generate`.

Runs grpc_tools.protoc from the repository root with `-I.`, so the .proto imports read
`import "protos/common.proto";` and the stubs import each other as `from protos import ...`
(no fixing of imports needed). Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py beside the
.proto files, or under OUT/protos/ with `--out OUT` (the staleness test does that, in a
subprocess: grpc_tools' bundled protobuf/abseil and NIXL's cannot share one process).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def proto_files() -> list[str]:
    """The .proto files as paths relative to the repository root, sorted."""
    return sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "protos").glob("*.proto"))


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Generate stubs for every .proto into out_root/protos/; returns the files written.

    Raises RuntimeError when protoc fails (its message is printed to stderr).
    """
    from grpc_tools import protoc  # here, not at the top: see the module docstring

    out_root = Path(out_root)
    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    protos = proto_files()
    grpc_include = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{grpc_include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    stems = [Path(p).stem for p in protos]
    return sorted(
        out_root / "protos" / f"{stem}{suffix}"
        for stem in stems
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write protos/*_pb2*.py under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
