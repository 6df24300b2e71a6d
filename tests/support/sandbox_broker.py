"""The REAL sandbox broker, in-process, for tests of other areas.

    async with sandbox_broker(layout) as (socket_path, link_secret, instance):
        channel = open_channel(socket_path, link_secret)
        ...

It serves only the "scheduler" caller (link_secret is that caller's secret),
labels every Docker object with a unique `afe.instance`, and removes all of
its own objects (and only those) on exit. `env_values` are the values the
broker would have read from its environment for declared ACP names: a
sandbox receives none of them in its container environment; a Process gets
exactly the `ProcessStart.env_names` it asks for, each of which must be in
the `SandboxSpec.env_names` the sandbox was created with. Exec gets none.

`egress_network`/`allow_private`: the proxies' outside network and a private
subnet they may reach (tests put a target server container there);
`upstream_ca`: the CA certificates a decrypting proxy trusts for upstreams
(AFE_CA_FILE's content, R44).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator

from services.common.host.images import ensure_images
from services.common.layout import Layout
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.secrecy.redact import Redactor
from services.sandbox.app import SandboxBrokerOptions, build_app
from tests.support.temp_roots import remove_temp_root, temp_root


def new_instance(prefix: str = "t") -> str:
    return f"{prefix}{secrets.token_hex(5)}"


@contextlib.asynccontextmanager
async def sandbox_broker(layout: Layout | None = None, *, env_values: dict | None = None,
                         egress_network: str = "bridge", allow_private: tuple[str, ...] = (),
                         instance: str | None = None, socket_path: str | None = None,
                         upstream_ca: bytes = b"") -> AsyncIterator[tuple[str, bytes, str]]:
    ensure_images(progress=lambda _m: None)
    tmp = None
    if layout is None:
        tmp = temp_root("afe-sb-")
        layout = Layout(tmp / "data", tmp / "run")
    layout.ensure()
    instance = instance or new_instance()
    socket_path = socket_path or str(layout.socket("sandbox"))
    secret = new_secret()
    options = SandboxBrokerOptions(socket_path=socket_path, instance=instance, egress_network=egress_network,
                                   allow_private=allow_private, upstream_ca=upstream_ca)
    broker = build_app(layout, LinkSecrets(serve={"scheduler": secret}), Redactor(), options,
                       env_values=env_values)
    await broker.start()
    try:
        yield socket_path, secret, instance
    finally:
        try:
            await broker.stop(0.5)
        finally:
            try:
                await broker.sandboxes.reconcile([])
            finally:
                if tmp is not None:
                    remove_temp_root(tmp)
