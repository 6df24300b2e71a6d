"""R42 at the credential broker: its Ed25519 key (made once, 0600, the same
after a restart, never in an answer or a log), and what it signs: only an
in-toto Statement v1 of afe's run record whose subject is a commit of the
ticket's own branch, holding no secret the broker holds. The real broker
core and servicer over gRPC on a Unix socket, a real git origin; the
envelopes are checked with services/common/provenance/attestation.py (what `afe verify`
uses) and the Statement with the JSON Schema written from the in-toto spec."""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
from pathlib import Path

import grpc
import jsonschema
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services.common.errors import FailedPrecondition
from services.common.provenance import attestation
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.secrecy.redact import Redactor
from services.credentials.app import CredentialBrokerOptions, build_app
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config

SCHEMA = json.loads((Path(__file__).parents[2] / "support" / "intoto_statement_v1.schema.json").read_text())
TOKEN_ENV = "AFE_TEST_FORGE_TOKEN"
TOKEN = "forge" + "Q7x" * 6 + "zz"


def statement(ticket: str, sha: str, **predicate) -> bytes:
    return attestation.canonical({
        "_type": attestation.STATEMENT_TYPE,
        "subject": [{"name": f"git+afe-workspace/local@afe/{ticket}", "digest": {"gitCommit": sha}}],
        "predicateType": attestation.PREDICATE_TYPE,
        "predicate": {"kind": "request", "ticket": {"id": ticket}, **predicate}})


async def _committed(stub, layout, ticket: str, text: str = "# changed\n") -> str:
    await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=ticket, workspace="local"))
    (layout.workspace(ticket) / "README.md").write_text(text)
    return (await stub.Commit(pb.CommitRequest(ticket_id=ticket, workspace="local", message="m"))).sha


async def _key(stub) -> pb.SigningKeyResponse:
    return await stub.SigningKey(pb.SigningKeyRequest())


async def test_r42_key_is_made_0600_and_the_same_after_a_restart_and_never_answered_or_logged(
        local_origin, layout, caplog):
    caplog.set_level(logging.DEBUG)
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        first = await _key(stub)
        sha = await _committed(stub, layout, "t1")
        env = (await stub.SignStatement(pb.SignStatementRequest(ticket_id="t1", statement=statement("t1", sha)))).envelope
    path = layout.data_dir / "credentials" / "signing" / "ed25519.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    async with broker_stub(config, layout) as (stub, _):
        again = await _key(stub)
    assert again.keyid == first.keyid and again.public_key_pem == first.public_key_pem
    raw = base64.b64decode(first.public_key_raw_b64)
    assert first.keyid == attestation.keyid_of(raw) and len(raw) == 32
    private_pem = path.read_text()
    body = "".join(private_pem.splitlines()[1:-1])
    assert "PRIVATE" in private_pem and body
    for answer in (first.SerializeToString(), again.SerializeToString(), env.encode()):
        assert body.encode() not in answer and b"PRIVATE" not in answer
    assert body not in caplog.text and "PRIVATE KEY" not in caplog.text


@pytest.mark.parametrize("damage", ["group_readable", "corrupt", "not_ed25519"])
async def test_r42_an_unusable_key_file_stops_the_broker_with_a_clear_error(local_origin, layout, damage):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    links = LinkSecrets(serve={"scheduler": new_secret()})
    options = CredentialBrokerOptions(socket_path=str(layout.run_dir / "cb.sock"), spare_checkouts=False)
    build_app(config, layout, links, {}, Redactor(), options)   # made here
    path = layout.data_dir / "credentials" / "signing" / "ed25519.pem"
    good = path.read_bytes()
    # Positive control: the intact key loads again.
    build_app(config, layout, links, {}, Redactor(), options)
    if damage == "group_readable":
        os.chmod(path, 0o640)
        why = "may be read by group or others"
    elif damage == "corrupt":
        path.write_bytes(good[:40] + b"garbage" + good[60:])
        why = "cannot be read as an Ed25519 PEM key"
    else:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        path.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        why = "is not an Ed25519 key"
    with pytest.raises(FailedPrecondition) as err:
        build_app(config, layout, links, {}, Redactor(), options)
    assert why in err.value.message and str(path) in err.value.message
    assert path.exists()          # never replaced silently: earlier records would stop verifying


async def test_r42_a_signed_record_verifies_and_tampering_is_detected(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        sha = await _committed(stub, layout, "t1")
        stmt = statement("t1", sha, note="plain")
        env_text = (await stub.SignStatement(pb.SignStatementRequest(ticket_id="t1", statement=stmt))).envelope
        key = attestation.public_key((await _key(stub)).public_key_pem)
    env = json.loads(env_text)
    assert env["payloadType"] == "application/vnd.in-toto+json" and base64.b64decode(env["payload"]) == stmt
    v = attestation.verify(env, key, sha)
    assert v.sha == sha and v.statement["predicate"]["note"] == "plain"
    jsonschema.validate(v.statement, SCHEMA)          # the in-toto Statement v1 schema
    # the signature is over PAE exactly (an independent check with the raw primitive)
    key.verify(base64.b64decode(env["signatures"][0]["sig"]),
               b"DSSEv1 28 application/vnd.in-toto+json %d " % len(stmt) + stmt)

    changed = dict(env, payload=base64.b64encode(stmt.replace(b"plain", b"plaiN")).decode())
    with pytest.raises(attestation.NotVerified, match="bad signature"):
        attestation.verify(changed, key, sha)
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(attestation.NotVerified, match="another key"):
        attestation.verify(env, other, sha)
    with pytest.raises(attestation.NotVerified, match="bad signature"):     # another key, keyid forged
        raw = other.public_bytes_raw()
        forged = dict(env, signatures=[{"keyid": attestation.keyid_of(raw), "sig": env["signatures"][0]["sig"]}])
        attestation.verify(forged, other, sha)
    with pytest.raises(attestation.NotVerified, match="wrong subject"):
        attestation.verify(env, key, "0" * 40)


async def test_r42_the_broker_signs_only_a_commit_of_the_tickets_branch_and_a_statement(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        sha1 = await _committed(stub, layout, "t1")
        await _committed(stub, layout, "t2", "# other\n")
        sha2 = git_plain("--git-dir", str(layout.gitdir("t2")), "rev-parse", "refs/heads/afe/t2").stdout.decode().strip()
        base = git_plain("--git-dir", str(local_origin), "rev-parse", "HEAD").stdout.decode().strip()
        cases = [
            (statement("t1", sha2), grpc.StatusCode.FAILED_PRECONDITION, "not on the branch"),   # another ticket's
            (statement("t1", "1" * 40), grpc.StatusCode.FAILED_PRECONDITION, "not on the branch"),
            (statement("t2", sha1), grpc.StatusCode.INVALID_ARGUMENT, "@afe/t1"),   # names t2, asked for t1
            (b'{"_type": "https://in-toto.io/Statement/v0.1"}', grpc.StatusCode.INVALID_ARGUMENT, "not an in-toto"),
            (statement("t1", sha1).replace(b"run-record/v1", b"run-record/v9"), grpc.StatusCode.INVALID_ARGUMENT,
             "predicateType"),
            (b"not json", grpc.StatusCode.INVALID_ARGUMENT, "not UTF-8 JSON"),
        ]
        for stmt, code, why in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SignStatement(pb.SignStatementRequest(ticket_id="t1", statement=stmt))
            assert err.value.code() == code and why in err.value.details(), (stmt, err.value.details())
        # Positive controls: the ticket's own head, and its base (an ancestor on its branch).
        for sha in (sha1, base):
            r = await stub.SignStatement(pb.SignStatementRequest(ticket_id="t1", statement=statement("t1", sha)))
            assert json.loads(r.envelope)["signatures"]


async def test_r42_a_statement_holding_a_secret_of_the_broker_is_refused(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout, secrets_={TOKEN_ENV: TOKEN}) as (stub, _):
        sha = await _committed(stub, layout, "t1")
        for leak in (TOKEN, f"x{TOKEN}y", base64.b64encode(TOKEN.encode()).decode()):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SignStatement(pb.SignStatementRequest(
                    ticket_id="t1", statement=statement("t1", sha, commands=[{"command": leak}])))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "holds a secret" in err.value.details() and TOKEN not in err.value.details()
        # Positive control: the same statement without the token is signed.
        r = await stub.SignStatement(pb.SignStatementRequest(
            ticket_id="t1", statement=statement("t1", sha, commands=[{"command": "make test"}])))
        assert attestation.verify(json.loads(r.envelope), attestation.public_key((await _key(stub)).public_key_pem))
