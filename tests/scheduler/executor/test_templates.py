"""Templates reach only ticket fields and earlier node outputs; a value is
data and is never expanded again."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.scheduler.executor import templates

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


# ---- run: commands (R36) ----------------------------------------------------------

# Quotes balanced so the naive control parses; the lone quotes are in ODD (checked on the safe path only).
HOSTILE = "$(touch {marker}) `touch {marker}`; touch {marker} 'single' \"double\" \\ {{{{ticket.id}}}} $HOME"
ODD = " it's a \" lone quote"


def _bash(script: str, args: list[str], cwd) -> str:
    import subprocess

    from services.scheduler.executor.nodes.run import command_argv

    argv = command_argv(script, args)   # the same argv the sandbox runs
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, timeout=30).stdout


@pytest.mark.parametrize("script", [
    "printf '<%s>' {{ticket.inputs.issue}}",             # unquoted
    'printf \'<%s>\' "{{ticket.inputs.issue}}"',         # the author quoted it themselves
    'printf \'<%s>\' "title: {{ticket.inputs.issue}}!"',  # inside a longer double-quoted string
])
def test_r36_run_command_input_reaches_the_command_as_one_literal_argument(tmp_path, script):
    marker = tmp_path / "x"
    value = HOSTILE.format(marker=marker)
    prefix = "title: " if "title:" in script else ""
    suffix = "!" if "title:" in script else ""
    for v in (value, value + ODD):
        ticket = {"id": "t-1", "title": "t", "body": "", "inputs": {"issue": v}}
        rendered, args = templates.render_command(script, ticket, {})
        out = _bash(rendered, args, tmp_path)
        assert out == f"<{prefix}{v}{suffix}>"          # one argument, byte for byte
        assert not marker.exists()                      # nothing in it ran
    ticket = {"id": "t-1", "title": "t", "body": "", "inputs": {"issue": value}}

    # Positive control: substituting the text into the line (as prompts are) runs the attacker's command.
    naive = templates.render(script, ticket, {})
    _bash(naive, [], tmp_path)
    assert marker.exists()


def test_r36_run_command_outputs_and_many_values_are_positional_parameters(tmp_path):
    ticket = {"id": "t-1", "title": "a b", "body": "", "inputs": {}}
    outputs = {f"n{i}": f"v{i}" for i in range(12)}
    script = "printf '%s|' {{ticket.title}} " + " ".join(f"{{{{nodes.n{i}.output}}}}" for i in range(12))
    rendered, args = templates.render_command(script, ticket, outputs)
    assert "${11}" in rendered and args[0] == "a b"
    assert _bash(rendered, args, tmp_path) == "a b|" + "".join(f"v{i}|" for i in range(12))


def test_run_command_reference_in_single_quotes_is_refused_at_check():
    with pytest.raises(InvalidArgument, match="single quotes"):
        templates.check("echo '{{ticket.title}}'", [], [], "node x", command=True)
    templates.check("echo '{{ticket.title}}'", [], [], "node x")   # a prompt may quote it
    templates.check("echo \"it's {{ticket.title}}\" \\'", [], [], "node x", command=True)


def test_check_refuses_an_input_when_the_workflow_declares_none():
    with pytest.raises(InvalidArgument, match="declared: none"):
        templates.check("{{ticket.inputs.issue}}", [], [], "node x")


def test_too_large_value_for_an_argument_says_to_use_a_file():
    ticket = {"id": "t", "title": "t", "body": "", "inputs": {}}
    with pytest.raises(InvalidArgument, match="write it to a file"):
        templates.render_command("cat {{nodes.a.output}}", ticket, {"a": "x" * (templates.MAX_ARG_BYTES + 1)})
