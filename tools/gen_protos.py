"""Generate the Python gRPC code of protos/ into loramux/v1/.

    python tools/gen_protos.py          # write loramux/v1/*_pb2*.py
    python tools/gen_protos.py --check  # exit 1 if the committed code is stale or missing

The generated files are build outputs: never edit them by hand. grpcio-tools is pinned in
pyproject.toml's test extra so that the check compares against one generator version.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = Path("loramux") / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto under protos/; return the generated files, relative to out_root."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_root) for p in (out_root / OUT_PACKAGE).glob("*_pb2*.py*"))


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(p.relative_to(ROOT) for p in (ROOT / OUT_PACKAGE).glob("*_pb2*.py*"))
        problems = [f"missing or extra: {p}" for p in sorted(set(fresh) ^ set(committed))]
        problems += [
            f"stale: {p}"
            for p in fresh
            if p in committed and not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False)
        ]
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print("generated gRPC code is stale: run `python tools/gen_protos.py`", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    if parser.parse_args().check:
        return check()
    for path in generate(ROOT):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
