"""`afe images build` and ensure_images: quiet when present, builds what is missing."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from services.common.host.images import (
    IMAGE_DIGEST_LABEL,
    IMAGES_DIR,
    STATX_LIBRARY,
    STATX_SOURCE,
    _compile_statx,
    ensure_images,
    image_digest,
)
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]


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
        # the gVisor statx library is in the sandbox image, preloaded into every program
        out = client.containers.run(sandbox, ["cat", "/etc/ld.so.preload"], remove=True, labels={"afe.instance": tag})
        assert out.decode() == f"/usr/local/lib/afe/{STATX_LIBRARY}\n"
        # kept while its inputs are the same (CI does not rebuild it every run)
        lines.clear()
        assert ensure_images(progress=lines.append, sandbox_image=sandbox, proxy_image=proxy) == []
        assert lines == []
        # an image built from other inputs (its label says so) is rebuilt, once
        client.images.build(fileobj=io.BytesIO(f"FROM {sandbox}\nLABEL {IMAGE_DIGEST_LABEL}=old\n".encode()),
                            tag=sandbox, rm=True)
        assert ensure_images(progress=lines.append, sandbox_image=sandbox, proxy_image=proxy) == [sandbox]
        assert ensure_images(progress=lines.append, sandbox_image=sandbox, proxy_image=proxy) == []
    finally:
        for image in (sandbox, proxy):
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(image, noprune=False)


def test_an_images_digest_changes_with_each_input_and_only_then(tmp_path):
    folder = tmp_path / "sandbox"
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM x\n")
    (folder / STATX_SOURCE).write_text("int x;\n")
    first = image_digest(folder, "sha256:base1")
    assert image_digest(folder, "sha256:base1") == first
    assert image_digest(folder, "sha256:base2") != first                  # a new base image
    (folder / STATX_SOURCE).write_text("int y;\n")
    assert image_digest(folder, "sha256:base1") != first                  # a changed source
    assert image_digest(IMAGES_DIR / "sandbox", "b") != image_digest(IMAGES_DIR / "proxy", "b")


def test_building_the_sandbox_image_without_a_c_compiler_warns_and_builds_without_the_library(
        tmp_path, monkeypatch):
    """A machine with only Python, git and Docker still builds afe/sandbox (the README's two
    commands): without the statx library, saying what gVisor sandboxes lack and what to install."""
    monkeypatch.setenv("PATH", str(tmp_path))          # no gcc, no cc
    monkeypatch.delenv("CC", raising=False)
    said: list[str] = []
    _compile_statx(IMAGES_DIR / "sandbox" / STATX_SOURCE, tmp_path / STATX_LIBRARY, said.append)
    assert any("apt-get install gcc libc6-dev" in m and "gVisor" in m and "make images" in m for m in said), said
    assert (tmp_path / STATX_LIBRARY).read_bytes() == b""        # the Dockerfile preloads nothing then
