"""`on_ci_failure` on a Workflow (docs/GITHUB.md, "Failing CI"): the bound of
CI rounds, with errors that say what to change."""

from __future__ import annotations

import pytest

from services.common.config.manifests import load_config
from services.common.errors import AfeError

DOC = """kind: Workspace
name: hello
repo: https://github.com/a/b.git
---
kind: Workflow
name: fix
workspace: hello
{line}
nodes:
  - id: work
    run: "echo working"
"""


def _load(tmp_path, line: str):
    (tmp_path / "afe.yaml").write_text(DOC.format(line=line))
    return load_config(tmp_path).workflows["fix"]


@pytest.mark.parametrize(("line", "rounds"), [("", 0), ("on_ci_failure: {}", 3), ("on_ci_failure: {max: 5}", 5)])
def test_rounds(tmp_path, line, rounds):
    assert _load(tmp_path, line).ci_rounds == rounds


@pytest.mark.parametrize(("line", "says"), [
    ("on_ci_failure: {max: 30}", "on_ci_failure.max: at most 20 rounds"),
    ("on_ci_failure: {max: 0}", "on_ci_failure.max: must be at least 1"),
    ("on_ci_failure: {rounds: 2}", "unknown field 'rounds'"),
    ("on_ci_failure: 3", "on_ci_failure: must be a mapping: on_ci_failure: {max: 3}"),
])
def test_errors_say_what_to_change(tmp_path, line, says):
    with pytest.raises(AfeError) as e:
        _load(tmp_path, line)
    assert says in str(e.value)
