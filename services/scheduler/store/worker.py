"""The store's own thread: in the scheduler every database statement runs on
one thread that owns the store's connection, never on the event loop, so a
database that stops answering cannot freeze gRPC, `/livez`, `/readyz` or
the lease heartbeat (issue 32).

- `StoreThread` runs jobs (a function of the store) one at a time, in the
  order they were submitted. Its retries (retry.py) wait between tries on
  the job's own event, so a job whose caller stopped waiting ends at its
  next wait, and one that nobody waits for any more is not started.
- `ThreadedStore` is the `Store` the engine holds. Each statement method of
  its repositories is a job. Called from the event loop while the database answers, it waits for
  its job (the statement's round trip, as before this thread existed).
  While the store is failing (a statement met a lost, refused or locked
  database and none has succeeded since) and a job holds the thread (it
  retries), it raises `StoreUnavailable` at once; a call waiting for its job
  gives up as soon as a failure is reported: no synchronous caller waits out
  an outage. (Failing but idle, a call runs: it is the quickest way to learn
  that the database is back.) A statement that hangs without an error holds
  a synchronous caller at most `SYNC_WAIT_S`, and then counts as a failure.
- `run_in_store(store, fn)` awaits a job: the paths that must go on through
  an outage (event writes, lease renewal, a node's state, readiness) wait for
  the database without holding the loop, the job retrying within the
  retrier's budget; `timeout` bounds the wait (the job is then given up).
- While the store is failing and no job runs, the thread pings the database
  every `PROBE_S`, so the failure ends within that time of its return.

The same holds for SQLite (its thread waits out another process's lock): the
store's one SQLAlchemy connection (database.py) is owned by this thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .database import is_local
from .retry import StoreUnavailable
from .store import REPOSITORIES, Store

log = logging.getLogger(__name__)

T = TypeVar("T")

SYNC_WAIT_S = 10.0      # the longest a synchronous caller waits for a statement that neither answers nor fails
SYNC_SLICE_S = 0.02     # how often a waiting synchronous caller looks whether the store failed meanwhile
PROBE_S = 1.0           # while failing and idle: the thread pings the database this often
READY_TIMEOUT_S = 1.5   # `store_answers` (readiness): within the ops server's 2 s probe timeout
CLOSE_WAIT_S = 5.0      # `close`: how long jobs still queued may run before they are given up
# Failures that say nothing about the database answering (PostgreSQL asks to run the transaction again).
TRANSIENT = frozenset({"serialization_failure", "deadlock"})


class Chain:
    """Jobs that must run in order or not at all (an event log's batches): once
    one of them fails, the later ones are not run (`Skipped`)."""

    broken = False


class Skipped(StoreUnavailable):
    """A job of a `Chain` not run because an earlier one failed."""


class StoreJob(Generic[T]):
    """One call on the store's thread: its result or error, when done."""

    __slots__ = ("_callbacks", "_lock", "abandoned", "chain", "done", "error", "fn", "value")

    def __init__(self, fn: Callable[[Store], T], chain: Chain | None = None) -> None:
        self.fn = fn
        self.chain = chain
        self.done = threading.Event()
        self.abandoned = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None
        self._callbacks: list[Callable[[StoreJob[T]], None]] = []
        self._lock = threading.Lock()

    def result(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]   # T itself may be None

    def abandon(self) -> None:
        """The caller stopped waiting: not started, it never runs; retrying, it stops at its next wait."""
        self.abandoned.set()

    def add_done_callback(self, fn: Callable[[StoreJob[T]], None]) -> None:
        """`fn(job)` once done: on the store's thread, or at once when done already."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def finish(self, value: T | None, error: BaseException | None) -> None:
        with self._lock:
            self.value, self.error = value, error
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:   # a callback's bug must not end the store's thread
                log.exception("store: a job's callback failed")

    def run_inline(self, store: Store) -> StoreJob[T]:
        """Run on the calling thread (a store without its own thread: tools and tests)."""
        try:
            value = self.fn(store)
        except Exception as exc:  # noqa: BLE001 - handed to whoever reads the job
            if self.chain is not None:
                self.chain.broken = True
            self.finish(None, exc)
        else:
            self.finish(value, None)
        return self


class StoreThread:
    """The thread that owns a store's connection and runs its jobs in order."""

    def __init__(self, store: Store, name: str = "afe-store") -> None:
        self.store = store
        retrier = getattr(store, "_retry", None)
        self.where: str = getattr(retrier, "where", "") or repr(store)
        self.failing_since: float | None = None    # time.monotonic() of the failure, None: answering
        self.failing_reason = ""
        self.failures = 0                           # failures reported so far (a waiting call's cue)
        self._current: StoreJob[Any] | None = None
        self._closing = False       # give up what waits (close took too long)
        self._closed = False        # no new jobs
        self._queue: queue.SimpleQueue[StoreJob[Any] | None] = queue.SimpleQueue()
        if retrier is not None:
            retrier.pause = self._pause
            retrier.health = self._health
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- on the store's thread ------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=PROBE_S if self.failing_since is not None else None)
            except queue.Empty:
                self._probe()
                continue
            if job is None:
                break
            self._run(job)
        try:
            self.store.close()
        except Exception:   # the process is stopping
            log.warning("store: closing %s failed", self.where, exc_info=True)

    def _run(self, job: StoreJob[Any]) -> None:
        if job.abandoned.is_set() or self._closing:
            job.finish(None, StoreUnavailable(f"{self.where}: the statement was not run; its caller stopped "
                                              "waiting"))
            return
        if job.chain is not None and job.chain.broken:
            job.finish(None, Skipped(f"{self.where}: not written; an earlier write failed"))
            return
        self._current = job
        try:
            value = job.fn(self.store)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the job
            if job.chain is not None:
                job.chain.broken = True
            self._current = None
            job.finish(None, exc)
        else:
            self._current = None
            job.finish(value, None)

    def _pause(self, seconds: float) -> bool:
        """The retrier's wait between tries: on this thread, on the job's event."""
        job = self._current
        if job is None or threading.get_ident() != self._thread.ident:
            time.sleep(seconds)
            return True
        return not (job.abandoned.wait(seconds) or self._closing)

    def _health(self, reason: str | None) -> None:
        """From the retrier (and pings): a failure's reason, or None when the database answered."""
        if reason is None:
            if self.failing_since is not None:
                log.warning("store: %s answers again after %.1f s", self.where,
                            time.monotonic() - self.failing_since)
                self.failing_since = None
                self.failing_reason = ""
            return
        if reason in TRANSIENT:
            return
        self.failures += 1
        self.failing_reason = reason
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.warning("store: %s does not answer (%s); calls that need it fail at once until it does",
                        self.where, reason.replace("_", " "))

    def ping(self, store: Store) -> bool:
        """A job: whether the database answers now (and the failure state with it)."""
        try:
            ok = bool(store.ping())
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            ok = False
        self._health(None if ok else "no_answer")
        return ok

    def _probe(self) -> None:
        if self.failing_since is not None and not self._closing:
            self.ping(self.store)

    # -- from any thread -----------------------------------------------------------------

    @property
    def on_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    @property
    def busy(self) -> bool:
        """A job runs or waits (while failing: one that retries holds the thread)."""
        return self._current is not None or not self._queue.empty()

    @property
    def refusing(self) -> bool:
        """A synchronous call now would only wait out an outage: refuse it."""
        return self.failing_since is not None and self.busy

    def submit(self, fn: Callable[[Store], T], chain: Chain | None = None) -> StoreJob[T]:
        job = StoreJob(fn, chain)
        if self.on_thread:      # a job's own nested call: run it now (the queue waits for this job)
            return job.run_inline(self.store)
        if self._closed:
            job.finish(None, StoreUnavailable(f"{self.where}: the store is closed (the scheduler stops)"))
            return job
        self._queue.put(job)
        return job

    def unavailable(self, what: str = "") -> StoreUnavailable:
        since = time.monotonic() - self.failing_since if self.failing_since is not None else 0.0
        why = self.failing_reason.replace("_", " ") or "no answer"
        return StoreUnavailable(
            f"{self.where} does not answer ({why}, for {since:.1f} s){what}: check that the database runs; "
            "afe goes on when it answers again")

    def call(self, fn: Callable[[Store], T]) -> T:
        """Run `fn(store)` on the store's thread and wait for it; at once
        `StoreUnavailable` while the store is failing (see the module's text)."""
        if self.on_thread:
            return fn(self.store)
        if self.refusing:
            raise self.unavailable()
        failures = self.failures
        job = self.submit(fn)
        end = time.monotonic() + SYNC_WAIT_S
        while not job.done.wait(SYNC_SLICE_S):
            hung = time.monotonic() > end
            if self.failures == failures and not hung:
                continue
            job.abandon()
            if job.done.is_set():
                break
            if hung:
                self._health("no_answer")
            raise self.unavailable()
        return job.result()

    async def run(self, fn: Callable[[Store], T], timeout: float | None = None) -> T:
        """Await `fn(store)` on the store's thread: through an outage within the
        retrier's budget, or `StoreUnavailable` after `timeout` seconds."""
        job = self.submit(fn)
        if not job.done.is_set():
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()

            def wake(_job: StoreJob[T]) -> None:
                with contextlib.suppress(RuntimeError):     # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(_resolve, done)
            job.add_done_callback(wake)
            try:
                await asyncio.wait_for(done, timeout)
            except TimeoutError:
                job.abandon()
                if not job.done.is_set():
                    raise self.unavailable(f"; no answer within {timeout:g} s") from None
            except asyncio.CancelledError:
                job.abandon()
                raise
        return job.result()

    def close(self) -> None:
        """Run what is queued (at most CLOSE_WAIT_S), then close the store on its thread."""
        if not self._thread.is_alive():
            return
        self._closed = True
        self._queue.put(None)
        if self.on_thread:
            return
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("store: %s still busy after %.0f s at stop; giving up what waits", self.where, CLOSE_WAIT_S)
            self._closing = True
            job = self._current
            if job is not None:
                job.abandon()
            self._thread.join(CLOSE_WAIT_S)


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


class _OnThread:
    """One repository of a `ThreadedStore`: each of its methods that runs a
    statement is a job on the store's thread; bookkeeping methods (`local`)
    and attributes are the repository's own, read and set here (also while
    the database is away)."""

    __slots__ = ("_name", "_repo", "_thread")

    def __init__(self, thread: StoreThread, name: str, repo: object) -> None:
        object.__setattr__(self, "_thread", thread)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_repo", repo)

    def __repr__(self) -> str:
        return f"<{self._name} of {self._thread.where} on the store's thread>"

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._repo, attr)
        if attr.startswith("_") or not callable(value) or is_local(value):
            return value
        name, thread = self._name, self._thread

        def call(*args: Any, **kwargs: Any) -> Any:
            return thread.call(lambda s: getattr(getattr(s, name), attr)(*args, **kwargs))
        call.__name__ = attr
        return call

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._repo, attr, value)


class ThreadedStore(Store):
    """A `Store` whose every statement runs on its `StoreThread` (see the
    module's text): each repository (`tickets`, `events`, `leases`, ...) is
    the wrapped store's, its statements sent to the thread. What the engine
    shares with the store (`leases.owner`, `leases.fences`, `shared`) is the
    wrapped store's own."""

    def __init__(self, store: Store) -> None:   # no super().__init__: the repositories are the inner store's
        self.inner = store
        self.thread = StoreThread(store)
        self.db = store.db
        self.shared = store.shared
        self._retry = store._retry
        for name in REPOSITORIES:
            setattr(self, name, _OnThread(self.thread, name, getattr(store, name)))

    def __repr__(self) -> str:
        return f"ThreadedStore({self.inner!r})"

    def close(self) -> None:
        self.thread.close()

    def checkpoint(self) -> None:
        self.thread.call(lambda s: s.checkpoint())

    def ping(self) -> bool:
        if self.thread.refusing:
            return False
        try:
            return self.thread.call(self.thread.ping)
        except StoreUnavailable:
            return False


def threaded(store: Store) -> ThreadedStore:
    """`store` on its own thread (once: a ThreadedStore is returned as it is)."""
    return store if isinstance(store, ThreadedStore) else ThreadedStore(store)


async def run_in_store(store: Store, fn: Callable[[Store], T], timeout: float | None = None) -> T:
    """Await `fn(store)` on the store's thread (`StoreThread.run`); a store
    without one (tools, tests) runs it here."""
    if isinstance(store, ThreadedStore):
        return await store.thread.run(fn, timeout)
    return fn(store)


def submit(store: Store, fn: Callable[[Store], T], chain: Chain | None = None) -> StoreJob[T]:
    """Queue `fn(store)` on the store's thread and return its job at once; a
    store without one runs it here (the job is done when returned)."""
    if isinstance(store, ThreadedStore):
        return store.thread.submit(fn, chain)
    return StoreJob(fn, chain).run_inline(store)


def store_failing(store: Store) -> bool:
    """The store's thread saw the database stop answering (and not come back yet)."""
    return isinstance(store, ThreadedStore) and store.thread.failing_since is not None


async def store_answers(store: Store, timeout: float = READY_TIMEOUT_S) -> bool:
    """Readiness: the database answers a ping within `timeout` (at once False
    while failing with a job retrying; failing but idle, the ping is the probe)."""
    if not isinstance(store, ThreadedStore):
        return store.ping()
    t = store.thread
    if t.refusing:
        return False
    try:
        return await t.run(t.ping, timeout)
    except StoreUnavailable:
        return False
