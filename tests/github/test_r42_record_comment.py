"""R42 on GitHub: the run record's pull request comment (run_record.comment_body)
through the real credential broker process to the fake GitHub (which checks
every call against GitHub's OpenAPI description): one comment per head,
edited with the decision, never repeated; the envelopes a reviewer saves
from it verify; untrusted text (a principal with markdown, HTML, fences and
an @mention) never appears raw in it. Positive control: the same hostile
text written raw into a comment is there for anyone to render."""

from __future__ import annotations

import base64
import re

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.common.provenance import attestation
from services.scheduler.executor.nodes.run_record import comment_body
from services.scheduler.store.run_records import DECISION, REQUEST, RunRecord

from .test_report import reporting  # noqa: F401  (the fixture)

HOSTILE = "ev`il ``` </details><img src=x onerror=alert(1)> @octocat"
SHA = "ab" * 20


def _envelope(key: Ed25519PrivateKey, tid: str, kind: str) -> str:
    predicate = {"kind": kind, "ticket": {"id": tid, "principal": HOSTILE}, "workflow": {
        "name": "fix", "nodes": [{"id": HOSTILE, "state": "succeeded"}]},
        "egress": {"denied": [{"host": HOSTILE, "count": 2}]}, "usage": {"total_tokens": 12, "cost_usd": 0.5},
        "verification": {"passed": True}}
    if kind == DECISION:
        predicate["decision"] = {"principal": HOSTILE, "granted": True, "sha": SHA}
    stmt = attestation.canonical({"_type": attestation.STATEMENT_TYPE, "predicateType": attestation.PREDICATE_TYPE,
                                  "subject": [{"name": f"git+o/r@afe/{tid}", "digest": {"gitCommit": SHA}}],
                                  "predicate": predicate})
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sig = key.sign(attestation.pae(attestation.PAYLOAD_TYPE, stmt))
    return attestation.canonical({"payload": base64.b64encode(stmt).decode(), "payloadType": attestation.PAYLOAD_TYPE,
                                  "signatures": [{"keyid": attestation.keyid_of(raw),
                                                  "sig": base64.b64encode(sig).decode()}]}).decode()


async def test_r42_the_record_comment_is_one_per_head_edited_and_verifies_when_saved(reporting, tmp_path):  # noqa: F811
    r = reporting
    tid = await r.ticket_from_issue()
    key = Ed25519PrivateKey.generate()
    req = RunRecord(tid, SHA, REQUEST, _envelope(key, tid, REQUEST), 1)
    dec = RunRecord(tid, SHA, DECISION, _envelope(key, tid, DECISION), 2)
    step = f"record-{SHA[:32]}"
    await r.app.credentials.upsert_comment("hello", "7", tid, step, comment_body(req, None))
    await r.app.credentials.upsert_comment("hello", "7", tid, step, comment_body(req, dec))
    bodies = [c["body"] for c in r.github.comments if c["number"] == 7]
    assert len(bodies) == 1 and r.github.edits == [1]          # edited with the decision, not repeated
    body = bodies[0]
    saved = tmp_path / "comment.md"
    saved.write_text(body)
    env = attestation.extract_envelope(saved.read_text())     # the last block: the decision
    v = attestation.verify(env, key.public_key(), SHA)
    assert v.kind == DECISION and v.statement["predicate"]["decision"]["principal"] == HOSTILE
    assert _rendered(body).count("```") == 0
    for piece in ("<img", "</details>", "@octocat", HOSTILE):
        assert piece not in _rendered(body), piece            # only inside inline code, where nothing renders
    assert "approved by `ev'il" in body and "verification: passed" in body and "tokens: 12" in body
    # Positive control: the same text written raw is left for GitHub to render.
    raw = body + "\n" + HOSTILE
    assert all(piece in _rendered(raw) for piece in ("<img", "@octocat"))


def _rendered(body: str) -> str:
    """What GitHub renders as markdown: the body without its fenced envelopes and inline code spans."""
    text = re.sub(r"```json afe-run-record\n\{[^\n]*\}\n```", "", body)
    return re.sub(r"`[^`\n]*`", "", text)
