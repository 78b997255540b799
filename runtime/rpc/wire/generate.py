"""Regenerate `runtime/rpc/wire/` from `proto/splitrun.proto` (`make proto`).

    python -m splitrun.runtime.rpc.wire.generate [--out DIR]

grpc_tools writes `import splitrun_pb2`; the package needs a relative import,
so the generated gRPC module is patched after generation.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

WIRE = pathlib.Path(__file__).resolve().parent
GENERATED = ("splitrun_pb2.py", "splitrun_pb2.pyi", "splitrun_pb2_grpc.py")


def _repo_root() -> pathlib.Path:
    # Works from the source tree (editable install): runtime/rpc/wire -> repo root.
    return WIRE.parents[2]


def generate(out_dir: pathlib.Path, proto_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
    from grpc_tools import protoc  # a development dependency ([test] extra)

    proto_dir = proto_dir or _repo_root() / "proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            str(proto_dir / "splitrun.proto")]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_dir / 'splitrun.proto'}")
    grpc_module = out_dir / "splitrun_pb2_grpc.py"
    text = grpc_module.read_text()
    grpc_module.write_text(text.replace("import splitrun_pb2 as splitrun__pb2",
                                        "from . import splitrun_pb2 as splitrun__pb2"))
    return [out_dir / name for name in GENERATED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=WIRE)
    args = parser.parse_args()
    for path in generate(args.out):
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
