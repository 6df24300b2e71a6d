"""One set of ticket limits (services/common/schema/tickets.py) for the
gateway's JSON-RPC params, the scheduler's CreateTicket check and the CLI:
each layer accepts a value exactly at a limit and refuses one past it, with
a message that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config.model import Config, Node, Workflow, Workspace
from services.common.errors import InvalidArgument
from services.common.schema.rpc import TICKET_STATE_NAMES, parse_params
from services.common.schema.tickets import MAX_BODY_BYTES, MAX_INPUT_BYTES, MAX_INPUTS, MAX_TITLE_CHARS
from services.scheduler.engine import tickets as scheduler_tickets

NAMES = [f"in_{i}" for i in range(MAX_INPUTS + 1)]
CONFIG = Config(directory=Path("/nowhere"),
                workspaces={"ws": Workspace(name="ws", repo="/nowhere/ws.git")},
                workflows={"wf": Workflow(name="wf", nodes=(Node(id="a", kind="run", run="true"),),
                                          workspace="ws", inputs=tuple(NAMES),
                                          input_defaults=tuple((n, "") for n in NAMES))})


def _gateway(**kw) -> None:
    parse_params("tickets.create", {"workflow": "wf", "title": "t", **kw})


def _scheduler(**kw) -> None:
    base = {"title": "t", "body": "", "inputs": {}}
    base.update(kw)
    scheduler_tickets.validate(CONFIG, "", "wf", base["title"], base["body"], base["inputs"], "p")


def _cli(**kw) -> None:
    from services.cli.tickets import CliError, _check_create

    try:
        _check_create({"workspace": "", "workflow": "wf", "title": "t", "body": "", "inputs": {}, **kw})
    except CliError as exc:
        raise InvalidArgument(str(exc)) from None


LAYERS = {"gateway": _gateway, "scheduler": _scheduler, "cli": _cli}

# (case, the value just at the limit, the value just past it, a fragment of the refusal)
EDGES = [
    ("title", {"title": "t" * MAX_TITLE_CHARS}, {"title": "t" * (MAX_TITLE_CHARS + 1)},
     f"'title' must be at most {MAX_TITLE_CHARS} characters"),
    ("blank-title", {"title": " t "}, {"title": "   "}, "the title is empty"),
    ("body-bytes", {"body": "é" * (MAX_BODY_BYTES // 2)}, {"body": "é" * (MAX_BODY_BYTES // 2) + "b"},
     "'body' must be at most 65536 bytes of UTF-8 (64 KiB)"),
    ("input-bytes", {"inputs": {"in_0": "é" * (MAX_INPUT_BYTES // 2)}},
     {"inputs": {"in_0": "é" * (MAX_INPUT_BYTES // 2) + "x"}}, f"at most {MAX_INPUT_BYTES} bytes"),
    ("input-count", {"inputs": {n: "v" for n in NAMES[:MAX_INPUTS]}}, {"inputs": {n: "v" for n in NAMES}},
     f"'inputs' may hold at most {MAX_INPUTS} entries"),
    ("input-name", {"inputs": {"in_1": "v"}}, {"inputs": {"in-1": "v"}}, "keys must be input names"),
]


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("case,ok,bad,message", EDGES, ids=[e[0] for e in EDGES])
def test_every_layer_has_the_same_limit(layer, case, ok, bad, message):
    check = LAYERS[layer]
    check(**ok)                       # the control: at the limit is accepted
    with pytest.raises(InvalidArgument) as info:
        check(**bad)
    assert message in str(info.value)


def test_scheduler_returns_the_trimmed_title_and_its_old_constants_are_the_shared_ones():
    t = scheduler_tickets.validate(CONFIG, "", "wf", "  hello  ", "", {}, "p")
    assert t.title == "hello" and t.workspace.name == "ws"
    assert scheduler_tickets.MAX_TITLE_CHARS == MAX_TITLE_CHARS == 200
    assert scheduler_tickets.MAX_BODY_BYTES == MAX_BODY_BYTES == 65536


def test_rpc_states_are_the_gateways_state_names():
    from gateway import convert

    assert set(TICKET_STATE_NAMES) == set(convert.TICKET_STATE_BY_NAME)


def test_params_of_every_method_refuse_unknown_fields_and_fill_defaults():
    assert parse_params("tickets.watch", {"id": "t-1"}) == {"id": "t-1", "from_seq": 0, "follow": True}
    assert parse_params("tickets.create", {"workflow": "wf", "title": "x", "body": None})["body"] == ""
    with pytest.raises(InvalidArgument, match=r"unknown field\(s\) 'sql'; allowed: id"):
        parse_params("tickets.get", {"id": "t-1", "sql": "x"})
