"""R41: a Workflow's `verify:` — accepted with its defaults, refused with a
message naming the field and what to change (empty run list, a base path
that is absolute, holds `..`, or is empty), and in the published schema."""

from __future__ import annotations

import pytest

from services.common.config.manifests import load_config
from services.common.schema.manifest_schema import manifest_json_schema
from tests.foundation.test_manifests import MODEL, WORKSPACE, errors_of, write

FLOW = """\
kind: Workflow
name: wf
workspace: shop
{verify}
nodes:
  - {{id: test, run: "pytest -q"}}
"""


def _config(tmp_path, verify: str) -> str:
    return "---\n".join([WORKSPACE, MODEL, FLOW.format(verify=verify)])


def test_r41_verify_is_read_with_its_defaults(tmp_path):
    cfg = load_config(write(tmp_path, _config(tmp_path, 'verify:\n  run: ["python -m pytest -q", "echo {{ticket.id}}"]')))
    v = cfg.workflows["wf"].verify
    assert v is not None and v.run == ("python -m pytest -q", "echo {{ticket.id}}")
    assert v.base_paths == () and v.timeout_s == 900.0
    cfg = load_config(write(tmp_path, _config(tmp_path, "verify:\n  run: [make test]\n  base_paths: [tests/, docs]\n"
                                                           "  timeout: 60")))
    v = cfg.workflows["wf"].verify
    assert v is not None and v.base_paths == ("tests/", "docs") and v.timeout_s == 60.0
    cfg = load_config(write(tmp_path, _config(tmp_path, "")))
    assert cfg.workflows["wf"].verify is None


@pytest.mark.parametrize("verify, expected", [
    ("verify:\n  run: []", "verify.run: must not be empty"),
    ("verify: {}", "verify.run: required field is missing"),
    ("verify: [make]", "verify: must be a mapping"),
    ("verify:\n  run: [make]\n  base_paths: [/etc]", "verify.base_paths[0]: '/etc' is absolute"),
    ("verify:\n  run: [make]\n  base_paths: [tests/../..]", "contains '..'"),
    ("verify:\n  run: [make]\n  base_paths: [tests, '']", "verify.base_paths[1]: must be a non-empty"),
    ("verify:\n  run: [make]\n  base_paths: ['  ']", "is empty"),
    ("verify:\n  run: [make]\n  timeout: 0", "verify.timeout: must be greater than 0"),
    ("verify:\n  run: [make]\n  image: evil", "verify.image: unknown field"),
    ("verify:\n  run: [make]\n  base_paths: ['tests/*.py']",
     "verify.base_paths[0]: 'tests/*.py' is a pattern, but base paths are taken literally; name tests/ instead"),
    ("verify:\n  run: [make]\n  base_paths: ['test_[ab].py']", "is a pattern"),
])
def test_r41_bad_verify_is_refused(tmp_path, verify, expected):
    assert expected in errors_of(tmp_path, _config(tmp_path, verify))


def test_r41_verify_is_in_the_manifest_schema():
    schema = manifest_json_schema()
    decl = schema["$defs"]["VerifyDecl"]
    assert set(decl["properties"]) == {"run", "base_paths", "timeout"} and decl["required"] == ["run"]


def test_r41_a_workspace_extends_the_harness(tmp_path):
    ws = WORKSPACE.rstrip("\n") + "\nverifyHarness: [scripts/ci.sh, ci/*.cfg, tools/]\n"
    cfg = load_config(write(tmp_path, "---\n".join([ws, MODEL, FLOW.format(verify="verify: {run: [make]}")])))
    assert cfg.workspaces["shop"].verify_harness == ("scripts/ci.sh", "ci/*.cfg", "tools/")
    for bad, expected in (("[../x]", "verifyHarness[0]: '../x' must not contain . or .."),
                          ("['/etc/x']", "must be a plain path relative to the repository root"),
                          ("[.git/hooks/]", "names git's own folder")):
        ws = WORKSPACE.rstrip("\n") + f"\nverifyHarness: {bad}\n"
        assert expected in errors_of(tmp_path, "---\n".join([ws, MODEL, FLOW.format(verify="")]))
