"""What a crashed test worker was doing, said by the run that lost it.

A worker of a parallel run that dies in C code (a segmentation fault) prints
its threads' stacks with pytest's faulthandler, but on the worker's stderr,
where xdist's own lines cut them off, and nothing names the test that ran.
Here each worker writes both to a file of its own in the run's folder: the
faulthandler dump (complete, every thread) and, before each test, the test's
id. When xdist reports a worker down, the controller prints that file.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import IO

_file: IO[str] | None = None
_current: Path | None = None


def crash_file(folder: Path, worker: str) -> Path:
    return folder / f"afe-crash-{worker}.log"


def current_file(folder: Path, worker: str) -> Path:
    return folder / f"afe-running-{worker}.txt"


def start(folder: Path, worker: str) -> None:
    """In a worker: send faulthandler's dump to this worker's file from now on."""
    global _file, _current
    if _file is not None:
        return
    _file = open(crash_file(folder, worker), "w")  # noqa: SIM115 - held for the worker's life
    faulthandler.enable(file=_file, all_threads=True)
    _current = current_file(folder, worker)


def running(nodeid: str) -> None:
    """In a worker: the test that starts now (overwritten for each test)."""
    if _current is None:
        return
    tmp = _current.with_suffix(".tmp")
    tmp.write_text(nodeid + "\n")
    os.replace(tmp, _current)


def report(folder: Path, worker: str) -> str:
    """In the controller: what the worker left, as lines to print."""
    lines = [f"worker {worker} went down"]
    cur = current_file(folder, worker)
    if cur.exists():
        lines.append(f"  running: {cur.read_text().strip()}")
    dump = crash_file(folder, worker)
    if dump.exists() and dump.stat().st_size:
        lines.append("  its threads when it crashed:")
        lines.extend("    " + line for line in dump.read_text(errors="replace").splitlines()[:400])
    return "\n".join(lines)
