"""Forges: the `local` forge (a bare repository on disk, real git merges) and
the `github` forge against a GitHub-REST-compatible local server. A merge
needs a person's approval of exactly the current head (R16); the token
reaches GitHub only in the Authorization header (R14)."""

from __future__ import annotations

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services.common.config.model import ForgeConfig, Workspace
from services.common.secrecy.redact import Redactor
from tests.credentials.conftest import TOKEN_ENV, broker_stub, git_plain, local_workspace, make_config
from tests.support.fakes.github import FakeGitHub

pytestmark = pytest.mark.timeout(120)


async def _error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value


def _sha(repo, ref: str) -> str:
    return git_plain("--git-dir", str(repo), "rev-parse", ref).stdout.decode().strip()


async def _work(s, layout, ticket: str, ws: str, files: dict[str, str]) -> pb.PushResponse:
    for rel, text in files.items():
        (layout.workspace(ticket) / rel).write_text(text)
    await s.Commit(pb.CommitRequest(ticket_id=ticket, workspace=ws, message=f"work on {ticket}"))
    return await s.Push(pb.PushRequest(ticket_id=ticket, workspace=ws))


def approval(sha: str) -> pb.ApprovalRecord:
    return pb.ApprovalRecord(principal="alice", sha=sha, at_ms=1)


async def test_r16_local_forge_merges_only_the_approved_head(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    base_before = _sha(local_origin, "refs/heads/main")
    async with broker_stub(config, layout) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="lf", workspace="local"))
        first = await _work(s, layout, "lf", "local", {"README.md": "# first\n"})
        pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="lf", workspace="local", title="Fix"))
        again = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="lf", workspace="local", title="Fix"))
        assert pr.number == again.number and pr.state == "open" and pr.head_sha == first.sha

        # No approval record: refused, nothing merged.
        err = await _error(s.MergePullRequest(pb.MergePullRequestRequest(ticket_id="lf", workspace="local",
                                                                          number=pr.number)))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "approv" in err.details()
        # The branch moves after the approval: the approved SHA is no longer the head.
        second = await _work(s, layout, "lf", "local", {"README.md": "# second\n"})
        err = await _error(s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id="lf", workspace="local", number=pr.number, approval=approval(first.sha))))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "changed after approval" in err.details()
        assert _sha(local_origin, "refs/heads/main") == base_before

        # Positive control: approving the current head merges, for real, once.
        merged = await s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id="lf", workspace="local", number=pr.number, approval=approval(second.sha)))
        twice = await s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id="lf", workspace="local", number=pr.number, approval=approval(second.sha)))
        state = await s.GetPullRequest(pb.GetPullRequestRequest(workspace="local", number=pr.number))
    assert merged.merged and not merged.already_merged
    assert twice.already_merged and not twice.merged and twice.merge_sha == merged.merge_sha
    assert state.state == "merged" and state.merge_sha == merged.merge_sha
    main = _sha(local_origin, "refs/heads/main")
    assert main == merged.merge_sha
    parents = git_plain("--git-dir", str(local_origin), "rev-list", "--parents", "-n1", main).stdout.split()
    assert [p.decode() for p in parents[1:]] == [base_before, second.sha]
    readme = git_plain("--git-dir", str(local_origin), "show", "main:README.md").stdout.decode()
    assert readme == "# second\n"


async def test_local_forge_refuses_conflicts_and_squashes(local_origin, layout, short_tmp):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin),
                         Workspace(name="squash", repo=str(local_origin),
                                   forge=ForgeConfig(type="local", merge_method="squash")))
    async with broker_stub(config, layout) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="c1", workspace="local"))
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="c2", workspace="local"))
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="sq", workspace="squash"))
        a = await _work(s, layout, "c1", "local", {"README.md": "# one way\n"})
        b = await _work(s, layout, "c2", "local", {"README.md": "# another way\n"})
        pa = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="c1", workspace="local"))
        pb_ = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="c2", workspace="local"))
        assert pa.number != pb_.number
        await s.MergePullRequest(pb.MergePullRequestRequest(ticket_id="c1", workspace="local", number=pa.number,
                                                            approval=approval(a.sha)))
        err = await _error(s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id="c2", workspace="local", number=pb_.number, approval=approval(b.sha))))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "conflicts" in err.details()

        c = await _work(s, layout, "sq", "squash", {"NEW.md": "new file\n"})
        pc = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="sq", workspace="squash"))
        m = await s.MergePullRequest(pb.MergePullRequestRequest(ticket_id="sq", workspace="squash",
                                                                number=pc.number, approval=approval(c.sha)))
        url = await s.CommentPullRequest(pb.CommentPullRequestRequest(workspace="squash", number=pc.number,
                                                                      body="looks good"))
    parents = git_plain("--git-dir", str(local_origin), "rev-list", "--parents", "-n1", m.merge_sha).stdout.split()
    assert len(parents) == 2  # the commit and one parent: squashed
    assert git_plain("--git-dir", str(local_origin), "show", "main:NEW.md").stdout == b"new file\n"
    assert git_plain("--git-dir", str(local_origin), "show", "main:README.md").stdout == b"# one way\n"
    assert url.url


def gh_workspace(fake: FakeGitHub, name: str = "gh", token_env: str = TOKEN_ENV) -> Workspace:
    return Workspace(name=name, repo="https://github.invalid/acme/widgets.git", token_env=token_env,
                     forge=ForgeConfig(type="github", repo="acme/widgets", base_url=fake.url, merge_method="squash"))


async def test_r14_r16_github_pull_request_flow(layout):
    token = "ghp_" + "Ab1" * 12
    async with FakeGitHub(token) as gh:
        config = make_config(layout.data_dir.parent, gh_workspace(gh))
        gh.branches["afe/gh1"] = "a" * 40
        async with broker_stub(config, layout, secrets_={TOKEN_ENV: token}) as (s, _):
            pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="gh1", workspace="gh", title="Fix it",
                                                                   body="details"))
            again = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="gh1", workspace="gh"))
            assert pr.number == again.number == "1" and len(gh.pulls) == 1
            assert pr.head_branch == "afe/gh1" and pr.base_branch == "main" and pr.head_sha == "a" * 40

            err = await _error(s.MergePullRequest(pb.MergePullRequestRequest(ticket_id="gh1", workspace="gh",
                                                                              number=pr.number)))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            gh.branches["afe/gh1"] = "b" * 40          # pushed again after the approval of a*40
            err = await _error(s.MergePullRequest(pb.MergePullRequestRequest(
                ticket_id="gh1", workspace="gh", number=pr.number, approval=approval("a" * 40))))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert gh.merges == [] and not any(x.method == "PUT" for x in gh.seen)

            merged = await s.MergePullRequest(pb.MergePullRequestRequest(
                ticket_id="gh1", workspace="gh", number=pr.number, approval=approval("b" * 40)))
            twice = await s.MergePullRequest(pb.MergePullRequestRequest(
                ticket_id="gh1", workspace="gh", number=pr.number, approval=approval("b" * 40)))
            got = await s.GetPullRequest(pb.GetPullRequestRequest(workspace="gh", number=pr.number))
            comment = await s.CommentPullRequest(pb.CommentPullRequestRequest(workspace="gh", number=pr.number,
                                                                              body="merged by afe"))
        assert merged.merged and twice.already_merged and twice.merge_sha == merged.merge_sha
        assert gh.merges == [{"number": 1, "method": "squash", "sha": "b" * 40}]
        assert got.state == "merged" and comment.url.endswith("#issuecomment-1")
        assert gh.comments == [{"number": 1, "body": "merged by afe"}]
        # R14: the token travelled only in the Authorization header, on every request.
        assert gh.seen and all(x.headers.get("Authorization") == f"Bearer {token}" for x in gh.seen)
        assert not gh.token_seen_outside(token, "Authorization")


@pytest.mark.parametrize("status,code", [
    (401, grpc.StatusCode.UNAUTHENTICATED),
    (403, grpc.StatusCode.PERMISSION_DENIED),
    (422, grpc.StatusCode.INVALID_ARGUMENT),
    (503, grpc.StatusCode.UNAVAILABLE),
])
async def test_r27_r30_github_errors_echoing_the_token_are_redacted(layout, status, code):
    token = "tok" + "Zx9" * 10       # not shaped like a known token: only registration can hide it
    async with FakeGitHub(token) as gh:
        config = make_config(layout.data_dir.parent, gh_workspace(gh))
        gh.fail_next(status, f'{{"message": "we got token {token} from you, Bearer {token}"}}', times=5)
        async with broker_stub(config, layout, secrets_={TOKEN_ENV: token}) as (s, _):
            err = await _error(s.GetPullRequest(pb.GetPullRequestRequest(workspace="gh", number="7")))
        assert err.code() == code, err.details()
        assert token not in err.details() and "[redacted]" in err.details()
        assert f"HTTP {status}" in err.details()
        # Positive control: the token is not secret-shaped; a redactor that was not
        # given it (patterns only) would have let it through.
        assert token in Redactor().redact(f"we got token {token}")


async def test_github_retries_5xx_and_rate_limits(layout):
    token = "ghp_" + "Qw2" * 12
    async with FakeGitHub(token) as gh:
        config = make_config(layout.data_dir.parent, gh_workspace(gh))
        gh.branches["afe/rt"] = "c" * 40
        gh.fail_next(502, "bad gateway")
        gh.fail_next(429, '{"message": "slow down"}', headers={"Retry-After": "0"})
        gh.fail_next(403, '{"message": "secondary rate limit"}', headers={"Retry-After": "0"})
        async with broker_stub(config, layout, secrets_={TOKEN_ENV: token}) as (s, _):
            pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="rt", workspace="gh"))
        assert pr.number == "1"
        assert [x.method for x in gh.seen][:4] == ["GET"] * 4


async def test_github_wrong_token_names_the_variable(layout):
    async with FakeGitHub("right-token-value-123") as gh:
        config = make_config(layout.data_dir.parent, gh_workspace(gh))
        async with broker_stub(config, layout, secrets_={TOKEN_ENV: "wrong-token-value-456"}) as (s, _):
            err = await _error(s.GetPullRequest(pb.GetPullRequestRequest(workspace="gh", number="1")))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and TOKEN_ENV in err.details()
            assert "wrong-token-value-456" not in err.details()
            err = await _error(s.GetPullRequest(pb.GetPullRequestRequest(workspace="gh", number="1; rm")))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_r3_r13_r15_push_pr_and_merge_happen_on_the_host_only(git_server, tls, git_token, layout):
    """The whole forge path through the broker: push over askpass, PR and merge over
    the REST API. The workspace the agent sees (its scratch .git included) never
    holds the token, a remote or a credential setting."""
    from tests.credentials.conftest import remote_workspace

    async with FakeGitHub(git_token) as gh:
        ws = remote_workspace(git_server, "gh-e2e")
        ws = Workspace(name=ws.name, repo=ws.repo, token_env=ws.token_env,
                       forge=ForgeConfig(type="github", repo="acme/widgets", base_url=gh.url))
        config = make_config(layout.data_dir.parent, ws)
        async with broker_stub(config, layout, secrets_={TOKEN_ENV: git_token}, ca_file=tls.cert_file) as (s, _):
            await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="e2e", workspace="gh-e2e"))
            pushed = await _work(s, layout, "e2e", "gh-e2e", {"README.md": "# e2e\n"})
            gh.branches[pushed.branch] = pushed.sha       # what GitHub would see after the push
            pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id="e2e", workspace="gh-e2e", title="E2E"))
            merged = await s.MergePullRequest(pb.MergePullRequestRequest(
                ticket_id="e2e", workspace="gh-e2e", number=pr.number, approval=approval(pushed.sha)))
    assert merged.merged and gh.merges[0]["sha"] == pushed.sha
    served = git_plain("--git-dir", str(git_server.root / "origin.git"), "rev-parse", "refs/heads/afe/e2e")
    assert served.stdout.decode().strip() == pushed.sha
    # Positive control: the token was really used, by git (Basic) and by the API (Bearer).
    assert git_server.token_in_authorization() and gh.seen[0].headers["Authorization"] == f"Bearer {git_token}"
    work = layout.workspace("e2e")
    for path in work.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert git_token.encode() not in path.read_bytes(), path
    scratch_config = (work / ".git" / "config").read_text()
    assert "[remote" not in scratch_config and "credential" not in scratch_config and "url" not in scratch_config
