"""`open_channel` presents the link secret on every kind of call without a
thread per call (gRPC runs call credentials' metadata plugins on a new
thread each call; the channel adds the secret in a client interceptor)."""

from __future__ import annotations

import threading

import grpc
import pytest

from services.common.rpc.grpcutil import _LinkAuth, open_channel
from services.common.rpc.links import METADATA_KEY
from services.common.rpc.sockets import OPTIONS, socket_target

SECRET = bytes(range(32))


def _ident(b: bytes) -> bytes:
    return b


RAW = {"request_serializer": _ident, "response_deserializer": _ident}


def _seen(context) -> bytes:
    return dict(context.invocation_metadata()).get(METADATA_KEY, "-").encode()


class _Echo(grpc.GenericRpcHandler):
    """Each method answers with the link metadata the call presented."""

    def service(self, details):
        method = details.method.rsplit("/", 1)[-1]

        async def uu(req, context):
            return _seen(context)

        async def us(req, context):
            yield _seen(context)

        async def su(it, context):
            async for _ in it:
                pass
            return _seen(context)

        async def ss(it, context):
            async for _ in it:
                yield _seen(context)

        kinds = {"UU": grpc.unary_unary_rpc_method_handler, "US": grpc.unary_stream_rpc_method_handler,
                 "SU": grpc.stream_unary_rpc_method_handler, "SS": grpc.stream_stream_rpc_method_handler}
        fns = {"UU": uu, "US": us, "SU": su, "SS": ss}
        if method not in kinds:
            return None
        return kinds[method](fns[method], request_deserializer=_ident, response_serializer=_ident)


@pytest.fixture
async def echo(short_tmp):
    path = str(short_tmp / "echo.sock")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_Echo(),))
    server.add_secure_port(socket_target(path), grpc.local_server_credentials(grpc.LocalConnectionType.UDS))
    await server.start()
    try:
        yield path
    finally:
        await server.stop(0)


async def _every_kind(channel: grpc.aio.Channel) -> list[bytes]:
    async def one_request():
        yield b"x"

    out = [await channel.unary_unary("/t.E/UU", **RAW)(b"x")]
    out += [m async for m in channel.unary_stream("/t.E/US", **RAW)(b"x")]
    out.append(await channel.stream_unary("/t.E/SU", **RAW)(one_request()))
    out += [m async for m in channel.stream_stream("/t.E/SS", **RAW)(one_request())]
    return out


class _ThreadCount:
    def __init__(self, monkeypatch) -> None:
        self.n = 0
        start = threading.Thread.start

        def counted(thread):
            self.n += 1
            return start(thread)
        monkeypatch.setattr(threading.Thread, "start", counted)


async def test_link_secret_on_every_call_kind_without_a_thread_per_call(echo, monkeypatch):
    async with open_channel(echo, SECRET) as ch:
        await _every_kind(ch)                       # connected, warm
        threads = _ThreadCount(monkeypatch)
        for _ in range(10):
            assert await _every_kind(ch) == [SECRET.hex().encode()] * 4
        assert threads.n == 0
    async with open_channel(echo, None) as ch:     # no secret: none presented
        assert await _every_kind(ch) == [b"-"] * 4


async def test_positive_control_call_credentials_start_a_thread_per_call(echo, monkeypatch):
    creds = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                               grpc.metadata_call_credentials(_LinkAuth(SECRET)))
    async with grpc.aio.secure_channel(socket_target(echo), creds, options=OPTIONS) as ch:
        await _every_kind(ch)
        threads = _ThreadCount(monkeypatch)
        for _ in range(10):
            assert await _every_kind(ch) == [SECRET.hex().encode()] * 4
        assert threads.n >= 40                      # one per call: what open_channel avoids
