"""npm packages as test data or test clients: `npm ci` of a committed
package.json + package-lock.json, once per content of the two files, into
~/.cache/afe-npm/<hash> (or $AFE_NPM_CACHE). Tests that need it skip only
when node/npm are absent (.ci/run installs Debian's nodejs and npm)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

HAVE_NPM = bool(shutil.which("node") and shutil.which("npm"))
needs_npm = pytest.mark.skipif(not HAVE_NPM, reason="node and npm are not installed "
                               "(.ci/run installs Debian's nodejs and npm)")


def node_modules(package_dir: Path, marker: str) -> Path:
    """The node_modules of `package_dir`'s lock file; `marker` is a file inside it that only a
    complete install has (e.g. "@grpc/grpc-js/package.json")."""
    lock = (package_dir / "package-lock.json").read_bytes()
    digest = hashlib.sha256(lock + (package_dir / "package.json").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("AFE_NPM_CACHE", Path.home() / ".cache" / "afe-npm"))
    target = cache / digest
    if (target / "node_modules" / marker).exists():
        return target / "node_modules"
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{digest}.", dir=cache))
    shutil.copy(package_dir / "package.json", work)
    shutil.copy(package_dir / "package-lock.json", work)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    done = subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=work, env=env,
                          capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        work.rename(target)              # atomic: a concurrent run keeps the first complete install
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return target / "node_modules"
