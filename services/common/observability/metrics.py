"""Prometheus metric families with bounded labels only (R25).

Every label takes its value from a closed set declared here (ticket state,
node kind, outcome, operation, provider, gRPC method, gRPC code). A value
outside its set raises `UnboundedLabel` instead of creating a new time
series, so a ticket id, an input, a path, a host name or a secret can never
become a label value by accident.

Each process builds its own families on its own `CollectorRegistry` with the
factory functions at the bottom (`scheduler_metrics(registry)` and so on);
calling a factory twice on one registry returns the same object.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.errors import InvalidArgument
from services.common.states import TicketState

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler, Middleware

T = TypeVar("T")

TICKET_STATES = tuple(s.value for s in TicketState)
NODE_KINDS = ("model", "agent", "run", "builtin")
OUTCOMES = ("ok", "error", "timeout", "denied", "cancelled")
GIT_OPS = ("clone", "fetch", "mirror", "checkout", "commit", "push", "merge", "diff")
FORGE_OPS = ("open_pr", "find_pr", "pr_status", "merge")
FORGE_TYPES = ("github", "local")
MODEL_PROVIDERS = ("openai", "anthropic", "gemini", "replay")
EGRESS_MODES = ("none", "allowlist")
RELAY_LIMITS = ("connections", "idle_timeout", "head_timeout", "body_timeout", "buffered")
STORE_RETRY_REASONS = ("connection_lost", "admin_shutdown", "starting_up", "serialization_failure", "deadlock",
                       "busy", "locked")
GRPC_CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
              "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
              "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
              "UNAUTHENTICATED")
# A gRPC method path of our own contracts, the health service or server
# reflection: a fixed set of names compiled into the servers, never user input
# (a path no server registered is not counted at all).
GRPC_METHOD = re.compile(r"/(?:afe\.[a-z]+\.v1\.[A-Za-z]+|grpc\.health\.v1\.Health"
                         r"|grpc\.reflection\.v1alpha\.ServerReflection)/[A-Za-z]+")


class UnboundedLabel(InvalidArgument):
    """A label value outside its declared set (R25)."""


class _Method:
    """Label domain for gRPC methods: a shape, not a list."""

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and GRPC_METHOD.fullmatch(value) is not None

    def __repr__(self) -> str:
        return "gRPC method path"


GRPC_METHODS = _Method()


class Bounded:
    """A metric family whose every label value must come from its domain."""

    def __init__(self, metric: Any, domains: dict[str, Any]) -> None:
        self.metric = metric
        self.domains = domains
        if tuple(domains) != tuple(metric._labelnames):
            raise ValueError("label domains must match the metric's label names")

    def labels(self, **values: str) -> Any:
        if set(values) != set(self.domains):
            raise UnboundedLabel(f"{self.metric._name}: labels must be exactly {sorted(self.domains)}")
        for name, value in values.items():
            if value not in self.domains[name]:
                # The value itself is not repeated: it may be the very thing R25 keeps out.
                raise UnboundedLabel(f"{self.metric._name}: value for label {name!r} is not one of "
                                     f"the allowed values {self.domains[name]!r}")
        return self.metric.labels(**values)


def _counter(registry: CollectorRegistry, name: str, doc: str, **domains: Any) -> Bounded:
    return Bounded(Counter(name, doc, list(domains), registry=registry), domains)


def _gauge(registry: CollectorRegistry, name: str, doc: str, **domains: Any) -> Bounded:
    return Bounded(Gauge(name, doc, list(domains), registry=registry), domains)


def _histogram(registry: CollectorRegistry, name: str, doc: str, buckets: Iterable[float],
               **domains: Any) -> Bounded:
    return Bounded(Histogram(name, doc, list(domains), registry=registry, buckets=tuple(buckets)), domains)


_SLOW = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_FAST = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class SchedulerMetrics:
    tickets: Bounded              # gauge {state}: tickets currently in each state
    ticket_transitions: Bounded   # counter {state}: tickets that entered a state
    node_duration: Bounded        # histogram {kind, outcome}, seconds
    lease_takeovers: Bounded      # counter {from_state}: live tickets taken over from a scheduler whose lease expired
    lease_renew_failures: Bounded  # counter {reason}: heartbeats that failed (error) or found a ticket gone (lost)
    pool_ready: Gauge             # warm sandboxes ready to be claimed (every workspace together)
    pool_wanted: Gauge            # what the pool aims to hold: the Workspaces' sandbox.pool, at most the cap
    store_retries: Bounded        # counter {store, reason}: statements tried again after a lost or busy database
    events_lost: Bounded          # counter {reason}: events that could not be stored (each is named on its ticket)

    def set_ticket_counts(self, counts: dict[str, int]) -> None:
        for state in TICKET_STATES:
            self.tickets.labels(state=state).set(counts.get(state, 0))


@dataclass(frozen=True)
class SandboxMetrics:
    create_seconds: Bounded       # histogram {egress}
    execs: Bounded                # counter {outcome}
    proxies_live: Any             # gauge, no labels
    sandboxes_live: Any           # gauge, no labels


@dataclass(frozen=True)
class CredentialsMetrics:
    git_ops: Bounded              # counter {op, outcome}
    forge_calls: Bounded          # counter {forge, op, outcome}
    model_calls: Bounded          # counter {provider, outcome}
    model_seconds: Bounded        # histogram {provider}


@dataclass(frozen=True)
class RelayMetrics:
    requests: Bounded             # counter {provider, outcome}: requests to the model relay (R32)
    tokens: Bounded               # counter {model, direction}: tokens counted by the relay
    limited: Bounded              # counter {reason}: connections and requests a ticket's relay limits stopped
    masked: Bounded               # counter: secrets of the broker masked in upstream answers


@dataclass(frozen=True)
class UsageMetrics:
    tokens: Bounded               # counter {model, direction}: tokens the scheduler recorded (nodes and agents)
    cost: Bounded                 # counter {model}: estimated USD (services/common/cost.py), priced Models only


@dataclass(frozen=True)
class GatewayMetrics:
    http_requests: Bounded        # counter {method, code_class}
    # logins, /rpc handshakes and JSON-RPC calls are counted by gateway/metrics.py


@dataclass(frozen=True)
class GrpcServerMetrics:
    handled: Bounded              # counter {method, code}
    seconds: Bounded              # histogram {method}
    dropped: Bounded              # counter {method}: server streams dropped because the caller stopped reading


_cache: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, object]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _once(registry: CollectorRegistry, kind: str, build: Callable[[], T]) -> T:
    with _cache_lock:
        per = _cache.setdefault(registry, {})
        if kind not in per:
            per[kind] = build()
        return cast(T, per[kind])   # built by `build` for this kind


def scheduler_metrics(registry: CollectorRegistry) -> SchedulerMetrics:
    def build() -> SchedulerMetrics:
        return SchedulerMetrics(
            tickets=_gauge(registry, "afe_tickets", "Tickets currently in each state.", state=TICKET_STATES),
            ticket_transitions=_counter(registry, "afe_ticket_transitions_total",
                                        "Tickets that entered each state.", state=TICKET_STATES),
            node_duration=_histogram(registry, "afe_node_duration_seconds", "Node run time by kind.",
                                     _SLOW, kind=NODE_KINDS, outcome=OUTCOMES),
            lease_takeovers=_counter(registry, "afe_lease_takeovers_total",
                                     "Live tickets this scheduler took over from one whose lease expired.",
                                     from_state=TICKET_STATES),
            lease_renew_failures=_counter(registry, "afe_lease_renew_failures_total",
                                          "Ticket lease heartbeats that failed (error), leases found "
                                          "taken over (lost), and leases this scheduler gave up before they "
                                          "could end because renewals failed (self_fenced, R45).",
                                          reason=("error", "lost", "self_fenced")),
            pool_ready=Gauge("afe_sandbox_pool_ready", "Warm sandboxes ready to be claimed by a new ticket.",
                             registry=registry),
            store_retries=_counter(registry, "afe_store_retries_total",
                                   "Store statements tried again after the database was lost, restarting, "
                                   "busy or asked for a retry.", store=("sqlite", "postgresql"),
                                   reason=STORE_RETRY_REASONS),
            events_lost=_counter(registry, "afe_events_lost_total",
                                 "Ticket events that could not be stored; each ticket says how many in an "
                                 "events.lost event.", reason=("store_unavailable", "store_error", "lease_lost")),
            pool_wanted=Gauge("afe_sandbox_pool_wanted", "Warm sandboxes the pool aims to hold (the "
                              "Workspaces' sandbox.pool, at most --sandbox-pool-max).", registry=registry),
        )
    return _once(registry, "scheduler", build)


def sandbox_metrics(registry: CollectorRegistry) -> SandboxMetrics:
    def build() -> SandboxMetrics:
        return SandboxMetrics(
            create_seconds=_histogram(registry, "afe_sandbox_create_seconds",
                                      "Time to create a ticket's sandbox (and proxy).", _FAST,
                                      egress=EGRESS_MODES),
            execs=_counter(registry, "afe_sandbox_execs_total", "Commands run in sandboxes.",
                           outcome=OUTCOMES),
            proxies_live=Gauge("afe_egress_proxies", "Egress proxy containers alive.", registry=registry),
            sandboxes_live=Gauge("afe_sandboxes", "Sandbox containers alive.", registry=registry),
        )
    return _once(registry, "sandbox", build)


def credentials_metrics(registry: CollectorRegistry) -> CredentialsMetrics:
    def build() -> CredentialsMetrics:
        return CredentialsMetrics(
            git_ops=_counter(registry, "afe_git_operations_total", "Host git operations.",
                             op=GIT_OPS, outcome=OUTCOMES),
            forge_calls=_counter(registry, "afe_forge_calls_total", "Forge API calls.",
                                 forge=FORGE_TYPES, op=FORGE_OPS, outcome=OUTCOMES),
            model_calls=_counter(registry, "afe_model_calls_total", "Model API calls.",
                                 provider=MODEL_PROVIDERS, outcome=OUTCOMES),
            model_seconds=_histogram(registry, "afe_model_call_seconds", "Model API call time.", _SLOW,
                                     provider=MODEL_PROVIDERS),
        )
    return _once(registry, "credentials", build)


def relay_metrics(registry: CollectorRegistry, model_names: Iterable[str]) -> RelayMetrics:
    """`model` labels are the Model manifest names: a fixed set read at start."""
    names = tuple(sorted(model_names))

    def build() -> RelayMetrics:
        return RelayMetrics(
            requests=_counter(registry, "afe_relay_requests_total", "Model relay requests (R32) by outcome; "
                              "denied = refused by the relay.", provider=MODEL_PROVIDERS, outcome=OUTCOMES),
            tokens=_counter(registry, "afe_relay_tokens_total", "Tokens counted by the model relay.",
                            model=names, direction=("input", "output")),
            limited=_counter(registry, "afe_relay_limited_total", "Connections and requests a ticket's model relay "
                             "limits stopped, by limit.", reason=RELAY_LIMITS),
            masked=_counter(registry, "afe_relay_secrets_masked_total", "Secrets of the credential broker found "
                            "in model answers (headers and bodies) and masked by the relay."),
        )
    return _once(registry, "relay", build)


def usage_metrics(registry: CollectorRegistry, model_names: Iterable[str]) -> UsageMetrics:
    """`model` labels are the Model manifest names: a fixed set read at start (R25)."""
    names = tuple(sorted(model_names))

    def build() -> UsageMetrics:
        return UsageMetrics(
            tokens=_counter(registry, "afe_model_tokens_total", "Model tokens used by tickets (model nodes and "
                            "agents), by Model manifest.", model=names, direction=("input", "output")),
            cost=_counter(registry, "afe_model_cost_usd_total", "Estimated model cost in US dollars, from the "
                          "Model manifests' price.", model=names),
        )
    return _once(registry, "usage", build)


HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "other")
CODE_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")


def gateway_metrics(registry: CollectorRegistry) -> GatewayMetrics:
    def build() -> GatewayMetrics:
        return GatewayMetrics(
            http_requests=_counter(registry, "afe_http_requests_total", "Gateway HTTP requests.",
                                   method=HTTP_METHODS, code_class=CODE_CLASSES),
        )
    return _once(registry, "gateway", build)


def grpc_server_metrics(registry: CollectorRegistry) -> GrpcServerMetrics:
    def build() -> GrpcServerMetrics:
        return GrpcServerMetrics(
            handled=_counter(registry, "afe_grpc_server_handled_total", "gRPC calls handled.",
                             method=GRPC_METHODS, code=GRPC_CODES),
            seconds=_histogram(registry, "afe_grpc_server_handling_seconds", "gRPC call time.", _FAST,
                               method=GRPC_METHODS),
            dropped=_counter(registry, "afe_grpc_server_streams_dropped_total",
                             "Server streams ended with RESOURCE_EXHAUSTED because the caller stopped reading.",
                             method=GRPC_METHODS),
        )
    return _once(registry, "grpc", build)


def code_class(status: int) -> str:
    return f"{min(max(status // 100, 1), 5)}xx"


def http_method(method: str) -> str:
    return method if method in HTTP_METHODS else "other"


def http_metrics_middleware(registry: CollectorRegistry) -> Middleware:
    """aiohttp middleware counting gateway requests by method and status class
    (never the path: it can carry a ticket id)."""
    from aiohttp import web

    families = gateway_metrics(registry)

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            families.http_requests.labels(method=http_method(request.method),
                                          code_class=code_class(status)).inc()

    return count


# GitHub intake (docs/GITHUB.md): webhook deliveries at the gateway, events at the scheduler.
GITHUB_OUTCOMES = ("accepted", "ignored", "duplicate", "refused")
GITHUB_REASONS = (
    "ok", "ping", "no_signature", "bad_signature", "too_large", "unsubscribed_event", "bad_delivery_id",
    "bad_content_type", "bad_payload", "rate_limited", "scheduler_unavailable", "duplicate", "no_trigger",
    "bot", "pull_request", "no_write_access", "permission_unknown", "invalid_ticket",
    "followup", "not_afe_pull_request", "busy",
    # one ticket per piece of work, and follow-ups gathered or queued (docs/GITHUB.md)
    "joined", "gathered", "queued",
    # failing CI on afe's pull requests (docs/GITHUB.md "Failing CI")
    "passing", "own_check", "stale_head", "merged", "no_ci_iteration", "past_max",
)


def github_deliveries(registry: CollectorRegistry, process: str) -> Bounded:
    """afe_<process>_github_deliveries_total{outcome, reason}: both labels from fixed tuples."""
    name = f"afe_{process}_github_deliveries_total"
    return _once(registry, name, lambda: _counter(
        registry, name, "GitHub webhook deliveries and polled events by outcome and reason.",
        outcome=GITHUB_OUTCOMES, reason=GITHUB_REASONS))
