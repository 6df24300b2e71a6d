"""Shared fixtures. Area fixtures live in each tests/<area>/conftest.py."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import warnings
from pathlib import Path

import pytest

from services.common.layout import Layout
from tests.support import crashlog, needs
from tests.support.temp_roots import release_disk_caps, remove_temp_root, temp_root, temp_roots
from tests.support.xdist_restart import install as install_xdist_restart_guard


def pytest_configure(config):
    """A worker that crashes must not end the parallel run (tests/support/xdist_restart.py);
    what tests need beyond Python is marked, and refused in a fast run (tests/support/needs.py)."""
    install_xdist_restart_guard()
    config.pluginmanager.register(needs.Plugin(), "afe-needs")


def pytest_collection_modifyitems(config, items):
    """In a parallel run (pytest-xdist's workers, as `make test` runs the suite),
    the test files that take longest start first (tests/slow_files.txt, then the
    files with a test marked `slow`), so no worker picks up a long file at the
    end while the others idle. The order within a file is kept; a serial run
    keeps pytest's own order. Every worker sorts alike (xdist requires it)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.support.durations import read_list

    listed = read_list()
    root = Path(str(config.rootpath))
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def key(item) -> tuple[float, float]:
        seconds = listed.get(item.path.relative_to(root).as_posix()) if item.path.is_relative_to(root) else None
        if seconds is not None:
            return (0, -seconds)
        return (1, 0 if item.path in slow_files else 1)

    items.sort(key=key)


class _AloneLock:
    """A test marked `alone` (a timing measurement) runs while no other test of
    this parallel run does: it takes the run's lock file exclusively, every
    other test takes it shared. The gate keeps new tests from starting while an
    `alone` test waits for the running ones to finish (no starvation)."""

    def __init__(self, folder: Path) -> None:
        self.gate = open(folder / "afe-alone.gate", "a")  # noqa: SIM115 - held for the worker's life
        self.main = open(folder / "afe-alone.lock", "a")  # noqa: SIM115

    @contextlib.contextmanager
    def hold(self, alone: bool):
        if alone:
            gate = _lock(self.gate, fcntl.LOCK_EX)    # no other test starts from now on
            main = gate and _lock(self.main, fcntl.LOCK_EX)     # and the running ones have finished
        else:
            gate = False
            if _lock(self.gate, fcntl.LOCK_SH):      # wait while an `alone` test waits or runs
                fcntl.flock(self.gate, fcntl.LOCK_UN)
            main = _lock(self.main, fcntl.LOCK_SH)
        try:
            yield
        finally:
            if main:
                fcntl.flock(self.main, fcntl.LOCK_UN)
            if gate:
                fcntl.flock(self.gate, fcntl.LOCK_UN)


ALONE_WAIT_S = 600.0    # a test stuck in another worker past its own timeout must not stall the whole run


def _lock(f, how: int) -> bool:
    """flock with a bound: False (the test runs without it, and says so) after ALONE_WAIT_S."""
    end = time.monotonic() + ALONE_WAIT_S
    while True:
        try:
            fcntl.flock(f, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > end:
                warnings.warn(f"the parallel run's `alone` lock was not free within {ALONE_WAIT_S:.0f} s; "
                              "the test runs beside others", stacklevel=1)
                return False
            time.sleep(0.05)


_alone_lock: _AloneLock | None = None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """In a parallel run, `alone` tests run with no other test beside them (see
    _AloneLock); outermost, so the wait does not count toward the test's timeout."""
    global _alone_lock
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    if _alone_lock is None:      # the run's folder: the parent of this worker's base temp (popen-gwN)
        folder = item.config._tmp_path_factory.getbasetemp().parent
        _alone_lock = _AloneLock(folder)
        crashlog.start(folder, os.environ["PYTEST_XDIST_WORKER"])
    crashlog.running(item.nodeid)
    with _alone_lock.hold(item.get_closest_marker("alone") is not None):
        yield


def pytest_testnodedown(node, error):
    """In the controller: a worker that crashed says which test ran and where
    its threads were (tests/support/crashlog.py)."""
    if error is None:
        return
    text = crashlog.report(node.config._tmp_path_factory.getbasetemp(), node.gateway.id)
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n" + text)


class LeakedDiskCap(UserWarning):
    """A test left a workspace disk cap (R34) mounted or attached."""


@pytest.fixture(scope="session", autouse=True)
def release_leaked_disk_caps(tmp_path_factory):
    """Safety net, at the end of the session: unmount and detach the
    workspace disk images (R34) left under the folders the tests made
    (`tests.support.temp_roots`, pytest's base temp) and warn naming them.
    Nothing whose image lives elsewhere is touched."""
    base = tmp_path_factory.getbasetemp()
    yield
    roots = [*temp_roots(), base]
    left = release_disk_caps(roots)
    for root in temp_roots():       # folders whose removal failed on a mount: gone now
        if root.exists():
            remove_temp_root(root)
    if left:
        warnings.warn(LeakedDiskCap(
            "tests left workspace disk caps behind (released now; reconcile the sandbox broker or call "
            "tests.support.temp_roots.remove_temp_root before deleting a data folder): " + "; ".join(left)),
            stacklevel=1)


@pytest.fixture
def short_tmp():
    """A short temporary folder: Unix socket paths are limited to 107 bytes."""
    d = temp_root("afe-")
    try:
        yield d
    finally:
        remove_temp_root(d)


@pytest.fixture
def layout(short_tmp) -> Layout:
    lay = Layout(short_tmp / "data", short_tmp / "run")
    lay.ensure()
    return lay


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    d = Path(os.environ.get("AFE_TEST_ARTIFACTS", "test-artifacts")).absolute()
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def pg_server():
    """A throwaway PostgreSQL server for this test session (tests/support/postgres.py);
    skips when the server binaries are not installed."""
    from tests.support import postgres

    reason = postgres.skip_reason()
    if reason:
        pytest.skip(reason)
    server = postgres.start_server()
    try:
        yield server
    finally:
        postgres.stop_server(server)


@pytest.fixture
def durable_pg():
    """A PostgreSQL server of this test's own, durable (fsync and synchronous
    commit on), for tests that restart or crash it."""
    from tests.support import postgres

    reason = postgres.skip_reason()
    if reason:
        pytest.skip(reason)
    server = postgres.start_server(durable=True)
    try:
        yield server
    finally:
        postgres.stop_server(server)


@pytest.fixture
def pg_url(pg_server) -> str:
    """AFE_DATABASE_URL of a new empty database on the test server (password login over TCP)."""
    name = pg_server.fresh_database()
    try:
        yield pg_server.app_url(name)
    finally:
        pg_server.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    """AFE_DATABASE_URL for each store backend: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/afe.db"
    return request.getfixturevalue("pg_url")
