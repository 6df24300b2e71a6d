"""Who may call whom: the one table of the callers each afe gRPC service
answers, by link name.

The launcher hands each process the link keys of its callers
(services/launcher/launch.py::make_links, checked against `SERVES` by
tests/foundation/test_callers.py); the guard in grpcutil identifies the caller
by its key and then answers only when this table lists that caller for the
service called. So a key the socket accepts is still refused on a service
that does not list it (the automation key on GitHubHooks: a local script
files tickets through the Scheduler API under its own name, never as GitHub,
R35/R36). Health and reflection answer every caller the socket accepts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from services._gen.afe.credentials.v1 import credentials_pb2
from services._gen.afe.sandbox.v1 import sandbox_pb2
from services._gen.afe.scheduler.v1 import hooks_pb2, scheduler_pb2

SCHEDULER = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
GITHUB_HOOKS = hooks_pb2.DESCRIPTOR.services_by_name["GitHubHooks"].full_name
SANDBOX = sandbox_pb2.DESCRIPTOR.services_by_name["SandboxBroker"].full_name
CREDENTIALS = credentials_pb2.DESCRIPTOR.services_by_name["CredentialBroker"].full_name

# service -> the link names that may call it
CALLERS: Mapping[str, frozenset[str]] = MappingProxyType({
    SCHEDULER: frozenset({"gateway", "automation"}),
    GITHUB_HOOKS: frozenset({"gateway"}),
    SANDBOX: frozenset({"scheduler"}),
    CREDENTIALS: frozenset({"scheduler"}),
})

# process -> the services it serves
SERVES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "scheduler": (SCHEDULER, GITHUB_HOOKS),
    "sandbox": (SANDBOX,),
    "credentials": (CREDENTIALS,),
})

# Answered for any caller whose key the socket accepts.
OPEN = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})


def service_of(method: str) -> str:
    """`/afe.scheduler.v1.Scheduler/GetTicket` -> `afe.scheduler.v1.Scheduler`."""
    return method.lstrip("/").split("/", 1)[0]


def may_call(caller: str, service: str) -> bool:
    return service in OPEN or caller in CALLERS.get(service, frozenset())


def callers_of(services: Iterable[str]) -> frozenset[str]:
    """Every link name that may call at least one of `services`."""
    out: set[str] = set()
    for s in services:
        out |= CALLERS.get(s, frozenset())
    return frozenset(out)


def refusal(caller: str, service: str) -> str:
    allowed = ", ".join(sorted(CALLERS.get(service, ()))) or "no caller"
    return (f"the {caller} link may not call {service} (it answers {allowed}); "
            "see services/common/rpc/callers.py for who may call whom")
