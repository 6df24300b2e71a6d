"""The per-ticket CA of a sandbox whose egress has rules (R44), seen from the
broker: the ticket's CA folder, the trust bundle the sandbox gets, and the
CA certificate read back from the proxy.

The proxy makes the CA itself when it starts (`PREPARE` in
proxy.py's command): its private key is made and kept in the proxy
container's tmpfs and never leaves it, so it is gone with the container
(R12 removes it with the ticket). The proxy prints only the certificate, on
stderr; the broker reads it from the container's log and writes, in
`<run>/egress-ca/<ticket>/sandbox/` (mounted read-only in the sandbox at
`/run/afe-ca`; `<ticket>/proxy/` is the proxy's, bump.py):

- `ticket-ca.pem`: the CA certificate alone (NODE_EXTRA_CA_CERTS adds it to
  Node's own roots);
- `bundle.pem`: the sandbox image's own CA store followed by the ticket's CA
  (SSL_CERT_FILE, REQUESTS_CA_BUNDLE, PIP_CERT, GIT_SSL_CAINFO,
  CURL_CA_BUNDLE), also bind-mounted over the image's store file, so tools
  that read the system store trust it too;
- `store.pem`: the image's store as it was read (to rebuild the bundle when
  a restarted proxy made a new CA).

The image's store is read once per image (a container created from it and
removed, not started) and kept in memory. The bundle is written in place (its
inode is what the sandbox has mounted).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tarfile
import threading
from pathlib import Path

import docker
import docker.errors
from cryptography import x509
from docker.types import Mount

from services.common import safefs
from services.common.errors import Unavailable
from services.common.layout import Layout, check_ticket_id

log = logging.getLogger(__name__)

CA_MOUNT = "/run/afe-ca"
BUNDLE = "bundle.pem"
TICKET_CA = "ticket-ca.pem"
STORE = "store.pem"
BEGIN = "afe-egress-ca-begin"        # the proxy's stderr lines around the certificate
END = "afe-egress-ca-end"
# Where images keep their system CA store (Debian/Ubuntu/Alpine, RHEL/Fedora, others).
STORE_PATHS = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
STORE_MAX = 4 << 20
CA_MAX = 16 << 10
_CACHED_IMAGES = 32


def sandbox_env() -> dict[str, str]:
    """What points a sandbox's tools at the bundle (they replace the store) or adds the CA (Node)."""
    bundle = f"{CA_MOUNT}/{BUNDLE}"
    return {"SSL_CERT_FILE": bundle, "REQUESTS_CA_BUNDLE": bundle, "PIP_CERT": bundle,
            "GIT_SSL_CAINFO": bundle, "CURL_CA_BUNDLE": bundle,
            "NODE_EXTRA_CA_CERTS": f"{CA_MOUNT}/{TICKET_CA}"}


def ticket_dir(layout: Layout, ticket_id: str) -> Path:
    return layout.run_dir / "egress-ca" / check_ticket_id(ticket_id)


def ca_dir(layout: Layout, ticket_id: str) -> Path:
    """The folder the sandbox has mounted at CA_MOUNT."""
    return ticket_dir(layout, ticket_id) / "sandbox"


def sandbox_mounts(folder: str, store_path: str | None) -> list[Mount]:
    """The CA folder read-only at CA_MOUNT and, when the image has a store, the
    bundle read-only over it."""
    mounts = [Mount(target=CA_MOUNT, source=folder, type="bind", read_only=True)]
    if store_path:
        mounts.append(Mount(target=store_path, source=os.path.join(folder, BUNDLE), type="bind",
                            read_only=True))
    return mounts


class ImageStores:
    """The CA store of each sandbox image (path in the image, content), read
    once per image id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stores: dict[str, tuple[str | None, bytes]] = {}

    def get(self, client: docker.DockerClient, image: str, labels: dict[str, str]) -> tuple[str | None, bytes]:
        """`labels`: the ticket's, so a reconcile removes the probe container if this broker dies."""
        image_id = client.api.inspect_image(image)["Id"]
        with self._lock:
            if image_id in self._stores:
                return self._stores[image_id]
        found = _read_store(client, image_id, labels)
        with self._lock:
            if len(self._stores) >= _CACHED_IMAGES:
                self._stores.pop(next(iter(self._stores)))
            self._stores[image_id] = found
        return found


def _read_store(client: docker.DockerClient, image_id: str, labels: dict[str, str]) -> tuple[str | None, bytes]:
    """(the store's path, its bytes) from a container of the image that never runs; (None, b"") if none."""
    cid = client.api.create_container(image_id, command=["true"], entrypoint=[], network_disabled=True,
                                      labels=labels)["Id"]
    try:
        for path in STORE_PATHS:
            target = path
            for _ in range(4):           # follow a few symbolic links inside the image
                try:
                    stream, _stat = client.api.get_archive(cid, target)
                except docker.errors.NotFound:
                    break
                data = b"".join(stream)
                with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                    member = tar.next()
                    if member is None:
                        break
                    if member.issym():
                        target = os.path.normpath(os.path.join(os.path.dirname(target), member.linkname))
                        continue
                    if not member.isfile() or member.size > STORE_MAX:
                        break
                    f = tar.extractfile(member)
                    if f is None:
                        break
                    return target, f.read()
        return None, b""
    finally:
        with contextlib.suppress(docker.errors.APIError):
            client.api.remove_container(cid, force=True)


def make_ca_dir(layout: Layout, ticket_id: str, store: bytes) -> str:
    """The ticket's CA folder with the bundle holding the image's store so far
    (the ticket's CA is added once the proxy made it)."""
    d = ca_dir(layout, ticket_id)
    d.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chmod(d.parent, 0o755)
    os.chmod(d, 0o755)
    _write(d / STORE, store)
    bundle = d / BUNDLE
    if not bundle.exists():
        _write(bundle, store)
    if not (d / TICKET_CA).exists():
        _write(d / TICKET_CA, b"")
    return str(d)


def _write(path: Path, data: bytes) -> None:
    """Write in place (the same inode: a bind mount of the file sees it), 0644."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)


def ca_from_log(text: str) -> bytes:
    """The last certificate the proxy printed between BEGIN and END, checked to be a CA certificate."""
    lines = text.splitlines()
    try:
        start = len(lines) - 1 - lines[::-1].index(BEGIN)
        end = lines.index(END, start)
    except ValueError:
        raise Unavailable("the egress proxy did not publish its CA certificate") from None
    pem = ("\n".join(lines[start + 1:end]) + "\n").encode()
    if len(pem) > CA_MAX:
        raise Unavailable("the egress proxy's CA certificate is too large")
    try:
        cert = x509.load_pem_x509_certificate(pem)
        ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except (ValueError, x509.ExtensionNotFound):
        ca = False
    if not ca:
        raise Unavailable("the egress proxy published no valid CA certificate")
    return pem


def install(client: docker.DockerClient, proxy_id: str, layout: Layout, ticket_id: str) -> None:
    """Read the CA the (running, listening) proxy made and put it into the
    ticket's bundle. Blocking; run in a worker thread."""
    started = client.api.inspect_container(proxy_id)["State"].get("StartedAt", "")
    since = _epoch(started)
    text = b"".join(client.api.logs(proxy_id, stdout=False, stderr=True, stream=True, follow=False,
                                    since=since)).decode("utf-8", "replace")
    pem = ca_from_log(text)
    d = ca_dir(layout, ticket_id)
    store = (d / STORE).read_bytes() if (d / STORE).exists() else b""
    if (d / TICKET_CA).exists() and (d / TICKET_CA).read_bytes() == pem:
        return
    sep = b"" if not store or store.endswith(b"\n") else b"\n"
    _write(d / TICKET_CA, pem)
    _write(d / BUNDLE, store + sep + pem)


def _epoch(started_at: str) -> int:
    """Docker's StartedAt (RFC 3339 with nanoseconds) as whole seconds, one second early."""
    from datetime import datetime
    try:
        t = datetime.fromisoformat(started_at[:19] + "+00:00")
    except ValueError:
        return 0
    return max(0, int(t.timestamp()) - 1)


def remove_ticket_dir(layout: Layout, ticket_id: str) -> None:
    safefs.remove_tree(ticket_dir(layout, ticket_id))


def reconcile(layout: Layout, live: set[str]) -> set[str]:
    """Remove the CA folders of tickets that are not live; returns their ids."""
    return safefs.remove_dirs_except(layout.run_dir / "egress-ca", live)
