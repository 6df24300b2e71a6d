"""Operator settings work under `afe up` and reach exactly the process that
needs them (docs/OPERATIONS.md, "Operator settings"; R33).

The credential broker, started by a real `afe up`, clones over HTTPS from a
git server and calls an OpenAI-compatible API over HTTPS; both servers have a
certificate signed by a CA this test makes, trusted only through
`AFE_CA_FILE`, and both calls go through an HTTP CONNECT proxy named by
`https_proxy`. Positive control: the same run without the two settings fails
with a certificate error and the proxy sees nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as rpc
from services.common import demo
from services.common.rpc.grpcutil import open_channel
from tests.support.fakes.git_http import GitHttpServer, make_bare_repo
from tests.support.fakes.models import FakeOpenAI
from tests.support.temp_roots import remove_temp_root, temp_root

from .launcher_support import ROOT, Afe, base_env, environ_of, wait_gone

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

GIT_TOKEN = f"opsgit{secrets.token_hex(12)}"
MODEL_KEY = f"opsmodel{secrets.token_hex(12)}"


def make_private_ca(folder: Path) -> tuple[Path, ssl.SSLContext]:
    """A CA (its PEM is what AFE_CA_FILE names) and a server context whose
    certificate for 127.0.0.1 that CA signed."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "afe test private CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    ca_file = folder / "private-ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(folder / "server.pem", folder / "server.key")
    return ca_file, ctx


class ConnectProxy:
    """A minimal HTTP CONNECT proxy on 127.0.0.1 that tunnels to 127.0.0.1
    only and records each target."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = client.recv(1024)
                if not chunk:
                    return
                head += chunk
            method, target = head.split(b" ", 2)[:2]
            host, _, port = target.decode().rpartition(":")
            if method != b"CONNECT" or host != "127.0.0.1":
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            self.targets.append(target.decode())
            with socket.create_connection((host, int(port))) as upstream:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                t = threading.Thread(target=self._pipe, args=(upstream, client), daemon=True)
                t.start()
                self._pipe(client, upstream)
                t.join(5)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def config_text(git_url: str, model_url: str) -> str:
    return f"""\
kind: Workspace
name: remote-git
repo: {git_url}
baseBranch: main
tokenEnv: OPS_GIT_TOKEN
forge: {{type: local}}
sandbox: {{image: afe/sandbox:latest}}
---
kind: Workspace
name: local
repo: repos/calc.git
baseBranch: main
forge: {{type: local}}
sandbox: {{image: afe/sandbox:latest}}
---
kind: Model
name: remote
provider: openai
model: ops-model
baseUrl: {model_url}/v1
apiKeyEnv: OPS_MODEL_KEY
---
kind: Workflow
name: clone
workspace: remote-git
nodes:
  - {{id: look, run: "test -f calc.py", timeout: 60}}
---
kind: Workflow
name: ask
workspace: local
nodes:
  - {{id: ask, model: remote, prompt: "say hello", max_turns: 2}}
"""


async def run_ticket(run_dir: Path, workspace: str, workflow: str) -> pb.Ticket:
    key = bytes.fromhex((run_dir / "automation.key").read_text().strip())
    async with open_channel(str(run_dir / "scheduler.sock"), key) as ch:
        stub = rpc.SchedulerStub(ch)
        t = await stub.CreateTicket(pb.CreateTicketRequest(workspace=workspace, workflow=workflow,
                                                           title=workflow, principal="ops-test"))
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            t = await stub.GetTicket(pb.GetTicketRequest(id=t.id))
            if pb.TicketState.Name(t.state).endswith(("SUCCEEDED", "FAILED", "CANCELLED")):
                return t
            await asyncio.sleep(0.3)
    raise AssertionError(f"{workflow} ticket did not finish")


async def afe_up_with(base: Path, extra_env: dict[str, str], check) -> None:
    env = base_env(OPS_GIT_TOKEN=GIT_TOKEN, OPS_MODEL_KEY=MODEL_KEY, **extra_env)
    argv = [sys.executable, "-m", "services.cli.main", "up", "--config", str(base / "cfg"),
            "--data", str(base / "data"), "--run", str(base / "run"), "--ops-port", "0",
            "--listen", "127.0.0.1:0", "--instance", f"ops-{secrets.token_hex(3)}"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,  # noqa: ASYNC220 - returns at once
                            stderr=subprocess.STDOUT, start_new_session=True)
    afe = Afe(base, proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            afe.output.append(line.decode("utf-8", "replace"))

    threading.Thread(target=pump, daemon=True).start()
    pids: list[int] = []
    try:
        await asyncio.to_thread(afe.wait_up)
        pids = list(afe.pids().values())
        await check(afe)
    finally:
        code = await asyncio.to_thread(afe.stop)
        wait_gone(pids, 10)
        remove_temp_root(base / "data")
        shutil.rmtree(base / "run", ignore_errors=True)
    assert code == 0, afe.text()[-3000:]


async def test_ca_file_and_https_proxy_reach_the_credential_broker_through_afe_up():
    base = temp_root("afe-ops-")
    try:
        ca_file, server_ctx = make_private_ca(base / "tls")
        served = base / "served"
        served.mkdir()
        make_bare_repo(served, "calc.git", {"calc.py": demo.CALC_BUGGY, "test_calc.py": demo.TEST_CALC})
        cfg = base / "cfg"
        demo.materialize(cfg)
        (cfg / "afe.yaml").unlink()
        (cfg / "demo-model.yaml").unlink()
        proxy = ConnectProxy()
        with GitHttpServer(served, GIT_TOKEN, server_ctx) as git_server:
            model = FakeOpenAI(MODEL_KEY)
            model.ssl_context = server_ctx
            async with model:
                (cfg / "ops.yaml").write_text(config_text(git_server.url("calc.git"), model.url))
                git_port, model_port = git_server.port, model.port

                async def with_settings(afe: Afe) -> None:
                    envs = {name: environ_of(pid) for name, pid in afe.pids().items()}
                    # Each setting reached the credential broker and nobody else, but the CA file
                    # also reaches the sandbox broker: its decrypting egress proxies trust it (R44).
                    assert envs["credentials"].get("AFE_CA_FILE") == str(ca_file)
                    assert envs["credentials"].get("https_proxy") == proxy.url
                    assert envs["sandbox"].get("AFE_CA_FILE") == str(ca_file)
                    for name in ("sandbox", "scheduler", "gateway"):
                        assert "https_proxy" not in envs[name], (name, envs[name])
                    for name in ("scheduler", "gateway"):
                        assert "AFE_CA_FILE" not in envs[name], (name, envs[name])
                    model.reply_text("hello from behind the proxy")
                    cloned = await run_ticket(afe.run_dir, "remote-git", "clone")
                    asked = await run_ticket(afe.run_dir, "local", "ask")
                    assert pb.TicketState.Name(cloned.state).endswith("SUCCEEDED"), cloned.error
                    assert pb.TicketState.Name(asked.state).endswith("SUCCEEDED"), asked.error
                    assert git_server.token_in_authorization() and model.seen
                    # Both went through the operator's proxy.
                    assert {f"127.0.0.1:{git_port}", f"127.0.0.1:{model_port}"} <= set(proxy.targets), \
                        proxy.targets

                await afe_up_with(base, {"AFE_CA_FILE": str(ca_file), "https_proxy": proxy.url}, with_settings)

                async def without_settings(afe: Afe) -> None:
                    before = len(proxy.targets)
                    cloned = await run_ticket(afe.run_dir, "remote-git", "clone")
                    asked = await run_ticket(afe.run_dir, "local", "ask")
                    # Positive control: without AFE_CA_FILE the private CA is not trusted ...
                    assert pb.TicketState.Name(cloned.state).endswith("FAILED"), cloned.error
                    assert "certificate" in cloned.error.lower(), cloned.error
                    assert pb.TicketState.Name(asked.state).endswith("FAILED"), asked.error
                    assert "certificate" in asked.error.lower() and "AFE_CA_FILE" in asked.error, asked.error
                    # ... and without https_proxy nothing goes through the proxy.
                    assert len(proxy.targets) == before, proxy.targets

                await afe_up_with(base, {}, without_settings)
        proxy.close()
    finally:
        remove_temp_root(base)


def test_afe_up_refuses_an_ca_file_that_does_not_exist(short_tmp):
    from services.common.errors import ConfigError
    from services.common.layout import Layout
    from services.launcher.launch import Options, preflight

    cfg = short_tmp / "cfg"
    demo.materialize(cfg)
    opts = Options(config_dir=cfg, layout=Layout(short_tmp / "d", short_tmp / "r"), check_images=False)
    with pytest.raises(ConfigError, match=re.escape("AFE_CA_FILE=/nonexistent/ca.pem is not a file")):
        preflight(opts, {"PATH": "/usr/bin", "AFE_CA_FILE": "/nonexistent/ca.pem"}, progress=lambda m: None)
    preflight(opts, {"PATH": "/usr/bin"}, progress=lambda m: None)      # control: unset is fine


def test_proxy_choice_follows_the_curl_conventions():
    from services.common.host.proxies import proxy_for

    both = {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2"}
    assert proxy_for("https://api.example.com/v1", both) == "http://lower:2"       # lower case wins
    assert proxy_for("http://api.example.com/v1", both) is None                    # no http_proxy set
    assert proxy_for("https://git.corp.example/x", {**both, "no_proxy": "corp.example"}) is None
    assert proxy_for("https://api.example.com/v1", {**both, "NO_PROXY": "corp.example"}) == "http://lower:2"
    assert proxy_for("https://api.example.com/v1", {}) is None
    assert proxy_for("https://127.0.0.1:8443/x", {**both, "no_proxy": "localhost, 127.0.0.1"}) is None
    assert proxy_for("https://api.example.com/v1", {**both, "no_proxy": "*"}) is None
    assert proxy_for("https://notexample.com/v1", {**both, "no_proxy": ".example.com"}) == "http://lower:2"
