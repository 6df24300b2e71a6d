"""R41: the merge is of the verified merge result: `MergePullRequest` with the
base tip the head was verified on merges only while the base branch is still
there (real broker, real git, the local forge), and answers ABORTED, naming
both tips, when the base moved — the scheduler then verifies again. Positive
control: the same moved base without the pin is merged, onto a tip nobody
verified."""

from __future__ import annotations

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config


async def _approved_pr(s, layout, ticket: str) -> tuple[str, str]:
    await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=ticket, workspace="local"))
    (layout.workspace(ticket) / f"{ticket}.txt").write_text(f"{ticket}\n")
    await s.Commit(pb.CommitRequest(ticket_id=ticket, workspace="local", message="work"))
    head = (await s.Push(pb.PushRequest(ticket_id=ticket, workspace="local"))).sha
    pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id=ticket, workspace="local", title="Fix"))
    return head, pr.number


def _move_base(origin, name: str) -> str:
    work = origin.parent / name
    git_plain("clone", "-q", str(origin), str(work))
    (work / "NEW.md").write_text("a maintainer's change\n")
    git_plain("add", "-A", cwd=work)
    git_plain("commit", "-qm", "moved", cwd=work)
    git_plain("push", "-q", "origin", "HEAD:main", cwd=work)
    return git_plain("rev-parse", "HEAD", cwd=work).stdout.decode().strip()


async def test_r41_a_merge_is_refused_when_the_base_moved_since_its_verification(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    verified = git_plain("--git-dir", str(local_origin), "rev-parse", "main").stdout.decode().strip()
    async with broker_stub(config, layout) as (s, _):
        head, number = await _approved_pr(s, layout, "m1")
        moved = _move_base(local_origin, "maintainer")
        appr = pb.ApprovalRecord(principal="alice", sha=head, at_ms=1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await s.MergePullRequest(pb.MergePullRequestRequest(
                ticket_id="m1", workspace="local", number=number, approval=appr, expected_base_sha=verified))
        assert refused.value.code() == grpc.StatusCode.ABORTED
        assert moved[:12] in refused.value.details() and verified[:12] in refused.value.details()
        assert git_plain("--git-dir", str(local_origin), "rev-parse", "main").stdout.decode().strip() == moved
        # verified again on the new tip: merged onto exactly it
        r = await s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id="m1", workspace="local", number=number, approval=appr, expected_base_sha=moved))
        assert r.merged
        parents = git_plain("--git-dir", str(local_origin), "rev-parse", r.merge_sha + "^1").stdout.decode()
        assert parents.strip() == moved


async def test_r41_positive_control_without_the_pin_a_moved_base_is_merged(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    verified = git_plain("--git-dir", str(local_origin), "rev-parse", "main").stdout.decode().strip()
    async with broker_stub(config, layout) as (s, _):
        head, number = await _approved_pr(s, layout, "m2")
        moved = _move_base(local_origin, "maintainer2")
        r = await s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id="m2", workspace="local", number=number,
            approval=pb.ApprovalRecord(principal="alice", sha=head, at_ms=1)))
        assert r.merged and moved != verified           # merged onto a tip the verification never saw
