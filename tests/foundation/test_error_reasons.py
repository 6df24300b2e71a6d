"""What one process recognises in another's error travels as a typed reason
(a google.rpc.ErrorInfo in the status details), never as words of the
message (issue 36): a lost lease (R37, R45) and a fence database that does
not answer. The reason goes through a real gRPC server with afe's guard and
a real client channel; the scheduler's side acts on the reason alone."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services._gen.afe.credentials.v1 import credentials_pb2_grpc as pb_grpc
from services.common import errors
from services.common.errors import FailedPrecondition, Reason, Unavailable
from services.common.rpc import grpcutil
from services.common.rpc.channels import error_from_rpc
from services.common.rpc.statuses import DETAILS_KEY, ORIGIN, reason_in, trailers_for
from services.common.secrecy.redact import Redactor
from services.scheduler.executor import brokercalls
from services.scheduler.sandboxes.brokers import fenced_errors
from services.scheduler.store.base import LeaseLost

WORDS = "this scheduler lost its lease"


def test_a_reason_goes_into_the_status_details_and_comes_back():
    exc = FailedPrecondition("stale", reason=Reason.LEASE_LOST)
    trailers = trailers_for(exc, grpc.StatusCode.FAILED_PRECONDITION, "stale")
    assert trailers[: len(ORIGIN)] == ORIGIN and trailers[-1][0] == DETAILS_KEY
    assert reason_in(trailers) is Reason.LEASE_LOST
    assert trailers_for(FailedPrecondition("plain"), grpc.StatusCode.FAILED_PRECONDITION, "plain") == ORIGIN
    assert reason_in([(DETAILS_KEY, b"\xff not a status")]) is None
    assert reason_in([("x-other", "LEASE_LOST")]) is None


async def test_the_reason_crosses_a_real_grpc_call_through_the_guard(tmp_path):
    """The credential broker's service, served by afe's own server (guard, redaction),
    with a servicer that raises what the broker's fences raise; afe's client channel."""
    raised: list[BaseException] = []

    class Failing(pb_grpc.CredentialBrokerServicer):
        async def Push(self, request, context):   # the gRPC method's name
            raise raised[0]

    sock = str(tmp_path / "s.sock")
    key = b"k" * 32
    server = grpcutil.create_server(sock, {"scheduler": key}, Redactor(),
                                    [lambda s: pb_grpc.add_CredentialBrokerServicer_to_server(Failing(), s)])
    await server.start()
    try:
        got = []
        for exc in (FailedPrecondition(f"fence 1 < 2; {WORDS}", reason=Reason.LEASE_LOST),
                    FailedPrecondition(f"branch 'afe/{WORDS}' exists"),    # the words, no reason
                    Unavailable("the fence cannot be checked", reason=Reason.FENCE_STORE_AWAY)):
            raised[:] = [exc]
            async with grpcutil.open_channel(sock, key) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.CredentialBrokerStub(ch).Push(pb.PushRequest(ticket_id="t-1"), timeout=5)
            err = error_from_rpc(info.value, "the credential broker", "a push")
            got.append((type(err).__name__, err.reason, err.message))
        assert got == [("FailedPrecondition", Reason.LEASE_LOST, f"fence 1 < 2; {WORDS}"),
                       ("FailedPrecondition", None, f"branch 'afe/{WORDS}' exists"),
                       ("Unavailable", Reason.FENCE_STORE_AWAY, "the fence cannot be checked")]
    finally:
        await server.stop(None)


async def _through_fenced_errors(exc: errors.AfeError) -> BaseException:
    try:
        async with fenced_errors("t-1", 3, "a push"):
            raise exc
    except BaseException as out:  # noqa: BLE001 - what came out is the result
        return out
    raise AssertionError("nothing raised")


async def test_r37_the_scheduler_stops_on_the_reason_and_not_on_the_words():
    assert isinstance(await _through_fenced_errors(FailedPrecondition("refused", reason=Reason.LEASE_LOST)),
                      LeaseLost)
    # Positive control: the same words in another refusal (a branch name a ticket chose) -- a
    # substring check, as before, would have taken it for a lost lease and stopped the run.
    words_only = FailedPrecondition(f"the branch 'afe/{WORDS}' already exists on the remote")
    assert WORDS in words_only.message
    out = await _through_fenced_errors(words_only)
    assert out is words_only and not isinstance(out, LeaseLost)


async def test_r45_a_step_is_tried_again_only_for_the_fence_database_reason(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    events: list[str] = []
    calls = {"n": 0}

    def flaky(first: BaseException):
        async def fn() -> str:
            calls["n"] += 1
            if calls["n"] == 1:
                raise first
            return "done"
        return fn

    away = Unavailable("the fence cannot be checked: the database does not answer",
                       reason=Reason.FENCE_STORE_AWAY)
    assert await brokercalls.step(10, lambda t, p: events.append(t), "push", "push", flaky(away)) == "done"
    assert calls["n"] == 2 and events == ["broker.retry", "broker.recovered"]
    # Positive control: the same words without the reason are the step's own answer, raised at once.
    calls["n"] = 0
    same_words = Unavailable(away.message)
    with pytest.raises(Unavailable) as info:
        await brokercalls.step(10, lambda t, p: None, "push", "push", flaky(same_words))
    assert info.value is same_words and calls["n"] == 1


async def _no_sleep(_s: float) -> None:
    return None
