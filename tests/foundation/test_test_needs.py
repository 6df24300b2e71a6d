"""`make test-fast` runs only tests that need nothing outside Python (issue 36):
the fast run refuses a process start or a PostgreSQL connection and says what
to mark; a recording run notes them per test, and the list it writes puts a
file's shared needs on one line. The refusals are shown against the real
calls (subprocess, asyncio's subprocesses, psycopg), each with its control:
the same call outside the guard goes through."""

from __future__ import annotations

import asyncio
import subprocess

import psycopg
import pytest

from tests.support import needs

pytestmark = pytest.mark.processes     # the controls start real processes


def test_a_fast_run_refuses_a_process_start_and_names_the_marker():
    with needs.watching(needs.refuse), pytest.raises(needs.NeedsMore, match=r"needs processes \(true\).*mark it"):
        subprocess.run(["true"], check=True)
    assert subprocess.run(["true"], check=True).returncode == 0      # control: outside the guard it runs


async def test_a_fast_run_refuses_an_asyncio_subprocess():
    with needs.watching(needs.refuse), pytest.raises(needs.NeedsMore):
        await asyncio.create_subprocess_exec("true")
    proc = await asyncio.create_subprocess_exec("true")              # control
    assert await proc.wait() == 0


def test_a_fast_run_refuses_a_postgresql_connection_before_it_is_tried():
    # a port nothing listens on: without the guard the attempt is made (and fails to connect)
    conninfo = "host=127.0.0.1 port=9 dbname=x connect_timeout=1"
    with needs.watching(needs.refuse), pytest.raises(needs.NeedsMore, match="needs database"):
        psycopg.connect(conninfo)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(conninfo)


def test_a_recording_notes_each_kind_and_the_list_keeps_a_files_shared_needs_on_one_line(tmp_path):
    used: list[str] = []
    with needs.watching(lambda kind, what: used.append(kind)):
        subprocess.run(["true"], check=True)
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect("host=127.0.0.1 port=9 dbname=x connect_timeout=1")
    assert "processes" in used and "database" in used
    (tmp_path / "gw0.txt").write_text("processes\ttests/a/test_x.py::test_1\n"
                                      "database,processes\ttests/a/test_x.py::test_2\n"
                                      "-\ttests/a/test_y.py::test_3\n")
    recorded = needs.collect(tmp_path)
    listed = needs.read_list(_written(tmp_path, needs.render(recorded)))
    assert listed == {"tests/a/test_x.py": {"processes"}, "tests/a/test_x.py::test_2": {"database"}}
    assert needs.needs_of("tests/a/test_x.py::test_2", listed) == {"processes", "database"}
    assert needs.needs_of("tests/a/test_y.py::test_3", listed) == set()


def _written(folder, text: str):
    path = folder / "needs.txt"
    path.write_text(text)
    return path
