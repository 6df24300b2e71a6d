"""Clone, fetch and push over a real smart-HTTP(S) server that demands the
token: the token goes only through GIT_ASKPASS into git's environment and the
Authorization header (R1, R2); bad inputs get clear, secret-free errors."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from tests.credentials.conftest import (
    TOKEN_ENV,
    WRONG_ENV,
    broker_stub,
    files_under,
    git_plain,
    local_workspace,
    make_config,
    remote_workspace,
)

pytestmark = pytest.mark.timeout(120)


class ProcWatch:
    """Polls /proc/*/cmdline and the files under `root` for `needle` until stopped."""

    def __init__(self, needle: str, root: Path) -> None:
        self.needle = needle.encode()
        self.root = root
        self.hits: list[str] = []
        self.git_seen = 0
        self.env_holders: set[bytes] = set()     # argv[0] of processes whose environment holds it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read()
                except OSError:
                    continue
                is_git = (cmd.startswith((b"git\0", b"git-remote")) or b"/git\0" in cmd) and b"http-backend" not in cmd
                if self.needle in cmd:
                    self.hits.append(f"cmdline of pid {pid}")
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if self.needle in f.read():
                            self.env_holders.add(cmd.split(b"\0")[0])
                            # git of this test (its token in the environment): another test's
                            # git, e.g. a parallel worker's, does not count as seen
                            self.git_seen += is_git
                except OSError:
                    pass
            for path in files_under(self.root) if self.root.exists() else []:
                try:
                    if path.is_file() and not path.is_symlink() and self.needle in path.read_bytes():
                        self.hits.append(str(path))
                except OSError:
                    continue

    def __enter__(self) -> ProcWatch:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _text(obj) -> str:
    return str(obj)


async def test_r1_r2_clone_and_push_only_through_askpass(git_server, tls, git_token, layout):
    ws = remote_workspace(git_server)
    config = make_config(layout.data_dir.parent, ws)
    git_server.delay_s = 0.2
    try:
        with ProcWatch(git_token, layout.data_dir) as watch:
            async with broker_stub(config, layout, secrets_={TOKEN_ENV: git_token}, ca_file=tls.cert_file) as (s, _):
                prep = await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="r1-push", workspace="remote"))
                work = layout.workspace("r1-push")
                (work / "README.md").write_text("# widgets, improved\n")
                commit = await s.Commit(pb.CommitRequest(ticket_id="r1-push", workspace="remote", message="improve"))
                pushed = await s.Push(pb.PushRequest(ticket_id="r1-push", workspace="remote"))
                diff = await s.Diff(pb.DiffRequest(ticket_id="r1-push", workspace="remote"))
    finally:
        git_server.delay_s = 0.0
    assert commit.changed and pushed.branch == "afe/r1-push" and pushed.sha == commit.sha
    served = git_plain("--git-dir", str(git_server.root / "origin.git"), "rev-parse", "refs/heads/afe/r1-push")
    assert served.stdout.decode().strip() == commit.sha
    assert "improved" in diff.diff
    # The poller really watched git run (so "no hit" means something).
    assert watch.git_seen > 0
    assert watch.hits == []
    # R1: the token is in the environment of git processes (and the askpass helper) only.
    assert watch.env_holders, "no git process was seen holding the token: the check would be vacuous"
    for argv0 in watch.env_holders:
        name = argv0.rsplit(b"/", 1)[-1]
        assert name in (b"git", b"git-remote-https", b"git-remote-http", b"sh", b"askpass.sh"), argv0
    # Nothing on disk holds the token, and no remote URL with credentials was written.
    for path in files_under(layout.data_dir):
        if path.is_file() and not path.is_symlink():
            assert git_token.encode() not in path.read_bytes(), path
    for text in (_text(prep), _text(commit), _text(pushed), diff.diff):
        assert git_token not in text
    # The server saw the token, and only in the Authorization header.
    assert git_server.token_in_authorization()
    assert not git_server.saw_token_outside_authorization()


async def test_r2_positive_control_poller_sees_a_token_in_argv(git_server, tls, git_token, short_tmp):
    """The same poller catches the token when a careless caller puts it in the URL."""
    git_server.delay_s = 0.2
    try:
        with ProcWatch(git_token, short_tmp / "none") as watch:
            url = git_server.url("origin.git").replace("https://", f"https://x:{git_token}@")
            git_plain("ls-remote", url, env={"GIT_SSL_CAINFO": str(tls.cert_file)})
    finally:
        git_server.delay_s = 0.0
    assert watch.hits


async def test_second_workspace_fetches_from_the_mirror_without_downloading(git_server, tls, git_token, layout):
    ws = remote_workspace(git_server)
    config = make_config(layout.data_dir.parent, ws)
    async with broker_stub(config, layout, secrets_={TOKEN_ENV: git_token}, ca_file=tls.cert_file) as (s, _):
        first = await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="m-one", workspace="remote"))
        mark = len(git_server.requests)
        second = await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="m-two", workspace="remote"))
        again = await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="m-two", workspace="remote"))
    assert first.base_sha == second.base_sha == again.base_sha
    later = git_server.requests[mark:]
    assert later, "the mirror is fetched on reuse"
    assert not any(b"command=fetch" in r.body or b"want " in r.body for r in later)
    assert (layout.workspace("m-two") / "src" / "app.py").read_text() == "print('hi')\n"
    assert layout.gitdir("m-two").exists()
    assert not str(layout.gitdir("m-two")).startswith(str(layout.workspace("m-two")))


async def test_release_removes_workspace_and_git_dir(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="rel", workspace="local"))
        assert layout.workspace("rel").is_dir() and layout.gitdir("rel").is_dir()
        await s.ReleaseWorkspace(pb.ReleaseWorkspaceRequest(ticket_id="rel", workspace="local"))
    assert not layout.workspace("rel").exists() and not layout.gitdir("rel").exists()


async def _error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value


async def test_bad_inputs_get_clear_errors_without_secrets(git_server, tls, git_token, layout, short_tmp, caplog,
                                                           closed_port):
    caplog.set_level("DEBUG")
    wrong = "wrong" + git_token[::-1]
    config = make_config(
        layout.data_dir.parent,
        remote_workspace(git_server, "wrong-token", token_env=WRONG_ENV),
        remote_workspace(git_server, "no-token", token_env=None),
        remote_workspace(git_server, "unset-token", token_env="AFE_TEST_NEVER_SET"),
        remote_workspace(git_server, "unknown-repo", repo="nope.git"),
        remote_workspace(git_server, "no-branch", base_branch="no-such-branch"),
        local_workspace(short_tmp / "missing.git", "missing-path"),
        remote_workspace(git_server, "unreachable").__class__(
            name="unreachable", repo=f"https://127.0.0.1:{closed_port}/x.git", token_env=TOKEN_ENV),
    )
    secrets_ = {TOKEN_ENV: git_token, WRONG_ENV: wrong}
    async with broker_stub(config, layout, secrets_=secrets_, ca_file=tls.cert_file) as (s, _):
        def prep(name: str, ticket: str = "bad"):
            return s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=ticket, workspace=name))

        cases = {
            "wrong-token": (grpc.StatusCode.UNAUTHENTICATED, WRONG_ENV),
            "no-token": (grpc.StatusCode.UNAUTHENTICATED, "tokenEnv"),
            "unset-token": (grpc.StatusCode.FAILED_PRECONDITION, "AFE_TEST_NEVER_SET"),
            "unknown-repo": (grpc.StatusCode.NOT_FOUND, "repo"),
            "no-branch": (grpc.StatusCode.NOT_FOUND, "no-such-branch"),
            "missing-path": (grpc.StatusCode.NOT_FOUND, "missing.git"),
            "unreachable": (grpc.StatusCode.UNAVAILABLE, "unreachable"),
            "not-in-manifests": (grpc.StatusCode.NOT_FOUND, "not-in-manifests"),
        }
        for name, (code, words) in cases.items():
            err = await _error(prep(name))
            assert err.code() == code, (name, err.code(), err.details())
            assert words in err.details(), (name, err.details())
            assert git_token not in err.details() and wrong not in err.details()
        err = await _error(prep("wrong-token", ticket="Bad/../id"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = await _error(s.Commit(pb.CommitRequest(ticket_id="never-prepared", workspace="no-token")))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "prepare" in err.details()
    # The broker's own log lines (git stderr included) hold neither token (R27).
    assert "the remote refused" in caplog.text or "failed" in caplog.text
    assert git_token not in caplog.text and wrong not in caplog.text
