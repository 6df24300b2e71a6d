"""The `local` forge with a working (non-bare) repository as repo: the push,
pull request and merge work against its `.git`, and a merge into the
checked-out base branch moves the checkout's files too — but never over
uncommitted changes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services.common.errors import InvalidArgument
from services.common.host.gitrepo import git_dir
from tests.credentials.conftest import FILES, broker_stub, git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(120)


def working_repo(root: Path) -> Path:
    repo = root / "project"
    git_plain("init", "-q", "-b", "main", str(repo))
    for rel, text in FILES.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git_plain("add", "-A", cwd=repo)
    git_plain("commit", "-qm", "initial", cwd=repo)
    return repo


async def _work(s, layout, ticket: str, files: dict[str, str]) -> pb.PushResponse:
    for rel, text in files.items():
        (layout.workspace(ticket) / rel).write_text(text)
    await s.Commit(pb.CommitRequest(ticket_id=ticket, workspace="local", message=f"work on {ticket}"))
    return await s.Push(pb.PushRequest(ticket_id=ticket, workspace="local"))


async def test_working_repository_is_a_local_forge_and_merge_updates_its_checkout(short_tmp, layout):
    repo = working_repo(short_tmp)
    config = make_config(layout.data_dir.parent, local_workspace(repo))
    async with broker_stub(config, layout) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="w1", workspace="local"))
        pushed = await _work(s, layout, "w1", {"README.md": "# fixed\n"})
        pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="w1", workspace="local", title="Fix"))
        assert pr.state == "open" and pr.head_sha == pushed.sha

        # Uncommitted changes on the checked-out base branch: refused, nothing moved.
        (repo / "src" / "app.py").write_text("print('local edit')\n")
        approval = pb.ApprovalRecord(principal="alice", sha=pushed.sha, at_ms=1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.MergePullRequest(pb.MergePullRequestRequest(ticket_id="w1", workspace="local",
                                                                number=pr.number, approval=approval))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "uncommitted changes" in info.value.details() and "commit or stash" in info.value.details()
        assert (repo / "README.md").read_text() == "# widgets\n"

        git_plain("checkout", "-q", "--", "src/app.py", cwd=repo)
        merged = await s.MergePullRequest(pb.MergePullRequestRequest(ticket_id="w1", workspace="local",
                                                                     number=pr.number, approval=approval))
    assert merged.merged
    head = git_plain("rev-parse", "HEAD", cwd=repo).stdout.decode().strip()
    assert head == merged.merge_sha
    assert (repo / "README.md").read_text() == "# fixed\n"          # the checkout moved with the branch
    assert git_plain("status", "--porcelain", cwd=repo).stdout == b""


async def test_working_repository_on_another_branch_only_moves_the_ref(short_tmp, layout):
    repo = working_repo(short_tmp)
    git_plain("checkout", "-q", "-b", "mine", cwd=repo)
    (repo / "notes.txt").write_text("mine\n")    # untracked work on another branch is left alone
    config = make_config(layout.data_dir.parent, local_workspace(repo))
    async with broker_stub(config, layout) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="w2", workspace="local"))
        pushed = await _work(s, layout, "w2", {"README.md": "# other\n"})
        pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="w2", workspace="local", title="Fix"))
        merged = await s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id="w2", workspace="local", number=pr.number,
            approval=pb.ApprovalRecord(principal="alice", sha=pushed.sha, at_ms=1)))
    assert git_plain("rev-parse", "main", cwd=repo).stdout.decode().strip() == merged.merge_sha
    assert (repo / "README.md").read_text() == "# widgets\n" and (repo / "notes.txt").exists()


def test_git_dir_names_what_to_do_for_a_folder_that_is_not_a_repository(tmp_path):
    with pytest.raises(InvalidArgument, match="git init"):
        git_dir(tmp_path, "ws")
    wt = tmp_path / "wt"
    repo = working_repo(tmp_path)
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", str(wt)], check=True, capture_output=True)
    with pytest.raises(InvalidArgument, match="main repository"):
        git_dir(wt, "ws")
    assert git_dir(repo) == repo / ".git"
