"""One state vocabulary (services/common/states.py): the proto enums carry
its members under the standard prefixes with the numbers v1 always had, and
the store, the gateway's JSON-RPC, the CLI, the UI and the metrics use its
words."""

from __future__ import annotations

import re
from pathlib import Path

from gateway import convert
from gateway.app import STATES_JS
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.cli import tickets as cli
from services.common.observability import metrics
from services.common.states import TERMINAL, NodeState, TicketState
from services.scheduler.store import base as store

ROOT = Path(__file__).resolve().parents[2]

# The wire numbers of the first, unprefixed names: the rename keeps every one.
TICKET_NUMBERS = {"queued": 1, "running": 2, "waiting_approval": 3, "succeeded": 4, "failed": 5, "cancelled": 6}
NODE_NUMBERS = {"pending": 1, "running": 2, "succeeded": 3, "failed": 4, "skipped": 5, "cancelled": 6,
                "waiting": 7}


def test_proto_values_are_the_members_with_the_standard_prefix_and_the_old_numbers():
    assert {s.value: s.proto for s in TicketState} == TICKET_NUMBERS
    assert {s.value: s.proto for s in NodeState} == NODE_NUMBERS
    assert {n: v for n, v in pb.TicketState.items() if v} == {f"TICKET_STATE_{s.name}": s.proto for s in TicketState}
    assert {n: v for n, v in pb.NodeState.items() if v} == {f"NODE_STATE_{s.name}": s.proto for s in NodeState}
    assert all(TicketState.from_proto(s.proto) is s for s in TicketState)
    assert TicketState.from_proto(pb.TICKET_STATE_UNSPECIFIED) is None and NodeState.from_proto(99) is None


def test_every_place_uses_the_words_of_the_one_vocabulary():
    words = [s.value for s in TicketState]
    # the store keeps plain text, the same words as before (no migration)
    assert words == [store.QUEUED, store.RUNNING, store.WAITING_APPROVAL, store.SUCCEEDED, store.FAILED,
                     store.CANCELLED]
    assert all(type(w) is str for w in (store.QUEUED, *store.TERMINAL, *store.LIVE, store.N_WAITING))
    assert {s.value for s in TERMINAL} == store.TERMINAL
    # the gateway's JSON-RPC results
    assert list(convert.TICKET_STATES.values()) == words
    assert {s.proto: s.value for s in NodeState} == convert.NODE_STATES
    # the CLI and the metrics
    assert words == cli.STATES and set(cli.TERMINAL) == {s.value for s in TERMINAL}
    assert list(metrics.TICKET_STATES) == words
    # the UI imports its lists from /states.js, which the gateway makes from the enum
    app_js = (ROOT / "gateway" / "static" / "app.js").read_text()
    assert 'from "/states.js"' in app_js
    assert not re.search(r'(state ===?|cols\.get\()\s*"', app_js)   # no state word written out
    assert f"export const STATES = {words!r};".replace("'", '"') in STATES_JS
