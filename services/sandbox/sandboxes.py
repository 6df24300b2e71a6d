"""Sandbox lifecycle: one hardened container per ticket (plus, with egress,
an internal network and a squid proxy), created idempotently, listed,
frozen, destroyed, and reconciled against the set of live tickets.

Only objects labelled with this broker's `afe.instance` are ever touched.
The Docker SDK is synchronous; its calls run in worker threads. Making the
containers is in provision.py, starting existing ones again in restart.py,
removing them in cleanup.py, the proxy wait and the bridge address in
egress_proxy.py, what is reported in sandbox_info.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import replace

import docker
import docker.errors

from services.common import safefs
from services.common.config import DEFAULT_PROXY_IMAGE
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.layout import SANDBOX_GID, SANDBOX_UID, Layout, check_ticket_id

from . import cleanup, diskcap, egress_proxy, hardening, provision, relayforward, restart, sandbox_info
from .egress import check_cidrs, check_egress_names, check_private
from .egress_proxy import bridge_ipv4
from .handover import Handover
from .hardening import LABEL_INSTANCE, LABEL_ROLE, LABEL_TICKET, SandboxSettings
from .sandbox_info import INSTANCE_RE, ReconcileResult, SandboxInfo, check_instance

__all__ = ["INSTANCE_RE", "ReconcileResult", "SandboxInfo", "SandboxManager", "bridge_ipv4",
           "check_bridge_has_no_address", "check_instance", "chown_tree"]

log = logging.getLogger(__name__)

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class SandboxManager:
    def __init__(self, layout: Layout, *, instance: str = "default", egress_network: str = "bridge",
                 allow_private: Iterable[str] = (), env_values: dict | None = None,
                 proxy_image: str = DEFAULT_PROXY_IMAGE, client: docker.DockerClient | None = None,
                 disk_mode: str | None = None) -> None:
        self.layout = layout
        self.instance = check_instance(instance)
        self.egress_network = egress_network
        self.allow_private = tuple(check_cidrs(list(allow_private)))
        self.env_values = dict(env_values or {})
        self.proxy_image = proxy_image
        self.client = client or docker.from_env(timeout=120)
        self._locks: dict[str, asyncio.Lock] = {}
        self._cache: dict[str, SandboxInfo] = {}
        # R34: the workspace disk cap (diskcap.py); `disk_mode` None = detect
        self.diskcap = diskcap.DiskCaps(layout.workspaces_dir, mode=disk_mode)
        # the workspace across hosts (ReadWorkspace/WriteWorkspace; handover.py)
        self.handover = Handover(layout)
        self._watches: dict[str, asyncio.Task] = {}
        self._exceeded: dict[str, str] = {}
        self._engine_ok = False

    # -- names ---------------------------------------------------------------
    def _prefix(self) -> str:
        return "afe" if self.instance == "default" else f"afe-{self.instance}"

    def container_name(self, ticket_id: str) -> str:
        return f"{self._prefix()}-{ticket_id}"

    def proxy_name(self, ticket_id: str) -> str:
        return f"{self._prefix()}-{ticket_id}-proxy"

    def network_name(self, ticket_id: str) -> str:
        return f"{self._prefix()}-{ticket_id}"

    def _filters(self, ticket_id: str | None = None, role: str | None = None) -> dict:
        labels = [f"{LABEL_INSTANCE}={self.instance}", LABEL_TICKET]
        if ticket_id:
            labels[1] = f"{LABEL_TICKET}={ticket_id}"
        if role:
            labels.append(f"{LABEL_ROLE}={role}")
        return {"label": labels}

    def _lock(self, ticket_id: str) -> asyncio.Lock:
        return self._locks.setdefault(ticket_id, asyncio.Lock())

    # -- health --------------------------------------------------------------
    async def ping(self) -> bool:
        return bool(await asyncio.to_thread(self.client.ping))

    # -- workspace -----------------------------------------------------------
    def _workspace_folder(self, ticket_id: str) -> str:
        """The ticket's workspace folder, made if missing; refused when it is not a directory."""
        path = self.layout.workspace(ticket_id)
        self.layout.workspaces_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o755)
        if not os.path.isdir(path) or os.path.islink(path):
            raise FailedPrecondition("the ticket's workspace is not a directory")
        return str(path)

    def prepare_workspace(self, ticket_id: str, disk_bytes: int = 0, *, new: bool = False) -> str:
        """The workspace dir (created if missing), owned by the sandbox uid so
        the sandbox can write it (host tools and host git run as root/owner).
        With `disk_bytes`, capped (R34): for a `new` sandbox the checkout moves
        into a loop-mounted image of that size; for an existing one only an
        image it already has is mounted again (its container binds the
        directory as it is)."""
        self._workspace_folder(ticket_id)
        path = self.layout.workspace(ticket_id)
        st = os.lstat(path)
        if disk_bytes and self.diskcap.mode == diskcap.MODE_MOUNT:
            try:
                self.diskcap.ensure_mounted(ticket_id, path, disk_bytes, create=new)
            except Unavailable:
                # logged by diskcap; the watchdog still holds the cap
                log.error("workspace of %s: no disk image mounted, the watchdog enforces the cap", ticket_id)
        if os.geteuid() == 0:
            # Files the host wrote (a clone, a checkout) become the sandbox's,
            # so it can change them; checked on every (idempotent) create.
            chown_tree(str(path), SANDBOX_UID, SANDBOX_GID)
        elif (st.st_uid, st.st_gid) != (SANDBOX_UID, SANDBOX_GID):
            log.warning("workspace of %s is not owned by the sandbox uid and the broker cannot chown it",
                        ticket_id)
        return str(path)

    # -- lifecycle -----------------------------------------------------------
    async def create(self, settings: SandboxSettings, started: Callable[[str], None] | None = None) -> SandboxInfo:
        """The ticket's sandbox, made (or found, as it was); `started(container
        id)` is called on this loop as soon as a new sandbox runs."""
        ticket_id = check_ticket_id(settings.ticket_id)
        egress = tuple(check_egress_names(list(settings.egress)))
        names, cidrs = check_private(list(settings.egress_private), list(egress))
        for n in settings.env_names:
            if not _ENV_NAME_RE.match(n):
                raise InvalidArgument(f"environment variable name {n[:64]!r} is not valid")
        settings = replace(settings, egress=egress, egress_private=(*names, *cidrs),
                           env_names=tuple(sorted(set(settings.env_names))),
                           disk_bytes=diskcap.resolve_disk(settings.disk_bytes))
        async with self._lock(ticket_id):
            if ticket_id in self._exceeded:
                raise FailedPrecondition(self._exceeded[ticket_id])
            existing = await asyncio.to_thread(self._find, ticket_id)
            if settings.relay:
                self._check_relay_dir(ticket_id)
                if existing is not None and not existing.relay:
                    raise FailedPrecondition(
                        f"the sandbox of {ticket_id} was made without the model relay; cancel the ticket and "
                        "create it again")
            if existing is not None:
                await asyncio.to_thread(self.prepare_workspace, ticket_id, settings.disk_bytes)
                await self._ensure_cap(ticket_id, settings.disk_bytes, existing.container_id)
                existing = await restart.bring_back(self.client, existing, self.egress_network)
                self._cache[ticket_id] = existing
                return existing
            # The folder exists before the container is made (the engine checks a bind's
            # source then); its disk image and ownership (R34) are made while the engine
            # creates the container, and are in place before it starts (and binds it).
            workspace = await asyncio.to_thread(self._workspace_folder, ticket_id)
            preparing = _PREPARE.submit(self.prepare_workspace, ticket_id, settings.disk_bytes, new=True)
            try:
                loop = asyncio.get_running_loop()

                def hook(cid: str) -> None:
                    if started is not None:
                        loop.call_soon_threadsafe(started, cid)
                def prepared() -> None:     # its error (the checkout does not fit) stops the start
                    preparing.result()
                info, proxy_ip = await asyncio.to_thread(self._create_sync, settings, workspace, hook, prepared)
            except BaseException:
                with contextlib.suppress(BaseException):
                    await asyncio.wrap_future(preparing)    # not left running under the cleanup
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(cleanup.remove_objects, self.client, self._filters(ticket_id))
                raise
            if info.proxy_container_id:
                await egress_proxy.wait_proxy(self.client, info.proxy_container_id, self.egress_network,
                                              proxy_ip)
            info = replace(info, disk_bytes=settings.disk_bytes)
            if settings.relay:
                try:
                    await asyncio.to_thread(relayforward.start, self.client, info.container_id)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(cleanup.remove_objects, self.client, self._filters(ticket_id))
                    raise
            await self._ensure_cap(ticket_id, settings.disk_bytes, info.container_id)
            self._cache[ticket_id] = info
            log.info("sandbox created for %s (egress: %s; private: %s)", ticket_id, ",".join(egress) or "none",
                     ",".join(settings.egress_private) or "none")
            return info

    def _create_sync(self, s: SandboxSettings, workspace: str, started: Callable[[str], None],
                     before_start: Callable[[], None] = lambda: None) -> tuple[SandboxInfo, str]:
        """Create (and start) the containers (provision.py); returns the info
        and the proxy's address on its outside network ("" without egress)."""
        names = provision.Names(sandbox=self.container_name(s.ticket_id), proxy=self.proxy_name(s.ticket_id),
                                network=self.network_name(s.ticket_id))
        return provision.create_containers(
            self.client, s, workspace, names, instance=self.instance, egress_network=self.egress_network,
            allow_private=self.allow_private, proxy_image=self.proxy_image,
            relay_dir=str(self.layout.relay_dir(s.ticket_id)) if s.relay else None,
            check_engine=self._check_engine_for_egress,
            # looked up here at each call: R31's check of the new bridge (tests replace it)
            check_network=lambda network: check_bridge_has_no_address(hardening.bridge_name(network)),
            started=started, before_start=before_start)

    # -- model relay (R32) -----------------------------------------------------
    def _check_relay_dir(self, ticket_id: str) -> None:
        """The folder mounted is the one the layout names for this ticket,
        never a path from a caller, and it must be a real directory (not a
        link that would mount some other host folder)."""
        d = self.layout.relay_dir(ticket_id)
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"the model relay of {ticket_id} is not open: the scheduler opens it at the credential broker "
                "(OpenRelay) before it creates the sandbox") from None
        if not stat.S_ISDIR(st.st_mode):
            raise FailedPrecondition(f"{d} is not a directory; remove it and run the ticket again")

    def _check_engine_for_egress(self) -> None:
        """R31 needs a bridge without a host address (`inhibit_ipv4`), which
        Docker 20.10 introduced; an older engine would ignore the option and
        give the bridge an address every sandbox could reach."""
        if self._engine_ok:
            return
        version = str(self.client.version().get("Version", ""))
        m = re.match(r"^(\d+)\.(\d+)", version)
        if not m or (int(m[1]), int(m[2])) < (20, 10):
            raise FailedPrecondition(
                f"egress sandboxes need Docker 20.10 or newer (this engine is {version or 'unknown'}): "
                "upgrade Docker, or run the ticket without sandbox.egress")
        self._engine_ok = True

    def _find(self, ticket_id: str) -> SandboxInfo | None:
        return sandbox_info.find_sandbox(self.client, self._filters(ticket_id))

    async def get(self, ticket_id: str) -> SandboxInfo:
        """The running sandbox of a ticket (cached; NotFound when missing)."""
        check_ticket_id(ticket_id)
        if ticket_id in self._exceeded:
            raise FailedPrecondition(self._exceeded[ticket_id])
        info = self._cache.get(ticket_id)
        if info is not None:
            return info
        info = await asyncio.to_thread(self._find, ticket_id)
        if info is None:
            raise NotFound(f"no sandbox for ticket {ticket_id}: create it first")
        # a restarted broker finds the sandbox here first: the cap holds again
        await self._ensure_cap(ticket_id, info.disk_bytes or diskcap.DEFAULT_DISK, info.container_id)
        self._cache[ticket_id] = info
        return info

    # -- disk cap (R34) ------------------------------------------------------
    async def _ensure_cap(self, ticket_id: str, cap: int, container_id: str) -> None:
        """A mounted image caps the workspace; otherwise the watchdog does."""
        if self.diskcap.mode == diskcap.MODE_MOUNT:
            path = self.layout.workspace(ticket_id)
            if await asyncio.to_thread(self.diskcap.mounted, path):
                return
        task = self._watches.get(ticket_id)
        if task is None or task.done():
            self._watches[ticket_id] = asyncio.get_running_loop().create_task(
                self._watchdog(ticket_id, cap, container_id))

    async def _watchdog(self, ticket_id: str, cap: int, container_id: str) -> None:
        path = self.layout.workspace(ticket_id)
        while True:
            await asyncio.sleep(diskcap.WATCH_INTERVAL_S)
            try:
                used, refused = await asyncio.to_thread(diskcap.usage, path, cap)
            except OSError as exc:
                log.warning("ticket %s: could not measure the workspace: %s", ticket_id, exc.strerror)
                continue
            if used <= cap and not refused:
                continue
            reason = diskcap.cap_reason(cap) if not refused else (
                f"{refused}: the sandbox was stopped (R34); write less into the workspace")
            self._exceeded[ticket_id] = reason
            self._cache.pop(ticket_id, None)
            log.warning("ticket %s: %s", ticket_id, reason)
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                await asyncio.to_thread(self.client.api.kill, container_id)
            return

    def disk_exceeded(self, ticket_id: str) -> str:
        """Why the watchdog stopped the ticket's sandbox, or ""."""
        return self._exceeded.get(ticket_id, "")

    def _stop_watch(self, ticket_id: str) -> None:
        task = self._watches.pop(ticket_id, None)
        if task is not None:
            task.cancel()
        self._exceeded.pop(ticket_id, None)

    def forget(self, ticket_id: str) -> None:
        self._cache.pop(ticket_id, None)

    async def destroy(self, ticket_id: str) -> int:
        check_ticket_id(ticket_id)
        async with self._lock(ticket_id):
            self._cache.pop(ticket_id, None)
            self._stop_watch(ticket_id)
            n = await asyncio.to_thread(cleanup.remove_objects, self.client, self._filters(ticket_id))
            # after the container is gone, before the credential broker removes the directory
            await asyncio.to_thread(self.diskcap.release, ticket_id, self.layout.workspace(ticket_id))
            # a workspace that came over the network (WriteWorkspace) has no credential broker here to remove it
            await asyncio.to_thread(self.handover.remove, ticket_id)
        self._locks.pop(ticket_id, None)
        log.info("sandbox of %s destroyed (%d objects)", ticket_id, n)
        return n

    async def list_all(self) -> list[SandboxInfo]:
        return await asyncio.to_thread(sandbox_info.list_sandboxes, self.client, self._filters())

    async def reconcile(self, live_tickets: Iterable[str]) -> ReconcileResult:
        live = set(live_tickets)

        def run() -> ReconcileResult:
            tickets, nc, nn = cleanup.remove_dead(self.client, self._filters(), live)
            for t in tickets:
                self._cache.pop(t, None)
            # R34: disk images and mounts of dead tickets (also after a broker restart)
            tickets.update(self.diskcap.reconcile(live, self.layout.workspace))
            tickets.update(self.handover.reconcile(live))
            return ReconcileResult(tuple(sorted(tickets)), nc, nn)
        for t in [t for t in self._watches if t not in live]:
            self._stop_watch(t)
        res = await asyncio.to_thread(run)
        if res.removed_tickets:
            log.info("reconcile removed %d containers, %d networks",
                     res.removed_containers, res.removed_networks)
        return res

    async def freeze(self, ticket_id: str, frozen: bool) -> None:
        info = await self.get(ticket_id)

        def run() -> None:
            state = self.client.api.inspect_container(info.container_id)["State"]
            if frozen and not state.get("Paused"):
                self.client.api.pause(info.container_id)
            elif not frozen and state.get("Paused"):
                self.client.api.unpause(info.container_id)
        try:
            await asyncio.to_thread(run)
        except docker.errors.NotFound as exc:
            self.forget(ticket_id)
            raise NotFound(f"no sandbox for ticket {ticket_id}: create it first") from exc
        self._cache[ticket_id] = replace(info, state="paused" if frozen else "running")

    def env_for(self, info: SandboxInfo, names: Iterable[str]) -> list[str]:
        """KEY=value entries for an exec: only declared names, values from the
        broker's own environment (never an argv)."""
        out = []
        for n in names:
            if n not in info.env_names:
                raise InvalidArgument(f"environment variable {n[:64]} was not declared for this sandbox")
            v = self.env_values.get(n)
            if v is None:
                raise FailedPrecondition(f"environment variable {n} is not set for the sandbox broker")
            out.append(f"{n}={v.reveal() if hasattr(v, 'reveal') else v}")
        return out

    def literal_env_for(self, info: SandboxInfo, entries: Iterable[str]) -> list[str]:
        """NAME=value entries the caller gives literally (the relay's base URL
        and placeholder capability, fixed tool settings). None may name a
        declared variable or one this broker holds: those come only from the
        broker's own environment, by name (R9)."""
        out, total = [], 0
        for e in entries:
            name, sep, value = e.partition("=")
            if not sep or not _ENV_NAME_RE.match(name):
                raise InvalidArgument(f"environment entry {e[:64]!r} is not NAME=value")
            if name in info.env_names or name in self.env_values:
                raise InvalidArgument(f"environment variable {name} is passed by name only (R9); "
                                      "it cannot also be given a value")
            if "\x00" in value:
                raise InvalidArgument(f"environment variable {name}: the value contains a NUL byte")
            total += len(e)
            if total > 64 * 1024:
                raise InvalidArgument("literal environment entries must total under 64 KiB")
            out.append(e)
        return out


# Workspaces prepared (disk image, ownership) while the engine creates their containers.
_PREPARE = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="afe-workspace")
CHOWN_LIMITS = safefs.Limits("the sandbox's workspace ownership check")  # depth 256, 1,000,000 entries


def check_bridge_has_no_address(name: str) -> None:
    """R31, checked at every egress sandbox's creation: the ticket's bridge
    must not give the host an address on it (where the broker can see it)."""
    addr = bridge_ipv4(name)
    if addr:
        raise FailedPrecondition(
            f"Docker gave the ticket network's bridge {name} the host address {addr}, so the sandbox could "
            "reach the host: this engine ignores com.docker.network.bridge.inhibit_ipv4; upgrade Docker "
            "(20.10 or newer)")
    if addr is None:
        log.debug("bridge %s is not visible from the broker's network namespace; not checked", name)


def chown_tree(root: str, uid: int, gid: int) -> int:
    """Give every entry of a tree to uid:gid without following any symlink:
    `safefs.chown_tree`, the one fix-up both brokers use (iterative, bounded by
    `CHOWN_LIMITS`, fchownat(AT_SYMLINK_NOFOLLOW) from the parent's fd; R34).
    Returns the count changed."""
    return safefs.chown_tree(root, uid, gid, CHOWN_LIMITS)
