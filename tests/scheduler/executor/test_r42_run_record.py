"""R42 in the scheduler: the real engine, store and executor (fake brokers,
whose signer signs like the broker's): a ticket reaching approval has a
signed request record of its head, stored once (a restart does not sign
again); the decision is signed after it; the statement is an in-toto
Statement v1 and holds the ticket's untrusted text only as digests."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import jsonschema

from services.common.provenance import attestation
from services.scheduler.executor.nodes import run_record
from services.scheduler.store.base import SUCCEEDED, WAITING_APPROVAL
from services.scheduler.store.run_records import DECISION, REQUEST

SCHEMA = json.loads((Path(__file__).parents[2] / "support" / "intoto_statement_v1.schema.json").read_text())
WORKFLOWS = """\
kind: Workflow
name: review
workspace: ws
nodes:
  - {id: test, run: "make test"}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""
HOSTILE = ("Fix it ``` </details><img src=x onerror=alert(1)> @octocat **bold** [x](javascript:alert(1)) "
           "<!-- afe-report --> \u202e")


async def _key(h):
    return attestation.public_key((await h.credentials.signing_key()).public_key_pem)


async def test_r42_the_request_and_the_decision_are_signed_stored_once_and_verify(harness):
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.engine.create_ticket("", "review", HOSTILE, HOSTILE, {}, "tester").ticket.id
    t = await h.until(tid, (WAITING_APPROVAL,))
    sha = t.awaiting_sha
    rec = h.store.run_records.run_record(tid, sha, REQUEST)
    assert rec is not None
    key = await _key(h)
    v = attestation.verify(json.loads(rec.envelope), key, sha)
    jsonschema.validate(v.statement, SCHEMA)
    p = v.statement["predicate"]
    assert v.statement["subject"][0]["name"] == f"git+afe-workspace/ws@afe/{tid}"
    assert [n["id"] for n in p["workflow"]["nodes"]] == ["test", "pr", "merge"]
    assert p["commands"] == [{"node": "test", "command": "make test", "command_sha256": run_record.run_statement
                              .digest("make test"), "exit_codes": [0]}]
    assert p["ticket"]["title_sha256"] == run_record.run_statement.digest(HOSTILE)
    # what approval.requested carries: keyid and the envelope's digest, never the envelope
    (_, req), = h.events(tid, "approval.requested")
    assert req["record"]["digest"] == attestation.envelope_digest(rec.envelope)
    assert req["record"]["keyid"] == v.keyid and "payload" not in json.dumps(req)
    # a restart resumes the waiting ticket: the stored record, not a second signature
    calls = h.credentials.calls.count("sign_statement")
    engine = await h.restart()
    await h.until(tid, (WAITING_APPROVAL,))
    assert h.store.run_records.run_record(tid, sha, REQUEST).envelope == rec.envelope
    await engine.approve(tid, "bob", sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert h.credentials.calls.count("sign_statement") == calls + 1      # the decision only
    dec = h.store.run_records.run_record(tid, sha, DECISION)
    d = attestation.verify(json.loads(dec.envelope), key, sha).statement["predicate"]["decision"]
    assert d["principal"] == "bob" and d["granted"] is True and d["sha"] == sha
    assert [r.kind for r in h.store.run_records.run_records(tid)] == [REQUEST, DECISION]


async def test_r42_untrusted_text_is_never_raw_in_the_statement_or_the_pr_comment(harness):
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.engine.create_ticket("", "review", HOSTILE, HOSTILE, {}, "te`st@er <b>").ticket.id
    t = await h.until(tid, (WAITING_APPROVAL,))
    await h.engine.approve(tid, "bob", t.awaiting_sha)
    await h.until(tid)
    req = h.store.run_records.run_record(tid, t.awaiting_sha, REQUEST)
    dec = h.store.run_records.run_record(tid, t.awaiting_sha, DECISION)
    payload = base64.b64decode(json.loads(dec.envelope)["payload"])
    body = run_record.comment_body(req, dec)
    for piece in ("```", "<img", "</details>", "@octocat", "javascript:", "<!--", "\u202e", HOSTILE):
        assert piece not in payload.decode() or piece == "```", piece
        assert piece not in body.replace(attestation.FENCE, "").replace("\n```", ""), piece
    assert payload.isascii()             # every non-ASCII character escaped
    assert "`te'st@er <b>`" not in body   # the principal only inside the statement, escaped JSON
    # Positive control: the same text put in raw would be found by these checks.
    raw = body + "\n" + HOSTILE
    assert "@octocat" in raw and "<img" in raw


async def test_r42_a_record_that_cannot_be_signed_fails_the_approval_request(harness):
    from services.common.errors import FailedPrecondition

    h = harness(WORKFLOWS)

    async def refuse(ticket_id: str, statement: bytes) -> str:
        raise FailedPrecondition("the statement holds a secret of the credential broker")

    h.credentials.sign_statement = refuse           # the broker refuses (e.g. a secret slipped in)
    await h.start()
    tid = h.create("review")
    t = await h.until(tid)
    assert t.state == "failed" and "could not be signed" in t.error and "holds a secret" in t.error
    assert h.events(tid, "approval.requested") == [] and h.credentials.merged == []
    assert h.store.run_records.run_records(tid) == []


async def test_r42_the_record_counts_the_hosts_the_proxy_let_through_and_refused(harness):
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.engine.create_ticket("", "review", "t", "b", {}, "tester").ticket.id
    h.sandbox.allowed[tid] = [("pypi.org", 7), ("files.pythonhosted.org", 3)]
    h.sandbox.denied[tid] = [("evil.example", 2)]
    t = await h.until(tid, (WAITING_APPROVAL,))
    rec = h.store.run_records.run_record(tid, t.awaiting_sha, REQUEST)
    egress = attestation.verify(json.loads(rec.envelope), await _key(h), t.awaiting_sha).statement[
        "predicate"]["egress"]
    assert egress["allowed_counts"] == [{"host": "pypi.org", "count": 7}, {"host": "files.pythonhosted.org",
                                                                           "count": 3}]
    assert egress["denied"] == [{"host": "evil.example", "count": 2}]


async def test_r42_every_decision_on_a_head_is_kept_a_rejection_then_an_approval(harness):
    """A head rejected, re-run to the same commit and approved has both decisions signed, in
    order; the comment and `afe verify` show the latest (the one that let it merge)."""
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.engine.create_ticket("", "review", "t", "b", {}, "tester").ticket.id
    t = await h.until(tid, (WAITING_APPROVAL,))
    sha = t.awaiting_sha
    await h.engine.reject(tid, "carol", "not yet")
    await h.until(tid)
    await h.engine.retry(tid, "merge", "dave")
    t = await h.until(tid, (WAITING_APPROVAL,))
    assert t.awaiting_sha == sha                 # the same head, asked again
    await h.engine.approve(tid, "erin", sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    key = await _key(h)
    decided = run_record.decisions(h.store, tid, sha)
    assert [r.kind for r in decided] == [DECISION, f"{DECISION}-2"]
    who = [attestation.verify(json.loads(r.envelope), key, sha).statement["predicate"]["decision"]
           for r in decided]
    assert [(d["principal"], d["granted"]) for d in who] == [("carol", False), ("erin", True)]


def test_r42_the_agents_terminal_commands_are_recorded_by_program_digest_and_exit():
    """What an ACP agent ran (its `agent.terminal` events): the program's name and the digest of
    its command line, never the agent's text, with the exit the agent waited for."""
    hostile = "/usr/bin/py`thon3 -c 'print(1)' ``` <img src=x> @octocat"
    events = [
        ("agent.terminal", {"node": "fix", "op": "create", "terminal_id": "term-1", "command": hostile,
                            "ok": True}),
        ("agent.terminal", {"node": "fix", "op": "create", "command": "rm -rf /", "ok": False, "error": "denied"}),
        ("agent.terminal", {"node": "fix", "op": "create", "terminal_id": "term-2", "command": "make test",
                            "ok": True}),
        ("agent.terminal", {"node": "fix", "op": "exit", "terminal_id": "term-1", "exit_code": 0, "signal": None}),
    ]
    got = run_record.run_statement._agent_commands(events)
    digest = run_record.run_statement.digest
    assert got == [
        {"node": "fix", "program": "python3", "command_sha256": digest(hostile), "exit_code": 0, "signal": None},
        {"node": "fix", "program": "make", "command_sha256": digest("make test"), "exit_code": None,
         "signal": None}]
    assert "print" not in json.dumps(got) and "<img" not in json.dumps(got)
