"""How long each test file takes, so parallel runs start the longest first.

`make test` runs the suite in several worker processes (pytest-xdist, `--dist
loadfile`: a file's tests stay on one worker). A worker that picks up a
five-minute file near the end keeps the whole run waiting, so
tests/conftest.py hands out the files listed in tests/slow_files.txt first,
longest first; files not listed follow in their usual order, those with a
test marked `slow` ahead of the rest. The list only orders the run: a stale
one makes it slower, never wrong.

Refresh it from the log of a run with `--durations=0` (one per area is fine):

    .venv/bin/python -m pytest -n 4 --durations=0 tests/system > /tmp/system.log
    .venv/bin/python -m tests.support.durations --write /tmp/*.log
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

LIST = Path(__file__).resolve().parents[1] / "slow_files.txt"
MIN_SECONDS = 15.0        # files faster than this are not listed
# A line of pytest's --durations table: "12.34s call     tests/x/test_y.py::test_z[param]"
_LINE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)s\s+(?:setup|call|teardown)\s+([^:\s]+\.py)::")


def file_seconds(log: str) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown summed) in a --durations table."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(2)] = out.get(m.group(2), 0.0) + float(m.group(1))
    return out


def read_list(path: Path = LIST) -> dict[str, float]:
    """{file: seconds} of tests/slow_files.txt ("SECONDS PATH" lines, # comments); empty when absent."""
    if not path.is_file():
        return {}
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            seconds, name = line.split(None, 1)
            out[name] = float(seconds)
    return out


def render(seconds: dict[str, float]) -> str:
    rows = sorted(((s, f) for f, s in seconds.items() if s >= MIN_SECONDS), reverse=True)
    head = ("# Test files that take long, longest first (seconds of a parallel run's --durations table).\n"
            "# tests/conftest.py starts these first when the suite runs in workers (make test).\n"
            "# Regenerate: .venv/bin/python -m tests.support.durations --write LOG... (see that module).\n")
    return head + "".join(f"{s:7.1f} {f}\n" for s, f in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.durations", description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="pytest logs with a --durations=0 table")
    p.add_argument("--write", action="store_true", help=f"update {LIST.name} (kept entries of files the "
                   "logs do not cover); without it, print the new list")
    args = p.parse_args(argv)
    seconds = read_list() if args.write else {}
    for log in args.logs:
        seconds.update(file_seconds(log.read_text(errors="replace")))
    seconds = {f: s for f, s in seconds.items() if (LIST.parent.parent / f).is_file()}   # gone files leave
    text = render(seconds)
    if args.write:
        LIST.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
