"""The bundled demo config and its generated repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CALC_BUGGY = '''"""A tiny calculator."""


def add(a, b):
    return a - b


def mul(a, b):
    return a * b
'''

TEST_CALC = '''import unittest

from calc import add, mul


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)


if __name__ == "__main__":
    unittest.main()
'''

README = "# calc\n\nThe afe demo repository: `add` has a bug and its test fails.\n"


def _git(*args: str, cwd: Path) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_AUTHOR_NAME": "afe demo",
        "GIT_AUTHOR_EMAIL": "demo@afe.invalid",
        "GIT_COMMITTER_NAME": "afe demo",
        "GIT_COMMITTER_EMAIL": "demo@afe.invalid",
    }
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def make_repo(bare: Path) -> Path:
    """Create the demo's bare repository (branch main, one commit) if absent."""
    if (bare / "HEAD").exists():
        return bare
    bare.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "calc"
        work.mkdir()
        (work / "calc.py").write_text(CALC_BUGGY)
        (work / "test_calc.py").write_text(TEST_CALC)
        (work / "README.md").write_text(README)
        _git("init", "-q", "-b", "main", ".", cwd=work)
        _git("add", "-A", cwd=work)
        _git("commit", "-q", "-m", "calc: initial version", cwd=work)
        _git("clone", "-q", "--bare", str(work), str(bare), cwd=Path(tmp))
    return bare


def materialize(target: Path) -> Path:
    """Copy the demo manifests into `target` and generate its repository."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("afe.yaml", "demo-model.yaml"):
        src = HERE / name
        dst = target / name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copyfile(src, dst)
    make_repo(target / "repos" / "calc.git")
    return target
