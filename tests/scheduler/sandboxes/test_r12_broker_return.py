"""A restarted sandbox broker is reconciled within 1 s of its return (issue
32, R12): the scheduler asks a broker that does not answer again every
0.2 s (teardown.AWAY_POLL_S) on a channel whose reconnect back-off is capped
(channels.RECONNECT_OPTIONS), so its reconcile removes what the broker held
for no live ticket right after the broker is back. The real sandbox broker
(Docker) stops with a leftover sandbox and starts again on the same socket.
Positive control: today's polling (every 2 s) and gRPC's default back-off
reconcile only seconds later."""

from __future__ import annotations

import asyncio
import time

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.host.images import ensure_images
from services.common.layout import Layout
from services.common.rpc import channels
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.rpc.sockets import OPTIONS
from services.common.secrecy.redact import Redactor
from services.sandbox.app import SandboxBrokerOptions, build_app
from services.scheduler.sandboxes import teardown
from services.scheduler.sandboxes.brokers import SandboxClient
from services.scheduler.sandboxes.teardown import Teardowns
from services.scheduler.store.store import Store
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


async def _seconds_to_reconcile(root) -> float:
    """Seconds from the broker's return to the start of the scheduler's reconcile
    (which then removes the leftover sandbox)."""
    ensure_images(progress=lambda _m: None)
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    instance, secret, sock = new_instance(), new_secret(), str(layout.socket("sandbox"))

    def broker():
        return build_app(layout, LinkSecrets(serve={"scheduler": secret}), Redactor(),
                         SandboxBrokerOptions(socket_path=sock, instance=instance))
    first = broker()
    await first.start()
    client = SandboxClient(sock, secret)
    store = Store.sqlite(layout.data_dir / "afe.db")
    watcher = teardowns = None
    reconciles: list[float] = []
    failed: list[float] = []
    try:
        teardowns = Teardowns(store, client, None, 2.0, lambda _t: False)   # type: ignore[arg-type]
        reconcile, identify = teardowns.reconcile, client.identify

        async def timed_reconcile() -> bool:
            reconciles.append(time.monotonic())
            return await reconcile()

        async def timed_identify() -> str:
            try:
                return await identify()
            except Exception:
                failed.append(time.monotonic())
                raise
        teardowns.reconcile = timed_reconcile            # type: ignore[method-assign]
        client.identify = timed_identify                 # type: ignore[method-assign]
        assert await teardowns.reconcile()               # as the engine's start does: the broker's boot id
        await client.create("t-orphan", spb.SandboxSpec())
        watcher = asyncio.create_task(teardowns.watch_broker())
        await first.stop(0.5)                            # the leftover stays, as after a crash
        while not failed:  # noqa: ASYNC110 - until the scheduler has found the broker away
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        second = broker()
        await second.start()
        back = time.monotonic()
        try:
            while not [t for t in reconciles if t > back]:
                await asyncio.sleep(0.01)
                assert time.monotonic() - back < 30, "no reconcile after the broker came back"
            listed = {s.ticket_id for s in (await client.stub.ListSandboxes(spb.ListSandboxesRequest())).sandboxes}
            while "t-orphan" in listed:
                await asyncio.sleep(0.1)
                listed = {s.ticket_id for s in
                          (await client.stub.ListSandboxes(spb.ListSandboxesRequest())).sandboxes}
            return next(t for t in reconciles if t > back) - back
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await second.sandboxes.reconcile([])
            await second.stop(0.5)
    finally:
        if watcher is not None and not watcher.done():
            watcher.cancel()
        await client.close()
        store.close()


async def test_r12_a_restarted_sandbox_broker_is_reconciled_within_1s_of_its_return(short_tmp):
    seconds = await _seconds_to_reconcile(short_tmp)
    print(f"reconcile started {seconds:.2f} s after the broker was back")
    assert seconds < 1.0, seconds


async def test_r12_positive_control_todays_polling_and_back_off_reconcile_seconds_later(short_tmp, monkeypatch):
    monkeypatch.setattr(teardown, "AWAY_POLL_S", 2.0)
    monkeypatch.setattr(channels, "CHANNEL_OPTIONS", OPTIONS)
    seconds = await _seconds_to_reconcile(short_tmp)
    print(f"today's polling: reconcile started {seconds:.2f} s after the broker was back")
    assert seconds > 1.0, seconds
