"""R39: links between hosts use mutual TLS with the deployment's own CA.

A real afe gRPC server (`create_server(listen=..., tls=...)`, the boundary
the sandbox broker uses with `--listen`) on 127.0.0.1, and real clients
(`open_remote_channel`). Certificates come from `afe certs`
(services/cli/certs.py): the deployment CA and a second, unrelated CA made
the same way. Each refusal has its positive control: the same client, with
the deployment's certificate, is served.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.certs import make_certs
from services.cli.main import main as afe_main
from services.common.errors import ConfigError, PeerUnavailable, PermissionDenied
from services.common.rpc import grpcutil
from services.common.rpc.tls import TlsFiles, read_secret_file
from services.common.secrecy.redact import Redactor

SERVING = health_pb2.HealthCheckResponse.SERVING


def _files(d: Path, name: str, ca: Path | None = None) -> TlsFiles:
    return TlsFiles(d / f"{name}.pem", d / f"{name}.key", ca or d / "ca.pem")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The deployment CA (`ours`) and another CA (`theirs`), each with a broker and a scheduler leaf."""
    root = tmp_path_factory.mktemp("pki")
    ours, theirs = root / "ours", root / "theirs"
    make_certs(ours, [("broker", ["127.0.0.1", "localhost"]), ("scheduler", [])])
    make_certs(theirs, [("broker", ["127.0.0.1", "localhost"]), ("scheduler", [])])
    return ours, theirs


@pytest.fixture
async def server(pki):
    """An afe server on TCP with mutual TLS (our CA), accepting the scheduler's link secret."""
    ours, _ = pki
    secret = read_secret_file(ours / "broker.secret", "the link secret")
    srv = grpcutil.create_server("", {"scheduler": secret}, Redactor(), [], listen="127.0.0.1:0",
                                 tls=_files(ours, "broker"))
    await srv.start()
    try:
        yield f"127.0.0.1:{srv.port}", secret
    finally:
        await srv.stop(0)


async def _check(address: str, secret: bytes | None, tls: TlsFiles) -> int:
    async with grpcutil.open_remote_channel(address, secret, tls) as ch, \
            grpcutil.rpc_errors("the test broker", "a health check"):
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return r.status


async def test_r39_a_peer_of_the_deployment_ca_is_served(server, pki):
    """Positive control for every refusal below."""
    ours, _ = pki
    address, secret = server
    assert await _check(address, secret, _files(ours, "scheduler")) == SERVING


async def test_r39_client_certificate_of_another_ca_is_refused(server, pki):
    ours, theirs = pki
    address, secret = server
    # Their scheduler's certificate, even trusting our CA for the server and with the right link secret.
    with pytest.raises(PeerUnavailable, match="went away"):
        await _check(address, secret, _files(theirs, "scheduler", ca=ours / "ca.pem"))
    assert await _check(address, secret, _files(ours, "scheduler")) == SERVING


async def test_r39_client_without_a_certificate_is_refused(server, pki):
    ours, _ = pki
    address, secret = server
    creds = grpc.ssl_channel_credentials(root_certificates=(ours / "ca.pem").read_bytes())
    async with grpc.aio.secure_channel(address, creds) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as got:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10,
                                                       metadata=(("x-afe-link", secret.hex()),))
    assert got.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_r39_plaintext_client_is_refused(server):
    address, secret = server
    async with grpc.aio.insecure_channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as got:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10,
                                                       metadata=(("x-afe-link", secret.hex()),))
    assert got.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_r39_server_of_another_ca_is_refused_by_the_client(pki):
    """The scheduler does not talk to a broker whose certificate our CA did not sign."""
    ours, theirs = pki
    secret = read_secret_file(ours / "broker.secret", "the link secret")
    # Their broker trusts our CA for clients, so only the client's check of the server can refuse.
    srv = grpcutil.create_server("", {"scheduler": secret}, Redactor(), [], listen="127.0.0.1:0",
                                 tls=_files(theirs, "broker", ca=ours / "ca.pem"))
    await srv.start()
    try:
        address = f"127.0.0.1:{srv.port}"
        with pytest.raises(PeerUnavailable):
            await _check(address, secret, _files(ours, "scheduler"))
        # Positive control: a client that trusts their CA reaches the same server.
        assert await _check(address, secret, _files(ours, "scheduler", ca=theirs / "ca.pem")) == SERVING
    finally:
        await srv.stop(0)


async def test_r39_same_ca_without_the_link_secret_is_refused(server, pki):
    """The link secret stays a second factor next to the certificate."""
    ours, _ = pki
    address, _secret = server
    with pytest.raises(PermissionDenied):
        await _check(address, b"\x00" * 32, _files(ours, "scheduler"))


def test_r39_tcp_without_tls_is_refused_at_start():
    with pytest.raises(ConfigError, match="mutual TLS"):
        grpcutil.create_server("", {"scheduler": b"x" * 32}, Redactor(), [], listen="127.0.0.1:0")


def test_r39_private_key_readable_by_others_is_refused(tmp_path):
    make_certs(tmp_path, [("broker", ["127.0.0.1"])])
    os.chmod(tmp_path / "broker.key", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        grpcutil.create_server("", {"scheduler": b"x" * 32}, Redactor(), [], listen="127.0.0.1:0",
                               tls=_files(tmp_path, "broker"))


def test_afe_certs_makes_private_files_and_keeps_the_ca(tmp_path, capsys):
    d = tmp_path / "pki"
    assert afe_main(["certs", str(d), "--name", "sandbox-1=10.0.0.11,sb1.internal"]) == 0
    ca_before = (d / "ca.pem").read_bytes()
    assert afe_main(["certs", str(d), "--name", "sandbox-2=sb2.internal"]) == 0
    assert (d / "ca.pem").read_bytes() == ca_before          # one CA per deployment
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    from cryptography import x509
    cert = x509.load_pem_x509_certificate((d / "sandbox-1.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.11"]
    assert sans.get_values_for_type(x509.DNSName) == ["sb1.internal"]
    assert len(read_secret_file(d / "sandbox-1.secret", "the secret")) == 32
    assert afe_main(["certs", str(d), "--name", "../x"]) == 1
    assert "a name is letters" in capsys.readouterr().err


def test_r39_remote_sandbox_brokers_need_mutual_tls(tmp_path):
    """The scheduler refuses `--sandbox-broker` without its certificate, and a link secret file open to others."""
    import argparse

    from services.scheduler.sandboxes.placement import add_flags, from_flags

    make_certs(tmp_path, [("scheduler", []), ("sb1", ["127.0.0.1"])])
    p = argparse.ArgumentParser()
    add_flags(p)
    with pytest.raises(ConfigError, match="needs mutual TLS"):
        from_flags(p.parse_args(["--sandbox-broker", "sb1=127.0.0.1:7443"]), store=None)  # type: ignore[arg-type]
    tls = ["--tls-cert", str(tmp_path / "scheduler.pem"), "--tls-key", str(tmp_path / "scheduler.key"),
           "--tls-ca", str(tmp_path / "ca.pem")]
    with pytest.raises(ConfigError, match="NAME=HOST:PORT"):
        from_flags(p.parse_args(["--sandbox-broker", "sb1", *tls]), store=None)  # type: ignore[arg-type]
    os.chmod(tmp_path / "sb1.secret", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        from_flags(p.parse_args(["--sandbox-broker", "sb1=127.0.0.1:7443", *tls]), store=None)  # type: ignore[arg-type]
