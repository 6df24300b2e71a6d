"""A remote's failure reaches the ticket as its real cause, at once: 401, 403,
404, a name that does not resolve and a corrupt object fail on the first
attempt with what to change (the token's variable named, never its value);
a 500 is tried again and the ticket goes on. "Fast" is counted in requests
the fake git server saw, not in seconds. The credential broker is the real
process (git, askpass, TLS to the fake server)."""

from __future__ import annotations

import subprocess

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import all_events, state_name, wait_for_state
from tests.support.credential_process import system_with_credential_process
from tests.support.fakes.git_http import make_bare_repo
from tests.support.remote_env import FILES, remote, write_config

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

WORKFLOW = """\
kind: Workflow
name: commit-only
nodes:
  - id: c
    uses: builtin:commit
"""

RAW = ("Stream removed", "Socket closed", "failed to connect to all addresses", "not answering", "Traceback")


def _corrupt_repo(root, name: str) -> None:
    """A bare repository whose `main` is a commit fsck rejects (author without an email)."""
    bare = make_bare_repo(root, name, FILES)

    def git(*args, stdin=None):
        return subprocess.run(["git", "--git-dir", str(bare), *args], input=stdin, capture_output=True,
                              text=True, check=True).stdout.strip()

    tree = git("rev-parse", "main^{tree}")
    bad = git("hash-object", "-t", "commit", "-w", "--literally", "--stdin",
              stdin=f"tree {tree}\nauthor no-email-here 0 +0000\ncommitter t <t@t> 0 +0000\n\nbad\n")
    git("update-ref", "refs/heads/main", bad)


# name -> (workspace repo, token env, HTTP failures to inject, expected state, texts the error must hold,
#          most requests for the repo the fake git server may see)
CASES = {
    "auth": ("auth.git", "WRONG_TOKEN", None, "failed",
             ["git fetch from https://127.0.0.1:", "/auth.git was refused: authentication failed (HTTP 401)",
              "check the token in WRONG_TOKEN"], 2),
    "forbidden": ("forbidden.git", "GIT_TOKEN", (403, 50), "failed",
                  ["/forbidden.git was refused: the token may not access it (HTTP 403)",
                   "check the token in GIT_TOKEN"], 1),
    "missing": ("missing.git", "GIT_TOKEN", None, "failed",
                ["/missing.git failed: repository not found (HTTP 404)", "check the Workspace's repo"], 2),
    "flaky": ("flaky.git", "GIT_TOKEN", (500, 1), "succeeded", [], 6),
    "corrupt": ("corrupt.git", "GIT_TOKEN", None, "failed",
                ["/corrupt.git failed: the remote sent a corrupt or invalid object", "missingEmail"], 4),
    "dns": ("https://afe-test-host.invalid/org/repo.git", "GIT_TOKEN", None, "failed",
            ["git fetch from https://afe-test-host.invalid/org/repo.git failed: the host name does not resolve",
             "check the Workspace's repo"], 0),
}


async def test_remote_errors_name_the_real_cause_and_fail_fast(short_tmp):
    async with remote(short_tmp) as r:
        for name in ("auth", "forbidden", "flaky"):
            make_bare_repo(r.root, f"{name}.git", FILES)
        _corrupt_repo(r.root, "corrupt.git")
        docs = [r.workspace(name, url=repo if repo.startswith("https://") else "", repo=repo, token_env=env)
                for name, (repo, env, *_rest) in CASES.items()]
        cfg = write_config(short_tmp, [*docs, WORKFLOW])
        layout = Layout(short_tmp / "data", short_tmp / "run")
        env = r.broker_env(WRONG_TOKEN="not-the-token-" + r.token[::-1])
        async with system_with_credential_process(cfg, layout, env) as (sys_, _broker):
            for name, (repo, _token_env, inject, want, texts, max_requests) in CASES.items():
                r.git.failures.clear()
                if inject:
                    r.git.fail_next(*inject)
                before = len(r.git.requests)
                t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="commit-only", workspace=name,
                                                                        title=name))
                t = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
                seen = [q for q in r.git.requests[before:] if q.path.startswith(f"/{repo}")]
                assert state_name(t) == want, (name, t.error)
                for text in texts:
                    assert text in t.error, (name, t.error)
                for raw in RAW:
                    assert raw not in t.error, (name, t.error)
                assert r.token not in t.error and env["WRONG_TOKEN"] not in t.error
                assert len(seen) <= max_requests, (name, [(q.method, q.path) for q in seen])
                events = await all_events(sys_.stub, t.id)
                assert not any(e.type in ("node.retry", "broker.retry") for e in events), name
                if name == "flaky":           # the 500 was seen and the fetch was made again
                    assert len(seen) >= 2 and seen[0].path.endswith("/info/refs?service=git-upload-pack")
                if name == "corrupt":         # one fetch: one authorized ref advertisement
                    assert sum(q.authorized and "/info/refs" in q.path for q in seen) == 1, \
                        [(q.method, q.path) for q in seen]
