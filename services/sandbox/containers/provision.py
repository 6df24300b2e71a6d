"""Making a ticket's containers in Docker: the hardened sandbox and, with
egress, the ticket's internal network and its squid proxy, made at the same
time (the sandbox finds the proxy by its alias on the internal network).

Synchronous (the Docker SDK is); `SandboxManager.create` runs it in a worker
thread and removes whatever was made when it fails.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import docker
import docker.errors

from services.common.errors import FailedPrecondition, Unavailable
from services.sandbox.containers import hardening
from services.sandbox.containers.hardening import SandboxSettings
from services.sandbox.containers.info import SandboxInfo
from services.sandbox.egress import ca as egress_ca
from services.sandbox.egress import over_socket as egress_socket
from services.sandbox.egress.allowlist import squid_conf

_STARTER = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="afe-proxy-start")
_IPV6_PROC = "/proc/sys/net/ipv6"


@dataclass(frozen=True)
class Names:
    """The Docker names of one ticket's objects."""
    sandbox: str
    proxy: str
    network: str


def create_containers(client: docker.DockerClient, s: SandboxSettings, workspace: str, names: Names, *,
                      instance: str, egress_network: str, allow_private: tuple[str, ...], proxy_image: str,
                      relay_dir: str | None, check_engine: Callable[[], None],
                      check_network: Callable[[str], None],
                      started: Callable[[str], None] = lambda _cid: None,
                      before_start: Callable[[], None] = lambda: None, egress_dir: str | None = None,
                      runtime_name: str | None = None, bump_dir: str | None = None,
                      prepare_ca: Callable[[], tuple[str, str | None]] | None = None,
                      upstream_ca: bool = False) -> tuple[SandboxInfo, str]:
    """Create (and start) the containers; returns the info and the
    proxy's address on its outside network ("" without egress).
    `check_engine` runs before the ticket's network is made, `check_network`
    (R31) with its name right after; `before_start()` between the sandbox's
    create and its start (the workspace folder must exist at create, its
    content and disk image only at start, when the engine binds it);
    `started(container id)` as soon as the sandbox runs, while its proxy may
    still be starting. With `egress_dir` (egress/over_socket.py) no ticket network
    is made: the proxy sits on its outside network alone and serves the
    socket folder, which the sandbox (on no network) has mounted. With egress
    rules (R44), `bump_dir` is the judge's folder for the proxy
    (egress/bump.py) and `prepare_ca()`, called while the proxy starts,
    makes the sandbox's CA folder and says where the image keeps its CA
    store ((folder, path or None), egress/ca.py); `upstream_ca`: the
    operator's CA file is in `bump_dir`."""
    ticket_id = s.ticket_id
    network = ""
    proxy_id = ""
    proxy_ip = ""
    env: dict[str, str] = {}
    starting: concurrent.futures.Future[tuple[str, str]] | None = None
    network_made = threading.Event()
    try:
        rules = s.egress_rules if s.egress and bump_dir else ()
        if s.egress and egress_dir:
            conf = squid_conf(list(s.egress), allow_private, s.egress_private, loopback_only=True, rules=rules,
                              upstream_ca=upstream_ca)
            proxy_kw = hardening.proxy_create_kwargs(
                ticket_id=ticket_id, name=names.proxy, instance=instance, outside_network=egress_network,
                conf=conf, image=proxy_image, egress_dir=egress_dir, bump_dir=bump_dir if rules else None)

            def start_socket_proxy() -> tuple[str, str]:
                proxy = client.containers.create(**proxy_kw)
                proxy.start()
                return proxy.id, ""
            starting = _STARTER.submit(start_socket_proxy)
            env.update(egress_socket.sandbox_proxy_env())
        elif s.egress:
            network = names.network
            conf = squid_conf(list(s.egress), allow_private, s.egress_private, rules=rules,
                              upstream_ca=upstream_ca)
            proxy_kw = hardening.proxy_create_kwargs(
                ticket_id=ticket_id, name=names.proxy, instance=instance,
                outside_network=egress_network, conf=conf, image=proxy_image, bump_dir=bump_dir if rules else None)

            def start_proxy() -> tuple[str, str]:
                proxy = client.containers.create(**proxy_kw)
                if not network_made.wait(60):
                    raise Unavailable("the ticket's network was not created")
                client.networks.get(network).connect(proxy.id, aliases=[hardening.PROXY_ALIAS])
                proxy.start()
                nets = client.api.inspect_container(proxy.id)["NetworkSettings"]["Networks"]
                return proxy.id, (nets.get(egress_network) or {}).get("IPAddress", "")
            # The sandbox finds its proxy by this alias (Docker's DNS on the
            # internal network answers it; nothing else resolves), so the
            # proxy and the sandbox are made at the same time.
            starting = _STARTER.submit(start_proxy)
            try:
                check_engine()
                client.networks.create(**hardening.ticket_network_kwargs(
                    name=network, instance=instance, ticket_id=ticket_id))
                check_network(network)
            finally:
                network_made.set()
            env.update(hardening.proxy_env(hardening.PROXY_ALIAS))
        ca_mounts = None
        if rules and prepare_ca is not None:
            # while the proxy starts (and makes the ticket's CA): the bundle the sandbox mounts
            folder, store_path = prepare_ca()
            ca_mounts = egress_ca.sandbox_mounts(folder, store_path)
            env.update(egress_ca.sandbox_env())
        kw = hardening.sandbox_create_kwargs(
            s, name=names.sandbox, instance=instance,
            workspace=workspace, network=network or None, env=env, ipv6=os.path.exists(_IPV6_PROC),
            relay_dir=relay_dir, egress_dir=egress_dir if s.egress else None, runtime_name=runtime_name,
            ca_mounts=ca_mounts)
        kw.pop("detach", None)
        c = client.containers.create(**kw)
        before_start()
        c.start()
        started(c.id)
        if starting is not None:
            proxy_id, proxy_ip = starting.result()
    except docker.errors.ImageNotFound as exc:
        image = proxy_image if "proxy" in str(exc) else s.image
        raise FailedPrecondition(f"image not found: {image}; run `afe images build`") from exc
    except docker.errors.APIError as exc:
        raise Unavailable(f"Docker refused to create the sandbox: {exc.explanation or exc}") from exc
    finally:
        if starting is not None and not starting.done():
            with contextlib.suppress(Exception):
                starting.result()
    info = SandboxInfo(ticket_id=ticket_id, container_id=c.id, state="running", image=s.image,
                       network=network, proxy_container_id=proxy_id,
                       created_at_ms=int(time.time() * 1000), env_names=s.env_names, relay=s.relay,
                       runtime=s.runtime, egress_socket=bool(s.egress and egress_dir),
                       egress_rules=bool(ca_mounts))
    return info, proxy_ip
