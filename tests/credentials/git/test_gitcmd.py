"""Every host git process gets an environment built from nothing and the -c
hardening: variables in the broker's own environment (traces, GIT_DIR,
config injected through GIT_CONFIG_*) never reach git."""

from __future__ import annotations

import os
import subprocess

from services.common.host.gitcmd import HARDENING, GitRunner
from services.common.secrecy.redact import Redactor


async def test_r1_git_never_inherits_the_broker_environment(short_tmp, monkeypatch):
    trace = short_tmp / "trace.log"
    hook_marker = short_tmp / "injected"
    monkeypatch.setenv("GIT_TRACE", str(trace))
    monkeypatch.setenv("GIT_CURL_VERBOSE", "1")
    monkeypatch.setenv("GIT_DIR", str(short_tmp / "elsewhere.git"))
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "alias.version")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", f"!touch {hook_marker}")
    runner = GitRunner(short_tmp / "home", Redactor())
    res = await runner.run(["config", "--list"], cwd=short_tmp)
    listed = res.out
    await runner.run(["var", "GIT_AUTHOR_IDENT"], env={"GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@a"})
    assert not trace.exists()
    assert "alias.version" not in listed
    for item in ("core.hookspath=/dev/null", "protocol.allow=never", "credential.helper=",
                 "transfer.fsckobjects=true", "core.fsmonitor=false"):
        assert item in listed, item
    assert len(HARDENING) >= 15
    # Positive control: plain git run with the same environment does pick them up.
    plain = subprocess.run(["git", "config", "--list"], capture_output=True, text=True, env=dict(os.environ),  # noqa: ASYNC221
                           cwd=short_tmp, check=False)
    assert "alias.version" in plain.stdout
    assert trace.exists()
