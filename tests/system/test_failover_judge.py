"""The judge of issue 32's failover test (failover_judge.py) on made-up
observations: a clean one passes, and each way the "Done when" can break
is named with its key. Fast: no Docker, no database."""

from __future__ import annotations

import copy

from tests.system.failover_judge import violations

LINES = 20


def _ev(events: list[dict], type_: str, **payload) -> None:
    events.append({"seq": len(events) + 1, "type": type_, "payload": payload, "at_ms": len(events)})


def _out(events: list[dict], run: str, first: int, last: int, attempt: int | None = None) -> None:
    for i in range(first, last + 1):
        extra = {"attempt": attempt} if attempt is not None else {}
        _ev(events, "node.output", node="edit", stream="stdout", text=f"{run} line-{i}\n", **extra)


def _forge(run: str) -> tuple[dict, list[dict]]:
    forge = {"refs": ["refs/heads/afe/t-x"], "tip": "c1", "notes_added": [f"streamed {run}"],
             "commits": [{"sha": "c1", "subject": "s", "files": ["NOTES.md"], "notes_added": [f"streamed {run}"],
                          "patch_id": "p1"}]}
    return forge, [{"head": "afe/t-x", "head_sha": "c1"}]


def _stream_taken_over() -> dict:
    """`stream`: attempt 1 by sched-a to line 8 (of 12 printed), the takeover by sched-b,
    events.lost for attempt 1, attempt 2 to the end."""
    ev: list[dict] = []
    _ev(ev, "ticket.created")
    _ev(ev, "node.started", node="edit", attempt=1, scheduler="sched-a")
    _out(ev, "aaaaaaaa", 1, 8, attempt=1)
    _ev(ev, "ticket.takeover", scheduler="sched-b", state="running")
    _ev(ev, "node.attempt", node="edit", attempt=2, previous=1, reason="takeover", scheduler="sched-b")
    _ev(ev, "node.started", node="edit", attempt=2, scheduler="sched-b")
    _ev(ev, "events.lost", count=4, reason="takeover", attempt=1)
    _out(ev, "bbbbbbbb", 1, LINES, attempt=2)
    _ev(ev, "node.finished", node="edit", state="succeeded", attempt=2)
    _ev(ev, "node.started", node="pr", attempt=1, scheduler="sched-b")
    _ev(ev, "ticket.finished", state="succeeded")
    forge, prs = _forge("bbbbbbbb")
    return {"id": "t-x", "state": "succeeded", "error": "", "nodes": [], "events": ev, "prs": prs, "forge": forge}


def _push_once() -> dict:
    ev: list[dict] = []
    _ev(ev, "ticket.created")
    _ev(ev, "node.started", node="edit", attempt=1, scheduler="sched-b")
    _out(ev, "cccccccc", 1, LINES)
    _ev(ev, "node.finished", node="edit", state="succeeded")
    _ev(ev, "ticket.finished", state="succeeded")
    forge, prs = _forge("cccccccc")
    return {"id": "t-x", "state": "succeeded", "error": "", "nodes": [], "events": ev, "prs": prs, "forge": forge}


def _clean() -> dict:
    t = {"created": 0.0, "push_held": 10.0, "stop": 10.0, "down": 11.0, "up": 70.0, "done": 100.0}
    livez = [[x / 2, 200, 0.01] for x in range(200)]
    readyz = [[x / 2, 503 if 10.5 <= x / 2 <= 70 else 200, ["store"] if 10.5 <= x / 2 <= 70 else []]
              for x in range(200)]
    probes = {name: {"livez": livez, "readyz": readyz} for name in ("sched-a", "sched-b")}
    return {"mode": "stop", "outage_s": 60.0, "lease_s": 3.0, "lines": LINES, "t": t, "probes": probes,
            "push_alive_at_down": True, "stream_line_at_stop": 8,
            "tickets": {"stream": _stream_taken_over(), "push": _push_once()}}


def _keys(obs: dict) -> set[str]:
    return {p.split(":", 1)[0] for p in violations(obs)}


def test_a_clean_observation_passes():
    assert violations(_clean()) == []


def test_the_old_owners_line_after_the_takeover_is_a_stale_write():
    obs = _clean()
    ev = obs["tickets"]["stream"]["events"]
    late = next(i for i, e in enumerate(ev) if e["type"] == "events.lost") + 1
    ev.insert(late, {"seq": 0, "type": "node.output", "at_ms": 0,
                     "payload": {"node": "edit", "stream": "stdout", "text": "aaaaaaaa line-9\n", "attempt": 1}})
    for i, e in enumerate(ev):
        e["seq"] = i + 1
    problems = violations(obs)
    assert [p for p in problems if p.startswith("stale:")], problems


def test_an_event_naming_the_old_owner_after_the_takeover_is_a_stale_write():
    obs = _clean()
    ev = obs["tickets"]["stream"]["events"]
    ev.insert(-1, {"seq": 0, "type": "node.started", "at_ms": 0,
                   "payload": {"node": "pr", "attempt": 1, "scheduler": "sched-a"}})
    for i, e in enumerate(ev):
        e["seq"] = i + 1
    assert "stale" in _keys(obs)


def test_a_line_twice_in_one_attempt_and_a_gap_in_the_seqs_are_named():
    obs = _clean()
    ev = obs["tickets"]["push"]["events"]
    ev.insert(5, copy.deepcopy(ev[4]))
    for i, e in enumerate(ev):
        e["seq"] = i + 1
    assert "lines" in _keys(obs)
    ev.pop(3)
    assert {"lines", "seq"} <= _keys(obs)


def test_a_lost_attempt_without_a_counted_events_lost_is_named():
    obs = _clean()
    ev = obs["tickets"]["stream"]["events"]
    lost = next(e for e in ev if e["type"] == "events.lost")
    lost["payload"]["count"] = 0
    assert "lost" in _keys(obs)
    lost["type"] = "ticket.note"
    assert "lost" in _keys(obs)


def test_a_run_that_streams_through_the_outage_as_one_attempt_acted_without_a_lease():
    obs = _clean()
    obs["tickets"]["stream"] = copy.deepcopy(obs["tickets"]["push"])
    assert _keys(obs) == {"self-fence"}


def test_a_second_commit_pr_or_branch_and_a_rerun_on_the_interrupted_files_are_named():
    obs = _clean()
    forge = obs["tickets"]["stream"]["forge"]
    forge["notes_added"] = ["streamed aaaaaaaa", "streamed bbbbbbbb"]
    forge["commits"].append({**forge["commits"][0], "sha": "c2"})
    problems = [p for p in violations(obs) if p.startswith("forge:")]
    assert len(problems) == 2, problems
    obs["tickets"]["push"]["prs"].append({"head_sha": "c1"})
    obs["tickets"]["push"]["forge"]["refs"].append("refs/heads/afe/t-x-2")
    assert len([p for p in violations(obs) if p.startswith("forge:")]) == 4


def test_a_frozen_or_silent_scheduler_is_named():
    obs = _clean()
    probes = obs["probes"]["sched-a"]
    probes["livez"] = [[at, None if 20 < at < 30 else st, took] for at, st, took in probes["livez"]]
    assert _keys(obs) == {"livez"}
    obs = _clean()
    obs["probes"]["sched-b"]["readyz"] = [[at, 200, []] for at, _st, _f in obs["probes"]["sched-b"]["readyz"]]
    assert _keys(obs) == {"readyz-503"}
    obs = _clean()
    obs["probes"]["sched-b"]["readyz"] = [[at, 503, ["store"]] for at, _st, _f in obs["probes"]["sched-b"]["readyz"]]
    assert _keys(obs) == {"readyz-200"}


def test_a_scenario_that_missed_the_stream_or_the_push_says_so():
    obs = _clean()
    obs["stream_line_at_stop"] = LINES
    obs["push_alive_at_down"] = False
    assert "scenario" in _keys(obs)


def test_the_paused_owners_silence_is_not_a_freeze_but_a_missing_takeover_is_named():
    obs = _clean()
    probes = obs["probes"]["sched-a"]
    probes["livez"] = [[at, None if 69 <= at <= 75 else st, took] for at, st, took in probes["livez"]]
    obs["paused"] = {"scheduler": "sched-a", "from": 69.5, "to": 75.0, "taken_over": True}
    assert violations(obs) == []
    obs["paused"]["scheduler"] = "sched-b"        # the silent one was not the paused one
    assert _keys(obs) == {"livez"}
    obs["paused"] = {"scheduler": "sched-a", "from": 69.5, "to": 75.0, "taken_over": False}
    assert _keys(obs) == {"scenario"}


def test_an_attempt_that_ended_before_the_database_stopped_needs_no_count():
    """Its owner fenced itself on a loaded machine and the next attempt began before the stop:
    it did not stream through the outage, so nothing may be left to count. The same attempt
    ending after the stop without a count is named (the control)."""
    obs = _clean()
    ev = obs["tickets"]["stream"]["events"]
    for e in ev:
        if e["type"] == "events.lost":
            e["type"] = "ticket.note"
    second = [e for e in ev if e["type"] == "node.started" and e["payload"].get("node") == "edit"][1]
    obs["stop_wall_ms"] = second["at_ms"] - 1
    assert "lost" in _keys(obs)
    obs["stop_wall_ms"] = second["at_ms"] + 1
    assert "lost" not in _keys(obs)
