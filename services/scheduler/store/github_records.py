"""Records of the GitHub intake kept in the store (store.py re-exports them):
the claim of a piece of work on its one live ticket (github_intake.py) and
where a workspace's polling stands (github/poll.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkClaim:
    """The claim of (repository, issue number, Trigger) on its one live ticket
    (`Store.claim_work`): `claim` is the claimer's token, `ticket_id` empty
    while that ticket is being created."""

    claim: str
    ticket_id: str
    claimed_at_ms: int


@dataclass(frozen=True)
class PollCursor:
    """Where the polling of a workspace's GitHub events stands (github/poll.py)."""

    etag: str = ""              # of the last listing: the next request is conditional
    last_event_id: str = ""     # newest event handled; "" = never listed (the first listing only sets it),
                                # "0" = listed, no event yet (every event is new)
    next_poll_ms: int = 0       # no request before (X-Poll-Interval, a rate limit, a back-off); 0 = at once
