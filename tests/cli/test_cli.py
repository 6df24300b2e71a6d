"""Every ticket verb of `afe` against the running system (real gateway,
scheduler, brokers, Docker, git): --json parses, exit codes are the
documented ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import tickets as cli

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def afe(live, *args: str, token: str | None = None, url: str | None = None, timeout: float = 300):
    env = {k: v for k, v in os.environ.items() if k not in ("AFE_TOKEN", "AFE_URL")}
    env["AFE_URL"] = url or live.gateway.url
    if token is not None:
        env["AFE_TOKEN"] = token
    argv = [sys.executable, "-m", "services.cli.main", *args]
    if args[0] in ("ticket", "approve", "reject"):
        argv += ["--data", str(live.layout.data_dir)]
    return subprocess.run(argv, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def as_json(proc):
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout)


def test_demo_create_watch_approve_merged(live_afe):
    live_afe.reset_demo_repo()
    created = afe(live_afe, "ticket", "create", "--demo", "--json")
    assert created.returncode == cli.EXIT_OK, created.stderr
    t = as_json(created)
    tid = t["id"]
    assert t["workflow"] == "demo-fix" and t["workspace"] == "demo"

    waited = afe(live_afe, "ticket", "watch", tid, "--until-waiting")
    assert waited.returncode == cli.EXIT_WAITING, waited.stdout + waited.stderr
    out = waited.stdout
    for node in ("fix", "test", "pr"):
        assert f" {node:<16} started" in out, out
    assert "-> write_file" in out and "waiting for approval" in out
    assert any(line.rstrip().endswith("s") and " succeeded " in line for line in out.splitlines()), out

    shown = as_json(afe(live_afe, "ticket", "show", tid, "--json"))
    assert shown["state"] == "waiting_approval" and shown["awaiting_sha"]
    human = afe(live_afe, "ticket", "show", tid, "--diff")
    assert human.returncode == 0 and "+    return a + b" in human.stdout and f"afe approve {tid}" in human.stdout

    wrong = afe(live_afe, "approve", tid, "--sha", "0" * 40)
    assert wrong.returncode == cli.EXIT_REFUSED, wrong.stderr
    assert "failed_precondition" in wrong.stderr

    ok = afe(live_afe, "approve", tid, "--sha", shown["awaiting_sha"], "--json")
    assert ok.returncode == cli.EXIT_OK, ok.stderr
    as_json(ok)
    done = afe(live_afe, "ticket", "watch", tid)
    assert done.returncode == cli.EXIT_OK, done.stdout + done.stderr
    assert f"{tid} succeeded" in done.stdout
    final = as_json(afe(live_afe, "ticket", "show", tid, "--json"))
    assert final["state"] == "succeeded" and final["pr"]["state"] == "merged"
    assert final["approval"]["principal"] == "cli" and final["approval"]["granted"]

    events = [json.loads(line) for line in afe(live_afe, "ticket", "watch", tid, "--json").stdout.splitlines()]
    # Already terminal: the history is replayed, nothing is followed, the outcome is the exit code.
    assert events[0]["type"] == "ticket.created" and events[-1]["type"] == "ticket.finished"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    listed = afe(live_afe, "ticket", "list", "--state", "succeeded", "--json")
    assert tid in [x["id"] for x in as_json(listed)]
    assert tid in afe(live_afe, "ticket", "list").stdout


def test_reject_fails_the_ticket(live_afe):
    live_afe.reset_demo_repo()
    tid = as_json(afe(live_afe, "ticket", "create", "--demo", "--title", "reject me", "--json"))["id"]
    streamed = afe(live_afe, "ticket", "watch", tid, "--until-waiting", "--json")
    assert streamed.returncode == cli.EXIT_WAITING
    types = [json.loads(line)["type"] for line in streamed.stdout.splitlines()]
    assert types[0] == "ticket.created" and "approval.requested" in types
    rej = afe(live_afe, "reject", tid, "--reason", "not like this")
    assert rej.returncode == cli.EXIT_OK, rej.stderr
    end = afe(live_afe, "ticket", "watch", tid)
    assert end.returncode == cli.EXIT_FAILED, end.stdout + end.stderr
    t = as_json(afe(live_afe, "ticket", "show", tid, "--json"))
    assert t["state"] == "failed" and t["approval"]["reason"] == "not like this"


def test_cancel_and_watch_exit_cancelled(live_afe):
    undeclared = afe(live_afe, "ticket", "create", "--workflow", "demo-fix", "--title", "t", "--input", "k=v")
    assert undeclared.returncode == cli.EXIT_USAGE and "unknown input 'k'" in undeclared.stderr
    made = afe(live_afe, "ticket", "create", "--workflow", "demo-fix", "--title", "cancel me", "--body", "x")
    assert made.returncode == 0 and "created " in made.stdout
    tid = made.stdout.split()[1]
    c = afe(live_afe, "ticket", "cancel", tid, "--json")
    assert c.returncode == cli.EXIT_OK, c.stderr
    w = afe(live_afe, "ticket", "watch", tid)
    assert w.returncode == cli.EXIT_CANCELLED, w.stdout + w.stderr
    again = afe(live_afe, "ticket", "cancel", tid)
    assert again.returncode == cli.EXIT_REFUSED and "already finished (cancelled)" in again.stderr


def test_error_exit_codes(live_afe, tmp_path):
    assert afe(live_afe, "ticket", "show", "no-such-ticket").returncode == cli.EXIT_REFUSED
    bad = afe(live_afe, "ticket", "show", "Not_An_Id")
    assert bad.returncode == cli.EXIT_USAGE and "ticket id" in bad.stderr
    assert afe(live_afe, "ticket", "create", "--title", "no workflow").returncode == cli.EXIT_USAGE
    unknown = afe(live_afe, "ticket", "create", "--workflow", "nope", "--title", "t")
    assert unknown.returncode == cli.EXIT_USAGE and "unknown workflow 'nope'" in unknown.stderr
    assert afe(live_afe, "ticket", "list", "--state", "bogus").returncode == cli.EXIT_USAGE  # argparse
    refused = afe(live_afe, "ticket", "list", token="wrong-token-0123456789")
    assert refused.returncode == cli.EXIT_CONNECT and "refused the token" in refused.stderr
    # Control: the same call with the right token (from AFE_TOKEN) works.
    assert afe(live_afe, "ticket", "list", token=live_afe.gateway.token).returncode == cli.EXIT_OK
    down = afe(live_afe, "ticket", "list", url="http://127.0.0.1:9")
    assert down.returncode == cli.EXIT_CONNECT and "cannot connect" in down.stderr
    assert afe(live_afe, "approve", "no-such-ticket").returncode == cli.EXIT_REFUSED
    assert afe(live_afe, "reject", "no-such-ticket").returncode == cli.EXIT_REFUSED
    assert afe(live_afe, "ticket", "cancel", "no-such-ticket").returncode == cli.EXIT_REFUSED


def test_token_rotate_writes_a_new_0600_token(tmp_path):
    data = tmp_path / "data"
    r1 = subprocess.run([sys.executable, "-m", "services.cli.main", "token", "rotate", "--data", str(data),
                         "--print"], check=False, cwd=ROOT, capture_output=True, text=True)
    assert r1.returncode == 0
    path = data / "ui-token"
    assert path.read_text().strip() == r1.stdout.strip() and len(r1.stdout.strip()) >= 32
    assert path.stat().st_mode & 0o777 == 0o600
    r2 = subprocess.run([sys.executable, "-m", "services.cli.main", "token", "rotate", "--data", str(data)],
                        check=False, cwd=ROOT, capture_output=True, text=True)
    assert r2.returncode == 0 and r2.stdout == "" and "ui-token" in r2.stderr
    assert path.read_text().strip() != r1.stdout.strip()
