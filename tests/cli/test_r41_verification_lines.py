"""R41: what the CLI shows of a head's clean-room verification — on the
approval line of `afe ticket watch`, its own lines, and `afe ticket show`."""

from __future__ import annotations

from services.cli.ticket_view import _print_verification
from services.cli.tickets import _describe

FAILED = {"node": "merge", "sha": "a" * 40, "passed": False, "base_paths": ["tests/"], "base_branch": "main",
          "base_sha": "b" * 40,
          "commands": [{"command": "python -m pytest -q", "exit_code": 1, "timed_out": False, "duration_ms": 1500}]}
PASSED = {**FAILED, "passed": True, "base_paths": [],
          "commands": [{"command": "make `x`\nlint", "exit_code": 0, "timed_out": False, "duration_ms": 10}]}


def _line(typ: str, payload: dict, verbose: bool = False) -> str | None:
    return _describe({"type": typ, "payload": payload, "at_ms": 1000}, {}, 0, verbose)


def test_r41_watch_shows_the_verification_on_the_approval_and_its_result():
    line = _line("approval.requested", {"node": "merge", "sha": "a" * 40, "verification": FAILED})
    assert line is not None
    assert "verification failed: `python -m pytest -q` exited 1 (tests/ from main)" in line
    assert "waiting for approval of " + "a" * 40 in line
    assert "verification passed: 1 command" in (_line("verification.finished", PASSED) or "")
    started = _line("verification.started", {"node": "merge", "sha": "a" * 40, "base_paths": ["tests/"],
                                             "commands": ["make"]})
    assert started is not None and "fresh sandbox (1 command(s), tests/ from the base branch)" in started
    out = {"node": "merge", "stream": "stdout", "text": "1 failed\n"}
    assert _line("verification.output", out) is None and "| 1 failed" in (_line("verification.output", out, True) or "")
    # without a verification the approval line is as before
    assert _line("approval.requested", {"sha": "c" * 40}) == "[   1.0s] waiting for approval of " + "c" * 40


def test_r41_show_lists_each_verification_and_its_commands(capsys):
    _print_verification([{"type": "node.prompt", "payload": {}},
                         {"type": "verification.finished", "payload": FAILED},
                         {"type": "verification.finished", "payload": PASSED}])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "verification failed: `python -m pytest -q` exited 1 (tests/ from main) on aaaaaaaaaaaa"
    assert out[1] == "    python -m pytest -q: exit 1 (1.5s)"
    assert out[2] == "    merged onto main at " + "b" * 12             # the base the head was verified on
    assert out[3].startswith("verification passed: 1 command on ")
    assert out[4] == "    make xlint: exit 0 (0.0s)"      # the template shown without backticks or line breaks
