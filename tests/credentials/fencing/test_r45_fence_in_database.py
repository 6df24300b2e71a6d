"""R37/R45 across machines: with a PostgreSQL store the credential broker
checks each side effect's fence against the ticket's row in the database
(services/credentials/fencing/database.py), not in a file of its own machine.

Two "machines": two real credential brokers (servicer over gRPC on their own
Unix sockets) with separate data folders, one real PostgreSQL (the session's
throwaway server), the scheduler's real store making the claims, one real
git origin both push to."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition, Unavailable
from services.common.layout import Layout
from services.credentials.fencing.database import DatabaseFences, database_from_url
from services.credentials.fencing.resource import Fences, StaleFence
from services.launcher.environment import child_env
from services.scheduler.executor import brokercalls
from services.scheduler.sandboxes.brokers import CredentialsClient
from services.scheduler.store.base import LeaseLost, NodeRunRecord, TicketRecord
from services.scheduler.store.store import Store
from tests.credentials.conftest import git_plain, local_workspace, make_config
from tests.support import postgres
from tests.support.credential_broker import credential_broker

LONG = 60_000


def _branch(origin: Path, ticket: str) -> str | None:
    r = git_plain("--git-dir", str(origin), "rev-parse", "--verify", "-q", f"refs/heads/afe/{ticket}", check=False)
    return r.stdout.decode().strip() if r.returncode == 0 else None


def _new_ticket(store, tid: str) -> None:
    t = TicketRecord(id=tid, workspace="local", workflow="wf", title="t", body="", inputs={}, state="queued",
                     created_at_ms=1, updated_at_ms=1)
    store.tickets.create(t, [NodeRunRecord(tid, "edit", "run")], [])


def _stores(pg_url: str) -> tuple[Store, Store]:
    """Two schedulers' stores on one database, as the scheduler composes them."""
    return (Store.postgresql(pg_url, "the test database", owner="machine-a"),
            Store.postgresql(pg_url, "the test database", owner="machine-b"))


def _take_over(a, b, tid: str) -> tuple[int, int]:
    """a claims the ticket with a short lease that runs out; b takes it over."""
    old = a.leases.claim(tid, ("queued",), 150)
    time.sleep(0.3)
    new = b.leases.claim(tid, ("queued",), LONG)
    assert old and new and new > old
    return old, new


async def _two_machines_stale_push(pg_url: str, origin: Path, root: Path, *, in_database: bool) -> tuple[str | None, str, bool]:
    """The new owner commits and pushes through machine A's broker; the stale owner
    (paused past its lease) then pushes through machine B's broker, which never saw
    the new fence. Returns (the branch on the origin, the new owner's sha, whether
    the stale push was refused)."""
    a, b = _stores(pg_url)
    tid = "t" + root.name[-6:].lower().replace("_", "")
    layouts = [Layout(root / f"m{i}" / "data", root / f"m{i}" / "run") for i in (1, 2)]
    config = make_config(root, local_workspace(origin))
    url = pg_url if in_database else ""
    try:
        _new_ticket(a, tid)
        stale, new = _take_over(a, b, tid)
        async with credential_broker(config, layouts[0], database_url=url) as (sock_a, key_a), \
                credential_broker(config, layouts[1], database_url=url) as (sock_b, key_b):
            on_a, on_b = CredentialsClient(sock_a, key_a), CredentialsClient(sock_b, key_b)
            try:
                # The stale owner had prepared and changed the workspace on machine B before its pause.
                await on_b.prepare(tid, "local")
                (layouts[1].workspace(tid) / "README.md").write_text("# the stale owner's change\n")
                # The new owner acts through machine A.
                await on_a.prepare(tid, "local")
                (layouts[0].workspace(tid) / "README.md").write_text("# the new owner's change\n")
                sha = (await on_a.commit(tid, "local", "new owner", new)).sha
                assert (await on_a.push(tid, "local", new)).sha == sha
                refused = False
                try:
                    await on_b.commit(tid, "local", "stale owner", stale)
                    await on_b.push(tid, "local", stale)
                except LeaseLost:
                    refused = True
                return _branch(origin, tid), sha, refused
            finally:
                await on_a.close()
                await on_b.close()
    finally:
        a.close()
        b.close()


async def test_r37_r45_a_stale_push_through_another_machines_broker_is_refused_by_the_fence_in_the_database(
        pg_url, local_origin, short_tmp):
    branch, new_sha, refused = await _two_machines_stale_push(pg_url, local_origin, short_tmp / "db",
                                                              in_database=True)
    assert refused
    assert branch == new_sha             # the new owner's push stands; nothing of the stale owner's


async def test_r37_r45_positive_control_with_each_machines_fence_file_the_stale_push_lands(
        pg_url, local_origin, short_tmp):
    branch, new_sha, refused = await _two_machines_stale_push(pg_url, local_origin, short_tmp / "file",
                                                              in_database=False)
    assert not refused                   # machine B's file never saw fence 2
    assert branch != new_sha and branch is not None
    shown = git_plain("--git-dir", str(local_origin), "show", f"{branch}:README.md").stdout.decode()
    assert shown == "# the stale owner's change\n"   # the stale owner overwrote the new owner's push


def _claim_in_thread(store, tid: str) -> list:
    got: list = []
    th = threading.Thread(target=lambda: got.append(store.leases.claim(tid, ("queued",), LONG)))
    th.start()
    th.join(30)
    return got


async def test_r37_r45_the_check_holds_the_row_so_a_claim_cannot_slip_in_during_the_side_effect(pg_url):
    a, b = _stores(pg_url)
    fences = DatabaseFences(database_from_url(pg_url))
    try:
        _new_ticket(a, "h1")
        fence = a.leases.claim("h1", ("queued",), 400)
        async with fences.hold("h1", fence):                 # a push under way, checked while the lease held
            await asyncio.sleep(0.6)                         # ... and outlasting it
            # Another machine's takeover finds the row locked and skips it; it cannot take the ticket.
            assert await asyncio.to_thread(_claim_in_thread, b, "h1") == [None]
            # The owner's own heartbeat and writes are not held up by the check (FOR KEY SHARE).
            started = time.monotonic()
            assert await asyncio.to_thread(a.leases.renew, ["h1"], 400)
            assert time.monotonic() - started < 2
            await asyncio.sleep(0.6)                          # the renewed lease runs out
        # The side effect returned: now the claim goes through, with a new fence ...
        assert await asyncio.to_thread(_claim_in_thread, b, "h1") == [fence + 1]
        # ... and the old owner's next side effect is refused, the new owner's allowed.
        with pytest.raises(StaleFence, match="this scheduler lost its lease"):
            async with fences.hold("h1", fence):
                raise AssertionError("ran with a stale fence")
        async with fences.hold("h1", fence + 1):
            pass
        # Positive control: without a hold under way the same takeover is made at once.
        _new_ticket(a, "h2")
        f2 = a.leases.claim("h2", ("queued",), 100)
        await asyncio.sleep(0.3)
        assert await asyncio.to_thread(_claim_in_thread, b, "h2") == [f2 + 1]
    finally:
        await fences.aclose()
        a.close()
        b.close()


async def test_r37_r45_an_expired_or_released_lease_or_another_database_is_refused_and_fence_0_is_not_checked(
        pg_url):
    a, _b = _stores(pg_url)
    fences = DatabaseFences(database_from_url(pg_url))
    ran: list[str] = []
    try:
        _new_ticket(a, "e1")
        fence = a.leases.claim("e1", ("queued",), 100)
        await asyncio.sleep(0.3)
        with pytest.raises(FailedPrecondition, match=r"ended \d+ ms ago by the database's clock\); this "
                                                     "scheduler lost its lease"):
            async with fences.hold("e1", fence):
                ran.append("expired")
        assert a.leases.claim("e1", ("queued",), LONG) == fence + 1      # its owner claims it again
        async with fences.hold("e1", fence + 1):
            ran.append("held")
        a.leases.release("e1")
        with pytest.raises(FailedPrecondition, match=r"the ticket was released\); this scheduler lost its lease"):
            async with fences.hold("e1", fence + 1):
                ran.append("released")
        with pytest.raises(FailedPrecondition, match="use different databases; give both the same "
                                                     "AFE_DATABASE_URL") as info:
            async with fences.hold("e1", fence + 7):
                ran.append("future")
        assert "lost its lease" not in str(info.value)                    # a configuration error, not a takeover
        with pytest.raises(FailedPrecondition, match="is not in the PostgreSQL database"):
            async with fences.hold("nosuch", 3):
                ran.append("unknown")
        async with fences.hold("e1", 0):                                  # unfenced (no lease store): not checked
            ran.append("unfenced")
        assert ran == ["held", "unfenced"]
    finally:
        await fences.aclose()
        a.close()
        _b.close()


async def test_r37_r45_a_database_that_does_not_answer_refuses_the_side_effect_naming_the_store(
        local_origin, layout, closed_port):
    url = f"postgresql://afe:pw-not-shown-91@127.0.0.1:{closed_port}/afe?connect_timeout=2"
    fences = DatabaseFences(database_from_url(url))
    with pytest.raises(Unavailable) as info:
        async with fences.hold("u1", 4):
            raise AssertionError("ran without a check")
    text = str(info.value)
    assert f"the PostgreSQL database afe on 127.0.0.1 port {closed_port} (the scheduler's store) does not " \
           "answer; nothing was done" in text
    assert "pw-not-shown-91" not in text and "postgresql://" not in text
    # Through the broker: the push is refused as UNAVAILABLE and nothing reaches the origin.
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with credential_broker(config, layout, database_url=url) as (sock, key):
        client = CredentialsClient(sock, key)
        try:
            await client.prepare("u1", "local")
            (layout.workspace("u1") / "README.md").write_text("# change\n")
            with pytest.raises(Unavailable, match="does not answer"):
                await client.push("u1", "local", fence=4)
            assert _branch(local_origin, "u1") is None
            assert (await client.commit("u1", "local", "unfenced", 0)).sha    # fence 0: no check
        finally:
            await client.close()


async def test_r37_r45_the_check_never_blocks_the_brokers_event_loop():
    """A database that accepts the connection and then says nothing: the loop goes on ticking."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        fences = DatabaseFences(database_from_url(f"postgresql://afe@127.0.0.1:{port}/afe?connect_timeout=1"))
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        with pytest.raises(Unavailable):
            async with fences.hold("s1", 2):
                pass
        waited = time.monotonic() - started
        ticker.cancel()
        assert waited >= 0.9 and ticks >= waited / 0.05 * 0.6, (waited, ticks)


async def test_r37_r45_a_push_refused_while_the_database_is_down_is_made_once_it_is_back(local_origin, layout):
    """The builtin step (brokercalls.step) tries the push again while the broker says the fence's
    database does not answer, and it lands once the database is back (the broker's pooled
    connection died with the restart: a new one is made)."""
    reason = postgres.skip_reason()
    if reason:
        pytest.skip(reason)
    server = postgres.start_server()
    try:
        url = server.app_url(server.fresh_database())
        a = Store.postgresql(url, "the test database", owner="machine-a")
        _new_ticket(a, "w1")
        fence = a.leases.claim("w1", ("queued",), LONG)
        a.close()
        config = make_config(layout.data_dir.parent, local_workspace(local_origin))
        async with credential_broker(config, layout, database_url=url) as (sock, key):
            client = CredentialsClient(sock, key)
            emitted: list[tuple[str, dict]] = []
            try:
                await client.prepare("w1", "local")
                (layout.workspace("w1") / "README.md").write_text("# while the database was away\n")
                sha = (await client.commit("w1", "local", "change", fence)).sha     # pools a connection
                await asyncio.to_thread(postgres.stop_only, server)
                # Positive control: an UNAVAILABLE that is not the fence's database fails the step at once.
                with pytest.raises(Unavailable, match="the forge is busy"):
                    await brokercalls.step(30, lambda t, p: emitted.append((t, p)), "pr", "open_pr",
                                           _raise(Unavailable("the forge is busy")))
                assert emitted == []
                later = asyncio.get_running_loop().call_later(
                    1.5, lambda: threading.Thread(target=postgres.start_again, args=(server,)).start())
                pushed = await brokercalls.step(30, lambda t, p: emitted.append((t, p)), "pr", "push",
                                                lambda: client.push("w1", "local", fence))
                later.cancel()
                assert pushed.sha == sha and _branch(local_origin, "w1") == sha
                assert [t for t, _ in emitted] == ["broker.retry", "broker.recovered"]
                assert "cannot check the fence of push: the database does not answer" in emitted[0][1]["message"]
            finally:
                await client.close()
    finally:
        postgres.stop_server(server)


def _raise(exc: Exception):
    async def call():
        raise exc
    return call


def test_r37_r45_the_credential_broker_gets_the_store_url_only_when_it_is_postgresql(tmp_path):
    config = make_config(tmp_path)
    pg = {"PATH": "/bin", "AFE_DATABASE_URL": "postgresql://afe:pw@db:5432/afe"}
    assert child_env("credentials", config, pg)["AFE_DATABASE_URL"] == pg["AFE_DATABASE_URL"]
    lite = {"PATH": "/bin", "AFE_DATABASE_URL": "sqlite:///srv/afe.db"}
    assert "AFE_DATABASE_URL" not in child_env("credentials", config, lite)      # one machine: the fence file
    assert "AFE_DATABASE_URL" in child_env("scheduler", config, lite)
    assert database_from_url("sqlite:///srv/afe.db") is None and database_from_url("") is None
    assert isinstance(Fences(None), Fences)
