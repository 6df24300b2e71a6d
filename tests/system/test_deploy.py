"""The deployment keeps the four processes apart: systemd units (own user,
own EnvironmentFile, socket groups naming exactly the intended caller,
hardening) and the compose file (only the sandbox broker sees docker.sock)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import yaml

from tests.system import deploycheck as dc


@pytest.fixture(scope="module")
def units():
    return dc.load_units()


@pytest.fixture(scope="module")
def sysusers():
    return dc.parse_sysusers((dc.SYSTEMD / "afe.sysusers.conf").read_text())


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(dc.COMPOSE.read_text())


def test_units_keep_the_processes_apart(units, sysusers):
    assert dc.unit_problems(units, sysusers) == []


def test_compose_keeps_the_processes_apart(compose):
    assert dc.compose_problems(compose) == []


@pytest.mark.parametrize("mutate, expect", [
    (lambda u, s: u["scheduler"]["Service"]["SupplementaryGroups"].append("docker"), "docker group"),
    (lambda u, s: u["gateway"]["Service"].__setitem__("User", ["afe-scheduler"]), "own non-root User"),
    (lambda u, s: u["gateway"]["Service"]["EnvironmentFile"].append("/etc/afe/credentials.env"),
     "EnvironmentFile"),
    (lambda u, s: s["afe-credentials-clients"].add("afe-gateway"), "members of afe-credentials-clients"),
    (lambda u, s: u["credentials"]["Service"].__setitem__("NoNewPrivileges", ["no"]), "NoNewPrivileges"),
    (lambda u, s: u["sandbox"]["Service"].__setitem__("ExecStart", [
        u["sandbox"]["Service"]["ExecStart"][0].replace("127.0.0.1", "0.0.0.0")]), "R23"),
])
def test_positive_control_unit_checker_catches_a_broken_unit(units, sysusers, mutate, expect):
    u, s = copy.deepcopy(units), copy.deepcopy(sysusers)
    mutate(u, s)
    problems = dc.unit_problems(u, s)
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("mutate, expect", [
    (lambda d: d["services"]["scheduler"]["volumes"].append("/var/run/docker.sock:/var/run/docker.sock"),
     "sees the Docker socket"),
    (lambda d: d["services"]["gateway"].__setitem__("env_file", ["env/gateway.env", "env/credentials.env"]),
     "env_file"),
    (lambda d: d["services"]["gateway"]["group_add"].append("3001"), "group_add of sandbox"),
    (lambda d: d["services"]["gateway"].__setitem__("environment", {"OPENAI_API_KEY": "x"}), "env_file"),
    (lambda d: d["services"]["credentials"].__setitem__("secrets", ["credentials_links", "scheduler_links"]),
     "own link secret"),
])
def test_positive_control_compose_checker_catches_a_broken_file(compose, mutate, expect):
    d = copy.deepcopy(compose)
    mutate(d)
    problems = dc.compose_problems(d)
    assert any(expect in p for p in problems), problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize("svc", dc.SERVICES)
def test_units_pass_systemd_analyze(svc):
    path = dc.SYSTEMD / f"afe-{svc}.service"
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines()
             if ln.strip() and "is not executable" not in ln]   # /opt/afe is not installed here
    assert lines == []
    assert dc.analyze_security(path) <= 2.5   # systemd's exposure score: "OK" band


def test_layout_refuses_a_run_dir_of_another_user(short_tmp):
    from services.common.errors import FailedPrecondition
    from services.common.layout import Layout

    run = short_tmp / "run"
    run.mkdir(mode=0o777)
    os.chown(run, 12345, 12345)
    with pytest.raises(FailedPrecondition):
        Layout(short_tmp / "data", run).ensure()


@pytest.mark.timeout(60)
def test_layout_leaves_the_root_owned_shared_run_dir_to_a_service_user(short_tmp):
    """deploy/systemd: /run/afe is root:root 0711 and each process runs as its
    own user; ensure() must neither fail nor change it."""
    run, data = short_tmp / "run", short_tmp / "data"
    run.mkdir(mode=0o711)
    os.chmod(run, 0o711)
    data.mkdir(mode=0o700)
    os.chown(data, 65534, 65534)
    os.chmod(short_tmp, 0o755)

    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    code = ("from services.common.layout import Layout; from pathlib import Path; "
            f"Layout(Path({str(data)!r}), Path({str(run)!r})).ensure()")
    # the system interpreter: the venv's base Python may sit under a 0700 /root
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    proc = subprocess.run([python, "-c", code], cwd=dc.ROOT, preexec_fn=drop,
                          capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(dc.ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert run.stat().st_mode & 0o777 == 0o711
