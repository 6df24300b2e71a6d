"""The gRPC boundary (services/common/rpc/guard.py) logs an unexpected error by
its type and traceback, never its repr: a UnicodeError's repr carries the
whole text it failed on (an issue's body, a webhook payload) into the error
log. Against a real server on a Unix socket.

Positive control: the repr of the very exception the servicer raised holds
the text, which is what the log line carried before."""

from __future__ import annotations

import logging

import grpc
import pytest

from services._gen.afe.scheduler.v1 import hooks_pb2, hooks_pb2_grpc
from services.common.rpc import grpcutil
from services.common.rpc.links import new_secret
from services.common.secrecy.redact import Redactor

pytestmark = pytest.mark.timeout(60)
MARK = "IssueBodyMarkW8"


class Failing(hooks_pb2_grpc.GitHubHooksServicer):
    def __init__(self) -> None:
        self.raised: list[BaseException] = []

    async def DeliverGitHubEvent(self, request, context):
        try:
            (MARK + " \ud800").encode("utf-8")
        except UnicodeEncodeError as exc:
            self.raised.append(exc)
            raise
        raise AssertionError("a lone surrogate encoded")


async def test_an_unexpected_error_is_logged_without_its_text(short_tmp, caplog):
    caplog.set_level(logging.INFO)
    key = new_secret()
    servicer = Failing()
    sock = str(short_tmp / "hooks.sock")
    server = grpcutil.create_server(sock, {"gateway": key}, Redactor(),
                                    [lambda s: hooks_pb2_grpc.add_GitHubHooksServicer_to_server(servicer, s)])
    await server.start()
    try:
        async with grpcutil.open_channel(sock, key) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await hooks_pb2_grpc.GitHubHooksStub(channel).DeliverGitHubEvent(
                    hooks_pb2.GitHubDelivery(delivery_id="d-1", event="issues", payload=b"{}"))
        assert err.value.code() == grpc.StatusCode.INTERNAL
    finally:
        await server.stop(0)
    assert "DeliverGitHubEvent failed: UnicodeEncodeError" in caplog.text
    assert "surrogates not allowed" in caplog.text             # the traceback is there, its cause named
    assert MARK not in caplog.text
    [raised] = servicer.raised
    assert MARK in repr(raised)                                  # positive control: what the old line logged
