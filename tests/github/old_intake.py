"""Behaviours of the intake before a fix, restored by the positive controls:
the answer to a write-access check that failed for a while (a rate limit,
the broker away) before such events were tried again (the rate-limit tests,
in webhook and polling modes); a ticket per event before one ticket per
piece of work (`old_claims`); a follow-up re-opening the ticket at once and
refused as `busy` while it runs (`old_follow_ups`)."""

from __future__ import annotations

import pytest

from services.common.errors import AfeError
from services.scheduler.engine.followups import follow_up
from services.scheduler.github import intake as github_intake
from services.scheduler.store.base import WorkClaim


def _intake(store):
    """The store's GitHub intake repository itself (a ThreadedStore's is its inner store's)."""
    return getattr(store, "inner", store).intake


def old_behaviour(monkeypatch: pytest.MonkeyPatch, store, which: str) -> None:
    """"refused": the event refused as `permission_unknown` (and so used up);
    "claim-kept": the failed event's claim kept, so its next try is a
    duplicate; "": today's behaviour."""
    if which == "refused":
        monkeypatch.setattr(github_intake, "TRY_AGAIN", ())
    elif which == "claim-kept":
        monkeypatch.setattr(_intake(store), "release_once", lambda key: None)
    else:
        assert which == "", which


def old_claims(monkeypatch: pytest.MonkeyPatch, store) -> None:
    """Every event starts its own ticket: the store's work claim always goes to the caller."""
    repo = _intake(store)
    monkeypatch.setattr(repo, "claim_work", lambda repo, number, trigger, claim, at_ms, grace_ms:
                        WorkClaim(claim, "", at_ms))
    monkeypatch.setattr(repo, "set_work_ticket", lambda *a: True)
    monkeypatch.setattr(repo, "release_work", lambda *a: None)


def old_follow_ups(monkeypatch: pytest.MonkeyPatch, intake) -> None:
    """A follow-up re-opens its ticket at once (followups.follow_up); while the re-run
    runs, the next one (a review's inline comment) is refused as `busy` and dropped."""
    async def follow_up_now(tid, text, *, login, source, path, line, url, delivery, review_id, what):
        try:
            await follow_up(intake.engine, tid, text, principal=f"github:{login}", author=login, source=source,
                            path=path, line=line, url=url)
        except AfeError:
            return github_intake.Outcome("ignored", "busy")
        return github_intake.Outcome("accepted", "followup", [tid])
    monkeypatch.setattr(intake, "_follow_up", follow_up_now)
