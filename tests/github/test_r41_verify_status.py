"""R41 on GitHub: the clean-room verification of a pull request's head is
a commit status `afe/verify` on that head (failure with the failing command
and the base paths, or success), set through the credential broker (a real
process) against the fake GitHub, which checks each request against
GitHub's OpenAPI description; set once per result (R37), again when the
head changes."""

from __future__ import annotations

from services.scheduler.store.base import RUNNING

from .test_report import reporting  # noqa: F401  (the fixture)

FAILED = {"node": "merge", "passed": False, "base_paths": ["tests/"], "base_branch": "main", "base_sha": "b" * 40,
          "commands": [{"command": "python -m pytest -q", "exit_code": 1, "timed_out": False, "duration_ms": 900}]}


def _verify_statuses(github) -> list[dict]:
    return [s for s in github.statuses if s["context"] == "afe/verify"]


async def test_r41_the_verification_is_a_commit_status_on_the_head(reporting):  # noqa: F811
    r = reporting
    tid = await r.ticket_from_issue()
    await r.move(tid, RUNNING)
    sha = "c0ffee" + "1" * 34
    await r.open_pr(tid, sha)
    assert _verify_statuses(r.github) == []                     # not verified yet: no status
    r.store.verifications.put_verification(tid, sha, False, {**FAILED, "sha": sha}, 1)
    await r.move(tid, "waiting_approval", awaiting_sha=sha)
    [status] = _verify_statuses(r.github)
    assert status["sha"] == sha and status["state"] == "failure"
    assert status["description"] == "verification failed: python -m pytest -q exited 1 (tests/ from main)"
    assert status["target_url"].endswith(f"/#/t/{tid}")
    await r.move(tid, RUNNING)                                   # another sync: not set again (R37)
    assert len(_verify_statuses(r.github)) == 1

    new = "c0ffee" + "2" * 34                                    # a new head, verified: its own status
    r.store.verifications.put_verification(tid, new, True, {**FAILED, "sha": new, "passed": True,
                                              "commands": [{**FAILED["commands"][0], "exit_code": 0}]}, 2)
    await r.open_pr(tid, new)
    last = _verify_statuses(r.github)[-1]
    assert (last["sha"], last["state"]) == (new, "success")
    assert last["description"] == "verification passed: 1 command (tests/ from main)"
