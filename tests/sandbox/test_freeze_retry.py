"""Freezing a sandbox (docker pause, before a builtin step reads its
workspace) tries again when runc gives up on a cgroup whose tasks did not
stop in time ("unable to freeze", seen on a loaded machine): the step goes on
instead of failing the ticket with an internal error."""

from __future__ import annotations

import docker
import pytest

from services.common.host.images import SANDBOX_IMAGE
from services.common.layout import Layout
from services.sandbox import sandboxes
from services.sandbox.containers.info import SandboxInfo

pytestmark = pytest.mark.docker

UNABLE = ("Cannot pause container x: OCI runtime pause failed: unable to freeze: unknown")


def _manager(short_tmp, client, fail_times: int) -> sandboxes.SandboxManager:
    """A manager whose engine refuses the first `fail_times` pauses as runc does."""
    real_pause = client.api.pause
    calls = {"n": 0}

    def pause(container_id):
        calls["n"] += 1
        if calls["n"] <= fail_times:
            raise docker.errors.APIError("500 Server Error", explanation=UNABLE)
        return real_pause(container_id)
    client.api.pause = pause
    return sandboxes.SandboxManager(Layout(short_tmp / "data", short_tmp / "run"), client=client)


async def test_freeze_tries_again_when_runc_could_not_freeze_yet(short_tmp, idle_container, monkeypatch):
    monkeypatch.setattr(sandboxes, "FREEZE_RETRY_S", (0.01, 0.01, 0.01))
    mgr = _manager(short_tmp, docker.from_env(), fail_times=2)
    mgr._cache["t-freeze"] = SandboxInfo("t-freeze", idle_container.id, "running", SANDBOX_IMAGE)
    await mgr.freeze("t-freeze", True)
    idle_container.reload()
    assert idle_container.attrs["State"]["Paused"] is True
    await mgr.freeze("t-freeze", False)
    idle_container.reload()
    assert idle_container.attrs["State"]["Paused"] is False


async def test_positive_control_without_the_retries_the_same_refusal_fails_the_freeze(short_tmp, idle_container,
                                                                                      monkeypatch):
    monkeypatch.setattr(sandboxes, "FREEZE_RETRY_S", ())
    mgr = _manager(short_tmp, docker.from_env(), fail_times=2)
    mgr._cache["t-freeze"] = SandboxInfo("t-freeze", idle_container.id, "running", SANDBOX_IMAGE)
    with pytest.raises(docker.errors.APIError, match="unable to freeze"):
        await mgr.freeze("t-freeze", True)


async def test_other_engine_errors_are_not_retried(short_tmp, idle_container, monkeypatch):
    monkeypatch.setattr(sandboxes, "FREEZE_RETRY_S", (0.01,) * 3)
    client = docker.from_env()
    calls = {"n": 0}

    def pause(container_id):
        calls["n"] += 1
        raise docker.errors.APIError("500 Server Error", explanation="Cannot pause container x: it is not running")
    client.api.pause = pause
    mgr = sandboxes.SandboxManager(Layout(short_tmp / "data", short_tmp / "run"), client=client)
    mgr._cache["t-freeze"] = SandboxInfo("t-freeze", idle_container.id, "running", SANDBOX_IMAGE)
    with pytest.raises(docker.errors.APIError, match="not running"):
        await mgr.freeze("t-freeze", True)
    assert calls["n"] == 1
