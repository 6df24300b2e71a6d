"""`afe ticket watch` prints a readable line for each engine event (never raw
JSON), with attempt numbers, tokens, and multi-line errors kept as lines."""

from __future__ import annotations

import pytest

from services.cli.tickets import _describe

EVENTS = [
    ("node.started", {"node": "test", "kind": "run", "attempt": 2}, "started (run, attempt 2)"),
    ("node.retry", {"node": "test", "attempt": 1, "error": "exit 1"}, "attempt 1 failed, retrying"),
    ("workspace.ready", {"base_sha": "a" * 40, "branch": "afe/t-1"}, "workspace ready: branch afe/t-1"),
    ("sandbox.ready", {"image": "afe/sandbox:latest", "egress": [], "network": False}, "(no network)"),
    ("sandbox.env_names", {"names": ["FOO_SETTING"], "agents": {"coder": ["FOO_SETTING"]}},
     "variables entered the sandbox (names): FOO_SETTING (agent coder: FOO_SETTING)"),
    ("commit.done", {"node": "pr", "sha": "b" * 40, "changed": True}, "committed bbbbbbbbbbbb"),
    ("push.done", {"node": "pr", "branch": "afe/t-1", "sha": "c" * 40}, "pushed afe/t-1"),
    ("model.usage", {"node": "code", "model": "m", "input_tokens": 12, "output_tokens": 3},
     "tokens: 12 in, 3 out (m)"),
    ("node.message", {"node": "fix", "turn": 3, "content": "ok", "input_tokens": 100, "output_tokens": 7},
     "[turn 3, 100 in / 7 out tokens]"),
    ("node.budget_exceeded", {"node": "fix", "limit": "max_turns", "reason": "max_turns (8) reached"},
     "budget spent (max_turns)"),
    ("broker.retry", {"node": "pr", "step": "open_pr", "broker": "credentials"}, "waiting for the credentials"),
    ("broker.recovered", {"node": "pr", "step": "open_pr", "broker": "credentials"}, "back: the credentials"),
    ("node.resumed", {"node": "fix", "was": "running"}, "resumed (was running)"),
    ("ticket.resumed", {}, "ticket resumed"),
    ("approval.stale", {"node": "merge", "approved_sha": "d" * 40, "head_sha": "e" * 40}, "approve again"),
    ("github.joined", {"delivery": "d-2", "event": "issues.assigned", "author": "octo", "trigger": "t", "url": ""},
     "issues.assigned by octo joined this ticket (d-2)"),
    ("followup.received", {"source": "github:review_comment", "author": "octo", "path": "a.py", "line": 3,
                           "url": "", "delivery": "d", "review_id": 1, "taken": "queued", "waiting": 1},
     "by octo on a.py line 3: queued for the next re-run"),
    ("followup.refused", {"source": "github:review", "author": "octo", "reason": "its pull request 2 is merged"},
     "refused: its pull request 2 is merged"),
    ("followup.dropped", {"count": 2, "reason": "its pull request 2 is merged", "followups": []},
     "2 follow-up(s) dropped"),
]


@pytest.mark.parametrize(("typ", "payload", "expected"), EVENTS, ids=[e[0] for e in EVENTS])
def test_every_engine_event_has_a_readable_line(typ, payload, expected):
    line = _describe({"type": typ, "payload": payload, "at_ms": 1500}, {}, 0, True)
    assert line is not None and expected in line
    assert "{" not in line and line.startswith("[   1.5s]")


def test_a_multi_line_error_stays_on_separate_lines():
    err = "the command exited with code 1:\nFAILED test_add\nassert -1 == 5"
    line = _describe({"type": "node.finished", "payload": {"node": "test", "state": "failed", "error": err},
                      "at_ms": 0}, {}, 0, False)
    assert line is not None
    assert line.splitlines()[1:] == [f"{'':>10} {ln}" for ln in err.split("\n")]


MORE = [
    ("model.usage", {"node": "code", "model": "m", "input_tokens": 1000, "output_tokens": 10, "cost_usd": 0.0123},
     "tokens: 1000 in, 10 out (m, ~$0.0123)"),
    ("node.prompt", {"node": "fix", "model": "m", "system": "s", "prompt": "fix it"}, "prompt sent to m (6 chars)"),
    ("node.feedback", {"node": "fix", "round": 1, "max": 2, "to": "code"}, "round 1 of 2: its output goes back to code"),
    ("node.feedback_spent", {"node": "test", "rounds": 2, "to": "code"}, "failed after 2 rounds back to code"),
    ("agent.tool_call_update", {"node": "code", "id": "c1", "status": "completed"}, "agent tool c1: completed"),
    ("agent.fs", {"node": "code", "op": "write", "path": "/etc/x", "ok": False}, "agent write /etc/x (refused)"),
    ("agent.terminal", {"node": "code", "op": "create", "command": "pytest", "ok": True}, "agent terminal create: pytest"),
    ("agent.permission", {"node": "code", "kind": "edit", "title": "edit a.py", "decision": "allow"},
     "agent asked permission for edit a.py: allow"),
    ("agent.plan", {"node": "code", "entries": [{"status": "completed"}, {"status": "pending"}]},
     "agent plan: 1 of 2 steps done"),
    ("agent.cancel", {"node": "code", "sent": "session/cancel"}, "agent asked to stop"),
    ("agent.protocol_error", {"node": "code", "reason": "bad"}, "agent protocol error: bad"),
    ("ticket.reopened", {"principal": "ui", "reason": "retry", "nodes": ["test"]}, "re-opened (retry) by ui: runs test again"),
    ("branch.conflict", {"paths": ["a.py", "b.py"]}, "conflicts in: a.py, b.py"),
]


@pytest.mark.parametrize(("typ", "payload", "expected"), MORE, ids=[e[0] for e in MORE])
def test_agent_feedback_and_cost_events_have_a_readable_line(typ, payload, expected):
    line = _describe({"type": typ, "payload": payload, "at_ms": 1500}, {}, 0, True)
    assert line is not None and expected in line, line
    assert "{" not in line and line.startswith("[   1.5s]")
