"""docs/GUIDE.md, "Start: `afe init`", followed literally: the commands of the
walkthrough are read from the guide (and must be exactly the ones run here),
the Model is the guide's `afe.d/model.yaml` block with only its `baseUrl`
pointed at a local fake OpenAI-compatible server, and the workflow is what
`afe init` wrote (the guide's workflow block must match it).

From `git clone` of a small Python project whose `add()` subtracts: `afe init`,
`afe images build`, `afe check`, `afe up` (the four real processes, real
Docker and git), `afe ticket create`. The fake model first writes a wrong fix;
the test node fails and `on_failure` gives its output back to the model, quoted;
the second fix passes, the pull request waits for approval; a follow-up reaches
the model quoted and adds a second commit to the same pull request, which needs a
new approval; `afe approve` merges it into the user's working repository (its
checkout fast-forwarded). Afterwards `afe ticket show --diff --json` still has
the diff, the test output, the usage and the pull request's URL."""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import docker
import pytest

from tests.foundation.launcher_support import base_env, wait_gone
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "GUIDE.md"

# The walkthrough's commands, in order, exactly as the guide writes them (comments removed).
STEPS = [
    "git clone https://git.example.org/you/myproject.git ~/src/myproject",
    "cd ~/src/myproject",
    "afe init",
    "export OPENAI_API_KEY=sk-...",
    "afe images build",
    "afe check",
    "afe up",
    'afe ticket create --workflow fix --title "add() returns a - b" --body "test_calc.py fails"',
    "afe ticket watch ID --until-waiting",
    "afe ticket show ID --diff",
    'afe ticket followup ID "Also give add() a docstring"',
    "afe ticket watch ID --until-waiting",
    "afe approve ID",
    "afe ticket watch ID",
    "git log --oneline -3",
]

CALC = "def add(a, b):\n    return a - b\n"
TEST_CALC = ("import unittest\n\nfrom calc import add\n\n\n"
             "class AddTest(unittest.TestCase):\n"
             "    def test_add(self):\n"
             "        self.assertEqual(add(2, 3), 5)\n\n\n"
             "if __name__ == '__main__':\n    unittest.main()\n")
WRONG_FIX = "def add(a, b):\n    return abs(a - b)\n"           # add(2, 3) == 1: the test fails
RIGHT_FIX = "def add(a, b):\n    return a + b\n"
DOC_FIX = 'def add(a, b):\n    """The sum of a and b."""\n    return a + b\n'
FEEDBACK_HEAD = "A later step failed after your previous attempt; fix the cause."
FOLLOWUP_HEAD = "Follow-up: this ticket ran before"


def _section() -> str:
    text = GUIDE.read_text()
    return text[text.index("## Start: `afe init`"):text.index("`afe init [PATH]` writes, and never overwrites:")]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.DOTALL)


def _commands(section: str) -> list[str]:
    out = []
    for block in _blocks(section, "sh"):
        for line in block.splitlines():
            line = re.split(r"\s{2,}#", line)[0].strip()
            if line:
                out.append(line)
    return out


class FakeModel:
    """An OpenAI-compatible Chat Completions server with tool calls: on the
    ticket's first prompt it writes WRONG_FIX, on a prompt with a quoted test
    failure RIGHT_FIX, on a follow-up DOC_FIX; after a tool result it answers."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.requests: list[dict] = []   # {"phase", "body"}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if self.path != "/v1/chat/completions" or self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self._send(401, {"error": {"message": "Incorrect API key provided"}})
                    return
                self._send(200, fake.answer(body))

            def _send(self, status: int, doc: dict) -> None:
                raw = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> dict:
        msgs = body["messages"]
        user = next(m["content"] for m in msgs if m["role"] == "user")
        phase = "followup" if FOLLOWUP_HEAD in user else "feedback" if FEEDBACK_HEAD in user else "first"
        self.requests.append({"phase": phase, "body": body})
        usage = {"prompt_tokens": 300, "completion_tokens": 40}
        if msgs[-1]["role"] == "tool":
            message = {"role": "assistant", "content": f"Done ({phase})."}
            reason = "stop"
        else:
            content = {"first": WRONG_FIX, "feedback": RIGHT_FIX, "followup": DOC_FIX}[phase]
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{len(self.requests)}", "type": "function",
                "function": {"name": "write_file", "arguments": json.dumps({"path": "calc.py", "content": content})}}]}
            reason = "tool_calls"
        return {"id": "chatcmpl-guide", "object": "chat.completion", "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": reason}], "usage": usage}

    def prompts(self, phase: str) -> list[str]:
        return [next(m["content"] for m in r["body"]["messages"] if m["role"] == "user")
                for r in self.requests if r["phase"] == phase]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _git(*args: str, cwd: Path) -> str:
    env = {**base_env(), "GIT_AUTHOR_NAME": "You", "GIT_AUTHOR_EMAIL": "you@example.org",
           "GIT_COMMITTER_NAME": "You", "GIT_COMMITTER_EMAIL": "you@example.org", "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def test_guide_walkthrough_clone_to_merged_fix_with_feedback_and_followup():
    section = _section()
    assert _commands(section) == STEPS, "the guide's walkthrough changed: update STEPS and this test"
    [model_yaml] = [b for b in _blocks(section, "yaml") if b.startswith("# afe.d/model.yaml\n")]
    [workflow_yaml] = [b for b in _blocks(section, "yaml") if b.startswith("# afe.d/workflow.yaml\n")]
    assert "baseUrl: http://localhost:8000/v1\n" in model_yaml and "apiKeyEnv: OPENAI_API_KEY\n" in model_yaml

    base = temp_root("afe-guide-")
    name = f"myproject-{secrets.token_hex(3)}"
    key = "sk-guide-" + secrets.token_hex(12)
    model = FakeModel(key)
    image = f"afe/project-{name}:latest"
    up = None
    try:
        # Your project somewhere to clone from: calc.py with the bug, and its unittest.
        seed = base / "seed"
        seed.mkdir()
        _git("init", "-q", "-b", "main", cwd=seed)
        (seed / "calc.py").write_text(CALC)
        (seed / "test_calc.py").write_text(TEST_CALC)
        _git("add", ".", cwd=seed)
        _git("commit", "-qm", "calc", cwd=seed)
        upstream = base / "myproject.git"
        _git("clone", "-q", "--bare", str(seed), str(upstream), cwd=base)

        env = {**base_env(), "PYTHONPATH": str(ROOT)}
        ticket = ""

        def line(text: str) -> list[str]:
            assert text in STEPS, text
            return [ticket if w == "ID" else w for w in shlex.split(text)]

        def afe(text: str, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
            argv = [sys.executable, "-m", "services.cli.main", *line(text)[1:], *extra]
            return subprocess.run(argv, check=False, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)

        # 1. git clone (the guide's URL and folder are placeholders), cd, afe init.
        _, _, _url, _dir = line(STEPS[0])
        repo = base / "src" / name
        _git("clone", "-q", str(upstream), str(repo), cwd=base)
        assert line(STEPS[1]) == ["cd", _dir]
        p = afe("afe init")
        assert p.returncode == 0, p.stderr
        # The workflow afe init wrote is the guide's (its "..." stands for the prompt).
        written = (repo / "afe.d" / "workflow.yaml").read_text()
        at = 0
        for wl in workflow_yaml.splitlines()[1:]:
            if wl.strip() == "...":
                continue
            at = written.index(wl + "\n", at)
        # 2. The guide's model.yaml, with only baseUrl changed to this test's server.
        (repo / "afe.d" / "model.yaml").write_text(
            model_yaml.replace("http://localhost:8000/v1", model.url))
        # 3. The key in the variable the guide names; images; check; afe up.
        assert line(STEPS[3])[1].startswith("OPENAI_API_KEY=")
        env["OPENAI_API_KEY"] = key
        p = afe("afe images build", timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        p = afe("afe check")
        assert p.returncode == 0, p.stdout + p.stderr
        # afe up as the guide says, plus a free port, ops ports and an instance id of this test's own.
        up = subprocess.Popen([sys.executable, "-m", "services.cli.main", *line("afe up")[1:], "--listen",
                               "127.0.0.1:0", "--ops-port", "0", "--instance", f"guide-{secrets.token_hex(3)}"],
                              cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
        up_out: list[str] = []

        def pump() -> None:
            for raw in iter(up.stdout.readline, b""):
                up_out.append(raw.decode("utf-8", "replace"))

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 120
        while not (m := re.search(r"^afe is up: open (\S+)", "".join(up_out), re.MULTILINE)):
            assert up.poll() is None and time.monotonic() < deadline, "".join(up_out)[-4000:]
            time.sleep(0.2)
        gw_url = m.group(1).rstrip("/")
        env["AFE_URL"] = gw_url

        # 4. The ticket: a wrong fix, the failed test fed back, the right fix, the pull request.
        p = afe(STEPS[7])
        assert p.returncode == 0, p.stderr
        ticket = re.search(r"^created (\S+) ", p.stdout, re.MULTILINE).group(1)
        p = afe("afe ticket watch ID --until-waiting")
        assert p.returncode == 6, p.stdout + p.stderr
        assert "test             failed; round 1 of 2: its output goes back to fix" in p.stdout, p.stdout
        [first] = model.prompts("first")[:1]
        assert "Title: add() returns a - b" in first and FEEDBACK_HEAD not in first
        feedback = model.prompts("feedback")
        assert feedback, [r["phase"] for r in model.requests]
        quoted = feedback[0].split(FEEDBACK_HEAD, 1)[1]
        assert "<<<QUOTED " in quoted and "the command exited with code 1" in quoted
        assert "AssertionError: 1 != 5" in quoted       # the wrong fix's failing test, quoted to the model
        shown = afe("afe ticket show ID --diff")
        assert shown.returncode == 0, shown.stderr
        assert "+    return a + b" in shown.stdout and f"{gw_url}/pulls/{name}/" in shown.stdout, shown.stdout
        before = json.loads(afe("afe ticket show ID --diff", "--json").stdout)
        pr = before["pr"]

        # 5. A follow-up: quoted to the model, a second commit on the same pull request.
        p = afe(STEPS[10])
        assert p.returncode == 0, p.stdout + p.stderr
        p = afe("afe ticket watch ID --until-waiting")
        assert p.returncode == 6, p.stdout + p.stderr
        [follow, *_] = model.prompts("followup")
        assert "<<<QUOTED " in follow and "\nAlso give add() a docstring\n<<<END " in follow
        assert FEEDBACK_HEAD not in follow                # the earlier round's failure is not given again
        after = json.loads(afe("afe ticket show ID --diff", "--json").stdout)
        assert after["pr"]["number"] == pr["number"] and after["pr"]["head_branch"] == f"afe/{ticket}"
        assert after["awaiting_sha"] and after["awaiting_sha"] != before["awaiting_sha"]
        _git("merge-base", "--is-ancestor", before["awaiting_sha"], after["awaiting_sha"], cwd=repo)
        stale = afe("afe approve ID", "--sha", before["awaiting_sha"])
        assert stale.returncode == 3, stale.stdout + stale.stderr   # the approval is asked again

        # 6. Approve and merge into the working repository.
        p = afe("afe approve ID")
        assert p.returncode == 0, p.stdout + p.stderr
        p = afe("afe ticket watch ID")
        assert p.returncode == 0, p.stdout + p.stderr
        log = _git(*line(STEPS[14])[1:], cwd=repo)
        assert len(log.splitlines()) == 3, log
        assert (repo / "calc.py").read_text() == DOC_FIX            # the checkout was fast-forwarded
        _git("merge-base", "--is-ancestor", after["awaiting_sha"], "HEAD", cwd=repo)   # what was approved

        # Records kept after the ticket ended, its workspace gone.
        assert not (repo / ".afe" / "data" / "workspaces" / ticket).exists()
        final = json.loads(afe("afe ticket show ID --diff", "--json").stdout)
        assert final["state"] == "succeeded" and final["pr"]["state"] == "merged"
        assert final["pr"]["url"] == f"{gw_url}/pulls/{name}/{pr['number']}"
        assert final["diff"]["recorded"] and '+    """The sum of a and b."""' in final["diff"]["diff"]
        assert final["usage"]["tokens"] > 0
        assert final["cost"]["ticket"]["input_tokens"] >= 300 and final["cost"]["ticket"]["cost_usd"] > 0
        test_node = next(n for n in final["nodes"] if n["id"] == "test")
        assert "OK" in test_node["output"]

        # The signed run records (R42, the guide's "The run record"): both heads asked for, and the decision.
        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "services.cli.main", *args], check=False, cwd=repo,
                                  env=env, capture_output=True, text=True, timeout=60)

        keys = cli("keys")
        assert keys.returncode == 0 and "BEGIN PUBLIC KEY" in keys.stdout and "keyid: " in keys.stdout, keys.stderr
        v = cli("verify", final["pr"]["url"])
        assert v.returncode == 0, v.stdout + v.stderr
        assert f"request record of commit {after['awaiting_sha']}" in v.stdout
        assert f'approved by "cli" of {after["awaiting_sha"]}' in v.stdout
        v = cli("verify", ticket, "--sha", before["awaiting_sha"])      # genuine, but of an older head: exit 8
        assert v.returncode == 8 and "OLDER HEAD" in v.stdout + v.stderr, v.stdout + v.stderr
        assert f"request record of commit {before['awaiting_sha']}" in v.stdout, v.stdout
        assert "decision record" not in v.stdout                    # the first head was never decided
    finally:
        model.close()
        if up is not None:
            pids = []
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids = [c["pid"] for c in json.loads((repo / ".afe/run/launcher.json").read_text())["children"]
                        .values()]
            if up.poll() is None:
                up.terminate()
                try:
                    up.wait(30)
                except subprocess.TimeoutExpired:
                    up.kill()
                    up.wait(5)
            wait_gone(pids, 15)
        client = docker.from_env()
        try:
            client.images.remove(image, noprune=False)
        except docker.errors.ImageNotFound:
            pass
        finally:
            client.close()
        remove_temp_root(base)
