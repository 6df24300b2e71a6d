"""CheckoutArchive (the checkout sent to a sandbox broker on another host):
the private copy it packs from (`<data>/handover/`) goes when the call ends,
however it ends. A caller that stops reading and cancels (a sandbox broker
that already holds the workspace reads none of it) must not leave a copy of
the repository behind until the garbage collector happens to run."""

from __future__ import annotations

import asyncio

import pytest

from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.scheduler.sandboxes.brokers import CredentialsClient
from tests.scheduler.conftest import write_config
from tests.support.credential_broker import credential_broker

pytestmark = pytest.mark.timeout(60)


async def _until_empty(folder, seconds: float) -> bool:
    for _ in range(int(seconds / 0.05)):
        if not any(folder.iterdir()):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["cancelled after the first message", "read to the end"])
async def test_abandoned_checkout_stream_leaves_no_private_copy(short_tmp, how):
    cfg = write_config(short_tmp, "")
    layout = Layout(short_tmp / "data", short_tmp / "run")
    handover = layout.data_dir / "handover"
    async with credential_broker(load_config(cfg), layout) as (sock, secret):
        creds = CredentialsClient(sock, secret)
        async with creds.checkout_archive("t-handover1", "ws") as (prepared, chunks):
            assert prepared.base_sha
            # Control: while the stream is open the private copy is there, so the
            # check below can see one that stays.
            assert any(handover.iterdir())
            if how == "read to the end":
                assert sum([len(c) async for c in chunks]) > 0
        # leaving the block cancels the call when it is still open (20 s: the copy's removal on a loaded machine)
        assert await _until_empty(handover, 20), sorted(p.name for p in handover.iterdir())
