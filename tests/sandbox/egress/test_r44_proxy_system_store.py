"""The egress proxy verifies an upstream it speaks TLS to (a host with egress
rules, R44, or an absolute https:// URL) against its image's system store,
which it reads through the store's hashed folder (egress.TLS_OUTGOING: squid
then starts without parsing the whole bundle). The real proxy image and the
rendered configuration, against the package host (tests/support/egress_hosts.py):
its CA in the store folder mounted over the image's lets the request through;
a store without it (the control) refuses it before anything reaches the origin."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
from docker.types import Mount

from services.common.host.images import PROXY_IMAGE
from services.sandbox.containers import hardening
from services.sandbox.egress.allowlist import PROXY_PORT, SYSTEM_CA_DIR, squid_conf
from tests.support.egress_hosts import package_host
from tests.support.fakes.tls import make_ca_and_server_cert
from tests.support.sandbox_broker import new_instance
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

# One request in absolute form: squid itself connects to the upstream with TLS.
GET = f"""
import socket, sys
s = socket.create_connection(("127.0.0.1", {PROXY_PORT}), timeout=30)
s.sendall(b"GET https://" + sys.argv[1].encode() + b"/demo-pkg HTTP/1.1\\r\\nHost: " + sys.argv[1].encode()
          + b"\\r\\nConnection: close\\r\\n\\r\\n")
out = b""
while chunk := s.recv(65536):
    out += chunk
print(out.split(b"\\r\\n", 1)[0].decode())
"""

FINGERPRINTS = r"""
set -eu
cd /tmp
awk '/BEGIN CERT/{n++} {print > ("b" n ".pem")}' /etc/ssl/certs/ca-certificates.crt
for f in b*.pem; do openssl x509 -in "$f" -noout -fingerprint -sha256; done | sort > bundle
for f in /etc/ssl/certs/*.[0-9]; do openssl x509 -in "$f" -noout -fingerprint -sha256; done | sort > hashed
wc -l < bundle
cmp bundle hashed
"""


def test_r44_the_proxy_images_hashed_store_holds_exactly_its_bundle(docker_client):
    """The folder the proxy trusts holds the same certificates as the bundle squid's default
    would have parsed: no public CA lost, none added."""
    out = docker_client.containers.run(PROXY_IMAGE, ["sh", "-c", FINGERPRINTS], entrypoint=[], remove=True,
                                       network_mode="none", user="proxy")
    assert int(out.decode().split()[0]) > 50, out


def _store(docker_client, folder: Path, ca_file: Path) -> str:
    """A store folder holding `ca_file` under its OpenSSL subject-hash name, as update-ca-certificates makes it."""
    folder.mkdir(parents=True)
    (folder / "ca.pem").write_bytes(ca_file.read_bytes())
    folder.chmod(0o755)
    (folder / "ca.pem").chmod(0o644)
    docker_client.containers.run(PROXY_IMAGE, ["openssl", "rehash", "/store"], entrypoint=[], remove=True,
                                 network_mode="none", user="0",
                                 mounts=[Mount(target="/store", source=str(folder), type="bind")])
    return str(folder)


def _proxy(docker_client, network: str, subnet: str, name: str, store: str):
    kw = hardening.proxy_create_kwargs(ticket_id="store-" + secrets.token_hex(3),
                                       name=f"afe-test-store-{secrets.token_hex(4)}", instance=new_instance("st"),
                                       outside_network=network, conf=squid_conf([name], allow_private=[subnet]))
    kw["mounts"] = [*kw["mounts"], Mount(target=SYSTEM_CA_DIR, source=store, type="bind", read_only=True)]
    proxy = docker_client.containers.create(**kw)
    proxy.start()
    deadline = time.monotonic() + 30
    while proxy.exec_run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{PROXY_PORT}"]).exit_code != 0:
        proxy.reload()
        assert proxy.status == "running" and time.monotonic() < deadline, proxy.logs().decode()[-2000:]
        time.sleep(0.1)
    return proxy


def test_r44_upstreams_are_verified_against_the_system_store_folder(docker_client, target_net):
    inst = new_instance("st")
    name = f"store-{inst}"
    root = temp_root("afe-r44s-")
    try:
        with package_host(docker_client, target_net["network"], [name], inst, root / "host") as host:
            other = make_ca_and_server_cert(root / "other", ["elsewhere.invalid"])
            answers = {}
            for kind, ca_file in (("without the host's CA", other.ca_file), ("with it", host.ca.ca_file)):
                store = _store(docker_client, root / kind.replace(" ", "-"), ca_file)
                proxy = _proxy(docker_client, target_net["network"], target_net["subnet"], name, store)
                try:
                    seen = len(host.requests(settle=True))
                    code, out = proxy.exec_run(["python3", "-c", GET, name])
                    assert code == 0, out
                    answers[kind] = (out.decode().strip(), [r["path"] for r in host.requests(settle=True)[seen:]])
                finally:
                    proxy.remove(force=True)
    finally:
        remove_temp_root(root)
    # control: a store without the host's CA refuses the upstream, and nothing reached it
    assert answers["without the host's CA"] == ("HTTP/1.1 503 Service Unavailable", []), answers
    assert answers["with it"] == ("HTTP/1.1 200 OK", ["/demo-pkg"]), answers
