"""`afe doctor` proves R4-R12 and R31 live; with a defence removed it says FAIL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import doctor
from services.sandbox import hardening, sandboxes

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
RULES = ("R4", "R5", "R6", "R7", "R8", "R9", "R10", "R11", "R12", "R31")


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


def test_r12_doctor_fails_when_a_claim_does_not_find_the_warm_sandbox(monkeypatch, capsys):
    """Positive control for the pool line: a claim that makes a second sandbox
    instead of finding the one made ahead (its own id) is a FAIL."""
    original = sandboxes.SandboxManager.create
    made: set[str] = set()

    async def fresh_each_time(self, settings):
        if settings.ticket_id in made:
            await self.destroy(settings.ticket_id)
        made.add(settings.ticket_id)
        return await original(self, settings)
    monkeypatch.setattr(sandboxes.SandboxManager, "create", fresh_each_time)
    assert asyncio.run(doctor.doctor(build=False)) == 1
    out = capsys.readouterr().out
    assert "FAIL pool: " in out and "PASS R5 " in out


def test_doctor_fails_when_a_defence_is_missing(monkeypatch, capsys):
    """Positive control: a sandbox that keeps its capabilities and runs as root is caught."""
    original = hardening.sandbox_create_kwargs

    def weakened(*a, **kw):
        out = original(*a, **kw)
        out.pop("cap_drop")
        out["user"] = "0:0"
        return out
    monkeypatch.setattr(hardening, "sandbox_create_kwargs", weakened)
    assert asyncio.run(doctor.doctor(build=False)) == 1
    out = capsys.readouterr().out
    assert "FAIL R6 " in out and "FAIL R7 " in out and "PASS R5 " in out


def test_r31_doctor_fails_when_the_ticket_bridge_has_a_host_address(monkeypatch, capsys):
    """Positive control: a ticket network made as before R31 (its bridge holds
    the host's gateway address), with the broker's own check switched off, is
    caught by the live probe."""
    original = hardening.ticket_network_kwargs

    def weakened(**kw):
        out = original(**kw)
        out["options"] = {"com.docker.network.bridge.enable_icc": "true"}
        return out
    monkeypatch.setattr(hardening, "ticket_network_kwargs", weakened)
    monkeypatch.setattr(sandboxes, "check_bridge_has_no_address", lambda name: None)
    assert asyncio.run(doctor.doctor(build=False)) == 1
    out = capsys.readouterr().out
    fail = [line for line in out.splitlines() if line.startswith("FAIL R31 ")]
    assert fail and "-> reached icmp " in fail[0] and ", tcp " in fail[0] and "PASS R11 " in out
