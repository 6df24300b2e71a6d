"""The coreutils agents use work in afe's sandbox image under both runtimes.

Debian's runsc refuses statx(2) with AT_NO_AUTOMOUNT, which bookworm's `ls -l`
and `stat` pass; the image preloads a library that asks again without it
(deploy/images/sandbox/statx-compat.c). The positive control runs the same
image under runsc with the preload masked: `ls -la` and `stat` fail again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common.host.images import IMAGES_DIR, SANDBOX_IMAGE
from tests.sandbox.conftest import gvisor_missing, run
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

TREE = "rm -rf cu && mkdir -p cu/a/b && echo hello > cu/a/b/f && ln -s f cu/a/b/l"

# (tool, command run in /workspace, what its output shows when it worked)
AGENT_COMMANDS = [
    ("ls -l", "ls -l cu/a/b", r"-rw\S* 1 sandbox sandbox 6 .* f\n"),
    ("ls -la", "ls -la cu", r"drwx\S* +\d+ sandbox sandbox .* a\n"),
    ("ls -R", "ls -R cu", r"cu/a/b:\nf\nl\n"),
    ("stat", "stat -c '%n %s %F' cu/a/b/f cu/a/b/l", r"cu/a/b/f 6 regular file\ncu/a/b/l 1 symbolic link\n"),
    ("find", "find cu -type f -size 6c; find cu -type l -lname f", r"^cu/a/b/f\ncu/a/b/l\n$"),
    ("cp -a", "rm -rf cu2 && cp -a cu cu2 && readlink cu2/a/b/l && cat cu2/a/b/f", r"^f\nhello\n$"),
    ("tar", "tar -cf /tmp/cu.tar cu && tar -tvf /tmp/cu.tar", r"cu/a/b/l -> f\n"),
]


@pytest.mark.parametrize(("tool", "command", "shows"), AGENT_COMMANDS, ids=[c[0] for c in AGENT_COMMANDS])
def test_agents_coreutils_work_in_the_sandbox_image(stub, plain_sandbox, runtime, tool, command, shows):
    assert run(stub, plain_sandbox, TREE).code == 0
    r = run(stub, plain_sandbox, command)
    assert r.code == 0 and r.stderr == b"", (tool, runtime, r.stderr)
    assert re.search(shows, r.stdout.decode(), re.MULTILINE), (tool, runtime, r.stdout)


def test_gvisor_control_without_the_preloaded_library_ls_and_stat_fail(docker_client, tmp_path):
    """The same image under runsc, once as it is and once with /etc/ld.so.preload masked."""
    if why := gvisor_missing(docker_client):
        pytest.skip(why)
    empty = tmp_path / "empty"
    empty.write_text("")
    script = "ls -la /etc >/dev/null && stat /etc/hostname >/dev/null && echo ok"
    labels = {"afe.instance": new_instance("cu")}

    def in_runsc(masked: bool) -> tuple[int, str]:
        c = docker_client.containers.run(
            SANDBOX_IMAGE, ["sh", "-c", script + " 2>&1"], runtime="runsc", network_mode="none", detach=True,
            labels=labels, volumes={str(empty): {"bind": "/etc/ld.so.preload", "mode": "ro"}} if masked else {})
        try:
            code = c.wait(timeout=60)["StatusCode"]
            return code, c.logs().decode()
        finally:
            c.remove(force=True)

    assert in_runsc(masked=False) == (0, "ok\n")
    code, out = in_runsc(masked=True)
    assert code != 0 and "Invalid argument" in out, out            # positive control: the library is what helps


def test_every_image_afe_runs_agents_in_starts_from_the_sandbox_image():
    """The library is in afe/sandbox; agent presets and the ACP test image are
    built FROM it (their builders pass BASE=afe/sandbox), so they have it too."""
    dockerfiles = [*IMAGES_DIR.glob("agents/*/Dockerfile"), IMAGES_DIR / "acp-test" / "Dockerfile"]
    assert len(dockerfiles) >= 5
    for f in dockerfiles:
        text = Path(f).read_text()
        assert re.search(r"^ARG BASE=afe/sandbox:latest$", text, re.MULTILINE), f
        assert re.findall(r"^FROM .*$", text, re.MULTILINE) == ["FROM ${BASE}"], f
        assert "ld.so.preload" not in text, f                     # nobody takes the library away
