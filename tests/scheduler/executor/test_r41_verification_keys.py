"""R41: what a stored verification is keyed by, in the executor's fast tier
(real engine and store, in-process broker fakes).

The base's own run of the verify commands is shared by the workspace's
tickets (one per base tip and configuration), but a verify command may carry
a ticket's values (`{{ticket.title}}`, a node's output) as `$1`: the base
run made with one ticket's values is no floor for another's. Here ticket A's
value selects one test, so its base run counts 1; ticket B's selects all
five, and B's head runs one (it deleted four tests outside `base_paths`).
Sharing A's base run would let B pass."""

from __future__ import annotations

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.scheduler.store.base import WAITING_APPROVAL

from .test_r41_verification import HEAD, Checkouts, Specs, workflow

BASE = "b" * 40
# (checked-out commit, the command's $1) -> the runner's summary
RUNS = {(BASE, "tests/unit"): "1 passed in 0.1s", (BASE, "tests"): "5 passed in 0.1s",
        (HEAD, "tests/unit"): "1 passed in 0.1s", (HEAD, "tests"): "1 passed in 0.1s"}


class ByValue(Specs):
    """A verification sandbox whose runner's summary depends on the commit and on `$1`."""

    async def exec(self, ticket_id, argv, timeout_ms=0, output_cap_bytes=0, cwd=""):  # type: ignore[no-untyped-def]
        if not ticket_id.endswith("-verify") or argv[:1] == ["true"]:
            async for ev in super().exec(ticket_id, argv, timeout_ms, output_cap_bytes, cwd):
                yield ev
            return
        self.started.append((ticket_id, argv[2]))
        yield spb.ExecEvent(stdout=(RUNS[(self.checkouts.checked_out, argv[4])] + "\n").encode())
        yield spb.ExecEvent(exit=spb.ExecExit(code=0))


def _harness(harness):
    h = harness(workflow('["python3 -m pytest -q {{ticket.title}}"]', "[tests/unit/]"))
    h.credentials = Checkouts()
    h.sandbox = ByValue(h.credentials)
    return h


async def test_r41_the_base_run_made_with_one_tickets_values_is_not_another_tickets_floor(harness):
    h = _harness(harness)
    await h.start()
    a = h.create("review", title="tests/unit")
    await h.until(a, (WAITING_APPROVAL,))
    va = h.events(a, "approval.requested")[0][1]["verification"]
    assert va["passed"] is True and va["base_tests"]["ran"] == 1            # control: A's values, A's floor
    b = h.create("review", title="tests")
    await h.until(b, (WAITING_APPROVAL,))
    vb = h.events(b, "approval.requested")[0][1]["verification"]
    assert vb["base_tests"]["ran"] == 5, vb
    assert vb["passed"] is False and any("fewer than the base's own run" in r for r in vb["reasons"])
    assert len(h.events(b, "verification.base")) == 1                        # B's values: a base run of its own


async def test_r41_the_base_run_is_shared_by_tickets_whose_commands_are_the_same(harness):
    """The control of the test above: the same values share one base run."""
    h = _harness(harness)
    await h.start()
    a = h.create("review", title="tests")
    await h.until(a, (WAITING_APPROVAL,))
    b = h.create("review", title="tests")
    await h.until(b, (WAITING_APPROVAL,))
    runs = len(h.events(a, "verification.base")) + len(h.events(b, "verification.base"))
    assert runs == 1

