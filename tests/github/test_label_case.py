"""A Trigger's labels match GitHub's label names whatever their case, as
GitHub itself treats them (and as assignee logins already matched): a label
`BUG` set on GitHub starts the Trigger that names `bug`.

The positive control puts the old, case-sensitive comparison back and shows
the same delivery start nothing."""

from __future__ import annotations

import pytest

from services.scheduler.github import intake as github_intake

from .conftest import example

pytestmark = pytest.mark.timeout(120)


def _labeled_in_other_case(examples) -> dict:
    e = example(examples, "issues", "labeled")
    name = e["label"]["name"]                  # the Trigger's label (conftest.py writes it from this example)
    e["label"]["name"] = name.swapcase()
    assert e["label"]["name"] != name
    return e


async def test_a_label_in_another_case_starts_the_trigger(stack, examples):
    payload = _labeled_in_other_case(examples)
    stack.github.permissions[payload["sender"]["login"]] = "write"
    status, doc = await stack.post("issues", payload)
    assert status == 202 and doc["reason"] == "ok", doc
    assert len(stack.tickets()) == 1


async def test_positive_control_the_case_sensitive_comparison_starts_nothing(stack, examples, monkeypatch):
    monkeypatch.setattr(github_intake, "_label_matches", lambda label, labels: label in labels)
    payload = _labeled_in_other_case(examples)
    stack.github.permissions[payload["sender"]["login"]] = "write"
    status, doc = await stack.post("issues", payload)
    assert status == 202 and doc["reason"] == "no_trigger", doc
    assert stack.tickets() == []
