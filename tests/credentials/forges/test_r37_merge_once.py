"""R37: a merge the broker made but did not record (it was killed between
moving the base branch and writing the PR record) is not made again when the
scheduler repeats the call: the local forge writes the merge ahead of the ref
update and, on a repeat, finds it on the base branch. Positive control: the
same crash state without the write-ahead gives a second merge commit."""

from __future__ import annotations

import json

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config


def _merges(repo, base: str) -> list[str]:
    return git_plain("--git-dir", str(repo), "rev-list", "--merges", f"{base}..main").stdout.decode().split()


async def _merged_then_crashed(s, layout, origin, ticket: str, keep_write_ahead: bool):
    await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=ticket, workspace="local"))
    (layout.workspace(ticket) / "README.md").write_text(f"# {ticket}\n")
    await s.Commit(pb.CommitRequest(ticket_id=ticket, workspace="local", message="work"))
    head = (await s.Push(pb.PushRequest(ticket_id=ticket, workspace="local"))).sha
    pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id=ticket, workspace="local", title="Fix"))
    appr = pb.ApprovalRecord(principal="alice", sha=head, at_ms=1)
    first = await s.MergePullRequest(pb.MergePullRequestRequest(ticket_id=ticket, workspace="local",
                                                                number=pr.number, approval=appr))
    # The state a SIGKILL right after `update-ref` leaves: base moved, record still open.
    (path,) = [p for p in layout.forges_dir.glob("*/*.json") if json.loads(p.read_text())["number"] == int(pr.number)]
    rec = json.loads(path.read_text())
    for k in ("merge_sha", "merged_head", "merged_ms"):
        rec.pop(k)
    rec["state"] = "open"
    if keep_write_ahead:
        rec["merging"] = {"sha": head, "merge_sha": first.merge_sha}
    path.write_text(json.dumps(rec))
    again = await s.MergePullRequest(pb.MergePullRequestRequest(ticket_id=ticket, workspace="local",
                                                                number=pr.number, approval=appr))
    return first, again


async def test_r37_merge_repeated_after_a_crash_is_not_merged_twice(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    base = git_plain("--git-dir", str(local_origin), "rev-parse", "main").stdout.decode().strip()
    async with broker_stub(config, layout) as (s, _):
        first, again = await _merged_then_crashed(s, layout, local_origin, "m1", keep_write_ahead=True)
        state = await s.GetPullRequest(pb.GetPullRequestRequest(workspace="local", number="1"))
    assert again.merge_sha == first.merge_sha and state.state == "merged"
    assert _merges(local_origin, base) == [first.merge_sha]          # exactly one merge


async def test_r37_positive_control_without_the_write_ahead_the_repeat_merges_again(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    base = git_plain("--git-dir", str(local_origin), "rev-parse", "main").stdout.decode().strip()
    async with broker_stub(config, layout) as (s, _):
        first, again = await _merged_then_crashed(s, layout, local_origin, "m2", keep_write_ahead=False)
    assert again.merge_sha != first.merge_sha
    assert len(_merges(local_origin, base)) == 2                     # the double merge R37 forbids
