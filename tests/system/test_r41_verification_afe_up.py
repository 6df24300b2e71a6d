"""R41 through `afe up` (the launcher and its four real processes, real
Docker and git, the local forge) and the CLI: a scripted model weakens the
failing test; `afe ticket watch` stops at the approval and shows that the
clean-room verification (the base branch's tests/ on the head) failed, `afe
ticket show` lists it, `afe approve` is refused (exit 3) saying why, and the
repository's main is untouched."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.foundation.launcher_support import base_env, start_afe
from tests.scheduler.conftest import git
from tests.scheduler.executor.test_r41_clean_room_verification import CHEAT, TEST, UNITTEST, make_repo
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = """\
kind: Workspace
name: calc
repo: repos/calc.git
forge: {type: local}
sandbox: {image: afe/sandbox:latest}
---
kind: Model
name: cheater
provider: replay
script: cheat.yaml
---
kind: Workflow
name: cheat
workspace: calc
verify:
  run: ["%(unittest)s"]
  base_paths: [tests/]
nodes:
  - {id: fix, model: cheater, prompt: "Make the tests pass", tools: [write_file], max_turns: 3}
  - {id: test, run: "%(unittest)s", needs: [fix]}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""


def _main(bare: Path) -> str:
    return git(bare, "rev-parse", "main").strip()


def test_r41_afe_up_cli_shows_the_failed_verification_and_the_merge_is_refused():
    base = temp_root("afe-r41-up-")
    afe = None
    try:
        cfg = base / "cfg"
        cfg.mkdir(parents=True)
        make_repo(cfg / "repos" / "calc.git")
        (cfg / "afe.yaml").write_text(CONFIG % {"unittest": UNITTEST})
        (cfg / "cheat.yaml").write_text(CHEAT % ('"' + TEST.format(want=-1).replace("\n", "\\n") + '"'))
        before = _main(cfg / "repos" / "calc.git")
        afe = start_afe(base, base_env())
        afe.wait_up()
        def cli(*args: str) -> subprocess.CompletedProcess:
            return afe.cli(*args, timeout=180)

        p = cli("ticket", "create", "--workflow", "cheat", "--title", "add() subtracts")
        assert p.returncode == 0, p.stdout + p.stderr
        ticket = re.search(r"^created (\S+) ", p.stdout, re.MULTILINE).group(1)
        p = cli("ticket", "watch", ticket, "--until-waiting")
        assert p.returncode == 6, p.stdout + p.stderr
        shown = f"verification failed: `{UNITTEST}` exited 1 (tests/ from main)"
        assert re.search(r"test\s+succeeded", p.stdout), p.stdout        # the workspace's own run passed
        assert "verifying " in p.stdout and shown in p.stdout, p.stdout
        assert re.search(r"waiting for approval of [0-9a-f]{40} \(" + re.escape(shown) + r"\)", p.stdout), p.stdout
        p = cli("ticket", "show", ticket)
        assert p.returncode == 0 and shown in p.stdout and f"    {UNITTEST}: exit 1" in p.stdout, p.stdout
        p = cli("approve", ticket)                  # a failed head is not approvable: exit 3, saying why
        assert p.returncode == 3 and shown in p.stderr and "cannot be approved" in p.stderr, p.stdout + p.stderr
        p = cli("reject", ticket, "--reason", "the base's tests fail")
        assert p.returncode == 0, p.stdout + p.stderr
        p = cli("ticket", "watch", ticket)
        assert "ticket failed" in p.stdout
        assert _main(cfg / "repos" / "calc.git") == before                  # nothing merged
    finally:
        if afe is not None:
            afe.stop()
        remove_temp_root(base)
