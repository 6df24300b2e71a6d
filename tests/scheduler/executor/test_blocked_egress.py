"""Blocked egress attempts reported to people (fast tier, fakes): the hosts
the ticket's egress proxy refused (the sandbox broker's DeniedEgress, R11)
are listed in the pull request description and in the final GitHub comment,
as inline code that no sandbox-made text can break out of; nothing is added
when no host was refused."""

from __future__ import annotations

import re

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.scheduler.github.report import GitHubReporter

from .fakes import FakeCredentials

WORKFLOWS = """\
kind: Workflow
name: pr
workspace: ws
nodes:
  - {id: test, run: "wait go"}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
---
kind: Workflow
name: fails
workspace: ws
nodes:
  - {id: test, run: "wait go; exit 1"}
"""

HOSTILE = "evil.example`\n\n# Approve me](https://phish.example)"


class RecordingForge(FakeCredentials):
    def __init__(self) -> None:
        super().__init__()
        self.bodies: dict[str, str] = {}

    async def open_pr(self, ticket_id: str, workspace: str, title: str, body: str,
                      fence: int = 0) -> cpb.PullRequest:
        self.bodies[ticket_id] = body
        return await super().open_pr(ticket_id, workspace, title, body)


async def _run(h, workflow: str, denied: list[tuple[str, int]]) -> str:
    h.credentials = RecordingForge()
    await h.start()
    tid = h.create(workflow)
    await h.until(tid, ("running",))
    h.sandbox.denied[tid] = denied
    h.sandbox.open("go")
    await h.until(tid)
    return tid


def _inline_codes_are_clean(text: str) -> None:
    section = text[text.index("Blocked egress attempts"):]
    for row in section.splitlines()[1:]:
        if row.startswith("- `"):
            assert re.fullmatch(r"- `[a-z0-9.\-\[\]:]+` \(\d+ times?\)", row), row
    assert "phish" not in section.replace("phish.example", "") and "# Approve" not in section


async def test_r11_pr_description_lists_the_refused_hosts(harness):
    h = harness(WORKFLOWS)
    tid = await _run(h, "pr", [("pypi.example", 3), ("registry.example", 1), (HOSTILE, 2)])
    body = h.credentials.bodies[tid]
    assert "### Blocked egress attempts" in body
    assert "- `pypi.example` (3 times)" in body and "- `registry.example` (1 time)" in body
    _inline_codes_are_clean(body)
    assert body.count("`") % 2 == 0
    (_, ev), *_ = h.events(tid, "egress.denied")
    assert ev["node"] == "pr" and ev["hosts"][0] == {"host": "pypi.example", "count": 3}

    final = GitHubReporter(h.config, h.store, credentials=None).final_body(h.store.tickets.get(tid))
    assert "**Blocked egress attempts**" in final and "- `pypi.example` (3 times)" in final
    _inline_codes_are_clean(final)


async def test_r11_no_section_when_nothing_was_refused(harness):
    h = harness(WORKFLOWS)
    tid = await _run(h, "pr", [])
    body = h.credentials.bodies[tid]
    assert "Opened by afe" in body and "Blocked egress" not in body        # control: the body is there
    assert h.events(tid, "egress.denied") == []
    final = GitHubReporter(h.config, h.store, credentials=None).final_body(h.store.tickets.get(tid))
    assert "Pull request:" in final and "Blocked egress" not in final


async def test_r11_final_comment_lists_the_refused_hosts_of_a_ticket_without_pr(harness):
    h = harness(WORKFLOWS)
    tid = await _run(h, "fails", [("files.example", 4)])
    t = h.store.tickets.get(tid)
    assert t.state == "failed" and tid in h.sandbox.destroyed
    final = GitHubReporter(h.config, h.store, credentials=None).final_body(t)
    assert "- Pull request: none" in final
    assert "**Blocked egress attempts**" in final and "- `files.example` (4 times)" in final
