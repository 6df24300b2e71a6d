"""The REAL credential broker servicer, in-process, on a temporary Unix socket.

    async with credential_broker(config, layout, secrets={"GIT_TOKEN": "..."}) as (sock, link_secret):
        ch = grpcutil.open_channel(sock, link_secret)  # present it as the scheduler

`secrets` maps env var NAMES to values (what the real process would take from
its environment); values are registered with the given/own redactor.
`spare_checkouts` is off by default here: background checkouts would only add
disk work to other areas' tests (tests/credentials/workspaces/test_workspaces.py covers them).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from services.common.config.model import Config
from services.common.layout import Layout
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.app import CredentialBrokerOptions, build_app
from services.credentials.httpclient import RetryPolicy

FAST_RETRY = RetryPolicy(attempts=4, backoff_s=0.05, max_wait_s=2.0)


@contextlib.asynccontextmanager
async def credential_broker(config: Config, layout: Layout, *, secrets: dict[str, str] | None = None,
                            redactor: Redactor | None = None, ca_file: Path | None = None,
                            retry: RetryPolicy | None = FAST_RETRY,
                            socket_path: Path | None = None,
                            spare_checkouts: bool = False,
                            database_url: str = "") -> AsyncIterator[tuple[str, bytes]]:
    """`database_url`: a postgresql:// AFE_DATABASE_URL makes the broker check the fences there
    (services/credentials/fencing/database.py) instead of its fence file."""
    from services.credentials.fencing.database import database_from_url

    redactor = redactor or Redactor()
    held = {}
    for name, value in (secrets or {}).items():
        redactor.register(value)
        held[name] = SecretValue(name, value)
    tmp = None
    if socket_path is None:
        tmp = tempfile.mkdtemp(prefix="afe-cb-", dir="/tmp")
        socket_path = Path(tmp) / "credentials.sock"
    link_secret = new_secret()
    options = CredentialBrokerOptions(socket_path=str(socket_path), ca_file=ca_file, retry=retry,
                                      spare_checkouts=spare_checkouts)
    app = build_app(config, layout, LinkSecrets(serve={"scheduler": link_secret}), held, redactor, options,
                    fence_db=database_from_url(database_url, redactor))
    await app.start()
    try:
        yield str(socket_path), link_secret
    finally:
        await app.stop(0)
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
