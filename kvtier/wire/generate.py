"""Regenerate the Python stubs of ``kvtier_cache.proto`` with grpcio-tools.

    python -m kvtier.wire.generate            # rewrite the committed stubs
    python -m kvtier.wire.generate --out DIR  # write them elsewhere (the staleness test)

The ``.proto`` is compiled from a temporary tree in which it sits at
``kvtier/wire/kvtier_cache.proto``, so the generated gRPC module imports
its messages as ``from kvtier.wire import kvtier_cache_pb2`` and works
as a package module without any editing of the output.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "kvtier_cache.proto"
PACKAGE_PATH = Path("kvtier/wire")
OUTPUTS = ("kvtier_cache_pb2.py", "kvtier_cache_pb2.pyi", "kvtier_cache_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile the ``.proto`` and write the three stub files into ``out_dir``.

    Returns:
        The written files.

    Raises:
        RuntimeError: protoc reported an error.
    """
    from grpc_tools import protoc  # a dev dependency, imported only when generating

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-proto-") as tmp:
        src = Path(tmp) / "src"
        gen = Path(tmp) / "gen"
        (src / PACKAGE_PATH).mkdir(parents=True)
        gen.mkdir()
        shutil.copyfile(PROTO, src / PACKAGE_PATH / PROTO.name)
        include = Path(protoc.__file__).resolve().parent / "_proto"
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{src}",
                f"-I{include}",
                f"--python_out={gen}",
                f"--pyi_out={gen}",
                f"--grpc_python_out={gen}",
                str(PACKAGE_PATH / PROTO.name),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with status {rc} on {PROTO}")
        written = []
        for name in OUTPUTS:
            target = out_dir / name
            shutil.copyfile(gen / PACKAGE_PATH / name, target)
            written.append(target)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", type=Path, default=HERE, help="where to write (default: next to the .proto)"
    )
    args = ap.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
