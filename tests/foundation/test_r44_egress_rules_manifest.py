"""Egress rules in a Workspace (R44): `egress: [pypi.org]` keeps its meaning;
an entry may bind a host to methods and paths or to a preset; `afe check`
refuses what the proxy could not enforce, naming the field and what to
write, and says what each rule and preset allows. The SandboxSpec of every
sandbox of the workspace (a ticket's, the clean room's) carries the rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config.egress_rules import ENTRY_FIELDS, PRESETS, EgressRule, check_rules, preset_rules
from services.common.config.manifests import load_config
from services.common.errors import ConfigError
from services.common.schema.text import fields_of
from services.common.schema.workspace import EgressRuleManifest
from services.scheduler.executor.nodes.verification import verify_spec
from services.scheduler.sandboxes.spec import sandbox_spec
from tests.support.fakes.git_http import make_bare_repo

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]

DOC = """\
kind: Workspace
name: ws
repo: /tmp/nowhere.git
sandbox:
  egress: %s
---
kind: Workflow
name: wf
workspace: ws
nodes:
  - id: a
    run: "true"
"""


def load(tmp_path: Path, egress: str):
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    (cfg / "afe.yaml").write_text(DOC % egress)
    return load_config(cfg)


def errors(tmp_path: Path, egress: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, egress)
    return str(exc.value)


def test_r44_plain_names_keep_their_meaning(tmp_path):
    sb = load(tmp_path, "[pypi.org, .example.com]").workspaces["ws"].sandbox
    assert sb.egress == ("pypi.org", ".example.com") and sb.egress_rules == ()


def test_r44_presets_and_own_rules(tmp_path):
    cfg = load(tmp_path, """
    - pypi.org
    - {host: registry.npmjs.org, preset: read-only}
    - {host: github.com, preset: git-fetch}
    - {host: api.example.com, methods: [GET, HEAD], paths: ["/v1/items/**", "/v1/search?q=x"]}
    - {host: api.example.com, methods: [POST], paths: ["/v1/echo"], pathCase: insensitive}""")
    sb = cfg.workspaces["ws"].sandbox
    assert sb.egress == ("pypi.org", "registry.npmjs.org", "github.com", "api.example.com")
    assert sb.egress_rules == (
        EgressRule("registry.npmjs.org", ("GET", "HEAD"), (), "read-only"),
        EgressRule("github.com", ("GET",), ("/**/info/refs?service=git-upload-pack",), "git-fetch"),
        EgressRule("github.com", ("POST",), ("/**/git-upload-pack",), "git-fetch"),
        EgressRule("api.example.com", ("GET", "HEAD"), ("/v1/items/**", "/v1/search?q=x"), "sandbox.egress[3]"),
        EgressRule("api.example.com", ("POST",), ("/v1/echo",), "sandbox.egress[4]", ignore_case=True),
    )
    # every sandbox of the workspace gets them: the ticket's and the clean room's (R41)
    for spec in (sandbox_spec(cfg, cfg.workflows["wf"], cfg.workspaces["ws"]), verify_spec(cfg.workspaces["ws"])):
        assert [(r.host, list(r.methods), list(r.paths), r.name, r.ignore_case) for r in spec.egress_rules] == [
            (r.host, list(r.methods), list(r.paths), r.name, r.ignore_case) for r in sb.egress_rules]
        assert list(spec.egress) == list(sb.egress)
    # what the scheduler sends, the broker accepts
    assert check_rules(sb.egress_rules, sb.egress) == sb.egress_rules


@pytest.mark.parametrize(("egress", "said"), [
    ("[{host: x.org, preset: write-all}]", ("sandbox.egress[0].preset: 'write-all' is not a preset; choose one of: "
     "read-only (")),
    ("[{host: x.org}]", ("sandbox.egress[0]: needs methods, paths or a preset; for the whole host write the name "
     "alone (- x.org)")),
    ("[{host: x.org, preset: read-only, methods: [POST]}]", "has both preset and methods/paths"),
    ("[{host: x.org, methods: [get]}]", ("sandbox.egress[0].methods[0]: 'get' is not an HTTP method; write it in "
     "capitals")),
    ("[{host: x.org, methods: [CONNECT]}]", "CONNECT cannot be allowed"),
    ("[{host: x.org, methods: []}]", "sandbox.egress[0].methods: is empty, which would allow nothing"),
    ("[{host: x.org, paths: [v1/x]}]", "'v1/x' must start with /"),
    ("[{host: x.org, paths: ['/v1/%2e%2e/x']}]", "must be written decoded (no %-escapes)"),
    ("[{host: x.org, paths: ['/v1/../admin']}]", "has a dot segment"),
    ("[{host: x.org, paths: ['/v1//x']}]", "has an empty segment (//)"),
    ("[{host: x.org, paths: ['/v1/a**']}]", "uses ** inside a segment"),
    ("[{host: x.org, paths: ['/a b']}]", "has characters a path cannot hold"),
    ("[{host: x.org, paths: ['/x?*']}]", "has a query part that is not name=value pairs"),
    ("[{host: x.org, methods: [GET], pathCase: upper}]", "sandbox.egress[0].pathCase: is sensitive"),
    ("[{host: x.org, preset: read-only, pathCase: insensitive}]", "applies to your own paths"),
    ("[{host: 'https://x.org', preset: read-only}]", "sandbox.egress[0].host: write a lower-case host name"),
    ("[{host: 10.0.0.1, preset: read-only}]", "is an IP address"),
    ("[{host: x.org, preset: read-only, port: 443}]", ("sandbox.egress[0].port: unknown field; allowed here: host, "
     "preset, methods, paths, pathCase")),
    ("[x.org, {host: x.org, preset: read-only}]", ("x.org is listed both alone (every request allowed) and with "
     "rules; keep one")),
    ("[.x.org, {host: a.x.org, preset: read-only}]", ".x.org (no rules) covers a.x.org, which has rules"),
    ("[a.x.org, {host: .x.org, preset: read-only}]", ".x.org has rules that cover a.x.org, listed alone"),
    ("[42]", "sandbox.egress[0]: '42' is not valid"),
])
def test_r44_afe_check_refuses_rules_the_proxy_could_not_enforce(tmp_path, egress, said):
    assert said in errors(tmp_path, egress)


def test_r44_manifest_schema_and_presets_agree():
    assert fields_of(EgressRuleManifest) == ENTRY_FIELDS
    props = EgressRuleManifest.model_json_schema()["properties"]
    assert set(props["preset"]["anyOf"][0]["enum"]) == set(PRESETS)
    for p in PRESETS.values():
        assert p.summary in props["preset"]["description"]
        for methods, _paths in p.clauses:
            assert "CONNECT" not in methods
    # read-only allows no write method; git-fetch never names receive-pack as allowed
    assert all(m in ("GET", "HEAD") for r in preset_rules("h", "read-only") for m in r.methods)
    assert not any("receive-pack" in p for r in preset_rules("h", "git-fetch") for p in r.paths)


def test_r44_afe_check_says_what_each_rule_allows(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    make_bare_repo(cfg, "repo.git", {"README": "x\n"})
    (cfg / "afe.yaml").write_text((DOC % "[{host: registry.npmjs.org, preset: read-only}, "
                                        "{host: github.com, preset: git-fetch}, "
                                         "{host: api.example.com, methods: [GET], paths: ['/v1/**']}]")
                                  .replace("/tmp/nowhere.git", "repo.git"))
    p = subprocess.run([sys.executable, "-m", "services.cli.main", "check", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("  egress rule of workspace ws: registry.npmjs.org: preset read-only: GET and HEAD on any path: "
            "downloads") in p.stdout
    assert "  egress rule of workspace ws: github.com: preset git-fetch: git clone and fetch over smart HTTP" \
        in p.stdout
    assert "git push (git-receive-pack) and everything else is refused" in p.stdout
    assert "  egress rule of workspace ws: api.example.com: sandbox.egress[2]: GET on /v1/**" in p.stdout
    assert p.stdout.count("github.com: preset git-fetch") == 1           # a preset's clauses shown once
