"""R42, "the record tells the truth", in the scheduler: the real engine, store
and executor over the in-process fake brokers (the fake forge answers a head
a person pushed). A head afe's run pushed is recorded as afe's with the run's
commands and models; a head someone else pushed to the ticket's branch is
recorded as `pushed_by: person`, and the run's commands, prompts, agents,
models and usage go under `afe_run`, attributed to the head afe pushed.
The verification's new keys (R41) and the acknowledged harness changes of a
decision are in the signed record, bounded, and shown escaped in the PR
comment."""

from __future__ import annotations

import json

from services.common.provenance import attestation
from services.scheduler.executor.nodes import run_record, run_statement
from services.scheduler.store.base import SUCCEEDED, WAITING_APPROVAL, ApprovalRecord, EventRecord
from services.scheduler.store.run_records import DECISION, REQUEST, RunRecord

WORKFLOWS = """\
kind: Workflow
name: review
workspace: ws
nodes:
  - {id: test, run: "make test"}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""
AFE = "c" * 40            # what the fake broker pushes
PERSON = "d" * 40         # what "a person" pushed to the ticket's branch since


async def _predicate(h, tid: str, sha: str, kind: str = REQUEST) -> dict:
    rec = h.store.run_records.run_record(tid, sha, kind)
    assert rec is not None, (sha, kind, [(r.sha, r.kind) for r in h.store.run_records.run_records(tid)])
    key = attestation.public_key((await h.credentials.signing_key()).public_key_pem)
    return attestation.verify(json.loads(rec.envelope), key, sha).statement["predicate"]


async def test_r42_a_head_afe_pushed_is_recorded_as_afes_with_the_runs_commands(harness):
    """The positive control of the next test: the same run, no foreign push."""
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    assert t.awaiting_sha == AFE
    p = await _predicate(h, tid, AFE)
    assert p["head"] == {"sha": AFE, "pushed_by": "afe", "afe_head": AFE, "afe_pushed": [AFE]}
    assert p["commands"][0]["command"] == "make test" and p["commands"][0]["exit_codes"] == [0]
    assert "afe_run" not in p


async def test_r42_a_head_a_person_pushed_is_recorded_as_such_not_with_the_agents_commands(harness):
    h = harness(WORKFLOWS)
    real_get_pr = h.credentials.get_pr

    async def moved(workspace: str, number: str):
        pr = await real_get_pr(workspace, number)
        if pr.state != "merged":
            pr.head_sha = PERSON          # a person pushed to afe/<ticket> after afe's push
        return pr

    h.credentials.get_pr = moved
    await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    assert t.awaiting_sha == PERSON
    p = await _predicate(h, tid, PERSON)
    assert p["head"]["pushed_by"] == "person" and p["head"]["afe_head"] == AFE
    assert p["head"]["afe_pushed"] == [AFE]
    # nothing of the run is attributed to the person's head ...
    for key in ("commands", "agent_commands", "prompts", "agents", "models"):
        assert p[key] == [], key
    assert p["usage"]["total_tokens"] == 0 and p["usage"]["models"] == []
    # ... it is kept, attributed to the head afe pushed
    assert p["afe_run"]["head"] == AFE
    assert p["afe_run"]["commands"][0]["command"] == "make test"
    # the PR comment says so too
    body = run_record.comment_body(h.store.run_records.run_record(tid, PERSON, REQUEST), None)
    assert "head pushed by a person, not by afe's run" in body and f"`{AFE}`" in body

    await h.engine.approve(tid, "bob", PERSON)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    d = await _predicate(h, tid, PERSON, DECISION)
    assert d["head"]["pushed_by"] == "person" and d["commands"] == [] and d["decision"]["principal"] == "bob"


def _event(seq: int, type_: str, payload: dict) -> EventRecord:
    return EventRecord("t-1", seq, type_, json.dumps(payload), seq)


class _EventsRepo:
    """A store's events repository over a list (as the store pages them)."""

    def __init__(self, events: list[EventRecord]) -> None:
        self._events = events

    def read(self, ticket_id: str, from_seq: int, limit: int = 1000) -> list[EventRecord]:
        return [e for e in self._events if e.seq >= from_seq][:limit]


class _Events:
    """A store whose `events` are a list."""

    def __init__(self, events: list[EventRecord]) -> None:
        self.events = _EventsRepo(events)


def test_r42_afe_knows_the_heads_it_pushed_from_its_push_and_update_branch_events():
    a, b, c, person = "a" * 40, "b" * 40, "e" * 40, "f" * 40
    events = [_event(1, "push.done", {"node": "pr", "sha": a}),
              _event(2, "approval.stale", {"approved_sha": a, "head_sha": person}),      # not afe's push
              _event(3, "ticket.reopened", {"reason": "update branch", "head_sha": person,
                                            "branch_updated": False}),                   # nothing pushed
              _event(4, "ticket.reopened", {"reason": "update branch", "head_sha": b, "branch_updated": True}),
              _event(5, "push.done", {"node": "pr", "sha": a}),                          # pushed again: latest
              _event(6, "push.done", {"node": "pr", "sha": "not a sha\n"}),
              *[_event(7 + i, "node.output", {"text": "x"}) for i in range(2500)],     # pages of events
              _event(3000, "push.done", {"node": "pr", "sha": c.upper()})]
    assert run_statement.afe_pushed(_Events(events), "t-1") == [b, a, c]


def test_r42_the_verification_keys_are_in_the_record_typed_and_bounded():
    hostile = "tests/\x1b[2Jconftest.py\u202e"
    v = {"passed": False, "sha": "a" * 40, "base_sha": "b" * 40, "merge_sha": "c" * 40, "base_branch": "main",
         "base_paths": ["tests/"], "reasons": ["ran no test"], "harness_changes": [hostile, "pytest.ini"],
         "binary_files": [f"pkg/__pycache__/m{i}.pyc" for i in range(run_statement.LIST_MAX + 5)],
         "shadowing": ["unittest/"], "error": "",
         "commands": [{"command": "python3 -m pytest", "exit_code": 0, "timed_out": False, "duration_ms": 12,
                       "counts": {"ran": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "deselected": 3,
                                  "runner": "pytest"}, "output_tail": "secret-looking output"}],
         "tests": {"ran": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "deselected": 3},
         "base_tests": {"ran": 5, "passed": 5, "failed": 0, "errors": 0, "skipped": 0, "deselected": 0},
         "unknown_key": "dropped"}
    r = run_statement.verification_record(v)
    assert r is not None
    assert (r["passed"], r["base_sha"], r["merge_sha"]) == (False, "b" * 40, "c" * 40)
    assert r["harness_changes"] == [hostile, "pytest.ini"] and r["shadowing"] == ["unittest/"]
    assert len(r["binary_files"]) == run_statement.LIST_MAX and r["omitted"] == {"binary_files": 5}
    assert r["commands"][0]["counts"]["deselected"] == 3 and "output_tail" not in r["commands"][0]
    assert r["base_tests"]["ran"] == 5 and "unknown_key" not in r
    # canonical JSON escapes what a terminal or a page would act on
    assert attestation.canonical(r).isascii() and b"\x1b" not in attestation.canonical(r)
    # an older summary (before these keys) keeps its shape: only what it has
    old = run_statement.verification_record({"passed": True, "sha": "a" * 40, "commands": []})
    assert old == {"passed": True, "sha": "a" * 40, "commands": []}
    assert run_statement.verification_record(None) is None
    # a "passed" that is not the boolean true is not a pass
    assert run_statement.verification_record({"passed": "yes"}) == {"passed": False}


def _signed_record(predicate: dict, sha: str, kind: str) -> RunRecord:
    stmt = {"_type": attestation.STATEMENT_TYPE, "predicateType": attestation.PREDICATE_TYPE,
            "subject": [{"name": "git+x@afe/t-1", "digest": {"gitCommit": sha}}], "predicate": predicate}
    import base64
    env = attestation.canonical({"payload": base64.b64encode(attestation.canonical(stmt)).decode(),
                                 "payloadType": attestation.PAYLOAD_TYPE, "signatures": []}).decode()
    return RunRecord("t-1", sha, kind, env, 1)


def test_r42_the_pr_comment_shows_the_verification_and_the_acknowledgement_escaped():
    sha = "a" * 40
    ver = run_statement.verification_record({
        "passed": True, "base_sha": "b" * 40, "merge_sha": "c" * 40, "base_branch": "main",
        "harness_changes": ["sub/conftest.py`\n<img src=x>\u202e"], "binary_files": ["m.pyc"],
        "tests": {"ran": 4, "passed": 4, "failed": 0, "errors": 0, "skipped": 0, "deselected": 0}})
    predicate = {"kind": "decision", "workflow": {"name": "review", "nodes": []}, "verification": ver,
                 "decision": {"principal": "bob", "granted": True, "sha": sha,
                              "accepted_harness_change": ["sub/conftest.py`\n<img src=x>\u202e"]}}
    body = run_record.comment_body(None, _signed_record(predicate, sha, DECISION))
    assert "4 ran, 4 passed" in body and f"`{'b' * 40}`" in body and f"`{'c' * 40}`" in body
    assert "changes how tests run" in body and "acknowledged harness changes" in body
    assert "\u202e" not in body
    # inline code on one line: the backtick, the line break and the bidi override gone
    assert "(the base's version was used): `sub/conftest.py' <img src=x>`\n" in body
    assert "acknowledged harness changes: `sub/conftest.py' <img src=x>`\n" in body


def test_r42_the_decision_carries_the_acknowledged_harness_files(tmp_path):
    """statement() puts the ApprovalRecord's `accepted_harness_change` into the decision."""
    from services.common.config.manifests import load_config
    from services.scheduler.store.base import NodeRunRecord, TicketRecord
    from services.scheduler.store.store import Store

    from .conftest import WORKSPACE

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "afe.yaml").write_text(WORKSPACE + WORKFLOWS)
    config = load_config(tmp_path / "cfg")
    store = Store.sqlite(tmp_path / "afe.db")
    try:
        t = TicketRecord(id="t-1", workspace="ws", workflow="review", title="t", body="b", inputs={},
                         state=WAITING_APPROVAL, created_at_ms=1, updated_at_ms=1, principal="p")
        store.tickets.create(t, [NodeRunRecord("t-1", n.id, n.kind) for n in config.workflows["review"].nodes], [])
        acked = ["conftest.py", "pytest.ini"]
        for appr, want in ((ApprovalRecord("t-1", "bob", "a" * 40, True, 5, accepted_harness_change=acked), acked),
                           (ApprovalRecord("t-1", "bob", "a" * 40, True, 6), [])):
            stmt = run_statement.statement(config, store, t, "a" * 40, pr=None, verification=None, denied=None,
                                           decision=appr)
            assert stmt["predicate"]["decision"]["accepted_harness_change"] == want
        # no push of afe's in this store: the head is not afe's
        assert stmt["predicate"]["head"]["pushed_by"] == "person"
    finally:
        store.close()
