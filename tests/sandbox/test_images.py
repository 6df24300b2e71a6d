"""`afe images build` and ensure_images: quiet when present, builds what is missing."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from services.sandbox.images import ensure_images
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_images_build_is_quiet_when_present():
    lines: list[str] = []
    assert ensure_images(progress=lines.append) == []
    assert lines == []
    p = subprocess.run([sys.executable, "-m", "services.cli.main", "images", "build"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and "already present" in p.stdout


def test_missing_images_are_built_with_progress():
    tag = new_instance("img")
    sandbox, proxy = f"afe/sandbox:{tag}", f"afe/proxy:{tag}"
    client = docker.from_env()
    lines: list[str] = []
    try:
        built = ensure_images(progress=lines.append, sandbox_image=sandbox, proxy_image=proxy)
        assert built == [sandbox, proxy]
        assert any(line.startswith(f"building {sandbox}") for line in lines)
        out = client.containers.run(sandbox, ["bash", "-c", "id -u; git --version; python3 -V"], remove=True,
                                    labels={"afe.instance": tag})
        assert out.decode().split("\n")[0] == "10001"
        assert client.images.get(proxy).attrs["Config"]["User"] == "proxy"
    finally:
        for image in (sandbox, proxy):
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(image, noprune=False)
