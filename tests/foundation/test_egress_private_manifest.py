"""`sandbox.egressPrivate` on a Workspace (R11): host names that are also in
`sandbox.egress`, or private CIDR subnets; never loopback, link-local or
multicast; each error names the field and what to change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

DOC = """\
kind: Workspace
name: ws
repo: /tmp/nowhere.git
sandbox:
  egress: [pypi.org, mirror.internal, .corp.example]
  egressPrivate: %s
---
kind: Workflow
name: wf
workspace: ws
nodes:
  - id: a
    run: "true"
"""


def load(tmp_path: Path, private: str):
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    (cfg / "afe.yaml").write_text(DOC % private)
    return load_config(cfg)


def test_r11_names_and_cidrs_are_accepted(tmp_path):
    ws = load(tmp_path, "[mirror.internal, git.corp.example, 10.20.0.0/16, 10.30.1.7, 'fd00:1::/64']").workspaces["ws"]
    assert ws.sandbox.egress_private == ("mirror.internal", "git.corp.example", "10.20.0.0/16", "10.30.1.7/32",
                                         "fd00:1::/64")


def test_r11_default_is_empty(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "afe.yaml").write_text(DOC.replace("  egressPrivate: %s\n", ""))
    assert load_config(cfg).workspaces["ws"].sandbox.egress_private == ()


@pytest.mark.parametrize(("private", "message"), [
    ("[other.internal]", "sandbox.egressPrivate[0]: 'other.internal' is not in sandbox.egress; add it there too"),
    ("[127.0.0.0/8]", "sandbox.egressPrivate[0]: '127.0.0.0/8' overlaps loopback"),
    ("[0.0.0.0/0]", "sandbox.egressPrivate[0]: '0.0.0.0/0' overlaps loopback"),
    ("[169.254.169.254]", "overlaps loopback, link-local"),
    ("['fe80::/10']", "overlaps loopback, link-local"),
    ("['http://mirror.internal/']", "is neither a host name (mirror.internal, .corp.example) nor a CIDR subnet"),
    ("mirror.internal", "sandbox.egressPrivate: must be a list"),
])
def test_r11_bad_entries_name_the_field(tmp_path, private, message):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, private)
    assert message in str(exc.value)


def test_r11_private_without_egress_is_refused(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "afe.yaml").write_text(DOC.replace("  egress: [pypi.org, mirror.internal, .corp.example]\n", "")
                                  % "[10.20.0.0/16]")
    with pytest.raises(ConfigError,
                       match=re.escape("sandbox.egressPrivate: has no effect without sandbox.egress")):
        load_config(cfg)
