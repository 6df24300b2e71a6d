"""A model's tool arguments that are not valid UTF-8 (a lone surrogate such as
"\\udc80", which JSON can escape) become a tool error the model sees; the
loop goes on to the model's final answer. Positive control: such a string
cannot cross gRPC at all (protobuf strings are UTF-8), which is what ended
the node with "internal error" before."""

from __future__ import annotations

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import all_events, payload, state_name, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

SCRIPT = r"""
responses:
  - content: "Reading."
    tool_calls:
      - {name: read_file, arguments: '{"path": "a\udc80.txt"}'}
      - {name: write_file, arguments: '{"path": "ok.txt", "content": "x\ud800y"}'}
      - {name: list_dir, arguments: '{"path": "."}'}
  - content: "Done after the errors."
"""

CONFIG = """\
kind: Model
name: scripted
provider: replay
script: script.yaml
---
kind: Workflow
name: odd-args
workspace: ws
nodes:
  - {id: think, model: scripted, prompt: "Fix it", tools: [read_file, write_file, list_dir], max_turns: 5}
"""


def test_positive_control_protobuf_refuses_lone_surrogates():
    with pytest.raises((ValueError, UnicodeError)):
        spb.ReadFileRequest(ticket_id="t", path="a\udc80.txt").SerializeToString()


async def test_non_utf8_tool_arguments_are_a_tool_error_and_the_loop_goes_on(short_tmp):
    cfg = write_config(short_tmp, CONFIG, files={"script.yaml": SCRIPT})
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="odd-args", title="odd"))
        done = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
        events = await all_events(sys_.stub, t.id)
        results = [payload(e) for e in events if e.type == "node.tool_result"]
        assert state_name(done) == "succeeded", done.error
        assert [(r["name"], r["ok"]) for r in results] == [("read_file", False), ("write_file", False),
                                                          ("list_dir", True)]
        assert "argument 'path' is not valid UTF-8" in results[0]["result"]
        assert "argument 'content' is not valid UTF-8" in results[1]["result"]
        messages = [payload(e) for e in events if e.type == "node.message"]
        assert messages[-1]["content"] == "Done after the errors." and len(messages) == 2
