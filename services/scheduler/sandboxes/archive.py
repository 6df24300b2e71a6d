"""Reading the credential broker's archive calls (CheckoutArchive,
VerificationArchive): a first `prepared` message, then the tar chunks of the
checkout, which remoteworkspace.py relays to a sandbox broker on another host."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from grpc.aio import EOF as grpc_eof

from services.common.errors import Unavailable
from services.common.rpc.grpcutil import rpc_errors

CREDENTIALS = "the credential broker"


@contextlib.asynccontextmanager
async def prepared_then_chunks(call: Any, what: str) -> AsyncIterator[tuple[Any, AsyncIterator[bytes]]]:
    """(the `prepared` message, the chunks that follow) of a server stream; the call is
    cancelled when the block ends (a receiver that stopped reading ends it)."""
    try:
        async with rpc_errors(CREDENTIALS, what):
            first = await call.read()
        if first is grpc_eof or first.WhichOneof("output") != "prepared":
            raise Unavailable(f"the credential broker sent nothing for {what}; retry")

        async def chunks() -> AsyncIterator[bytes]:
            async with rpc_errors(CREDENTIALS, what):
                async for msg in call:
                    yield msg.chunk

        yield first.prepared, chunks()
    finally:
        call.cancel()
