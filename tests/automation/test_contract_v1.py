"""The v1 promise of afe.scheduler.v1 (docs/AUTOMATION.md): fields, enum values
and RPCs are only ever added. Today's contract — compiled from the .proto file
itself and as generated into services/_gen — is compared with the committed
snapshot of what was published (proto/afe/scheduler/v1/published.json)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from scripts.proto_compat import ROOT, SNAPSHOT, breaking_changes, current, describe

pytestmark = pytest.mark.timeout(60)


def _compiled_from_proto(tmp_path) -> dict:
    out = tmp_path / "scheduler.pb"
    from grpc_tools import protoc

    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--descriptor_set_out={out}",
                        "afe/scheduler/v1/scheduler.proto"]) == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fdp,) = [f for f in fds.file if f.name == "afe/scheduler/v1/scheduler.proto"]
    return describe(fdp)


def _published() -> dict:
    return json.loads(SNAPSHOT.read_text())


def test_todays_contract_keeps_every_published_promise(tmp_path):
    published = _published()
    from_proto = _compiled_from_proto(tmp_path)
    assert breaking_changes(published, from_proto) == []
    assert breaking_changes(published, current()) == []
    # The generated stubs are the .proto file (no drift between what callers compile and what we serve).
    assert from_proto == current()


def test_the_snapshot_covers_every_rpc_of_the_service():
    rpcs = set(_published()["services"]["afe.scheduler.v1.Scheduler"])
    assert {"CreateTicket", "ListTickets", "GetTicket", "CancelTicket", "ApproveTicket", "RejectTicket",
            "WatchTicket", "GetTicketDiff", "ListWorkflows", "ListWorkspaces"} <= rpcs
    assert _published()["services"]["afe.scheduler.v1.Scheduler"]["WatchTicket"]["server_streaming"]


def _field(d: dict, msg: str, name: str) -> dict:
    return d["messages"][f"afe.scheduler.v1.{msg}"]["fields"][name]


# Positive controls: each mutation of today's contract is a breaking change the checker must name.
BREAKING = {
    "field removed": (lambda d: d["messages"]["afe.scheduler.v1.Ticket"]["fields"].pop("awaiting_sha"),
                      "field afe.scheduler.v1.Ticket.awaiting_sha (= 15) removed"),
    "field renumbered": (lambda d: _field(d, "Event", "seq").update(number=20),
                         "field afe.scheduler.v1.Event.seq: number changed 2 -> 20"),
    "field retyped": (lambda d: _field(d, "WatchTicketRequest", "from_seq").update(type="int32"),
                      "field afe.scheduler.v1.WatchTicketRequest.from_seq: type changed int64 -> int32"),
    "field message type changed": (lambda d: _field(d, "Ticket", "pr").update(type_name="afe.scheduler.v1.Approval"),
                                   "field afe.scheduler.v1.Ticket.pr: type_name changed"),
    "field made repeated": (lambda d: _field(d, "Ticket", "error").update(label="repeated"),
                            "field afe.scheduler.v1.Ticket.error: label changed optional -> repeated"),
    "field renamed": (lambda d: d["messages"]["afe.scheduler.v1.Ticket"]["fields"].update(
        head_sha=d["messages"]["afe.scheduler.v1.Ticket"]["fields"].pop("awaiting_sha")),
        "field afe.scheduler.v1.Ticket.awaiting_sha (= 15) removed (its number now belongs to head_sha)"),
    "rpc removed": (lambda d: d["services"]["afe.scheduler.v1.Scheduler"].pop("RejectTicket"),
                    "rpc afe.scheduler.v1.Scheduler/RejectTicket removed"),
    "rpc request type changed": (
        lambda d: d["services"]["afe.scheduler.v1.Scheduler"]["GetTicketDiff"].update(
            input="afe.scheduler.v1.TicketDiffRequest"),
        "rpc afe.scheduler.v1.Scheduler/GetTicketDiff: input changed"),
    "rpc response type changed": (
        lambda d: d["services"]["afe.scheduler.v1.Scheduler"]["ApproveTicket"].update(
            output="afe.scheduler.v1.Approval"),
        "rpc afe.scheduler.v1.Scheduler/ApproveTicket: output changed"),
    "rpc streaming changed": (
        lambda d: d["services"]["afe.scheduler.v1.Scheduler"]["WatchTicket"].update(server_streaming=False),
        "rpc afe.scheduler.v1.Scheduler/WatchTicket: server_streaming changed"),
    "message removed": (lambda d: d["messages"].pop("afe.scheduler.v1.TicketDiff"),
                        "message afe.scheduler.v1.TicketDiff removed"),
    "enum value removed": (lambda d: d["enums"]["afe.scheduler.v1.TicketState"].pop("TICKET_STATE_CANCELLED"),
                           "enum value afe.scheduler.v1.TicketState.TICKET_STATE_CANCELLED (= 6) removed"),
    "enum value renamed": (
        lambda d: d["enums"]["afe.scheduler.v1.TicketState"].update(
            QUEUED=d["enums"]["afe.scheduler.v1.TicketState"].pop("TICKET_STATE_QUEUED")),
        "enum value afe.scheduler.v1.TicketState.TICKET_STATE_QUEUED (= 1) removed"),
    "enum value renumbered": (lambda d: d["enums"]["afe.scheduler.v1.NodeState"].update(NODE_STATE_WAITING=8),
                              "enum value afe.scheduler.v1.NodeState.NODE_STATE_WAITING: number changed 7 -> 8"),
}


@pytest.mark.parametrize("case", sorted(BREAKING))
def test_checker_catches_a_breaking_change(case):
    mutate, expected = BREAKING[case]
    today = current()
    assert breaking_changes(_published(), today) == []      # control: unmutated, nothing breaks
    mutated = copy.deepcopy(today)
    mutate(mutated)
    problems = breaking_changes(_published(), mutated)
    assert any(p.startswith(expected) for p in problems), problems


ADDITIVE = {
    "field added": lambda d: d["messages"]["afe.scheduler.v1.Ticket"]["fields"].update(
        priority={"number": 16, "type": "int32", "type_name": "", "label": "optional"}),
    "rpc added": lambda d: d["services"]["afe.scheduler.v1.Scheduler"].update(
        PauseTicket={"input": "afe.scheduler.v1.GetTicketRequest", "output": "afe.scheduler.v1.Ticket",
                     "client_streaming": False, "server_streaming": False}),
    "message added": lambda d: d["messages"].update({"afe.scheduler.v1.Label": {"fields": {}}}),
    "enum value added": lambda d: d["enums"]["afe.scheduler.v1.NodeState"].update(NODE_STATE_RETRYING=8),
}


@pytest.mark.parametrize("case", sorted(ADDITIVE))
def test_checker_accepts_additions(case):
    mutated = copy.deepcopy(current())
    ADDITIVE[case](mutated)
    assert breaking_changes(_published(), mutated) == []


def test_checker_on_a_mutated_real_descriptor(tmp_path):
    """End to end on a real FileDescriptorProto (not the JSON form): renumber a field and drop an RPC."""
    from services._gen.afe.scheduler.v1 import scheduler_pb2

    fdp = descriptor_pb2.FileDescriptorProto()
    scheduler_pb2.DESCRIPTOR.CopyToProto(fdp)
    assert breaking_changes(_published(), describe(fdp)) == []
    (ticket,) = [m for m in fdp.message_type if m.name == "Ticket"]
    (state,) = [f for f in ticket.field if f.name == "state"]
    state.number = 99
    (svc,) = fdp.service
    keep = [m for m in svc.method if m.name != "CancelTicket"]
    del svc.method[:]
    svc.method.extend(keep)
    problems = breaking_changes(_published(), describe(fdp))
    assert "field afe.scheduler.v1.Ticket.state: number changed 7 -> 99" in problems
    assert "rpc afe.scheduler.v1.Scheduler/CancelTicket removed" in problems


def test_cli_check_passes_on_todays_contract():
    ok = subprocess.run([sys.executable, "scripts/proto_compat.py"], cwd=ROOT, capture_output=True, text=True,
                        check=False)
    assert ok.returncode == 0, ok.stderr
