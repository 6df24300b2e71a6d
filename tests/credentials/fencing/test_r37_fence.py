"""R37 at the resource: the credential broker keeps, per ticket, the highest
fence (the lease's fencing token) it has seen and refuses a side effect with
a lower one, so a scheduler paused between its own lease check and the call
cannot push after another scheduler took the ticket over. The real broker
core and servicer over gRPC on a Unix socket, a real git origin."""

from __future__ import annotations

import stat

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services._gen.afe.credentials.v1 import credentials_pb2_grpc as pb_grpc
from services.common.errors import Reason
from services.common.rpc import grpcutil
from services.common.rpc.statuses import reason_in
from services.scheduler.sandboxes.brokers import CredentialsClient
from services.scheduler.store.base import LeaseLost
from tests.credentials.conftest import git_plain, local_workspace, make_config
from tests.support.credential_broker import credential_broker


def _branch(origin, ticket: str) -> str | None:
    r = git_plain("--git-dir", str(origin), "rev-parse", "--verify", "-q", f"refs/heads/afe/{ticket}", check=False)
    return r.stdout.decode().strip() if r.returncode == 0 else None


async def _change(client: CredentialsClient, layout, ticket: str, text: str, fence: int) -> str:
    (layout.workspace(ticket) / "README.md").write_text(text)
    return (await client.commit(ticket, "local", text, fence)).sha


async def test_r37_push_with_an_older_fence_is_refused_and_nothing_is_pushed(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with credential_broker(config, layout) as (sock, key):
        client = CredentialsClient(sock, key)
        try:
            await client.prepare("t1", "local")
            await _change(client, layout, "t1", "# by the new owner\n", fence=2)   # the new owner acted
            (layout.workspace("t1") / "README.md").write_text("# by the stale owner\n")
            with pytest.raises(LeaseLost):                  # the scheduler's face of the refusal
                await client.push("t1", "local", fence=1)
            assert _branch(local_origin, "t1") is None      # nothing pushed
            with pytest.raises(LeaseLost):
                await client.commit("t1", "local", "stale", fence=1)
        finally:
            await client.close()
    # The refusal's text, as the broker says it (what an operator sees in the log).
    async with credential_broker(config, layout) as (sock, key), grpcutil.open_channel(sock, key) as ch:
        stub = pb_grpc.CredentialBrokerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Push(pb.PushRequest(ticket_id="t1", workspace="local", fence=1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "a newer owner of ticket t1 exists (fence 1 < 2); this scheduler lost its lease" in err.value.details()
    # ... and what the scheduler acts on: the reason in the status details, not the words
    assert reason_in(err.value.trailing_metadata()) is Reason.LEASE_LOST
    assert _branch(local_origin, "t1") is None


async def test_r37_positive_control_the_same_push_alone_or_unfenced_is_made(local_origin, layout):
    """Without a newer fence on record the very same push goes through (fence 1
    alone), and fence 0 (a store of one scheduler) is never checked."""
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with credential_broker(config, layout) as (sock, key):
        client = CredentialsClient(sock, key)
        try:
            await client.prepare("t2", "local")
            sha = await _change(client, layout, "t2", "# one owner\n", fence=1)
            assert (await client.push("t2", "local", fence=1)).sha == sha
            assert _branch(local_origin, "t2") == sha
            await client.prepare("t3", "local")
            await _change(client, layout, "t3", "# newer\n", fence=2)
            sha3 = (await client.commit("t3", "local", "unfenced", 0)).sha
            assert (await client.push("t3", "local", fence=0)).sha == sha3
            assert _branch(local_origin, "t3") == sha3
        finally:
            await client.close()


async def test_r37_the_fence_survives_a_broker_restart_and_goes_with_the_ticket(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with credential_broker(config, layout) as (sock, key):
        client = CredentialsClient(sock, key)
        try:
            await client.prepare("t4", "local")
            await _change(client, layout, "t4", "# new owner\n", fence=3)
        finally:
            await client.close()
    fences = layout.data_dir / "credentials" / "fences.json"
    assert stat.S_IMODE(fences.stat().st_mode) == 0o600
    async with credential_broker(config, layout) as (sock, key):      # a new broker on the same data dir
        client = CredentialsClient(sock, key)
        try:
            with pytest.raises(LeaseLost):
                await client.push("t4", "local", fence=2)
            assert _branch(local_origin, "t4") is None
            await client.release("t4", "local")                          # the ticket ended: its entry goes
            assert "t4" not in fences.read_text()
        finally:
            await client.close()
