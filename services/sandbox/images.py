"""The local images: a Debian base made with debootstrap (no registry
needed), the default sandbox image and the egress proxy image, all built
from `deploy/images/`.

`ensure_images()` builds whatever is missing and stays quiet when all three
are present; `force=True` rebuilds the sandbox and proxy images (the base is
only rebuilt when it is missing: it is the slow, network-bound step).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from services.common.childenv import DOCKER_CLI_NAMES, PROXY_NAMES, docker_cli_env, tool_env
from services.common.config import DEFAULT_PROXY_IMAGE, DEFAULT_SANDBOX_IMAGE
from services.common.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

BASE_IMAGE = os.environ.get("AFE_BASE_IMAGE", "afe/base:bookworm")
IMAGES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "images"
SANDBOX_IMAGE = DEFAULT_SANDBOX_IMAGE
PROXY_IMAGE = DEFAULT_PROXY_IMAGE

Progress = Callable[[str], None]

# build-base.sh runs debootstrap (apt over HTTP: the operator's proxies and
# mirror) and `docker import` (the docker CLI's settings); nothing else (R33).
BASE_BUILD_NAMES = (*DOCKER_CLI_NAMES, *PROXY_NAMES, "AFE_DEBIAN_MIRROR")


def _present(image: str) -> bool:
    r = subprocess.run(["docker", "image", "inspect", image], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False, env=docker_cli_env())
    return r.returncode == 0


def _run(argv: list[str], what: str, progress: Progress, env: dict[str, str]) -> None:
    progress(f"{what}...")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-30:]
        if line.startswith(("Step ", "#", "built ", "debootstrap", "base image")):
            progress("  " + line)
    if proc.wait() != 0:
        raise FailedPrecondition(f"{what} failed (exit {proc.returncode}); last output:\n" + "\n".join(tail))


def check_engine() -> None:
    r = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                       capture_output=True, text=True, check=False, env=docker_cli_env())
    if r.returncode != 0:
        raise Unavailable("the Docker engine is not reachable: start it (or set DOCKER_HOST) and retry")


def ensure_images(progress: Progress = print, force: bool = False,
                  sandbox_image: str = SANDBOX_IMAGE, proxy_image: str = PROXY_IMAGE) -> list[str]:
    """Build missing images (all of them with force, except an existing base).

    Returns the names of the images that were built.
    """
    check_engine()
    built: list[str] = []
    base = BASE_IMAGE
    if not _present(base):
        if base != "afe/base:bookworm":
            _run(["docker", "pull", base], f"pulling {base}", progress, docker_cli_env())
        else:
            _run(["bash", str(IMAGES_DIR / "build-base.sh"), base],
                 f"building {base} with debootstrap (a few minutes)", progress, tool_env(BASE_BUILD_NAMES))
        built.append(base)
    for image, folder in ((sandbox_image, "sandbox"), (proxy_image, "proxy")):
        if force or not _present(image):
            _run(["docker", "build", "--build-arg", f"BASE={base}", "-t", image,
                  str(IMAGES_DIR / folder)], f"building {image}", progress, docker_cli_env())
            built.append(image)
    if built:
        progress("images ready: " + ", ".join(built))
    return built
