"""Egress rules enforced on the decrypted request (R44), with the real
sandbox broker, the real squid proxy (ssl-bump, the ticket's own CA) and
real npm, pip and git in the sandbox, against a package registry and git
host over HTTPS (tests/support/fakes/package_host.py, its certificate from a
test CA the proxy trusts as AFE_CA_FILE).

One ticket has rules: the registry `read-only`, the git host `git-fetch`,
a file host `PUT /upload/public/**`, and a plain host without rules. The
positive control is a ticket with the same hosts and no rules: there the
publish, the uploads, the push and the encoded paths all reach the origin.
"""

from __future__ import annotations

import json
import secrets
import textwrap

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.layout import Layout
from services.sandbox.egress import ca as egress_ca
from tests.sandbox.conftest import BrokerThread, gvisor_missing, run, sync_stub
from tests.support.egress_hosts import ensure_tools_image, package_host
from tests.support.npm import needs_npm
from tests.support.sandbox_broker import new_instance
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600), needs_npm]   # npm and node for the tools image (tests/support/npm.py)


@pytest.fixture(scope="module")
def world(docker_client, target_net):
    """The package host (as registry-, git-, files- and plain-<id>), a broker
    that trusts its CA for upstreams, the tools image."""
    inst = new_instance("r44")
    names = {k: f"{k}-{inst}" for k in ("registry", "git", "files", "plain")}
    root = temp_root("afe-r44-")
    image = ensure_tools_image(docker_client)
    try:
        with package_host(docker_client, target_net["network"], list(names.values()), inst, root / "host") as host:
            broker = BrokerThread(Layout(root / "data", root / "run"), instance=inst + "b",
                                  egress_network=target_net["network"], allow_private=(target_net["subnet"],),
                                  upstream_ca=host.ca.ca_file.read_bytes()).start()
            ch, stub = sync_stub(broker.socket, broker.secret)
            try:
                yield {"names": names, "host": host, "stub": stub, "image": image, "broker": broker,
                       "inst": inst, "net": target_net}
            finally:
                ch.close()
                broker.stop()
    finally:
        remove_temp_root(root)


def rules_spec(names: dict[str, str]) -> list[pb.EgressRule]:
    return [pb.EgressRule(host=names["registry"], methods=["GET", "HEAD"], name="read-only"),
            pb.EgressRule(host=names["git"], methods=["GET"], paths=["/**/info/refs?service=git-upload-pack"],
                          name="git-fetch"),
            pb.EgressRule(host=names["git"], methods=["POST"], paths=["/**/git-upload-pack"], name="git-fetch"),
            pb.EgressRule(host=names["files"], methods=["GET", "PUT"], paths=["/upload/public/**"],
                          name="sandbox.egress[2]")]


def make(world, prefix: str, rules: bool, runtime: str = "") -> tuple[str, pb.Sandbox]:
    ticket = f"{prefix}-{secrets.token_hex(4)}"
    spec = pb.SandboxSpec(image=world["image"], egress=list(world["names"].values()), runtime=runtime,
                          egress_rules=rules_spec(world["names"]) if rules else [])
    return ticket, world["stub"].CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=spec))


@pytest.fixture(scope="module")
def ruled(world):
    ticket, sb = make(world, "ruled", True)
    try:
        yield ticket, sb
    finally:
        world["stub"].DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


# Without rules the sandbox speaks TLS with the origin itself: it trusts the test CA as a
# sandbox trusts a public registry's CA (its image's store).
TRUST_ORIGIN = ("SSL_CERT_FILE=/workspace/origin-ca.pem NODE_EXTRA_CA_CERTS=/workspace/origin-ca.pem "
                "GIT_SSL_CAINFO=/workspace/origin-ca.pem PIP_CERT=/workspace/origin-ca.pem")


@pytest.fixture(scope="module")
def unruled(world):
    ticket, sb = make(world, "open", False)
    try:
        world["stub"].WriteFile(pb.WriteFileRequest(ticket_id=ticket, path="origin-ca.pem",
                                                    content=world["host"].ca.ca_file.read_bytes()))
        yield ticket, sb
    finally:
        world["stub"].DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def sh(world, ticket: str, script: str, timeout_ms: int = 180000):
    script = textwrap.dedent(script)
    if ticket.startswith("open-"):
        script = f"export {TRUST_ORIGIN}\n{script}"
    r = run(world["stub"], ticket, script, timeout_ms=timeout_ms)
    return r.code, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


def publish_script(registry: str, version: str) -> str:
    return f"""
    set -e
    mkdir -p /workspace/pub-{version} && cd /workspace/pub-{version}
    printf '{{"name": "demo-pkg", "version": "{version}"}}' > package.json
    echo 'module.exports = 1;' > index.js
    printf '//{registry}/:_authToken=test-token\\n' > .npmrc
    npm publish --registry https://{registry}/ --no-audit 2>&1
    """


def versions(world, ticket: str) -> list[str]:
    reg = world["names"]["registry"]
    code, out, err = sh(world, ticket, f"npm view demo-pkg versions --json --registry https://{reg}/")
    assert code == 0, out + err
    return json.loads(out)


def writes_to(world, host: str) -> list[dict]:
    return [r for r in world["host"].requests(settle=True) if r["host"] == host and r["method"] not in ("GET", "HEAD")]


UPLOAD = """
import json, sys, urllib.request, urllib.error
out = []
for method, url in json.loads(sys.argv[1]):
    try:
        data = None if method in ("GET", "HEAD") else b"exfiltrated"
        r = urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=30)
        out.append([r.status, r.read().decode()[:300]])
    except urllib.error.HTTPError as e:
        out.append([e.code, e.read().decode(errors="replace")[:300]])
print(json.dumps(out))
"""


def upload(world, ticket: str, requests: list[tuple[str, str]]) -> list[list]:
    code, out, err = sh(world, ticket, f"python3 -c '{UPLOAD}' '{json.dumps(requests)}'")
    assert code == 0, out + err
    return json.loads(out)


def test_r44_read_only_registry_installs_and_downloads_but_never_publishes_or_uploads(world, ruled):
    ticket, _ = ruled
    reg = world["names"]["registry"]
    code, out, err = sh(world, ticket, f"""
        set -e
        mkdir -p /workspace/app && cd /workspace/app
        npm install --no-audit --no-fund --registry https://{reg}/ demo-pkg 2>&1
        node -e 'console.log("installed", require("demo-pkg"))'
        /opt/py/bin/pip download --no-deps --index-url https://{reg}/simple/ demo-pkg==1.0 -d /workspace/dl 2>&1
        ls /workspace/dl""")
    assert code == 0, out + err
    assert "installed demo-pkg@1.0.0" in out and "demo_pkg-1.0-py3-none-any.whl" in out
    code, out, _ = sh(world, ticket, publish_script(reg, "2.0.0"))
    assert code != 0 and "403" in out, out
    got = upload(world, ticket, [("PUT", f"https://{reg}/upload/x"), ("POST", f"https://{reg}/upload/y")])
    for status, body in got:
        assert status == 403
        assert "refused: no rule allows" in body and "read-only: GET and HEAD on any path" in body, body
    assert writes_to(world, reg) == []                 # nothing but reads ever reached the registry
    assert "2.0.0" not in versions(world, ticket)


def test_r44_git_fetch_clones_but_never_pushes(world, ruled):
    ticket, _ = ruled
    git = world["names"]["git"]
    before = world["host"].git("rev-parse", "main")
    code, out, err = sh(world, ticket, f"""
        set -e
        cd /workspace && rm -rf demo && git clone https://{git}/demo.git 2>&1
        cd demo && git log --oneline
        echo change > file && git add file
        git -c user.name=t -c user.email=t@t commit -qm exfiltrate
        git push origin HEAD:refs/heads/ruled 2>&1 || echo PUSH-REFUSED""")
    assert code == 0, out + err
    assert "initial" in out and "PUSH-REFUSED" in out and "403" in out, out
    assert world["host"].git("rev-parse", "main") == before
    assert world["host"].git("branch", "--list", "ruled") == ""
    assert not [r for r in world["host"].requests(settle=True) if r["host"] == git and "receive-pack" in r["path"]]


def test_r44_positive_control_without_rules_publish_uploads_and_push_go_through(world, unruled):
    ticket, _ = unruled
    reg, git = world["names"]["registry"], world["names"]["git"]
    code, out, _ = sh(world, ticket, publish_script(reg, "3.0.0"))
    assert code == 0, out
    assert "3.0.0" in versions(world, ticket)
    got = upload(world, ticket, [("PUT", f"https://{reg}/upload/x"), ("POST", f"https://{reg}/upload/y")])
    assert [s for s, _ in got] == [201, 201]
    code, out, err = sh(world, ticket, f"""
        set -e
        cd /workspace && rm -rf demo && git clone -q https://{git}/demo.git && cd demo
        echo change > file && git add file && git -c user.name=t -c user.email=t@t commit -qm pushed
        git push origin HEAD:refs/heads/open 2>&1""")
    assert code == 0, out + err
    assert world["host"].git("branch", "--list", "open").strip() == "open"


RAW = """
import json, os, socket, ssl, sys
proxy = os.environ["HTTPS_PROXY"].split("//")[1]
phost, pport = proxy.rsplit(":", 1)
host, requests = sys.argv[1], json.loads(sys.argv[2])
out = []
for method, target, extra in requests:
    s = socket.create_connection((phost, int(pport)), timeout=20)
    s.sendall(f"CONNECT {host}:443 HTTP/1.1\\r\\nHost: {host}:443\\r\\n\\r\\n".encode())
    s.recv(4096)
    ctx = ssl.create_default_context()
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    t = ctx.wrap_socket(s, server_hostname=host)
    alpn = t.selected_alpn_protocol()
    if method == "H2":
        head = b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n"
    else:
        body = "" if method in ("GET", "HEAD", "CONNECT") else "Content-Length: 4\\r\\n"
        head = f"{method} {target} HTTP/1.1\\r\\nHost: {host}\\r\\n{body}{extra}Connection: close\\r\\n\\r\\n".encode()
        head += b"" if not body else b"body"
    t.sendall(head)
    data = b""
    try:
        while len(data) < 65536:
            chunk = t.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    line = data.split(b"\\r\\n", 1)[0].decode(errors="replace")
    out.append([line.split(" ")[1] if line.count(" ") >= 1 else "", alpn, data.decode(errors="replace")[-400:]])
print(json.dumps(out))
"""


def raw(world, ticket: str, host: str, requests: list[tuple[str, str, str]]) -> list[list]:
    code, out, err = sh(world, ticket, f"python3 -c '{RAW}' {host} '{json.dumps(requests)}'")
    assert code == 0, out + err
    return json.loads(out)


PRIVATE = "/upload/private/x"
VARIANTS = ["/upload/public/../private/x", "/upload/public/%2e%2e/private/x", "/upload/public/%2E%2E/private/x",
            "/upload/public/.%2e/private/x", "/upload/public%2f..%2fprivate/x", "/upload/public/..%2Fprivate/x",
            "/upload/./public/../private/x", "/upload/public/..;/private/x", "/upload/public/%252e%252e/private/x",
            "/upload/public/..%5cprivate/x", "//upload//private/x", "/UPLOAD/private/x"]


def test_r44_encoded_variants_of_a_refused_path_are_refused(world, ruled, unruled):
    files = world["names"]["files"]
    ok = raw(world, ruled[0], files, [("PUT", "/upload/public/ok", "")])
    assert ok[0][0] == "201"                                   # the rule itself allows this
    seen = len(world["host"].requests(settle=True))
    got = raw(world, ruled[0], files, [("PUT", PRIVATE, "")] + [("PUT", v, "") for v in VARIANTS])
    for (status, _alpn, body), target in zip(got, [PRIVATE, *VARIANTS], strict=True):
        assert status == "403", (target, status, body)
        assert "refused" in body and "sandbox.egress[2]" in body, body
    assert [r for r in world["host"].requests(settle=True)[seen:] if r["host"] == files] == []
    # positive control: without rules the same spellings reach the origin, which stores
    # most of them at the refused path itself
    got = raw(world, unruled[0], files, [("PUT", v, "") for v in VARIANTS])
    landed = [v for v, (status, _a, body) in zip(VARIANTS, got, strict=True)
              if status == "201" and f'"stored": "{PRIVATE}"' in body]
    assert len(landed) >= 5, got


FRONT = """
import os, socket, ssl, sys
phost, pport = os.environ["HTTPS_PROXY"].split("//")[1].rsplit(":", 1)
plain, ruled = sys.argv[1], sys.argv[2]
for sni in (plain, ruled):
    s = socket.create_connection((phost, int(pport)), timeout=20)
    s.sendall(f"CONNECT {plain}:443 HTTP/1.1\\r\\nHost: {plain}:443\\r\\n\\r\\n".encode())
    s.recv(4096)
    try:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE       # only: served, or cut?
        t = ctx.wrap_socket(s, server_hostname=sni)
        t.sendall(f"GET /demo-pkg HTTP/1.1\\r\\nHost: {sni}\\r\\nConnection: close\\r\\n\\r\\n".encode())
        print("PLAIN" if sni == plain else "FRONTED", t.recv(100).split(b" ")[1].decode())
    except OSError:
        print("CUT")
"""


def test_r44_requests_the_proxy_cannot_judge_are_refused(world, ruled, unruled):
    reg, plain = world["names"]["registry"], world["names"]["plain"]
    upgrade = ("GET", "/demo-pkg", ("Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZQ==\r\n"
               "Sec-WebSocket-Version: 13\r\n"))
    seen = len(world["host"].requests(settle=True))
    got = raw(world, ruled[0], reg, [upgrade, ("H2", "", ""), ("CONNECT", f"{plain}:443", "")])
    (ws, alpn, ws_body), (h2, _, _), (nested, _, nested_body) = got
    assert ws == "403" and "protocol upgrade" in ws_body, ws_body
    assert alpn != "h2"                                         # the proxy never offers HTTP/2 to the sandbox
    assert h2 in ("400", "403")                                  # squid cannot parse it, or the judge refuses it
    assert nested == "403" and "CONNECT inside a decrypted connection" in nested_body, nested_body
    assert [r for r in world["host"].requests(settle=True)[seen:] if r["host"] == reg] == []
    # a ClientHello naming a host with rules through a tunnel to a host without: cut
    code, out, err = sh(world, ruled[0], f"python3 -c '{FRONT}' {plain} {reg}")
    assert code == 0, out + err
    assert out.split() == ["PLAIN", "200", "CUT"], out
    # positive control: without rules the upgrade request reaches the origin
    seen = len(world["host"].requests(settle=True))
    assert raw(world, unruled[0], reg, [upgrade])[0][0] == "200"
    assert [r["path"] for r in world["host"].requests(settle=True)[seen:]] == ["/demo-pkg"]


def test_r44_every_request_allowed_or_refused_is_reported(world, ruled):
    ticket, _ = ruled
    reg = world["names"]["registry"]
    upload(world, ticket, [("GET", f"https://{reg}/demo-pkg"), ("PUT", f"https://{reg}/upload/report-me?token=s3cret")])
    d = world["stub"].DeniedEgress(pb.DeniedEgressRequest(ticket_id=ticket))
    reqs = list(d.requests)
    put = [r for r in reqs if r.method == "PUT" and r.path == "/upload/report-me"]
    assert put and put[0].denied and put[0].status == 403 and put[0].reason == "method"
    assert put[0].rule == "read-only" and put[0].bytes_out > 0 and len(put[0].path_sha256) == 64
    assert any(not r.denied and r.method == "GET" and r.host == reg and r.status == 200 and r.bytes_in > 0
               for r in reqs)
    git_refused = [r for r in reqs if r.host == world["names"]["git"] and r.denied]
    assert all(r.rule == "git-fetch" for r in git_refused)
    assert "s3cret" not in str(d)
    assert reg in [h.host for h in d.hosts]                   # the refused host in the host counts too


def test_r44_the_ticket_ca_is_its_own_and_its_key_never_leaves_the_proxy(world, ruled, docker_client):
    ticket, sb = ruled
    layout = world["broker"].layout
    code, ca, err = sh(world, ticket, "cat /run/afe-ca/ticket-ca.pem")
    assert code == 0 and ca.startswith("-----BEGIN CERTIFICATE-----"), ca + err
    # the image's own store, mounted over with the bundle: every certificate it had, then the ticket's CA
    code, tail, _ = sh(world, ticket, f"tail -c {len(ca)} /etc/ssl/certs/ca-certificates.crt; "
                                      "grep -c 'BEGIN CERTIFICATE' /etc/ssl/certs/ca-certificates.crt")
    assert code == 0 and tail.startswith(ca) and int(tail[len(ca):]) > 100, tail
    folder = egress_ca.ticket_dir(layout, ticket)
    for f in folder.rglob("*"):
        if f.is_file():
            assert b"PRIVATE KEY" not in f.read_bytes(), f
    proxy = docker_client.containers.get(sb.proxy_container_id)
    code, _ = proxy.exec_run(["sh", "-c", "grep -q 'PRIVATE KEY' /tmp/afe-tls/ca.key"])
    assert code == 0                                           # the key is in the proxy's tmpfs
    mounts = proxy.attrs["Mounts"]
    assert all(m["Destination"] != "/tmp" for m in mounts)     # not on any host folder
    # another ticket gets another CA; once a ticket is gone, so is its folder (and the proxy with the key)
    other, _ = make(world, "ruled2", True)
    try:
        code, out2, _ = sh(world, other, "cat /run/afe-ca/ticket-ca.pem")
        assert code == 0 and out2.strip() and out2.strip() != ca.strip()
    finally:
        world["stub"].DestroySandbox(pb.DestroySandboxRequest(ticket_id=other))
    assert not egress_ca.ticket_dir(layout, other).exists()


def test_r44_the_upstream_certificate_is_verified(world, docker_client):
    """A proxy that does not trust the upstream's CA refuses to re-encrypt to it;
    the module's broker, given the test CA as AFE_CA_FILE, is the positive control."""
    root = temp_root("afe-r44u-")
    broker = BrokerThread(Layout(root / "data", root / "run"), instance=world["inst"] + "u",
                          egress_network=world["net"]["network"], allow_private=(world["net"]["subnet"],)).start()
    ch, stub = sync_stub(broker.socket, broker.secret)
    ticket = "untrusted-" + secrets.token_hex(4)
    try:
        reg = world["names"]["registry"]
        stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
            image=world["image"], egress=[reg], egress_rules=rules_spec(world["names"])[:1])))
        seen = len(world["host"].requests(settle=True))
        r = run(stub, ticket, ["python3", "-c", UPLOAD, json.dumps([["GET", f"https://{reg}/demo-pkg"]])],
                timeout_ms=60000)
        status, body = json.loads(r.stdout)[0]
        assert status == 503 and "demo-pkg" not in body[:20], body
        assert world["host"].requests(settle=True)[seen:] == []
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
        ch.close()
        broker.stop()
        remove_temp_root(root)


def test_r44_rules_hold_under_gvisor_through_the_proxy_socket(world, docker_client):
    if why := gvisor_missing(docker_client):
        pytest.skip(why)
    ticket, sb = make(world, "gv", True, runtime="gvisor")
    try:
        assert not sb.network                                   # the socket transport: no interface
        reg, git = world["names"]["registry"], world["names"]["git"]
        got = upload(world, ticket, [("GET", f"https://{reg}/demo-pkg"), ("PUT", f"https://{reg}/upload/gv")])
        assert [s for s, _ in got] == [200, 403]
        _code, out, err = sh(world, ticket, f"""
            cd /workspace && git clone -q https://{git}/demo.git && cd demo && echo x > f && git add f
            git -c user.name=t -c user.email=t@t commit -qm gv && git push origin HEAD:refs/heads/gv 2>&1
            echo "push exit $?" """)
        assert "push exit 128" in out and "403" in out, out + err
        assert world["host"].git("branch", "--list", "gv") == ""
    finally:
        world["stub"].DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def test_r44_a_restarted_proxy_makes_a_new_ca_and_the_sandbox_trusts_it(world, docker_client):
    """After an engine restart the proxy's tmpfs is new, so is its CA: bringing the sandbox
    back puts that CA into its bundle, and a request with rules still passes."""
    ticket, sb = make(world, "restart", True)
    try:
        reg = world["names"]["registry"]
        code, before, _ = sh(world, ticket, "cat /run/afe-ca/ticket-ca.pem")
        assert code == 0
        for cid in (sb.container_id, sb.proxy_container_id):
            docker_client.containers.get(cid).stop(timeout=1)
        spec = pb.SandboxSpec(image=world["image"], egress=list(world["names"].values()),
                              egress_rules=rules_spec(world["names"]))
        again = world["stub"].CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=spec))
        assert again.container_id == sb.container_id                # the same sandbox, brought back
        code, after, _ = sh(world, ticket, "cat /run/afe-ca/ticket-ca.pem")
        assert code == 0 and after.startswith("-----BEGIN CERTIFICATE-----") and after != before
        got = upload(world, ticket, [("GET", f"https://{reg}/demo-pkg"), ("PUT", f"https://{reg}/upload/r")])
        assert [s for s, _ in got] == [200, 403]
    finally:
        world["stub"].DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
