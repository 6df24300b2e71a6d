"""Issue #24 on GitHub, end to end through `afe up` (the four real processes,
real Docker and git): the fake GitHub (tests/support/fakes/github.py, every
request checked against GitHub's OpenAPI description) whose branches are the
real refs of a repository and its fork served over TLS smart HTTP (the
credential broker trusts the test CA through AFE_CA_FILE), and a fake
OpenAI-compatible model. The Workspace pushes to the fork (`forge.pushRepo`,
docs/GITHUB.md): every head lands in the fork, never in the repository, and
the pull request is opened with `head: "<fork owner>:afe/<ticket>"`, so all
that follows reads a fork pull request.

GitHub's own webhook examples (`@octokit/webhooks-examples`), signed with the
webhook secret, reach the gateway's POST /hooks/github: an `issues.labeled`
starts the ticket through a Trigger; the model fixes the code, afe pushes
head H1 and opens the pull request; the clean-room verification (R41) is the
commit status `afe/verify` on H1 and the signed run record (R42) a comment on
the pull request. A failing `check_run` on H1 (its Actions job log holding the
token as bait) becomes a follow-up round (on_ci_failure): the model's next
prompt quotes the check and the log's tail, never the token; it pushes H2 to
the same pull request, which is verified and waits for a new approval; the
pull request says "round 1 of 2". A second failure of H1 is then stale and
starts nothing. `afe approve` merges exactly H2 (R16) and the run record's
comment, saved from the fake GitHub, verifies with `afe verify`, naming the
approver."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import docker
import pytest

from gateway.hooks import sign
from tests.foundation.launcher_support import base_env, start_afe, wait_gone
from tests.scheduler.conftest import git as git_in
from tests.support.fakes.git_http import CLEAN_ENV, GitHttpServer, make_bare_repo
from tests.support.fakes.github import FakeGitHub
from tests.support.fakes.models import FakeOpenAI
from tests.support.fakes.openapi import OpenApi
from tests.support.fakes.tls import make_cert
from tests.support.npm import HAVE_NPM, node_modules
from tests.support.remote_env import LiveBranches
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(not HAVE_NPM, reason="node and npm are not installed (GitHub's OpenAPI "
                                 "description and webhook examples come from npm)")]

ROOT = Path(__file__).resolve().parents[2]
NPM_DIR = ROOT / "tests" / "github" / "npm"
SECRET = "whsec-e2e-" + secrets.token_hex(12)
CALC = "def add(a, b):\n    return a - b\n"
TEST_CALC = ("import unittest\n\nfrom calc import add\n\n\nclass AddTest(unittest.TestCase):\n"
             "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
FIX = "def add(a, b):\n    return a + b\n"
FIX_CI = 'def add(a, b):\n    """The sum of a and b (CI asked for a docstring)."""\n    return a + b\n'
CI_LINE = "E   D103 Missing docstring in public function `add`"

CONFIG = """\
kind: Workspace
name: widgets
repo: {clone}
tokenEnv: GH_E2E_TOKEN
forge: {{type: github, repo: {repo}, baseUrl: '{api}', pushRepo: {fork}}}
sandbox: {{limits: {{cpus: 1, memory: 256m, pids: 128}}}}
---
kind: Model
name: coder
provider: openai
model: test-model
baseUrl: {model}
apiKeyEnv: GH_E2E_MODEL_KEY
---
kind: Workflow
name: fix
workspace: widgets
on_ci_failure: {{max: 2}}
verify: {{run: ["python3 -m unittest -q test_calc"], base_paths: [test_calc.py], timeout: 60}}
nodes:
  - {{id: fix, model: coder, prompt: "Fix: {{{{ticket.title}}}}", tools: [read_file, write_file]}}
  - {{id: pr, uses: builtin:open_pr, needs: [fix]}}
  - {{id: merge, uses: builtin:merge, needs: [pr]}}
---
kind: Trigger
name: issues
workspace: widgets
workflow: fix
when: {{labels: [{label}]}}
"""


class Loop:
    """An asyncio loop in a thread for the aiohttp fakes (this test is synchronous, like the CLI)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gh-e2e-fakes")
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _until(what: str, cond, timeout: float = 120):
    end = time.monotonic() + timeout
    while not (found := cond()):
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.3)
    return found


def _remove_sandboxes(instance: str) -> None:
    """A run stopped mid-ticket (a failed assertion) leaves its sandbox for a restart to resume: this
    test's own instance's containers only."""
    client = docker.from_env()
    try:
        for c in client.containers.list(all=True, filters={"label": f"afe.instance={instance}"}):
            c.remove(force=True)
    finally:
        client.close()


def test_issue_to_merge_on_github_with_a_failing_check_verification_and_run_record():
    octokit = node_modules(NPM_DIR, "@octokit/openapi/package.json") / "@octokit"
    index = json.loads((octokit / "webhooks-examples" / "api.github.com" / "index.json").read_text())
    examples = {e["name"]: e["examples"] for e in index}

    def example(event: str, action: str) -> dict:
        return copy.deepcopy(next(e for e in examples[event] if e.get("action") == action))

    labeled = example("issues", "labeled")
    repo, sender = labeled["repository"]["full_name"], labeled["sender"]["login"]
    token = "ghp_" + secrets.token_hex(18)
    key = "sk-e2e-" + secrets.token_hex(12)
    base = temp_root("afe-ghe2e-")
    loop = Loop()
    git = afe = None
    github = FakeGitHub(token, repo=repo, openapi=OpenApi(octokit / "openapi" / "generated" / "api.github.com.json"))
    model = FakeOpenAI(key)
    try:
        # The repository, served like GitHub serves it (https://host/owner/name.git), over TLS.
        cert = make_cert(base / "tls")
        served = base / "served"
        owner, name = repo.split("/")
        (served / owner).mkdir(parents=True)
        bare = make_bare_repo(served / owner, f"{name}.git", {"calc.py": CALC, "test_calc.py": TEST_CALC})
        fork, fork_bare = f"afe-bot/{name}", served / "afe-bot" / f"{name}.git"
        fork_bare.parent.mkdir()
        subprocess.run(["git", "clone", "-q", "--bare", "--", str(bare), str(fork_bare)], check=True, env=CLEAN_ENV)
        git = GitHttpServer(served, token, cert.server_context()).start()
        github.branches = LiveBranches(bare)
        github.forks = {fork: LiveBranches(fork_bare)}
        github.permissions[sender] = "write"
        loop.run(github.__aenter__())
        loop.run(model.__aenter__())
        model.reply_tool_call("write_file", {"path": "calc.py", "content": FIX}, "call_1")
        model.reply_text("Fixed add().")
        model.reply_tool_call("write_file", {"path": "calc.py", "content": FIX_CI}, "call_2")
        model.reply_text("Added the docstring CI asked for.")

        cfg = base / "cfg"
        cfg.mkdir()
        (cfg / "afe.yaml").write_text(CONFIG.format(clone=git.url(f"{repo}.git"), repo=repo, api=github.url, fork=fork,
                                                    model=model.url + "/v1", label=labeled["label"]["name"]))
        env = base_env(PYTHONPATH=str(ROOT), GH_E2E_TOKEN=token, GH_E2E_MODEL_KEY=key,
                       AFE_CA_FILE=str(cert.cert_file), AFE_GITHUB_WEBHOOK_SECRET=SECRET)
        started = time.monotonic()
        afe = start_afe(base, env)
        afe.wait_up(120)
        up = re.compile(r"^afe is up: open (\S+)", re.MULTILINE)
        url = _until("afe is up", lambda: (m := up.search(afe.text())) and m.group(1).rstrip("/"), 30)
        env["AFE_URL"] = url
        env["AFE_TOKEN"] = (afe.data / "ui-token").read_text().strip()

        def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
            p = subprocess.run([sys.executable, "-m", "services.cli.main", *args], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120, check=False)
            assert not ok or p.returncode == 0, p.stdout + p.stderr
            return p

        def deliver(event: str, payload: dict) -> dict:
            body = json.dumps(payload).encode()
            req = urllib.request.Request(url + "/hooks/github", data=body, method="POST", headers={
                "X-GitHub-Event": event, "X-GitHub-Delivery": str(uuid.uuid4()), "Content-Type": "application/json",
                "User-Agent": "GitHub-Hookshot/e2e", "X-Hub-Signature-256": sign(SECRET.encode(), body)})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 202, r.status
                return json.loads(r.read())

        def show() -> dict:
            return json.loads(cli("ticket", "show", ticket, "--json").stdout)

        def waiting_on_new_head(old: str):
            def cond():
                t = show()
                return t if t["state"] == "waiting_approval" and t["awaiting_sha"] not in ("", old) else None
            return cond

        def failing_check(sha: str) -> dict:
            e = example("check_run", "completed")
            e["repository"]["full_name"] = repo
            r = e["check_run"]
            r.update(head_sha=sha, name="lint", conclusion="failure", id=4242)
            r["output"].update(title="1 error", summary="calc.py: D103")
            for pr in r["pull_requests"]:
                pr["number"], pr["head"]["sha"] = number, sha
            return e

        # 1. The issue is labeled on GitHub: the Trigger's ticket runs, H1 is pushed and the PR opened.
        answer = deliver("issues", labeled)
        assert answer["outcome"] == "accepted", answer
        [ticket] = answer["tickets"]
        first = _until("the first approval", waiting_on_new_head(""), 150)
        h1, number = first["awaiting_sha"], int(first["pr"]["number"])
        assert github.pulls[number]["head"] == f"afe/{ticket}" and github.pulls[number]["head_repo"] == fork
        created = [x.json()["head"] for x in github.seen if x.method == "POST" and x.path == f"/repos/{repo}/pulls"]
        assert created == [f"afe-bot:afe/{ticket}"], created
        assert github.forks[fork].get(f"afe/{ticket}") == h1 and github.branches.get(f"afe/{ticket}") is None
        assert git_in(fork_bare, "show", f"{h1}:calc.py") == FIX
        up_to_h1 = time.monotonic() - started

        # 2. CI fails on H1; its Actions job log names the token (bait for the broker's redaction).
        github.check_runs.append({"id": 4242, "name": "lint", "head_sha": h1, "conclusion": "failure",
                                  "output": {"title": "1 error", "summary": "calc.py: D103", "text": None,
                                             "annotations_count": 0}})
        github.job_logs[4242] = "".join(f"step {i}\n" for i in range(300)) + f"auth {token}\n{CI_LINE}\n"
        answer = deliver("check_run", failing_check(h1))
        assert (answer["outcome"], answer["reason"], answer["tickets"]) == ("accepted", "followup", [ticket])
        second = _until("the approval of the CI round's head", waiting_on_new_head(h1), 150)
        h2 = second["awaiting_sha"]
        assert int(second["pr"]["number"]) == number and github.forks[fork].get(f"afe/{ticket}") == h2
        assert len(github.pulls) == 1 and github.branches.get(f"afe/{ticket}") is None
        git_in(fork_bare, "merge-base", "--is-ancestor", h1, h2)

        # The model's prompt of the re-run quotes the failing check and its log's tail, not the token.
        prompts = [s.json() for s in model.seen]
        assert len(prompts) == 4, [p["messages"][-1]["role"] for p in prompts]
        user = next(m["content"] for m in prompts[2]["messages"] if m["role"] == "user")
        quoted = user[user.index("<<<QUOTED"):]
        for want in (f"CI failed on commit {h1}", "Check lint (check_run by github-actions): failure",
                     "Summary: calc.py: D103", CI_LINE, "step 299"):
            assert want in quoted, (want, user)
        assert "<<<END" in quoted[quoted.index(CI_LINE):]
        assert all(token not in json.dumps(p) for p in prompts)
        assert github.downloads and all(d["authorization"] == "" for d in github.downloads)
        ci_comments = [c["body"] for c in github.comments if c["number"] == number and "CI failed on" in c["body"]]
        assert len(ci_comments) == 1 and f"CI failed on `{h1[:12]}`: `lint`; afe is on it, round 1 of 2" \
            in ci_comments[0]

        # 3. The same failure of H1 delivered again after H2 exists: a stale head, nothing starts.
        answer = deliver("check_run", failing_check(h1))
        assert (answer["outcome"], answer["reason"]) == ("ignored", "stale_head"), answer
        time.sleep(1)
        assert show()["awaiting_sha"] == h2 and len(model.seen) == 4

        # 4. Verification (R41): afe/verify passed on both heads, on GitHub.
        verify = {s["sha"]: s for s in github.statuses if s["context"] == "afe/verify"}
        assert {h1, h2} <= set(verify), github.statuses
        assert verify[h1]["state"] == verify[h2]["state"] == "success", verify

        # 5. Approve: the merge endpoint gets exactly the approved head (R16).
        cli("approve", ticket)
        _until("the merge", lambda: show()["state"] == "succeeded", 90)
        assert [(m["number"], m["sha"]) for m in github.merges] == [(number, h2)]
        assert show()["pr"]["state"] == "merged"

        # 6. The run record (R42): the PR comment of H2, saved from GitHub, verifies and names the approver.
        records = [c["body"] for c in github.comments if c["number"] == number and "afe-run-record" in c["body"]]
        assert [sum(h in b for b in records) for h in (h1, h2)] == [1, 1], records     # one comment per head
        h2_record = next(b for b in records if h2 in b)
        saved = base / "record.md"
        saved.write_text(h2_record)
        v = cli("verify", str(saved), "--sha", h2)
        assert f"record of commit {h2}" in v.stdout and "verification: passed" in v.stdout, v.stdout
        assert f'decision: approved by "cli" of {h2}' in v.stdout, v.stdout
        other = cli("verify", str(saved), "--sha", h1, ok=False)              # not a record of H1
        assert other.returncode != 0 and "FAILED" in other.stderr, other.stdout + other.stderr
        v = cli("verify", github.url + f"/{repo}/pull/{number}")
        assert f'approved by "cli" of {h2}' in v.stdout, v.stdout
        took = time.monotonic() - started
        print(f"afe up to H1 waiting: {up_to_h1:.1f} s; whole run: {took:.1f} s")
        assert github.undocumented == [], github.undocumented
        seen_by_github = json.dumps([github.comments, github.statuses, github.pulls])
        assert token not in seen_by_github and key not in seen_by_github
    finally:
        if afe is not None:
            pids = list(afe.pids().values())
            afe.stop(30)
            wait_gone(pids, 15)
            _remove_sandboxes(afe.proc.args[afe.proc.args.index("--instance") + 1])
        with contextlib.suppress(Exception):
            loop.run(model.__aexit__(None, None, None))
        with contextlib.suppress(Exception):
            loop.run(github.__aexit__(None, None, None))
        loop.close()
        if git is not None:
            git.stop()
        remove_temp_root(base)
