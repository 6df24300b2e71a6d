"""`afe up --egress-network NAME` reaches the sandbox broker (and only it),
and the banner / `afe doctor` summary names the network and each
Workspace's private egress entries; defaults stay as today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.launcher.launch import Options, build_specs, egress_lines, make_links

from .launcher_support import base_env, make_config

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def argv_of(tmp_path: Path, **kw) -> dict[str, list[str]]:
    cfg = make_config(tmp_path)
    opts = Options(config_dir=cfg, layout=Layout(tmp_path / "d", tmp_path / "r"), check_images=False, **kw)
    links, _ = make_links()
    return {s.service: s.argv for s in build_specs(opts, load_config(cfg), base_env(), links)}


def test_egress_network_goes_to_the_sandbox_broker_only(tmp_path):
    argv = argv_of(tmp_path, egress_network="corp-mirror-net")
    i = argv["sandbox"].index("--egress-network")
    assert argv["sandbox"][i + 1] == "corp-mirror-net"
    assert all("--egress-network" not in a for s, a in argv.items() if s != "sandbox")


def test_default_egress_network_adds_no_flag(tmp_path):
    assert all("--egress-network" not in a for a in argv_of(tmp_path).values())


def test_banner_lines_name_the_network_and_private_entries(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "afe.yaml").write_text("""\
kind: Workspace
name: shop
repo: /tmp/nowhere.git
sandbox:
  egress: [pypi.org, mirror.internal]
  egressPrivate: [mirror.internal, 10.20.0.0/16]
---
kind: Workspace
name: plain
repo: /tmp/nowhere.git
---
kind: Workflow
name: wf
nodes:
  - id: a
    run: "true"
""")
    assert egress_lines(load_config(cfg), "corp-mirror-net") == [
        "  egress network: corp-mirror-net (the egress proxies join it; --egress-network)",
        "  private egress: shop: mirror.internal, 10.20.0.0/16"]
    (cfg / "afe.yaml").write_text((cfg / "afe.yaml").read_text().replace(
        "  egressPrivate: [mirror.internal, 10.20.0.0/16]\n", ""))
    assert egress_lines(load_config(cfg), "bridge")[1] == "  private egress: none (every private address is refused)"


def test_cli_accepts_egress_network():
    for cmd in ("up", "doctor"):
        r = subprocess.run([sys.executable, "-m", "services.cli.main", cmd, "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=False, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0 and "--egress-network NAME" in r.stdout, r.stderr


def test_gvisor_runtime_and_egress_transport_go_to_the_sandbox_broker_only(tmp_path):
    argv = argv_of(tmp_path, gvisor_runtime="gvisor-nightly", egress_transport="socket")
    sandbox = argv["sandbox"]
    assert sandbox[sandbox.index("--gvisor-runtime") + 1] == "gvisor-nightly"
    assert sandbox[sandbox.index("--egress-transport") + 1] == "socket"
    assert all("--gvisor-runtime" not in a and "--egress-transport" not in a
               for s, a in argv.items() if s != "sandbox")
    # the defaults (runsc, the ticket network) add no flag
    assert all("--gvisor-runtime" not in a and "--egress-transport" not in a for a in argv_of(tmp_path / "d").values())
