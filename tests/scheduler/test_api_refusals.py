"""Bad ticket input is refused with INVALID_ARGUMENT and a clear message,
and nothing is stored; unknown ticket ids and event seqs give NOT_FOUND."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from services.scheduler.engine.tickets import MAX_BODY_BYTES, MAX_TITLE_CHARS
from tests.support.system import afe_system

from .conftest import state_name, wait_for_state, write_config

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]

CONFIG = """\
kind: Workflow
name: quick
workspace: ws
inputs: [{name: issue, default: ""}]
nodes:
  - {id: one, run: "true"}
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def system(tmp_path_factory):
    from tests.support.temp_roots import remove_temp_root, temp_root

    root = temp_root("afe-")
    try:
        cfg = write_config(root, CONFIG)
        async with afe_system(cfg, Layout(root / "data", root / "run")) as sys_:
            yield sys_
    finally:
        remove_temp_root(root)


def _req(**kw) -> pb.CreateTicketRequest:
    base = {"workflow": "quick", "title": "A title", "body": "a body"}
    base.update(kw)
    return pb.CreateTicketRequest(**base)


BAD = [
    ("unknown workspace", _req(workspace="nope"), "unknown workspace 'nope'"),
    ("unknown workflow", _req(workflow="nope"), "unknown workflow 'nope'"),
    ("empty title", _req(title="   "), "title is empty"),
    ("title over cap", _req(title="t" * (MAX_TITLE_CHARS + 1)), f"limit is {MAX_TITLE_CHARS}"),
    ("body over cap", _req(body="b" * (MAX_BODY_BYTES + 1)), "64 KiB"),
    ("body over cap in bytes", _req(body="é" * (MAX_BODY_BYTES // 2 + 1)), "64 KiB"),
    ("unknown input", _req(inputs={"zzz": "1"}), "unknown input 'zzz'"),
]


async def _count(stub) -> int:
    return len((await stub.ListTickets(pb.ListTicketsRequest(page_size=500))).tickets)


@pytest.mark.parametrize(("case", "request_", "message"), BAD, ids=[b[0] for b in BAD])
async def test_bad_ticket_input_is_refused_and_nothing_stored(system, case, request_, message):
    before = await _count(system.stub)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await system.stub.CreateTicket(request_)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in exc.value.details()
    assert await _count(system.stub) == before


async def test_invalid_utf8_is_refused_and_nothing_stored(system):
    good = _req(title="TITLE!").SerializeToString()
    bad = good.replace(b"TITLE!", b"TI\xff\xfeE!")
    call = system.channel.unary_unary("/afe.scheduler.v1.Scheduler/CreateTicket",
                                      request_serializer=lambda b: b,
                                      response_deserializer=pb.Ticket.FromString)
    before = await _count(system.stub)
    # Positive control: the same raw path accepts the well-formed bytes.
    accepted = await call(good)
    assert accepted.title == "TITLE!"
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call(bad)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in exc.value.details()
    assert await _count(system.stub) == before + 1
    await wait_for_state(system.stub, accepted.id, {"succeeded"})


async def test_limits_are_inclusive_and_declared_inputs_accepted(system):
    t = await system.stub.CreateTicket(_req(title="t" * MAX_TITLE_CHARS, body="b" * MAX_BODY_BYTES, inputs={"issue": "42"}))
    assert t.inputs == {"issue": "42"} and len(t.body) == MAX_BODY_BYTES
    t = await wait_for_state(system.stub, t.id, {"succeeded", "failed"})
    assert state_name(t) == "succeeded"


@pytest.mark.parametrize("ticket_id", ["t-000000000000", "../etc", ""])
async def test_unknown_ticket_is_not_found(system, ticket_id):
    stub = system.stub
    calls = [
        stub.GetTicket(pb.GetTicketRequest(id=ticket_id)),
        stub.CancelTicket(pb.CancelTicketRequest(id=ticket_id, principal="p")),
        stub.ApproveTicket(pb.ApproveTicketRequest(id=ticket_id, principal="p")),
        stub.RejectTicket(pb.RejectTicketRequest(id=ticket_id, principal="p")),
        stub.GetTicketDiff(pb.GetTicketRequest(id=ticket_id)),
    ]
    for c in calls:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await c
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, follow=True)):
            pass
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unknown_event_seq_is_not_found_and_server_keeps_serving(system):
    stub = system.stub
    t = await stub.CreateTicket(_req())
    t = await wait_for_state(stub, t.id, {"succeeded"})
    last = t.last_seq
    # Positive control: the last seq and the one after it are valid cursors.
    got = [e.seq async for e in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=last, follow=True))]
    assert got == [last]
    assert [e async for e in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=last + 1))] == []
    for seq in (last + 2, 10**12):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=seq, follow=True)):
                pass
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and f"last seq is {last}" in exc.value.details()
    assert (await stub.GetTicket(pb.GetTicketRequest(id=t.id))).id == t.id


async def test_listing_pages_through_every_ticket_once(system):
    stub = system.stub
    seen, token = [], ""
    while True:
        r = await stub.ListTickets(pb.ListTicketsRequest(page_size=2, page_token=token))
        seen += [t.id for t in r.tickets]
        token = r.next_page_token
        if not token:
            break
    everything = (await stub.ListTickets(pb.ListTicketsRequest(page_size=500))).tickets
    assert seen == [t.id for t in everything] and len(seen) >= 3
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.ListTickets(pb.ListTicketsRequest(page_token="not-a-token"))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_approving_a_ticket_that_is_not_waiting_is_refused(system):
    t = await system.stub.CreateTicket(_req())
    t = await wait_for_state(system.stub, t.id, {"succeeded"})
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await system.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice"))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
