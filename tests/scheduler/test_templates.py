"""Templates reach only ticket fields and earlier node outputs; a value is
data and is never expanded again."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.scheduler import templates

TICKET = {"id": "t-1", "title": "Fix {{nodes.secret.output}}", "body": "{{ticket.title}} $(rm -rf /)",
          "inputs": {"issue": "42"}}


def test_values_are_substituted_once_and_stay_literal():
    out = templates.render("T={{ticket.title}} B={{ ticket.body }} I={{ticket.inputs.issue}} "
                           "P={{nodes.plan.output}}", TICKET, {"plan": "do {{ticket.id}}"})
    assert out == ("T=Fix {{nodes.secret.output}} B={{ticket.title}} $(rm -rf /) I=42 "
                   "P=do {{ticket.id}}")


def test_only_listed_outputs_are_reachable_and_unknown_references_stay_text():
    assert templates.render("{{nodes.other.output}}|{{env.HOME}}", TICKET, {}) == "|{{env.HOME}}"


@pytest.mark.parametrize(("template", "message"), [
    ("{{env.HOME}}", "unknown template reference"),
    ("{{nodes.later.output}}", "add it to `needs`"),
    ("{{ticket.inputs.nope}}", "does not declare"),
])
def test_check_refuses_what_a_template_may_not_reach(template, message):
    with pytest.raises(InvalidArgument, match=message):
        templates.check(template, earlier_nodes=["plan"], inputs=["issue"], where="node x")
    templates.check("{{nodes.plan.output}} {{ticket.inputs.issue}}", ["plan"], ["issue"], "node x")
