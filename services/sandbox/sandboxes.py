"""Sandbox lifecycle: one hardened container per ticket (plus, with egress,
an internal network and a squid proxy), created idempotently, listed,
frozen, destroyed, and reconciled against the set of live tickets.

Only objects labelled with this broker's `afe.instance` are ever touched.
The Docker SDK is synchronous; its calls run in worker threads. Making the
containers is in provision.py, starting existing ones again in restart.py,
removing them in cleanup.py, the proxy wait and the bridge address in
egress/proxy.py, what is reported in containers/info.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import docker
import docker.errors

from services.common.config.egress_rules import check_rules
from services.common.config.model import DEFAULT_PROXY_IMAGE
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.layout import (
    INSTANCE_RE,
    SANDBOX_GID,
    SANDBOX_UID,
    Layout,
    check_instance,
    check_ticket_id,
)
from services.common.secrecy.env_secrets import SecretValue
from services.sandbox import checks
from services.sandbox.containers import cleanup, hardening, provision, restart
from services.sandbox.containers import info as sandbox_info
from services.sandbox.containers.env import ENV_NAME_RE, SandboxEnv
from services.sandbox.containers.execstarts import EXEC_STARTS
from services.sandbox.containers.hardening import (
    LABEL_INSTANCE,
    LABEL_ROLE,
    LABEL_TICKET,
    RUNTIMES,
    SandboxSettings,
)
from services.sandbox.containers.info import ReconcileResult, SandboxInfo
from services.sandbox.egress import (
    bump as egress_bump,
)
from services.sandbox.egress import (
    ca as egress_ca,
)
from services.sandbox.egress import (
    over_socket as egress_socket,
)
from services.sandbox.egress import (
    proxy as egress_proxy,
)
from services.sandbox.egress.allowlist import check_cidrs, check_egress_names, check_private
from services.sandbox.egress.proxy import bridge_ipv4
from services.sandbox.files import diskcap
from services.sandbox.files.handover import Handover
from services.sandbox.relays import forward as relayforward

from .checks import GVISOR_RUNTIME, check_bridge_has_no_address, chown_tree

__all__ = ["INSTANCE_RE", "ReconcileResult", "SandboxInfo", "SandboxManager", "bridge_ipv4",
           "check_bridge_has_no_address", "check_instance", "chown_tree"]

log = logging.getLogger(__name__)


class SandboxManager(SandboxEnv):
    def __init__(self, layout: Layout, *, instance: str = "default", egress_network: str = "bridge",
                 allow_private: Iterable[str] = (), env_values: Mapping[str, SecretValue | str] | None = None,
                 proxy_image: str = DEFAULT_PROXY_IMAGE, client: docker.DockerClient | None = None,
                 disk_mode: str | None = None, gvisor_runtime: str = GVISOR_RUNTIME,
                 egress_transport: str = "network", upstream_ca: bytes = b"") -> None:
        """`gvisor_runtime`: the engine's name of the runtime a `gvisor`
        sandbox runs on; `egress_transport`: how a runc sandbox reaches its
        proxy (`network`: the ticket's internal network, or `socket`:
        egress/over_socket.py; a gVisor sandbox always uses the socket);
        `upstream_ca`: the operator's CA certificates (AFE_CA_FILE), which a
        proxy that decrypts (R44) trusts besides the system store when it
        connects to the upstream."""
        if egress_transport not in egress_socket.TRANSPORTS:
            raise InvalidArgument(f"egress transport {egress_transport!r}: network or socket")
        self.layout = layout
        self.instance = check_instance(instance)
        self.egress_network = egress_network
        self.allow_private = tuple(check_cidrs(list(allow_private)))
        self.env_values = dict(env_values or {})
        self.proxy_image = proxy_image
        self.client = client or docker.from_env(timeout=120)
        self.exec_starts = EXEC_STARTS     # the execs this process is starting (a freeze waits for them)
        self._locks: dict[str, asyncio.Lock] = {}
        self._cache: dict[str, SandboxInfo] = {}
        # R34: the workspace disk cap (diskcap.py); `disk_mode` None = detect
        self.diskcap = diskcap.DiskCaps(layout.workspaces_dir, mode=disk_mode)
        # the workspace across hosts (ReadWorkspace/WriteWorkspace; handover.py)
        self.handover = Handover(layout)
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._exceeded: dict[str, str] = {}
        self._engine_ok = False
        self.gvisor_runtime = gvisor_runtime
        self.egress_transport = egress_transport
        self.upstream_ca = upstream_ca
        self.ca_stores = egress_ca.ImageStores()      # each sandbox image's CA store (R44)
        self._runtimes_ok: set[str] = set()

    # -- names ---------------------------------------------------------------
    def _prefix(self) -> str:
        return "afe" if self.instance == "default" else f"afe-{self.instance}"

    def container_name(self, ticket_id: str) -> str:
        return f"{self._prefix()}-{ticket_id}"

    def proxy_name(self, ticket_id: str) -> str:
        return f"{self._prefix()}-{ticket_id}-proxy"

    def network_name(self, ticket_id: str) -> str:
        return f"{self._prefix()}-{ticket_id}"

    def _filters(self, ticket_id: str | None = None, role: str | None = None) -> dict[str, list[str]]:
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
        try:
            rules = check_rules(settings.egress_rules, settings.egress)
        except ValueError as exc:
            raise InvalidArgument(f"{exc}; fix the Workspace's sandbox.egress") from None
        for n in settings.env_names:
            if not ENV_NAME_RE.match(n):
                raise InvalidArgument(f"environment variable name {n[:64]!r} is not valid")
        settings = replace(settings, egress=egress, egress_private=(*names, *cidrs), egress_rules=rules,
                           env_names=tuple(sorted(set(settings.env_names))),
                           disk_bytes=diskcap.resolve_disk(settings.disk_bytes))
        if settings.runtime not in RUNTIMES:
            raise InvalidArgument(f"sandbox runtime {settings.runtime!r}: runc or gvisor")
        async with self._lock(ticket_id):
            if ticket_id in self._exceeded:
                raise FailedPrecondition(self._exceeded[ticket_id])
            await self._check_runtime(settings.runtime)       # before any Docker object is made
            existing = await asyncio.to_thread(self._find, ticket_id)
            if settings.relay:
                checks.check_relay_dir(self.layout, ticket_id)
                if existing is not None and not existing.relay:
                    raise FailedPrecondition(
                        f"the sandbox of {ticket_id} was made without the model relay; cancel the ticket and "
                        "create it again")
            if existing is not None:
                await asyncio.to_thread(self.prepare_workspace, ticket_id, settings.disk_bytes)
                await self._ensure_cap(ticket_id, settings.disk_bytes, existing.container_id)
                existing = await restart.bring_back(self.client, existing, self.egress_network, self.layout)
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
            info = replace(info, disk_bytes=settings.disk_bytes)
            try:
                await self._start_ways_out(info, proxy_ip)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(cleanup.remove_objects, self.client, self._filters(ticket_id))
                raise
            await self._ensure_cap(ticket_id, settings.disk_bytes, info.container_id)
            self._cache[ticket_id] = info
            log.info("sandbox created for %s (runtime: %s; egress: %s%s; private: %s)", ticket_id, settings.runtime,
                     ",".join(egress) or "none", " through its socket" if info.egress_socket else "",
                     ",".join(settings.egress_private) or "none")
            return info

    async def _start_ways_out(self, info: SandboxInfo, proxy_ip: str) -> None:
        """Wait for the egress proxy, then start the sandbox's forwarders: the
        proxy socket's (egress/over_socket.py) and the model relay's (R32)."""
        if info.egress_socket:
            def running() -> bool:
                return bool(self.client.api.inspect_container(info.proxy_container_id)["State"].get("Running"))
            await egress_socket.wait_socket(self.layout, info.ticket_id, running)
            await asyncio.to_thread(relayforward.start, self.client, info.container_id,
                                    egress_socket.SANDBOX_FORWARDER, "the egress proxy's forwarder")
        elif info.proxy_container_id:
            await egress_proxy.wait_proxy(self.client, info.proxy_container_id, self.egress_network, proxy_ip)
        if info.egress_rules:       # the proxy listens: the CA it made is in its log
            await asyncio.to_thread(egress_ca.install, self.client, info.proxy_container_id, self.layout,
                                    info.ticket_id)
        if info.relay:
            await asyncio.to_thread(relayforward.start, self.client, info.container_id)

    async def _check_runtime(self, runtime: str) -> None:
        """A gVisor sandbox needs the engine's runtime; checked before anything
        is made (the answer is kept once it is yes)."""
        if runtime == "runc" or runtime in self._runtimes_ok:
            return
        await asyncio.to_thread(checks.check_runtime, self.client, self.gvisor_runtime)
        self._runtimes_ok.add(runtime)

    def _socket_egress(self, s: SandboxSettings) -> bool:
        return bool(s.egress) and (s.runtime == "gvisor" or self.egress_transport == "socket")

    def _create_sync(self, s: SandboxSettings, workspace: str, started: Callable[[str], None],
                     before_start: Callable[[], None] = lambda: None) -> tuple[SandboxInfo, str]:
        """Create (and start) the containers (provision.py); returns the info
        and the proxy's address on its outside network ("" without egress)."""
        names = provision.Names(sandbox=self.container_name(s.ticket_id), proxy=self.proxy_name(s.ticket_id),
                                network=self.network_name(s.ticket_id))
        egress_dir = egress_socket.make_egress_dir(self.layout, s.ticket_id) if self._socket_egress(s) else None
        bump_dir = None
        if s.egress and s.egress_rules:
            bump_dir = egress_bump.make_proxy_dir(self.layout, s.ticket_id, s.egress_rules, self.upstream_ca)

        def prepare_ca() -> tuple[str, str | None]:
            probe = hardening.labels(self.instance, s.ticket_id, "ca-store")
            store_path, store = self.ca_stores.get(self.client, s.image, probe)
            return egress_ca.make_ca_dir(self.layout, s.ticket_id, store), store_path
        return provision.create_containers(
            self.client, s, workspace, names, instance=self.instance, egress_network=self.egress_network,
            allow_private=self.allow_private, proxy_image=self.proxy_image,
            relay_dir=str(self.layout.relay_dir(s.ticket_id)) if s.relay else None,
            check_engine=self._check_engine_for_egress,
            # looked up here at each call: R31's check of the new bridge (tests replace it)
            check_network=lambda network: check_bridge_has_no_address(hardening.bridge_name(network)),
            started=started, before_start=before_start, egress_dir=egress_dir,
            runtime_name=self.gvisor_runtime if s.runtime == "gvisor" else None,
            bump_dir=bump_dir, prepare_ca=prepare_ca, upstream_ca=bool(self.upstream_ca))

    def _check_engine_for_egress(self) -> None:
        if not self._engine_ok:
            checks.check_engine_for_egress(self.client)
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
            await asyncio.to_thread(egress_socket.remove_egress_dir, self.layout, ticket_id)
            await asyncio.to_thread(egress_ca.remove_ticket_dir, self.layout, ticket_id)
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
            tickets.update(egress_socket.reconcile(self.layout, live))
            tickets.update(egress_ca.reconcile(self.layout, live))
            return ReconcileResult(tuple(sorted(tickets)), nc, nn)
        for t in [t for t in self._watches if t not in live]:
            self._stop_watch(t)
        res = await asyncio.to_thread(run)
        if res.removed_tickets:
            log.info("reconcile removed %d containers, %d networks",
                     res.removed_containers, res.removed_networks)
        return res

    async def freeze(self, ticket_id: str, frozen: bool) -> None:
        async with self._lock(ticket_id):     # not while a create starts the sandbox's ways out
            await self._freeze(ticket_id, frozen)

    async def _freeze(self, ticket_id: str, frozen: bool) -> None:
        info = await self.get(ticket_id)

        def run() -> None:
            state = self.client.api.inspect_container(info.container_id)["State"]
            if frozen and not state.get("Paused"):
                self.client.api.pause(info.container_id)
            elif not frozen and state.get("Paused"):
                self.client.api.unpause(info.container_id)
        try:
            for delay in (*FREEZE_RETRY_S, None):
                try:
                    # never on an exec still starting: its runc would wait in the frozen cgroup for
                    # ever, holding the engine's lock on the container (execstarts.py)
                    async with (self.exec_starts.quiet(info.container_id) if frozen else contextlib.nullcontext()):
                        await asyncio.to_thread(run)
                    break
                except docker.errors.APIError as exc:
                    # runc gives up freezing a cgroup whose tasks do not stop in time (a loaded
                    # machine, a task in uninterruptible I/O): "unable to freeze". It is tried again.
                    if delay is None or isinstance(exc, docker.errors.NotFound) or \
                            "unable to freeze" not in str(exc.explanation or exc):
                        raise
                    log.warning("ticket %s: the engine could not freeze the sandbox yet; trying again in %.1f s",
                                ticket_id, delay)
                    await asyncio.sleep(delay)
        except docker.errors.NotFound as exc:
            self.forget(ticket_id)
            raise NotFound(f"no sandbox for ticket {ticket_id}: create it first") from exc
        except TimeoutError as exc:
            raise Unavailable(f"the sandbox of {ticket_id} was not frozen: {exc}; try again") from None
        self._cache[ticket_id] = replace(info, state="paused" if frozen else "running")


# Waits before freezing a sandbox again after runc's "unable to freeze" (its tasks did not stop in time).
FREEZE_RETRY_S = (0.2, 0.5, 1.0, 2.0)


# Workspaces prepared (disk image, ownership) while the engine creates their containers.
_PREPARE = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="afe-workspace")
