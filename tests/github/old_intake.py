"""The intake's answer to a write-access check that failed for a while (a
rate limit, the broker away) before such events were tried again: restored
by the positive controls of the rate-limit tests, in webhook and polling
modes."""

from __future__ import annotations

import pytest

from services.scheduler import github_intake


def old_behaviour(monkeypatch: pytest.MonkeyPatch, store, which: str) -> None:
    """"refused": the event refused as `permission_unknown` (and so used up);
    "claim-kept": the failed event's claim kept, so its next try is a
    duplicate; "": today's behaviour."""
    if which == "refused":
        monkeypatch.setattr(github_intake, "TRY_AGAIN", ())
    elif which == "claim-kept":
        monkeypatch.setattr(store, "release_once", lambda key: None)
    else:
        assert which == "", which
