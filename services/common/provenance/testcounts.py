"""How many tests a verification command ran, read from its test runner's
own summary (R41: a check that ran no test did not pass).

Known summaries, the last one in the output wins:

- pytest: `==== 3 passed, 1 skipped, 2 deselected in 0.12s ====` (also
  without the rule of `=`, as `-q` prints it), `no tests ran in 0.01s`;
- unittest: `Ran 4 tests in 0.002s` followed by `OK`, `OK (skipped=1)`
  or `FAILED (failures=1, errors=2, skipped=1)`.

`ran` counts the tests that were run to a result — passed, failed, errors,
expected failures and unexpected successes — never the skipped or the
deselected. A runner's summary is output like any other, so code under test
could print a fake one; the counts catch a harness that runs fewer tests,
not code that lies (docs/SECURITY.md, R41).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

FIELDS = ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed")

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_PYTEST_LINE = re.compile(
    r"^[= ]*((?:\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)(?:, )?)+|no tests ran)"
    r"(?: in [\d.]+s(?: \([^)]*\))?)?[= ]*$")
_PYTEST_PART = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s$")
_UNITTEST_END = re.compile(r"^(OK|FAILED|NO TESTS RAN)(?: \(([^)]*)\))?$")
_TAIL_LINES = 400


@dataclass(frozen=True)
class Counts:
    runner: str                  # pytest | unittest
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    deselected: int = 0
    xfailed: int = 0
    xpassed: int = 0

    @property
    def ran(self) -> int:
        return self.passed + self.failed + self.errors + self.xfailed + self.xpassed

    def as_dict(self) -> dict[str, int | str]:
        d: dict[str, int | str] = dict(asdict(self))
        d["ran"] = self.ran
        return d


def parse(output: str) -> Counts | None:
    """The counts of the last summary in `output` (its tail is enough), or None."""
    lines = [_ANSI.sub("", ln).strip() for ln in output.splitlines()[-_TAIL_LINES:]]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        end = _UNITTEST_END.match(line)
        if end:
            ran = _ran_before(lines, i)
            if ran is not None:
                return _unittest(ran, end.group(1), end.group(2) or "")
            continue
        if _PYTEST_LINE.match(line):
            return _pytest(line)
    return None


def _ran_before(lines: list[str], i: int) -> int | None:
    for j in range(i - 1, max(-1, i - 4), -1):
        m = _UNITTEST_RAN.match(lines[j])
        if m:
            return int(m.group(1))
        if lines[j]:
            return None
    return None


def _unittest(ran: int, verdict: str, detail: str) -> Counts:
    kv: dict[str, int] = {}
    for part in detail.split(","):
        if "=" in part:
            k, _, v = part.strip().partition("=")
            if v.strip().isdigit():
                kv[k.strip()] = int(v)
    failed, errors, skipped = kv.get("failures", 0), kv.get("errors", 0), kv.get("skipped", 0)
    xfailed, xpassed = kv.get("expected failures", 0), kv.get("unexpected successes", 0)
    passed = max(0, ran - failed - errors - skipped - xfailed - xpassed)
    return Counts("unittest", passed=passed, failed=failed, errors=errors, skipped=skipped,
                  xfailed=xfailed, xpassed=xpassed)


def _pytest(line: str) -> Counts:
    got: dict[str, int] = {}
    for n, word in _PYTEST_PART.findall(line):
        key = "errors" if word.startswith("error") else word
        got[key] = got.get(key, 0) + int(n)
    return Counts("pytest", **got)


def total(counts: list[Counts | None]) -> dict[str, int] | None:
    """The sum over the commands that reported counts; None when none did."""
    known = [c for c in counts if c is not None]
    if not known:
        return None
    out = {f: sum(getattr(c, f) for c in known) for f in FIELDS}
    out["ran"] = sum(c.ran for c in known)
    return out


def runs_tests(command: str) -> str:
    """The test runner a command visibly runs ("pytest", "unittest"), or ""."""
    words = command.replace("'", " ").replace('"', " ").split()
    for i, w in enumerate(words):
        name = w.rsplit("/", 1)[-1]
        if name in ("pytest", "py.test"):
            return "pytest"
        if w == "-m" and i + 1 < len(words) and words[i + 1] in ("pytest", "unittest"):
            return words[i + 1]
    return ""
