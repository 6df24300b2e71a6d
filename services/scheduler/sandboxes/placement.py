"""Several sandbox brokers as one (docs/SCALE.md, "Sandbox brokers on
several hosts").

`BrokerSet` is a `SandboxBroker` over a list of brokers, each reached over
mutual TLS (R39) and allowed `capacity` sandboxes at once:

- placement: the first `create` of a ticket puts its sandbox on the broker
  with the most room (its live sandboxes from ListSandboxes, plus the
  creates this scheduler has in flight there) and records the broker in the
  store (`Store.place_sandbox`), so every later call of the ticket, also
  after a scheduler restart, goes to the same broker. No broker with room:
  `ResourceExhausted` naming each broker's load, or the ones away;
- a broker that goes away: the calls of its tickets fail with
  `PeerUnavailable` naming it ("the sandbox broker sandbox-2 at HOST:PORT
  went away during the command"), so those tickets fail with that reason
  and nothing is moved behind the user's back; tickets on the other brokers
  go on. Their teardowns are retried (teardown.py) until the broker answers;
- reconcile and identify ask every broker: `identify` is one string of
  every broker's boot id (`away` for one that does not answer), so a broker
  that comes back, or restarted, changes it and the scheduler's watch
  (teardown.py::Teardowns.watch_broker) reconciles at once: the sandboxes of
  tickets that ended while it was away are removed there. Nothing leaks.

The core has no grpc import: the members are `SandboxClient`s.
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.errors import (
    AfeError,
    ConfigError,
    FailedPrecondition,
    PeerUnavailable,
    ResourceExhausted,
)
from services.common.layout import verify_owner
from services.common.rpc.tls import TlsFiles, read_secret_file

from ..store.store import Store
from .brokers import SandboxClient

log = logging.getLogger(__name__)

AWAY = "away"


@dataclass
class Member:
    """One sandbox broker of the set and how many sandboxes it may hold at once."""

    client: SandboxClient
    capacity: int

    @property
    def name(self) -> str:
        return self.client.name


class BrokerSet:
    """A `SandboxBroker` that places each ticket on one of several brokers."""

    def __init__(self, members: list[Member], store: Store) -> None:
        if not members:
            raise FailedPrecondition("no sandbox broker is configured; give --sandbox-broker NAME=HOST:PORT")
        self.members = {m.name: m for m in members}
        self.store = store
        self._placed: dict[str, str] = {}
        self._pending: dict[str, set[str]] = {m.name: set() for m in members}
        self._place_lock = asyncio.Lock()
        self._creates_open = asyncio.Event()
        self._creates_open.set()
        self.stub: Any = None    # several brokers: `stub_for(ticket_id)` is the ticket's broker's stub

    def stub_for(self, ticket_id: str) -> Any:
        return self.holder(ticket_id).stub

    async def close(self) -> None:
        for m in self.members.values():
            await m.client.close()

    # -- placement -----------------------------------------------------------
    def placed_on(self, ticket_id: str) -> str | None:
        """The broker the ticket's sandbox is placed on (None: not placed)."""
        name = self._placed.get(ticket_id)
        if name is None:
            name = self.store.placements.sandbox_placement(ticket_id)
            if name is not None:
                self._placed[ticket_id] = name
        return name

    def holder(self, ticket_id: str) -> SandboxClient:
        """The client of the broker holding the ticket's sandbox."""
        name = self.placed_on(ticket_id)
        if name is None:
            raise FailedPrecondition(f"ticket {ticket_id} has no sandbox on any sandbox broker")
        m = self.members.get(name)
        if m is None:
            raise FailedPrecondition(
                f"ticket {ticket_id}'s sandbox is on the sandbox broker {name}, which this scheduler no longer "
                "lists; add it back with --sandbox-broker, or cancel the ticket")
        return m.client

    async def _load(self, m: Member) -> int | None:
        """Sandboxes on `m` (live there, or being made by this scheduler); None when it does not answer."""
        try:
            listed = {s.ticket_id for s in await m.client.list()}
        except AfeError as exc:
            log.warning("%s is not answering; no sandbox is placed there: %s", m.client.peer, exc)
            return None
        return len(listed | self._pending[m.name])

    async def _choose(self, ticket_id: str) -> Member:
        members = list(self.members.values())
        loads = await asyncio.gather(*(self._load(m) for m in members))
        best: tuple[float, int, Member] | None = None
        for i, (m, load) in enumerate(zip(members, loads, strict=True)):
            if load is None or load >= m.capacity:
                continue
            key = (load / m.capacity, i, m)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            said = ", ".join(f"{m.name} {AWAY}" if load is None else f"{m.name} full ({load}/{m.capacity})"
                             for m, load in zip(members, loads, strict=True))
            raise ResourceExhausted(f"no sandbox broker has room for ticket {ticket_id}'s sandbox ({said}); "
                                    "wait for running tickets to end, add a broker with --sandbox-broker, or "
                                    "lower --max-running to the brokers' total capacity")
        return best[2]

    @contextlib.asynccontextmanager
    async def creates_held(self) -> AsyncIterator[None]:
        """New creates wait inside this block (as SandboxClient.creates_held)."""
        self._creates_open.clear()
        try:
            yield
        finally:
            self._creates_open.set()

    async def _place_locked(self, ticket_id: str) -> str:
        name = self.placed_on(ticket_id)
        if name is None:
            # A ticket's clean-room verification (R41) goes with the ticket: on its broker, in its
            # slot (it lives for the verification only), so a full broker does not refuse it.
            owner = verify_owner(ticket_id)
            m = self.members.get(self.placed_on(owner) or "") if owner else None
            if m is None:
                m = await self._choose(ticket_id)
            name = m.name
            self.store.placements.place_sandbox(ticket_id, name, int(time.time() * 1000))
            self._placed[ticket_id] = name
            log.info("ticket %s: sandbox placed on %s", ticket_id, m.client.peer)
        return name

    async def place(self, ticket_id: str) -> SandboxClient:
        """Place the ticket now (before its sandbox exists: its workspace goes
        there first, remoteworkspace.py); it counts as a create in flight there
        until its create ends."""
        await self._creates_open.wait()
        async with self._place_lock:
            name = await self._place_locked(ticket_id)
            self._pending[name].add(ticket_id)
        return self.holder(ticket_id)

    async def create(self, ticket_id: str, spec: spb.SandboxSpec) -> spb.Sandbox:
        await self._creates_open.wait()
        async with self._place_lock:
            name = await self._place_locked(ticket_id)
            client = self.holder(ticket_id)
            self._pending[name].add(ticket_id)
        try:
            return await client.create(ticket_id, spec)
        finally:
            self._pending[name].discard(ticket_id)

    async def destroy(self, ticket_id: str) -> int:
        """Remove the ticket's sandbox where it is placed; raises when that broker does not answer
        (the teardown is retried). A ticket never placed is looked for on every broker that answers."""
        if self.placed_on(ticket_id) is not None:
            removed = await self.holder(ticket_id).destroy(ticket_id)
        else:   # placement is recorded before a create: nothing of it can be on a broker away now
            removed = 0
            for m in self.members.values():
                with contextlib.suppress(AfeError):
                    removed += await m.client.destroy(ticket_id)
        self.store.placements.unplace_sandbox(ticket_id)
        self._placed.pop(ticket_id, None)
        return removed

    # -- every broker ----------------------------------------------------------
    async def reconcile(self, live: list[str]) -> spb.ReconcileResponse:
        """Reconcile every broker that answers; raises only when none does."""
        members = list(self.members.values())
        got = await asyncio.gather(*(m.client.reconcile(live) for m in members), return_exceptions=True)
        out = spb.ReconcileResponse()
        boots, errors = [], []
        for m, r in zip(members, got, strict=True):
            if isinstance(r, AfeError):
                log.warning("could not reconcile %s (again when it answers): %s", m.client.peer, r)
                boots.append(f"{m.name}={AWAY}")
                errors.append(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                boots.append(f"{m.name}={r.boot_id}")
                out.removed_tickets.extend(r.removed_tickets)
        if len(errors) == len(members):
            raise errors[0]
        out.boot_id = ";".join(boots)
        return out

    async def identify(self) -> str:
        """Every broker's boot id in one string (`NAME=away` for one not answering)."""
        members = list(self.members.values())
        got = await asyncio.gather(*(m.client.identify() for m in members), return_exceptions=True)
        parts = []
        for m, r in zip(members, got, strict=True):
            if isinstance(r, AfeError):
                parts.append(f"{m.name}={AWAY}")
            elif isinstance(r, BaseException):
                raise r
            else:
                parts.append(f"{m.name}={r}")
        if all(p.endswith("=" + AWAY) for p in parts):
            raise PeerUnavailable("no sandbox broker answers (" + ", ".join(self.members) + ")")
        return ";".join(parts)

    # -- a ticket's broker -----------------------------------------------------
    async def freeze(self, ticket_id: str, frozen: bool) -> None:
        await self.holder(ticket_id).freeze(ticket_id, frozen)

    async def denied_egress(self, ticket_id: str) -> spb.DeniedEgressResponse:
        return await self.holder(ticket_id).denied_egress(ticket_id)

    async def exec(self, ticket_id: str, argv: list[str], timeout_ms: int = 0, output_cap_bytes: int = 0,
                   cwd: str = "") -> AsyncIterator[spb.ExecEvent]:
        async for ev in self.holder(ticket_id).exec(ticket_id, argv, timeout_ms, output_cap_bytes, cwd):
            yield ev

    async def read_file(self, ticket_id: str, path: str, max_bytes: int = 0) -> spb.ReadFileResponse:
        return await self.holder(ticket_id).read_file(ticket_id, path, max_bytes)

    async def write_file(self, ticket_id: str, path: str, content: bytes) -> int:
        return await self.holder(ticket_id).write_file(ticket_id, path, content)

    async def list_dir(self, ticket_id: str, path: str) -> spb.ListDirResponse:
        return await self.holder(ticket_id).list_dir(ticket_id, path)

    async def search(self, ticket_id: str, pattern: str, path: str = "", regex: bool = False,
                     max_results: int = 0) -> spb.SearchResponse:
        return await self.holder(ticket_id).search(ticket_id, pattern, path, regex, max_results)

    # last: a method named `list` shadows the builtin in the annotations after it
    async def list(self) -> builtins.list[spb.Sandbox]:
        """The sandboxes of every broker that answers."""
        out: builtins.list[spb.Sandbox] = []
        for m in self.members.values():
            with contextlib.suppress(AfeError):
                out.extend(await m.client.list())
        return out


# -- configuration (the scheduler's flags) -------------------------------------
DEFAULT_CAPACITY = 8


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox-broker", action="append", default=[], metavar="NAME=HOST:PORT[,capacity=N]",
                   help="a sandbox broker on another host (its `--listen`), reached with mutual TLS; repeatable. "
                   f"capacity: sandboxes it may hold at once (default {DEFAULT_CAPACITY}); its link secret is "
                   "NAME.secret next to --tls-ca (or secret=FILE). With any, the local sandbox broker is not used")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="this scheduler's certificate (`afe certs`)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key (mode 0600)")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="the deployment CA: only brokers with a certificate it signed are called")


def parse_broker(value: str, ca: Path) -> tuple[str, str, int, Path]:
    """`NAME=HOST:PORT[,capacity=N][,secret=FILE]` -> (name, address, capacity, secret file)."""
    name, _, rest = value.partition("=")
    address, *opts = rest.split(",")
    host, _, port = address.rpartition(":")
    if not name or not host or not port.isdigit():
        raise ConfigError(f"--sandbox-broker {value!r}: write NAME=HOST:PORT[,capacity=N] "
                          "(e.g. sandbox-1=sb1.internal:7443,capacity=8)")
    capacity, secret = DEFAULT_CAPACITY, ca.parent / f"{name}.secret"
    for opt in opts:
        key, _, v = opt.partition("=")
        if key == "capacity" and v.isdigit() and int(v) > 0:
            capacity = int(v)
        elif key == "secret" and v:
            secret = Path(v)
        else:
            raise ConfigError(f"--sandbox-broker {value!r}: {opt!r} is not capacity=N (N > 0) or secret=FILE")
    return name, address, capacity, secret


def from_flags(args: argparse.Namespace, store: Store) -> BrokerSet | None:
    """The set of `--sandbox-broker`s, None when none is given (the local broker then)."""
    if not args.sandbox_broker:
        return None
    tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca, "--sandbox-broker")
    if tls is None:
        raise ConfigError("--sandbox-broker needs mutual TLS: give --tls-cert, --tls-key and --tls-ca "
                          "(make them with `afe certs`)")
    tls.read()   # a missing or open key file is reported now, not at the first call
    members: list[Member] = []
    for value in args.sandbox_broker:
        name, address, capacity, secret_file = parse_broker(value, tls.ca)
        if any(m.name == name for m in members):
            raise ConfigError(f"--sandbox-broker {name} is given twice; each broker needs its own name")
        secret = read_secret_file(secret_file, f"the link secret of sandbox broker {name}")
        members.append(Member(SandboxClient(address, secret, tls=tls, name=name), capacity))
    return BrokerSet(members, store)
