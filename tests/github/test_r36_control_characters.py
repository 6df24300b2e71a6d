"""R36, issue text is data, down to its control characters: GitHub's own
`issues.labeled` example with a NUL, a terminal escape and a bell in the
issue's title (and a NUL in its body), delivered to the real scheduler core
on either store. The NUL becomes U+FFFD where the payload is decoded
(github/delivery.py), as a lone surrogate does, so the ticket is made;
PostgreSQL stores no NUL in text, and there the event used to fail every
delivery (the positive control). The escape stays in the ticket's title, as
data: it is taken out only where the title becomes a commit message or a
pull request's title (tests/scheduler/executor/test_r36_forge_text.py)."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from services.common.errors import AfeError
from services.scheduler.github import delivery

from .test_report import reporting  # noqa: F401 - the fixture: scheduler core, credential broker, fake GitHub

pytestmark = pytest.mark.timeout(180)

TITLE = "Crash on \x00 input \x1b[2J\x1b[31mred\x07"


def _labeled(payload: dict) -> bytes:
    e = json.loads(json.dumps(payload))
    e["issue"]["title"], e["issue"]["body"] = TITLE, "steps\x00here"
    body = json.dumps(e).encode()
    assert b"\\u0000" in body            # as GitHub's JSON spells it
    return body


async def test_r36_a_nul_in_an_issue_becomes_u_fffd_and_its_ticket_is_made(reporting):  # noqa: F811
    r = reporting
    r.github.permissions[r.payload["sender"]["login"]] = "write"
    out = await r.app.intake.deliver(str(uuid.uuid4()), "issues", _labeled(r.payload))
    assert (out.outcome, out.reason) == ("accepted", "ok"), out
    t = r.store.tickets.get(out.ticket_ids[0])
    assert t.title == f"#{r.issue} Crash on \ufffd input \x1b[2J\x1b[31mred\x07"
    assert t.body == "steps\ufffdhere" and t.inputs["issue"] == "steps\ufffdhere"


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_r36_positive_control_a_nul_kept_fails_the_delivery_on_postgresql(reporting, monkeypatch):  # noqa: F811
    r = reporting
    r.github.permissions[r.payload["sender"]["login"]] = "write"
    monkeypatch.setattr(delivery, "_UNSTORABLE", re.compile("[\ud800-\udfff]"))     # the decoding before
    with pytest.raises(AfeError, match="redeliver it later"):
        await r.app.intake.deliver(str(uuid.uuid4()), "issues", _labeled(r.payload))
    assert r.store.tickets.list(limit=10) == []
