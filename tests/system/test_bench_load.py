"""bench/bench_load.py: its checks catch a lost, duplicated or foreign event
and a ticket that did not succeed; a small load through a real `afe up`
passes them and leaves no Docker object."""

from __future__ import annotations

import pytest

from bench import bench_load
from bench.bench_load import Watched, check_sequence, verify
from bench.common import Result, Section


def _ticket(tid: str, seqs: list[int], nodes: list[str], state: str = "succeeded") -> Watched:
    evs = [{"ticket_id": tid, "seq": s, "type": "node.output", "payload": {}, "at_ms": 1000 + s} for s in seqs]
    for ev, node in zip(evs[1:], nodes, strict=False):
        ev["type"], ev["payload"] = "node.finished", {"node": node}
    if evs:
        evs[-1]["type"] = "ticket.finished"
    return Watched(ticket_id=tid, events=evs, state=state)


def test_check_sequence_accepts_only_one_to_n():
    assert check_sequence([1, 2, 3, 4]) is None
    assert "missing seq [3]" in check_sequence([1, 2, 4, 5])
    assert "1 duplicated" in check_sequence([1, 2, 2, 3])
    assert "out of order" in check_sequence([1, 3, 2])
    assert "missing seq [1]" in check_sequence([2, 3])
    assert check_sequence([]) == "no events"


def test_verify_flags_each_broken_stream_and_passes_a_good_one():
    good = _ticket("t-good", list(range(1, 6)), ["a", "b", "z"])
    assert verify([good], 3) == []
    gap = _ticket("t-gap", [1, 2, 3, 5, 6], ["a", "b", "z"])
    dup = _ticket("t-dup", [1, 2, 3, 4, 4, 5], ["a", "b", "z", "z"])
    failed = _ticket("t-failed", list(range(1, 6)), ["a", "b", "z"], state="failed")
    foreign = _ticket("t-foreign", list(range(1, 6)), ["a", "b", "z"])
    foreign.events[2]["ticket_id"] = "t-other"
    cut = _ticket("t-cut", list(range(1, 5)), ["a", "b", "z"])
    cut.events[-1]["type"] = "node.output"
    problems = "\n".join(verify([good, gap, dup, failed, foreign, cut], 3))
    assert "t-good" not in problems
    assert "ticket t-gap: events missing seq [4]" in problems
    assert "ticket t-dup: events 1 duplicated" in problems
    assert "ticket t-dup: 4 node.finished events for 3 of 3 nodes" in problems
    assert "ticket t-failed: ended failed, not succeeded" in problems
    assert "ticket t-foreign: another ticket's event on its watch" in problems
    assert "ticket t-cut: its watch did not end with ticket.finished" in problems
    assert "the same ticket id" in "\n".join(verify([good, good], 3))


@pytest.mark.docker
@pytest.mark.timeout(280)
def test_small_load_through_a_real_afe_up(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_load, "TICKETS", 4)
    monkeypatch.setattr(bench_load, "MAX_RUNNING", 2)
    items = bench_load.run(tmp_path)
    [result] = [r for r in items if isinstance(r, Result)]
    [section] = [s for s in items if isinstance(s, Section)]
    assert section.problems == ()
    assert "| tickets succeeded | 4 of 4 |" in section.body
    assert "| Docker objects left after `afe up` stopped (label afe.instance) | 0 " in section.body
    assert result.measured_s > 0 and result.baseline_s > 0
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"
