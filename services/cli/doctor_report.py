"""The report of `afe doctor` (doctor.py): one PASS/FAIL line per rule with
its evidence, printed as it is added. Its own module so that the check
modules (isolation.py, egresschecks.py, doctor_gvisor.py) and doctor.py
import it without importing each other in a circle."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    lines: list[tuple[str, bool, str]] = field(default_factory=list)

    def add(self, rule: str, ok: bool, evidence: str) -> None:
        self.lines.append((rule, ok, evidence))
        print(f"{'PASS' if ok else 'FAIL'} {rule}: {evidence}", flush=True)

    @property
    def failed(self) -> bool:
        return any(not ok for _, ok, _ in self.lines)
