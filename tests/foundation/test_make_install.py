"""`make run` installs afe alone; `make test` (and `make install`) add the dev
extras (issue 35: a first `make run` spent 49 of its 75 s installing test and
lint tools). The real Makefile runs in a folder of its own, with a venv whose
`python`, `pip` and `afe` are stand-ins that write down how they were called.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$(dirname "$0")/../calls.log"
"""


def _folder(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    for tool in ("python", "pip", "afe"):
        path = work / ".venv" / "bin" / tool
        path.write_text(STUB)
        path.chmod(0o755)
    return work


def make(work: Path, *targets: str) -> list[str]:
    """Run the real Makefile's targets in `work`; the stand-ins' calls, in order."""
    log = work / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(work)}
    subprocess.run(["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), *targets], cwd=work,
                   env=env, capture_output=True, text=True, check=True, timeout=60)
    return log.read_text().splitlines() if log.exists() else []


def test_make_run_installs_afe_without_the_dev_extras(tmp_path):
    work = _folder(tmp_path)
    calls = make(work, "run", "AFE_ARGS=--config ./afe.d --listen 127.0.0.1:8421")
    assert calls == ["pip install --quiet --upgrade pip", "pip install --quiet -e .",
                     "afe up --config ./afe.d --listen 127.0.0.1:8421"]
    assert make(work, "run") == ["afe up"]                       # installed once
    # The dev install (make test, make install) adds the extras, and counts for make run too.
    assert make(work, "install") == ["pip install --quiet --upgrade pip", "pip install --quiet -e .[dev]"]
    assert make(work, "run") == ["afe up"]


def test_a_dev_install_first_serves_make_run_and_a_changed_pyproject_reinstalls_runtime_only(tmp_path):
    work = _folder(tmp_path)
    assert make(work, "install")[-1] == "pip install --quiet -e .[dev]"
    assert make(work, "run") == ["afe up"]
    later = time.time() + 5
    os.utime(work / "pyproject.toml", (later, later))
    assert make(work, "run") == ["pip install --quiet --upgrade pip", "pip install --quiet -e .", "afe up"]


def test_install_cli_links_afe_into_prefix_bin(tmp_path):
    work = _folder(tmp_path)
    prefix = tmp_path / "prefix"
    make(work, "install-cli", f"PREFIX={prefix}")
    link = prefix / "bin" / "afe"
    assert link.is_symlink() and Path(os.readlink(link)) == work / ".venv" / "bin" / "afe"
