"""Regenerate the Python stubs of proto/attention/v1/attention.proto into ``attention_wire.pb``.

    python proto/generate.py          # write client/attention_wire/pb/*
    python proto/generate.py --check  # exit 1 if the checked-in stubs are stale

The stubs live in ``attention_wire``, the package client and server share (it ships with the
client distribution, which installs alone).
grpc_tools writes ``from attention.v1 import attention_pb2``; we rewrite that to the package
path so no bare ``attention`` module is ever needed on sys.path.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO = "attention/v1/attention.proto"
OUT_DIR = ROOT / "client" / "attention_wire" / "pb"
FILES = ("attention_pb2.py", "attention_pb2.pyi", "attention_pb2_grpc.py")


def generate(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", PROTO,
        ]
        subprocess.run(cmd, check=True)
        src = Path(tmp) / "attention" / "v1"
        dest.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            text = (src / name).read_text()
            text = text.replace(
                "from attention.v1 import attention_pb2",
                "from attention_wire.pb import attention_pb2",
            )
            (dest / name).write_text(text)
    init = dest / "__init__.py"
    init.write_text('"""Generated protobuf/gRPC stubs (proto/generate.py). Do not edit."""\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if stubs are stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUT_DIR)
        print(f"wrote {', '.join(FILES)} to {OUT_DIR.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            n
            for n in (*FILES, "__init__.py")
            if not (OUT_DIR / n).exists()
            or not filecmp.cmp(Path(tmp) / n, OUT_DIR / n, shallow=False)
        ]
    if stale:
        print(f"stale generated stubs: {stale}; run: python proto/generate.py", file=sys.stderr)
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
