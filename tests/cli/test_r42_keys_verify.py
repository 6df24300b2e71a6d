"""R42 through the CLI against the running system (real gateway, scheduler,
brokers, Docker, git; the local forge): a ticket reaching approval has a
signed record `afe verify <ticket>` and `afe verify <PR>` accept with the key
`afe keys` prints; a record saved to a file verifies with `--key`, and a
changed byte, another key, another commit or a payload that is not a
Statement are each refused with their reason (the positive control is the
unchanged file passing); after `afe approve` the decision record names the
approver and the approved SHA and verifies too."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.common.layout import Layout
from services.common.provenance import attestation

from .test_cli import afe, as_json

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]


def _afe(live, *args: str):
    return afe(live, *args, "--data", str(live.layout.data_dir))


def _signed(key: Ed25519PrivateKey, payload: bytes) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sig = key.sign(attestation.pae(attestation.PAYLOAD_TYPE, payload))
    return json.dumps({"payload": base64.b64encode(payload).decode(), "payloadType": attestation.PAYLOAD_TYPE,
                       "signatures": [{"keyid": attestation.keyid_of(raw), "sig": base64.b64encode(sig).decode()}]})


def test_r42_afe_keys_and_afe_verify_a_ticket_a_pr_and_a_file(live_afe, tmp_path):
    live_afe.reset_demo_repo()
    tid = as_json(afe(live_afe, "ticket", "create", "--demo", "--json"))["id"]
    afe(live_afe, "ticket", "watch", tid, "--until-waiting")
    shown = as_json(afe(live_afe, "ticket", "show", tid, "--json"))
    sha = shown["awaiting_sha"]

    keys = _afe(live_afe, "keys")
    assert keys.returncode == 0, keys.stderr
    pem = keys.stdout.split("keyid:")[0].strip() + "\n"
    keyid = keys.stdout.split("keyid:")[1].strip()
    layout: Layout = live_afe.layout
    private = serialization.load_pem_private_key(
        (layout.data_dir / "credentials" / "signing" / "ed25519.pem").read_bytes(), password=None)
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert keyid == attestation.keyid_of(raw) and "PRIVATE" not in keys.stdout

    by_ticket = _afe(live_afe, "verify", tid)
    assert by_ticket.returncode == 0, by_ticket.stderr
    assert f"verified: request record of commit {sha}" in by_ticket.stdout and keyid in by_ticket.stdout
    pr = shown["pr"]["url"]
    by_pr = _afe(live_afe, "verify", pr)
    assert by_pr.returncode == 0 and sha in by_pr.stdout, (pr, by_pr.stderr)

    # The record as a file, checked with the key in a file.
    records = json.loads(_afe(live_afe, "verify", tid, "--json").stdout.splitlines()[0])
    assert records["sha"] == sha
    from services.scheduler.store.store import Store
    store = Store.sqlite(layout.data_dir / "afe.db")
    try:
        envelope = store.run_records.run_record(tid, sha, "request").envelope
    finally:
        store.close()
    key_file, rec_file = tmp_path / "afe.pub", tmp_path / "record.json"
    key_file.write_text(pem)
    rec_file.write_text(envelope)
    good = _afe(live_afe, "verify", str(rec_file), "--key", str(key_file), "--sha", sha)
    assert good.returncode == 0, good.stderr                          # positive control
    comment = tmp_path / "comment.md"
    comment.write_text(f"### afe run record\n\n{attestation.FENCE}\n{envelope}\n```\n")
    assert _afe(live_afe, "verify", str(comment), "--key", str(key_file), "--sha", sha).returncode == 0

    env = json.loads(envelope)
    payload = base64.b64decode(env["payload"])
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(dict(env, payload=base64.b64encode(payload.replace(b"demo-fix", b"demo-fiX"))
                                       .decode())))
    other_key = Ed25519PrivateKey.generate()
    other_pub = tmp_path / "other.pub"
    other_pub.write_bytes(other_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    not_statement = tmp_path / "not-statement.json"
    not_statement.write_text(_signed(other_key, b'{"_type": "https://example.org/Other/v1", "subject": []}'))
    cases = [
        (changed, key_file, sha, "bad signature"),
        (rec_file, other_pub, sha, "another key"),
        (rec_file, key_file, "0" * 40, "wrong subject"),
        (not_statement, other_pub, sha, "not a Statement"),
    ]
    for path, key, want_sha, why in cases:
        p = _afe(live_afe, "verify", str(path), "--key", str(key), "--sha", want_sha)
        assert p.returncode == 1 and why in p.stderr, (path.name, p.stderr)

    assert afe(live_afe, "approve", tid, "--sha", sha).returncode == 0
    afe(live_afe, "ticket", "watch", tid)
    after = _afe(live_afe, "verify", tid, "--sha", sha)
    assert after.returncode == 0, after.stderr
    assert "decision record" in after.stdout and f'approved by "cli" of {sha}' in after.stdout
