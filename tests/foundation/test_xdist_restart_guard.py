"""A crashed pytest-xdist worker whose replacement collects other tests does not end the run."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUITE = {
    "test_a.py": """
        import os
        def test_a1(): pass
        def test_a2():
            if not os.path.exists(os.environ["CRASH_MARK"]):
                open(os.environ["CRASH_MARK"], "w").close()
                os.abort()
        def test_a3(): pass
    """,
    "test_b.py": "import time\ndef test_b1(): time.sleep(1)\ndef test_b2(): pass\n",
    "test_c.py": "import time\ndef test_c1(): time.sleep(1)\ndef test_c2(): pass\n",
    "test_f.py": """
        import os
        if os.path.exists(os.environ["CRASH_MARK"]):
            def test_extra(): pass
        def test_f1(): pass
    """,
}


def _run(tmp_path: Path, guard: bool) -> subprocess.CompletedProcess[str]:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "conftest.py").write_text(
        "from tests.support import xdist_restart\n"
        f"def pytest_configure(config):\n    {'xdist_restart.install()' if guard else 'pass'}\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CRASH_MARK": str(tmp_path / "crashed")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "positive-control"])
def test_a_crashed_worker_with_a_different_collection_does_not_end_the_run(tmp_path, guard):
    r = _run(tmp_path, guard)
    if guard:
        assert "INTERNALERROR" not in r.stdout + r.stderr, r.stdout[-3000:]
        m = re.search(r"1 failed, (\d+) passed", r.stdout)
        assert m and int(m.group(1)) >= 7, r.stdout[-3000:]      # every test ran (one may run again)
    else:
        assert "INTERNALERROR" in r.stdout + r.stderr, r.stdout[-3000:]
