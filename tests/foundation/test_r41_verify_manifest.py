"""R41: a Workflow's `verify:` — accepted with its defaults, refused with a
message naming the field and what to change (empty run list, a base path
that is absolute, holds `..`, or is empty), and in the published schema."""

from __future__ import annotations

import pytest

from services.common.manifests import load_config
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
])
def test_r41_bad_verify_is_refused(tmp_path, verify, expected):
    assert expected in errors_of(tmp_path, _config(tmp_path, verify))


def test_r41_verify_is_in_the_manifest_schema():
    schema = manifest_json_schema()
    decl = schema["$defs"]["VerifyDecl"]
    assert set(decl["properties"]) == {"run", "base_paths", "timeout"} and decl["required"] == ["run"]
