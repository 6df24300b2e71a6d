"""`afe check --schema`: the JSON Schema (draft 2020-12) of the manifests,
generated from the pydantic models whose fields the loader allows. Every
example we ship (the bundled demo, README.md and the docs) validates against
it; documents `afe check` refuses for their shape are refused by the schema
too (the control that shows the schema is not vacuous)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from services.common import demo
from services.common.config.manifests import load_config
from services.common.errors import ConfigError
from services.common.schema import KINDS
from services.common.schema.manifest_schema import MANIFEST_MODELS
from services.common.schema.text import fields_of

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    import contextlib
    import io

    from services.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["check", "--schema"]) == 0
    schema = json.loads(out.getvalue())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict) and d.get("kind") in KINDS]


def _doc_examples() -> list[tuple[str, dict]]:
    found = []
    for path in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.DOTALL):
            if not re.search(r"^kind:", block, re.MULTILINE):
                continue    # an excerpt of a manifest (e.g. a few nodes, `...` for the rest), not a document
            found += [(f"{path.name}:{d['kind']}:{d.get('name')}", d) for d in _documents(block)]
    return found


def test_bundled_demo_validates_against_the_schema(validator, tmp_path):
    folder = demo.materialize(tmp_path / "demo")
    docs = [d for p in sorted(folder.glob("*.yaml")) for d in _documents(p.read_text())]
    assert {d["kind"] for d in docs} >= {"Workspace", "Workflow"}
    for d in docs:
        assert not list(validator.iter_errors(d)), d


def test_docs_examples_validate_against_the_schema(validator):
    examples = _doc_examples()
    assert {k.split(":")[1] for k, _ in examples} == set(KINDS)   # every kind has an example
    for where, d in examples:
        problems = [e.message for e in validator.iter_errors(d)]
        assert not problems, (where, problems)


# Documents whose shape is wrong: both the schema and `afe check` refuse them.
BAD_SHAPES = [
    ("unknown-field", "kind: Workspace\nname: shop\nrepo: /r.git\ncolour: red\n", "colour"),
    ("missing-repo", "kind: Workspace\nname: shop\n", "repo"),
    ("bad-provider", "kind: Model\nname: m\nprovider: llama\n", "provider"),
    ("env-value", "kind: Agent\nname: a\ntype: acp\ncommand: [x]\nenv: [lower]\n", "env[0]"),
    ("no-command-or-preset", "kind: Agent\nname: a\ntype: acp\n", "command"),
    ("two-node-kinds", "kind: Workflow\nname: w\nnodes: [{id: a, run: x, uses: 'builtin:merge'}]\n", "nodes[0]"),
    ("node-field-of-other-kind", "kind: Workflow\nname: w\nnodes: [{id: a, run: x, prompt: p}]\n",
     "nodes[0].prompt"),
    ("zero-pids", "kind: Workspace\nname: s\nrepo: /r.git\nsandbox: {limits: {pids: 0}}\n",
     "sandbox.limits.pids"),
    ("trigger-field", ("kind: Trigger\nname: t\nworkspace: w\nworkflow: f\nwhen: {labels: [a]}\n"
                       "inputs: {issue: colour}\n"), "inputs.issue"),
    ("unknown-kind", "kind: Gadget\nname: g\n", "kind"),
]


@pytest.mark.parametrize("case,text,field", BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_a_bad_shape_is_refused_by_schema_and_by_afe_check(validator, tmp_path, case, text, field):
    assert list(validator.iter_errors(yaml.safe_load(text))), case
    (tmp_path / "afe.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert f"afe.yaml#1 {field}" in str(info.value)


def test_the_schema_lists_the_fields_the_loader_allows(validator):
    """One declaration: each kind's schema properties are the keys the loader accepts."""
    defs = validator.schema["$defs"]
    for model in MANIFEST_MODELS:
        assert list(defs[model.__name__]["properties"]) == list(fields_of(model))
