"""R43 (R9, R42): when a ticket's sandbox is made, the variable NAMES its
agents take into it are a `sandbox.env_names` event and part of the run
record's agents; never a value. A workflow whose agents declare none has no
such event (the control: the event follows the manifest)."""

from __future__ import annotations

import json

import pytest

from services.scheduler.executor.nodes import run_statement
from services.scheduler.sandboxes.spec import agent_env_names
from services.scheduler.store.base import FAILED

pytestmark = pytest.mark.timeout(10)

WORKFLOWS = """\
kind: Agent
name: coder
type: acp
command: [coder-acp]
env: [FOO_SETTING, BAR_MODE]
---
kind: Agent
name: reviewer
type: acp
command: [reviewer-acp]
---
kind: Workflow
name: with-env
workspace: ws
nodes:
  - {id: first, run: "echo setup; exit 3"}
  - {id: code, agent: coder, prompt: "do it", needs: [first]}
  - {id: review, agent: reviewer, prompt: "look", needs: [first]}
---
kind: Workflow
name: without-env
workspace: ws
nodes:
  - {id: first, run: "echo setup; exit 3"}
  - {id: review, agent: reviewer, prompt: "look", needs: [first]}
"""


async def test_r43_the_names_that_entered_the_sandbox_are_an_event_and_in_the_run_record(harness, monkeypatch):
    monkeypatch.setenv("FOO_SETTING", "value-canary-3141")     # a value: never in an event
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.create("with-env")
    assert (await h.until(tid)).state == FAILED                 # the agents never start: run fails first
    events = h.events(tid, "sandbox.env_names")
    assert [p for _, p in events] == [{"names": ["BAR_MODE", "FOO_SETTING"],
                                       "agents": {"coder": ["BAR_MODE", "FOO_SETTING"]}}]
    assert "value-canary-3141" not in json.dumps(h.events(tid))
    wf = h.config.workflows["with-env"]
    agents = {a["name"]: a for a in run_statement._agents(h.config, wf)}
    assert agents["coder"]["env_names"] == ["BAR_MODE", "FOO_SETTING"]
    assert agents["reviewer"]["env_names"] == []

    # control: no agent declares a name, no event
    tid2 = h.create("without-env")
    await h.until(tid2)
    assert h.events(tid2, "sandbox.ready") and not h.events(tid2, "sandbox.env_names")
    assert agent_env_names(h.config, h.config.workflows["without-env"]) == {}
