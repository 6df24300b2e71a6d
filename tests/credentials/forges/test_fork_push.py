"""forge.pushRepo (issue 31, "CI without the repository's secrets"): the ticket's
branch goes to a fork and the pull request is opened from there, so the base
repository's CI runs it as a fork PR. Through the REAL credential broker: git
over TLS smart HTTP to a server holding the repository and its fork the way
GitHub serves them (https://host/owner/name.git), and the fake GitHub checked
against GitHub's REST description (@octokit/openapi). The control: without
pushRepo the same steps put the branch in the repository itself."""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services.common.config.model import ForgeConfig, Workspace
from tests.credentials.conftest import TOKEN_ENV, broker_stub, git_plain, make_config
from tests.support.fakes.git_http import GitHttpServer, make_bare_repo
from tests.support.fakes.github import FakeGitHub
from tests.support.fakes.openapi import OpenApi
from tests.support.fakes.tls import make_cert
from tests.support.npm import HAVE_NPM, node_modules
from tests.support.remote_env import LiveBranches

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
BASE, FORK = "acme/widgets", "afe-bot/widgets"
FILES = {"README.md": "# widgets\n", "src/app.py": "print('hi')\n"}


def _openapi() -> OpenApi | None:
    if not HAVE_NPM:
        return None
    octokit = node_modules(ROOT / "tests" / "github" / "npm", "@octokit/openapi/package.json") / "@octokit"
    return OpenApi(octokit / "openapi" / "generated" / "api.github.com.json")


def _ref(bare: Path, ref: str) -> str:
    res = git_plain("--git-dir", str(bare), "rev-parse", "--verify", "-q", ref, check=False)
    return res.stdout.decode().strip()


def _advance(bare: Path, branch: str, path: str, text: str) -> str:
    """A new commit on `branch` of the bare repository `bare` changing `path` (a person's push)."""
    blob = git_plain("--git-dir", str(bare), "hash-object", "-w", "--stdin", stdin=text.encode()).stdout.decode().strip()
    index = bare / "afe-test.index"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git_plain("--git-dir", str(bare), "read-tree", branch, env=env)
        git_plain("--git-dir", str(bare), "update-index", "--add", "--cacheinfo", f"100644,{blob},{path}", env=env)
        tree = git_plain("--git-dir", str(bare), "write-tree", env=env).stdout.decode().strip()
    finally:
        index.unlink(missing_ok=True)
    sha = git_plain("--git-dir", str(bare), "commit-tree", "-p", branch, "-m", f"change {path}",
                    tree).stdout.decode().strip()
    git_plain("--git-dir", str(bare), "update-ref", f"refs/heads/{branch}", sha)
    return sha


class Served:
    """The repository and its fork on a TLS git server, and a fake GitHub whose branches are theirs."""

    def __init__(self, root: Path, token: str) -> None:
        self.token = token
        self.cert = make_cert(root / "tls")
        served = root / "served"
        (served / "acme").mkdir(parents=True)
        (served / "afe-bot").mkdir()
        self.base = make_bare_repo(served / "acme", "widgets.git", FILES)
        self.fork = served / "afe-bot" / "widgets.git"
        subprocess.run(["git", "clone", "-q", "--bare", str(self.base), str(self.fork)], check=True,
                       env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"})
        self.git = GitHttpServer(served, token, self.cert.server_context()).start()
        self.github = FakeGitHub(token, repo=BASE, openapi=_openapi())
        self.github.branches = LiveBranches(self.base)
        self.github.forks = {FORK: LiveBranches(self.fork)}

    def workspace(self, push_repo: str = "") -> Workspace:
        return Workspace(name="gh", repo=self.git.url(f"{BASE}.git"), token_env=TOKEN_ENV,
                         forge=ForgeConfig(type="github", repo=BASE, base_url=self.github.url, push_repo=push_repo))

    def pr_requests(self) -> list[dict]:
        return [s.json() for s in self.github.seen if s.method == "POST" and s.path == f"/repos/{BASE}/pulls"]


@pytest.fixture
async def served(short_tmp):
    token = "tok" + "Fk7" * 10 + "Zq"
    s = Served(short_tmp / "remote", token)
    try:
        async with s.github:
            yield s
    finally:
        s.git.stop()


async def test_push_repo_pushes_to_the_fork_and_opens_the_pull_request_from_it(served, layout):
    gh, tid = served.github, "fork1"
    # A branch of the ticket's name in the repository itself (someone's): never the ticket's with a fork.
    _advance(served.base, "main", "README.md", "# widgets, base\n")
    git_plain("--git-dir", str(served.base), "branch", f"afe/{tid}", "main")
    stray = _ref(served.base, f"refs/heads/afe/{tid}")
    config = make_config(layout.data_dir.parent, served.workspace(FORK))
    async with broker_stub(config, layout, secrets_={TOKEN_ENV: served.token}, ca_file=served.cert.cert_file) as (s, _):
        prep = await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=tid, workspace="gh"))
        assert prep.base_sha == _ref(served.base, "refs/heads/main")
        (layout.workspace(tid) / "src" / "app.py").write_text("print('fixed')\n")
        c = await s.Commit(pb.CommitRequest(ticket_id=tid, workspace="gh", message="fix"))
        pushed = await s.Push(pb.PushRequest(ticket_id=tid, workspace="gh"))
        assert pushed.branch == f"afe/{tid}" and pushed.sha == c.sha

        # The branch is in the fork; the repository's own afe/<ticket> is untouched.
        assert _ref(served.fork, f"refs/heads/afe/{tid}") == c.sha
        assert _ref(served.base, f"refs/heads/afe/{tid}") == stray != c.sha

        # The pull request is the base repository's, from the fork's branch.
        pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id=tid, workspace="gh", title="Fix"))
        again = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id=tid, workspace="gh", title="Fix"))
        assert [r["head"] for r in served.pr_requests()] == [f"afe-bot:afe/{tid}"]
        assert pr.number == again.number == "1" and pr.head_branch == f"afe/{tid}" and pr.head_sha == c.sha
        assert gh.pulls[1]["head_repo"] == FORK
        searched = [parse_qs(x.query)["head"] for x in gh.seen if x.method == "GET" and x.path == f"/repos/{BASE}/pulls"]
        assert searched and all(h == [f"afe-bot:afe/{tid}"] for h in searched), searched

        # The base moves; update-branch merges it into the fork's branch and pushes there.
        base_tip = _advance(served.base, "main", "NEWS.md", "news\n")
        up = await s.UpdateBranch(pb.UpdateBranchRequest(ticket_id=tid, workspace="gh"))
        assert up.changed and not up.conflicts
        assert _ref(served.fork, f"refs/heads/afe/{tid}") == up.head_sha
        git_plain("--git-dir", str(served.fork), "merge-base", "--is-ancestor", base_tip, up.head_sha)
        assert _ref(served.base, f"refs/heads/afe/{tid}") == stray
        got = await s.GetPullRequest(pb.GetPullRequestRequest(workspace="gh", number=pr.number))
        assert got.head_sha == up.head_sha

        # A retry continues from the fork's branch (the mirror's afe/* are the fork's).
        await s.ReleaseWorkspace(pb.ReleaseWorkspaceRequest(ticket_id=tid, workspace="gh"))
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=tid, workspace="gh"))
        assert (layout.workspace(tid) / "src" / "app.py").read_text() == "print('fixed')\n"
        assert (layout.workspace(tid) / "NEWS.md").read_text() == "news\n"

        merged = await s.MergePullRequest(pb.MergePullRequestRequest(
            ticket_id=tid, workspace="gh", number=pr.number,
            approval=pb.ApprovalRecord(principal="alice", sha=up.head_sha, at_ms=1)))
    assert merged.merged and gh.merges == [{"number": 1, "method": "merge", "sha": up.head_sha}]
    assert gh.undocumented == [], gh.undocumented
    assert served.git.token_in_authorization() and not served.git.saw_token_outside_authorization()


async def test_push_repo_control_without_it_the_branch_lands_in_the_repository(served, layout):
    gh, tid = served.github, "fork0"
    config = make_config(layout.data_dir.parent, served.workspace())
    async with broker_stub(config, layout, secrets_={TOKEN_ENV: served.token}, ca_file=served.cert.cert_file) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=tid, workspace="gh"))
        (layout.workspace(tid) / "src" / "app.py").write_text("print('fixed')\n")
        c = await s.Commit(pb.CommitRequest(ticket_id=tid, workspace="gh", message="fix"))
        await s.Push(pb.PushRequest(ticket_id=tid, workspace="gh"))
        pr = await s.OpenPullRequest(pb.OpenPullRequestRequest(ticket_id=tid, workspace="gh", title="Fix"))
    assert _ref(served.base, f"refs/heads/afe/{tid}") == c.sha
    assert _ref(served.fork, f"refs/heads/afe/{tid}") == ""
    assert [r["head"] for r in served.pr_requests()] == [f"afe/{tid}"]
    assert pr.head_sha == c.sha and gh.pulls[1]["head_repo"] == BASE
    assert gh.undocumented == [], gh.undocumented


async def test_push_repo_missing_fork_names_the_field(served, layout):
    """A fork that does not exist (or the token cannot see): the error says which field to check."""
    config = make_config(layout.data_dir.parent, served.workspace("afe-bot/nothing-here"))
    async with broker_stub(config, layout, secrets_={TOKEN_ENV: served.token}, ca_file=served.cert.cert_file) as (s, _):
        import grpc

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="fork2", workspace="gh"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    assert "forge.pushRepo" in info.value.details() and "afe-bot/nothing-here" in info.value.details()
