"""Build (when missing or stale) the ACP test image `afe/sandbox-acp-test:latest`.

    from tests.acp.image import ensure_acp_test_image, agent_command
    ensure_acp_test_image()            # idempotent; rebuilds when inputs change
    agent_command("good")              # argv for a test agent inside the image

The image is `afe/sandbox:latest` plus a venv at /opt/acp holding
agent-client-protocol (wheels fetched on the host with `pip download`, then
installed with `--no-index`: the build needs no network) and the agents in
tests/acp/agents/. Its label `afe.acp-test.digest` hashes every input
(Dockerfile, agents, base image id), so a stale image is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import docker

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE_DIR = ROOT / "deploy" / "images" / "acp-test"
AGENTS_DIR = Path(__file__).resolve().parent / "agents"
IMAGE = "afe/sandbox-acp-test:latest"
BASE = "afe/sandbox:latest"
LABEL = "afe.acp-test.digest"
ACP_REQUIREMENT = "agent-client-protocol==0.12.1"
AGENT_PYTHON = "/opt/acp/bin/python"
AGENT_DIR = "/opt/acp/agents"
LOCK = Path(tempfile.gettempdir()) / "afe-acp-test-image.lock"


def agent_command(name: str) -> tuple[str, ...]:
    """The argv that runs test agent `name` (tests/acp/agents/<name>.py) in the image."""
    return (AGENT_PYTHON, f"{AGENT_DIR}/{name}.py")


def _digest(client: docker.DockerClient) -> str:
    h = hashlib.sha256()
    h.update(client.images.get(BASE).id.encode())
    h.update(ACP_REQUIREMENT.encode())
    h.update((DOCKERFILE_DIR / "Dockerfile").read_bytes())
    for f in sorted(AGENTS_DIR.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:32]


def _download_wheels(dest: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
         "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
         "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
         "--platform", "manylinux_2_28_x86_64", "--dest", str(dest), ACP_REQUIREMENT],
        check=True, timeout=600)


def ensure_acp_test_image() -> str:
    """Return the image name, building it first if it is missing or stale."""
    client = docker.from_env()
    try:
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            digest = _digest(client)
            stale = None
            try:
                current = client.images.get(IMAGE)
                if current.labels.get(LABEL) == digest:
                    return IMAGE
                stale = current.id if LABEL in current.labels else None
            except docker.errors.ImageNotFound:
                pass
            with tempfile.TemporaryDirectory(prefix="afe-acp-img-") as tmp:
                ctx = Path(tmp)
                shutil.copy(DOCKERFILE_DIR / "Dockerfile", ctx / "Dockerfile")
                (ctx / "agents").mkdir()
                for f in AGENTS_DIR.glob("*.py"):
                    shutil.copy(f, ctx / "agents" / f.name)
                _download_wheels(ctx / "wheels")
                client.images.build(path=str(ctx), tag=IMAGE, labels={LABEL: digest},
                                    buildargs={"BASE": BASE}, rm=True, forcerm=True, network_mode="none")
            if stale is not None:       # our previous build, now untagged; in use elsewhere -> kept
                with contextlib.suppress(docker.errors.APIError):
                    client.images.remove(stale, noprune=False)
            return IMAGE
    finally:
        client.close()
