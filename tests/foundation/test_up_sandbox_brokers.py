"""`afe up --sandbox-broker ... --tls-cert/--tls-key/--tls-ca` reaches the
scheduler (and only it) as given, paths made absolute; without the TLS
flags `afe up` stops at once naming them (docs/SCALE.md)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.launcher.launch import Options, build_specs, make_links

from .launcher_support import base_env, make_config

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def argv_of(tmp_path: Path, **kw) -> dict[str, list[str]]:
    cfg = make_config(tmp_path)
    opts = Options(config_dir=cfg, layout=Layout(tmp_path / "d", tmp_path / "r"), check_images=False, **kw)
    links, _ = make_links()
    return {s.service: s.argv for s in build_specs(opts, load_config(cfg), base_env(), links)}


def test_sandbox_brokers_and_tls_go_to_the_scheduler_only(tmp_path):
    pki = tmp_path / "pki"
    argv = argv_of(tmp_path, sandbox_brokers=("sb1=10.0.0.11:7443,capacity=8", "sb2=10.0.0.12:7443"),
                   tls_cert=pki / "scheduler.pem", tls_key=pki / "scheduler.key", tls_ca=pki / "ca.pem")
    s = argv["scheduler"]
    pairs = list(itertools.pairwise(s))
    assert ("--sandbox-broker", "sb1=10.0.0.11:7443,capacity=8") in pairs
    assert ("--sandbox-broker", "sb2=10.0.0.12:7443") in pairs
    assert ("--tls-cert", str(pki / "scheduler.pem")) in pairs and ("--tls-key", str(pki / "scheduler.key")) in pairs
    assert ("--tls-ca", str(pki / "ca.pem")) in pairs
    for service, a in argv.items():
        if service != "scheduler":
            assert "--sandbox-broker" not in a and "--tls-cert" not in a


def test_without_sandbox_brokers_no_flag_is_added(tmp_path):
    assert all("--sandbox-broker" not in a and "--tls-ca" not in a for a in argv_of(tmp_path).values())


@pytest.mark.parametrize("flags,says", [
    (["--sandbox-broker", "sb1=10.0.0.11:7443", "--tls-cert", "c.pem"], "needs mutual TLS"),
    (["--tls-ca", "ca.pem"], "are for --sandbox-broker"),
])
def test_up_refuses_half_the_scale_out_flags(tmp_path, flags, says):
    r = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--data", str(tmp_path / "d"),
                        "--config", str(make_config(tmp_path)), "--no-images", *flags],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert says in r.stderr and "Traceback" not in r.stderr
