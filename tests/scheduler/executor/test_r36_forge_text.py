"""R36 where a ticket's title becomes git and forge data (executor/nodes/
forge_text.py): `builtin:open_pr` of a ticket whose title holds a NUL, a
terminal escape, a bell and a line break (as an issue's title may, through
the API or on SQLite). The commit message and the pull request's title it
hands the credential broker hold no control character, and real git takes
the message as the broker gives it (`git commit-tree -F -`). Positive
control: the message as it was composed before, the title unchanged, is
refused by git ("a NUL byte in commit log message not allowed"): the
ticket failed at open_pr."""

from __future__ import annotations

import unicodedata

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.scheduler.store.base import SUCCEEDED
from tests.credentials.conftest import git_plain

from .fakes import FakeCredentials

WORKFLOW = """\
kind: Workflow
name: pr
workspace: ws
nodes:
  - {id: pr, uses: builtin:open_pr}
"""
TITLE = "#12 Crash on \x00 input \x1b[2J\x1b[31mred\x07\r\nsecond line"


class RecordingForge(FakeCredentials):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.opened: list[tuple[str, str]] = []

    async def commit(self, ticket_id: str, workspace: str, message: str, fence: int = 0) -> cpb.CommitResponse:
        self.messages.append(message)
        return await super().commit(ticket_id, workspace, message, fence)

    async def open_pr(self, ticket_id: str, workspace: str, title: str, body: str,
                      fence: int = 0) -> cpb.PullRequest:
        self.opened.append((title, body))
        return await super().open_pr(ticket_id, workspace, title, body)


def _commit_tree(repo, message: str):
    """What the credential broker runs for a commit (credentials/workspaces/host.py)."""
    tree = git_plain("--git-dir", str(repo), "write-tree").stdout.decode().strip()
    return git_plain("--git-dir", str(repo), "commit-tree", "-F", "-", tree, check=False,
                     stdin=(message.strip() + "\n").encode())


def _controls(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c) == "Cc" and c not in "\n\t"]


async def test_r36_a_title_with_control_characters_becomes_a_commit_git_takes(harness, tmp_path):
    h = harness(WORKFLOW)
    h.credentials = RecordingForge()
    await h.start()
    tid = h.create("pr", title=TITLE)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert h.store.tickets.get(tid).title == TITLE          # the ticket keeps its text, as data
    [message], [(title, body)] = h.credentials.messages, h.credentials.opened
    assert message == f"#12 Crash on  input [2J[31mred\nsecond line\n\nafe ticket {tid}"
    assert title == "#12 Crash on input [2J[31mred second line"
    assert _controls(message) == _controls(title) == _controls(body) == []
    repo = tmp_path / "repo.git"
    git_plain("init", "--bare", "--quiet", str(repo))
    taken = _commit_tree(repo, message)
    assert taken.returncode == 0, taken.stderr
    # Positive control: the message as builtins composed it before (the title unchanged).
    refused = _commit_tree(repo, f"{TITLE}\n\nafe ticket {tid}")
    assert refused.returncode != 0 and b"NUL byte in commit log message" in refused.stderr
