"""`afe doctor` proves R4-R12 and R31 live; with a defence removed it says FAIL.
With gVisor's runsc registered it runs the checks of a sandbox without
egress on gVisor too; without it, it says how to add it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from services.cli import doctor, doctor_gvisor
from services.common.config.manifests import load_config
from tests.support import planted_sandbox_broker as planted

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
RULES = ("R4", "R5", "R6", "R7", "R8", "R9", "R10", "R11", "R12", "R31")
# The runc-only controls name a runtime the engine lacks, so the doctor skips its gVisor half (an
# info line, no FAIL: no Workspace asks for gVisor); the gVisor half has its own control below.
RUNC_ONLY = "afe-no-such-runtime"
GVISOR_RULES = ("R4", "R5", "R6", "R7", "R8", "R34", "R9", "R10", "R11")


def _has_runsc() -> bool:
    return "runsc" in (docker.from_env().info().get("Runtimes") or {})


def test_doctor_prints_pass_for_every_rule():
    p = subprocess.run([sys.executable, "-m", "services.cli.main", "doctor", "--no-build"], cwd=REPO,
                       capture_output=True, text=True, timeout=200, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    for rule in RULES:
        assert any(line.startswith(f"PASS {rule} ") for line in lines), rule
    assert not any(line.startswith("FAIL") for line in lines)
    assert any(line.startswith("PASS pool: ") for line in lines)   # the probes ran on a claimed warm sandbox
    assert "every probe object removed" in p.stdout
    runc_r4 = next(line for line in lines if line.startswith("PASS R4 ") and "[gVisor]" not in line)
    assert "runtime=runc" in runc_r4
    if _has_runsc():
        for rule in GVISOR_RULES:
            assert any(line.startswith(f"PASS {rule} ") and line.split(":")[0].endswith(" [gVisor]")
                       for line in lines), rule
        assert any(line.startswith("PASS gVisor runtime: the engine has runsc") for line in lines)
        kernel = next(line for line in lines if line.startswith("PASS gVisor kernel: "))
        assert "the gVisor sandbox sees kernel 4.4.0" in kernel and "(the host's, as runc shares it)" in kernel
    else:
        assert "info gVisor: the engine has no runtime runsc" in p.stdout and "apt-get install runsc" in p.stdout


def test_r12_doctor_fails_when_a_claim_does_not_find_the_warm_sandbox(capsys):
    """Positive control for the pool line: a claim that makes a second sandbox
    instead of finding the one made ahead (its own id) is a FAIL (planted in the
    broker process the doctor drives)."""
    assert asyncio.run(doctor.doctor(build=False, gvisor_runtime=RUNC_ONLY,
                                     broker_command=planted.command("fresh_claims"))) == 1
    out = capsys.readouterr().out
    assert "FAIL pool: " in out and "PASS R5 " in out


def test_doctor_fails_when_a_defence_is_missing(capsys):
    """Positive control: a sandbox that keeps its capabilities and runs as root is caught."""
    assert asyncio.run(doctor.doctor(build=False, gvisor_runtime=RUNC_ONLY,
                                     broker_command=planted.command("caps_and_root"))) == 1
    out = capsys.readouterr().out
    assert "FAIL R6 " in out and "FAIL R7 " in out and "PASS R5 " in out


def test_r31_doctor_fails_when_the_ticket_bridge_has_a_host_address(capsys):
    """Positive control: a ticket network made as before R31 (its bridge holds
    the host's gateway address), with the broker's own check switched off, is
    caught by the live probe."""
    assert asyncio.run(doctor.doctor(build=False, gvisor_runtime=RUNC_ONLY,
                                     broker_command=planted.command("bridge_with_host_address"))) == 1
    out = capsys.readouterr().out
    fail = [line for line in out.splitlines() if line.startswith("FAIL R31 ")]
    assert fail and "-> reached icmp " in fail[0] and ", tcp " in fail[0] and "PASS R11 " in out


def test_gvisor_doctor_fails_when_the_gvisor_sandbox_runs_on_runc(capsys):
    """Positive control for the gVisor lines: a sandbox that asks for gVisor
    but is created without the engine's runtime (so on runc, the host's
    kernel) is caught by the kernel it sees, though every other check passes."""
    if not _has_runsc():
        pytest.skip("the Docker engine has no runsc runtime (scripts/ensure_runsc.sh installs and registers it)")
    assert asyncio.run(doctor.doctor(build=False, broker_command=planted.command("gvisor_on_runc"))) == 1
    out = capsys.readouterr().out
    assert "FAIL gVisor kernel: " in out and "PASS R5 no network by default [gVisor]" in out
    assert "runtime=runc, kernel=" in next(line for line in out.splitlines()
                                           if line.startswith("PASS R4 ") and "[gVisor]" in line)


def test_doctor_without_the_gvisor_runtime_says_how_to_add_it(tmp_path, capsys):
    """An engine without the runtime (a name it does not have): the steps to
    add it, a FAIL only when a Workspace asks for gVisor."""
    client = docker.from_env()
    report = doctor.Report()
    assert doctor_gvisor.engine_runtimes(report, client, "afe-no-such-runtime", None) is False
    out = capsys.readouterr().out
    assert not report.failed and "info gVisor: the engine has no runtime afe-no-such-runtime" in out
    assert "info runtimes: " in out and "runc" in out.split("info runtimes: ")[1].splitlines()[0]
    entry = '"runtimes": {"afe-no-such-runtime": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", ' \
        '"--host-uds=open"]}}'
    for step in ("apt-get install runsc", entry, "kill -HUP $(cat /var/run/docker.pid)", "scripts/ensure_runsc.sh"):
        assert step in out, step

    (tmp_path / "afe.yaml").write_text(f"kind: Workspace\nname: shop\nrepo: {tmp_path}\nbaseBranch: main\n"
                                       "sandbox: {runtime: gvisor}\n")
    report = doctor.Report()
    assert doctor_gvisor.engine_runtimes(report, client, "afe-no-such-runtime", load_config(str(tmp_path))) is False
    out = capsys.readouterr().out
    assert report.failed and "FAIL gVisor runtime: the engine has no runtime afe-no-such-runtime, and Workspace " \
        "shop ask(s) for sandbox.runtime gvisor" in out and "apt-get install runsc" in out
