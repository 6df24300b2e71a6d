"""Generate the gRPC contracts into services/_gen (run by `make proto`).

Message stubs (`*_pb2.pyi`) and async/sync service stubs (`*_pb2_grpc.pyi`)
come from mypy-protobuf, so `mypy services gateway` checks calls and
servicers against the contracts.

protoc writes imports as `from afe.<svc>.v1 import ...`; the generated modules
live inside the `services._gen` package, so those imports are rewritten to be
absolute from there. `--check` regenerates into a temporary folder and fails
when the committed code differs (CI drift check).
"""

from __future__ import annotations

import filecmp
import os
import pathlib
import re
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
GEN = ROOT / "services" / "_gen"


def generate(out: pathlib.Path) -> None:
    # protoc finds the mypy plugin on PATH: the venv's bin folder.
    os.environ["PATH"] = str(pathlib.Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    files = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in out.rglob("*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^from afe\.", "from services._gen.afe.", text, flags=re.MULTILINE)
        fixed = re.sub(r"^import afe\.", "import services._gen.afe.", fixed, flags=re.MULTILINE)
        if fixed != text:
            path.write_text(fixed)
    for d in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = pathlib.Path(tmp) / "_gen"
            generate(fresh)
            cmp = filecmp.dircmp(fresh, GEN)
            bad: list[str] = []

            def walk(c: filecmp.dircmp, prefix: str) -> None:
                bad.extend(prefix + n for n in c.left_only + c.right_only + c.diff_files
                           if n != "__pycache__")
                for name, sub in c.subdirs.items():
                    if name != "__pycache__":
                        walk(sub, prefix + name + "/")

            walk(cmp, "")
            if bad:
                print("generated code is stale; run `make proto`:", ", ".join(sorted(bad)))
                return 1
            print("generated code is up to date")
            return 0
    if GEN.exists():
        shutil.rmtree(GEN)
    generate(GEN)
    print(f"generated {GEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
