"""Recovery and records through real processes: the demo with a workflow
whose test node fails on its first run, then `afe ticket retry` and
`afe ticket followup` as CLI subprocesses against the real gateway and
scheduler processes, real brokers, Docker and git. The retry succeeds on the
same branch and opens the pull request; the follow-up pushes a new commit to
that pull request and asks for a new approval; once merged and the workspace
is gone, `afe ticket show --diff` still shows the diff, the test output, the
pull request's page URL and the usage."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import tickets as cli
from services.common import demo
from services.common.layout import Layout
from services.common.secrecy.tokenfile import write_token_file

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]

# The demo's workflow, but its test step fails on purpose the first time it runs in a ticket
# (.afe-runs, kept with the workspace between runs, counts them; each run changes it, so every
# run of the ticket has something new to commit).
RETRY_WORKFLOW = """
---
kind: Workflow
name: demo-retry
workspace: demo
nodes:
  - id: fix
    model: demo-model
    prompt: "Fix the failing test. Ticket: {{ticket.title}}"
    tools: [read_file, write_file, list_dir, run]
    max_turns: 8
  - id: test
    run: >-
      n=$(cat .afe-runs 2>/dev/null || echo 0); echo $((n + 1)) > .afe-runs;
      if [ "$n" = 0 ]; then echo FIRST-RUN-FAILS-ON-PURPOSE; exit 1; fi;
      python3 -m unittest -v
    needs: [fix]
    timeout: 120
  - {id: pr, uses: builtin:open_pr, needs: [test]}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""


def _afe(gw_url: str, layout: Layout, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("AFE_TOKEN", "AFE_URL")}
    env["AFE_URL"] = gw_url
    argv = [sys.executable, "-m", "services.cli.main", *args, "--data", str(layout.data_dir)]
    return subprocess.run(argv, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


async def test_retry_then_followup_through_the_cli_same_branch_and_pr_records_kept(tmp_path):
    from tests.gateway.conftest import start_gateway
    from tests.support.system import afe_system

    cfg = demo.materialize(tmp_path / "cfg")
    text = (cfg / "afe.yaml").read_text()
    (cfg / "afe.yaml").write_text(re.sub(r"\n  pool: 1[^\n]*", "", text) + RETRY_WORKFLOW)   # no warm sandbox
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    write_token_file(layout.token_file)
    async with afe_system(cfg, layout, subprocess=True) as system:
        gw = await asyncio.to_thread(start_gateway, layout, system.gateway_secret, config_dir=cfg)
        try:
            async def afe(*args: str) -> subprocess.CompletedProcess:
                return await asyncio.to_thread(_afe, gw.url, layout, *args)

            async def show(tid: str) -> dict:
                p = await afe("ticket", "show", tid, "--json")
                assert p.returncode == cli.EXIT_OK, p.stderr
                return json.loads(p.stdout)

            made = await afe("ticket", "create", "--workflow", "demo-retry", "--workspace", "demo",
                             "--title", "Fix add()", "--json")
            assert made.returncode == cli.EXIT_OK, made.stderr
            tid = json.loads(made.stdout)["id"]
            ended = await afe("ticket", "watch", tid)
            assert ended.returncode == cli.EXIT_FAILED, ended.stdout + ended.stderr
            failed = await afe("ticket", "show", tid, "--diff")
            assert "FIRST-RUN-FAILS-ON-PURPOSE" in failed.stdout, failed.stdout      # the test's output, kept
            assert "+    return a + b" in failed.stdout and "afe ticket retry" in failed.stdout
            assert re.search(r"usage: [1-9][0-9]* model tokens", failed.stdout), failed.stdout

            retried = await afe("ticket", "retry", tid)
            assert retried.returncode == cli.EXIT_OK, retried.stderr
            waited = await afe("ticket", "watch", tid, "--until-waiting")
            assert waited.returncode == cli.EXIT_WAITING, waited.stdout + waited.stderr
            first = await show(tid)
            pr = first["pr"]
            assert pr["head_branch"] == f"afe/{tid}" and pr["state"] == "open"
            # The local forge's reference becomes the gateway's page for it.
            assert pr["ref"] == f"local:demo/pulls/{pr['number']}"
            assert pr["url"] == f"{gw.url}/pulls/demo/{pr['number']}"
            assert [n["attempt"] for n in first["nodes"] if n["id"] == "fix"] == [1]   # fix kept its result

            followed = await afe("ticket", "followup", tid, "Also keep the tests green")
            assert followed.returncode == cli.EXIT_OK, followed.stderr
            waited = await afe("ticket", "watch", tid, "--until-waiting")
            assert waited.returncode == cli.EXIT_WAITING, waited.stdout + waited.stderr
            second = await show(tid)
            assert second["pr"]["number"] == pr["number"] and second["pr"]["head_branch"] == pr["head_branch"]
            assert second["awaiting_sha"] and second["awaiting_sha"] != first["awaiting_sha"]   # a new commit
            stale = await afe("approve", tid, "--sha", first["awaiting_sha"])
            assert stale.returncode == cli.EXIT_REFUSED, stale.stdout + stale.stderr   # a new approval is needed
            ok = await afe("approve", tid, "--sha", second["awaiting_sha"])
            assert ok.returncode == cli.EXIT_OK, ok.stderr
            done = await afe("ticket", "watch", tid)
            assert done.returncode == cli.EXIT_OK, done.stdout + done.stderr

            final = await show(tid)
            assert final["state"] == "succeeded" and final["pr"]["state"] == "merged"
            assert not layout.workspace(tid).exists()                 # the workspace is gone
            shown = await afe("ticket", "show", tid, "--diff")
            out = shown.stdout
            assert "+    return a + b" in out and "(the diff stored when the ticket ended)" in out, out
            assert "test output of test (succeeded)" in out and "OK" in out
            assert f"{gw.url}/pulls/demo/{pr['number']}" in out and "usage: " in out
        finally:
            await asyncio.to_thread(gw.stop)
