"""What a test needs beyond its own Python process, so `make test-fast` runs
exactly the tests that need nothing else (issue 36).

Markers (pyproject.toml): `docker` and `browser` are written on the tests;
`database` (a PostgreSQL server) and `processes` (it starts a process: git,
an afe process, an agent, a server) come from tests/needs.txt, applied at
collection (tests/conftest.py). That list is recorded, not guessed: a run
with AFE_TEST_NEEDS_RECORD=<folder> notes, per test, every process started
and every PostgreSQL connection opened during its setup, call and teardown;
`--write` turns the notes into the list.

A fast run (AFE_TEST_FAST=1, what `make test-fast` sets) forbids both: a
test that starts a process or connects to PostgreSQL fails, naming the
marker it needs. So a new test that needs either cannot slip into the fast
run unnoticed: record again, or mark it.

Record (after adding tests that need a process or a database):

    rm -rf /tmp/needs; AFE_TEST_NEEDS_RECORD=/tmp/needs .venv/bin/python -m pytest -p no:cacheprovider \\
        -n 2 -m "not docker and not browser and not slow"
    .venv/bin/python -m tests.support.needs --write /tmp/needs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

LIST = Path(__file__).resolve().parents[1] / "needs.txt"
KINDS = ("database", "processes")
FAST_ENV = "AFE_TEST_FAST"
RECORD_ENV = "AFE_TEST_NEEDS_RECORD"


class NeedsMore(AssertionError):
    """A test of the fast run started a process or opened a database connection."""


def _patches() -> list[tuple[Any, str, str]]:
    """(owner, attribute, kind) of everything that starts a process or connects to PostgreSQL."""
    found: list[tuple[Any, str, str]] = [
        (subprocess.Popen, "_execute_child", "processes"),   # subprocess.*, asyncio's subprocesses
        (os, "fork", "processes"),
        (os, "posix_spawn", "processes"),
        (os, "posix_spawnp", "processes"),
    ]
    with contextlib.suppress(ImportError):
        import psycopg

        # `psycopg.connect` (what SQLAlchemy calls) is bound when psycopg loads: patched apart
        found += [(psycopg, "connect", "database"), (psycopg.Connection, "connect", "database"),
                  (psycopg.AsyncConnection, "connect", "database")]
    return found


@contextlib.contextmanager
def watching(on_use: Callable[[str, str], None]) -> Iterator[None]:
    """While the block runs, `on_use(kind, what)` is called before each process start or
    PostgreSQL connection (and may raise to refuse it)."""
    saved: list[tuple[Any, str, Any]] = []
    for owner, attr, kind in _patches():
        original = owner.__dict__.get(attr, getattr(owner, attr, None))
        if original is None:
            continue
        saved.append((owner, attr, original))

        def wrap(original: Any = original, kind: str = kind, attr: str = attr) -> Any:
            if isinstance(original, classmethod):
                func = original.__func__

                def cm(cls: Any, *a: Any, **k: Any) -> Any:
                    on_use(kind, attr)
                    return func(cls, *a, **k)
                return classmethod(cm)

            def plain(*a: Any, **k: Any) -> Any:
                on_use(kind, _what(attr, a))
                return original(*a, **k)
            return plain

        setattr(owner, attr, wrap())
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def _what(attr: str, args: tuple[Any, ...]) -> str:
    if attr == "_execute_child" and len(args) > 1:
        argv = args[1]
        return str(argv[0] if isinstance(argv, (list, tuple)) and argv else argv)
    return attr


def refuse(kind: str, what: str) -> None:
    raise NeedsMore(f"this test needs {kind} ({what}): the fast run (make test-fast) runs only tests that need "
                    f"nothing outside Python; mark it `@pytest.mark.{kind}` or record tests/needs.txt again "
                    "(tests/support/needs.py)")


def read_list(path: Path = LIST) -> dict[str, set[str]]:
    """{node id or file: kinds} of tests/needs.txt ("KIND[,KIND] ID" lines, # comments)."""
    out: dict[str, set[str]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            kinds, ident = line.split(None, 1)
            out.setdefault(ident, set()).update(kinds.split(","))
    return out


def needs_of(nodeid: str, listed: dict[str, set[str]]) -> set[str]:
    return listed.get(nodeid, set()) | listed.get(nodeid.split("::", 1)[0], set())


def render(recorded: dict[str, set[str]]) -> str:
    """The list: a file whose every test needs the same kinds is one line; else one line a test."""
    by_file: dict[str, dict[str, set[str]]] = {}
    for nodeid, kinds in recorded.items():
        by_file.setdefault(nodeid.split("::", 1)[0], {})[nodeid] = kinds
    lines: list[str] = []
    for f in sorted(by_file):
        tests = by_file[f]
        common = set.intersection(*tests.values())
        if common:
            lines.append(f"{','.join(sorted(common))} {f}")
        for nodeid in sorted(tests):
            rest = tests[nodeid] - common
            if rest:
                lines.append(f"{','.join(sorted(rest))} {nodeid}")
    head = ("# What tests need beyond Python (tests/support/needs.py): `database`, `processes`.\n"
            "# Recorded by a run, applied at collection; make test-fast runs the tests that need none.\n"
            "# Record again: see tests/support/needs.py.\n")
    return head + "".join(line + "\n" for line in lines)


def collect(folder: Path) -> dict[str, set[str]]:
    """Every test of a recording run (files `<worker>.txt`: "KINDS<TAB>NODEID", "-" for none)."""
    out: dict[str, set[str]] = {}
    for f in sorted(folder.glob("*.txt")):
        for line in f.read_text().splitlines():
            kinds, nodeid = line.split("\t", 1)
            out.setdefault(nodeid, set()).update(k for k in kinds.split(",") if k != "-")
    return out


class Plugin:
    """The pytest side (registered by tests/conftest.py). A fixture's needs count for
    every test that uses it, also when an earlier test set it up (a session's server)."""

    def __init__(self) -> None:
        self._fixtures: list[str] = []                  # fixtures being set up, outermost first
        self._fixture_needs: dict[str, set[str]] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Before `-m` selects: each test's `database` and `processes` markers from the list."""
        listed = read_list()
        for item in items:
            for kind in needs_of(item.nodeid, listed):
                item.add_marker(kind)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Iterator[None]:
        self._fixtures.append(fixturedef.argname)
        try:
            yield
        finally:
            self._fixtures.pop()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        """A fast run refuses a process start or a PostgreSQL connection; a recording run
        notes them. Setup and teardown count (a fixture that starts a server is a need)."""
        if os.environ.get(FAST_ENV):
            with watching(refuse):
                yield
            return
        record = os.environ.get(RECORD_ENV)
        if not record:
            yield
            return
        used: set[str] = set()

        def note(kind: str, _what: str) -> None:
            used.add(kind)
            for name in self._fixtures:
                self._fixture_needs.setdefault(name, set()).add(kind)

        with watching(note):
            yield
        for name in getattr(item, "fixturenames", ()):
            used |= self._fixture_needs.get(name, set())
        folder = Path(record)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.txt", "a") as f:
            f.write(f"{','.join(sorted(used)) or '-'}\t{item.nodeid}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=Path, metavar="FOLDER", required=True,
                    help="the AFE_TEST_NEEDS_RECORD folder of a recording run")
    args = ap.parse_args(argv)
    recorded = collect(args.write)
    if not recorded:
        print(f"no recording in {args.write}", file=sys.stderr)
        return 2
    LIST.write_text(render(recorded))
    n = sum(1 for k in recorded.values() if k)
    print(f"{LIST}: {n} of {len(recorded)} tests need a process or a database")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
