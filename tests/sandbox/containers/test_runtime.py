"""sandbox.runtime: a gVisor sandbox runs on the engine's runsc runtime, and
one asked of an engine without it fails before any Docker object is made,
with an error that says how to install and register it."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition
from services.common.layout import Layout
from services.sandbox.containers.hardening import SandboxSettings
from services.sandbox.sandboxes import SandboxManager
from tests.sandbox.conftest import gvisor_missing
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def _objects(client, instance: str) -> list:
    flt = {"label": [f"afe.instance={instance}"]}
    return [*client.containers.list(all=True, filters=flt), *client.networks.list(filters=flt)]


@pytest.mark.parametrize("runtime_name", ["afe-no-such-runtime", "runsc"])
async def test_a_missing_runtime_fails_the_sandbox_before_any_docker_object_naming_how_to_install_it(
        tmp_path, docker_client, runtime_name):
    if runtime_name == "runsc" and (why := gvisor_missing(docker_client)):
        pytest.skip(why)
    instance = new_instance("rt")
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    mgr = SandboxManager(layout, instance=instance, client=docker_client, gvisor_runtime=runtime_name)
    settings = SandboxSettings(ticket_id="rt-" + new_instance("t"), runtime="gvisor", egress=("x.invalid",))
    try:
        if runtime_name == "runsc":
            # positive control: the engine has it, so the same request makes the sandbox and its proxy
            info = await mgr.create(settings)
            assert info.runtime == "gvisor" and info.egress_socket and len(_objects(docker_client, instance)) == 2
            return
        with pytest.raises(FailedPrecondition) as ei:
            await mgr.create(settings)
        text = str(ei.value)
        assert "afe-no-such-runtime" in text and "apt-get install runsc" in text and "daemon.json" in text
        assert "runtime: runc" in text                                      # or what to use instead
        assert _objects(docker_client, instance) == []                      # nothing was made
        assert not (layout.run_dir / "egress" / settings.ticket_id).exists()
    finally:
        await mgr.reconcile([])
