"""A decorator for the credential broker's core that records its metric
families (metrics.py): git operations, forge calls by forge type and model
calls by provider, each with its outcome. It wraps the core handed to the
servicer; every other attribute passes through unchanged. It knows only
method names, so the core stays free of metrics code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from services.common.observability.metrics import (
    FORGE_TYPES,
    MODEL_PROVIDERS,
    UnboundedLabel,
    credentials_metrics,
)

# (positional args, keyword args, outcome) of a wrapped call -> its labelled child metric
LabelsOf = Callable[[tuple[Any, ...], dict[str, Any], str], Any]


def outcome_of(exc: BaseException | None) -> str:
    """Map an exception (or None) to the bounded `outcome` label."""
    import asyncio

    from services.common import errors

    if exc is None:
        return "ok"
    if isinstance(exc, (asyncio.CancelledError, errors.Cancelled)):
        return "cancelled"
    if isinstance(exc, (asyncio.TimeoutError, errors.DeadlineExceeded)):
        return "timeout"
    if isinstance(exc, (errors.PermissionDenied, errors.Unauthenticated)):
        return "denied"
    return "error"


_GIT_METHODS = {"prepare_workspace": "checkout", "commit": "commit", "diff": "diff", "push": "push"}
_FORGE_METHODS = {"open_pull_request": "open_pr", "get_pull_request": "pr_status",
                  "merge_pull_request": "merge"}


class MeteredCredentials:
    """The credential broker's core, counting git operations, forge calls
    (by forge type) and model calls (by provider) with their outcome."""

    def __init__(self, inner: Any, registry: CollectorRegistry) -> None:
        self._inner = inner
        self._m = credentials_metrics(registry)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in _GIT_METHODS:
            return self._wrap(attr, lambda a, kw, o: self._m.git_ops.labels(op=_GIT_METHODS[name], outcome=o))
        if name in _FORGE_METHODS:
            def forge(a: tuple[Any, ...], kw: dict[str, Any], o: str) -> Any:
                pos = 0 if name == "get_pull_request" else 1
                ws = kw.get("workspace") or (a[pos] if len(a) > pos else "")
                kind = self._forge_type(ws)
                return self._m.forge_calls.labels(forge=kind, op=_FORGE_METHODS[name], outcome=o)
            return self._wrap(attr, forge)
        if name == "complete":
            return self._wrap(attr, lambda a, kw, o: self._m.model_calls.labels(
                provider=self._provider(kw.get("model") or (a[0] if a else "")), outcome=o), timed=True)
        return attr

    def _forge_type(self, workspace: str) -> str:
        try:
            kind = self._inner.workspace(workspace).forge.type
        except Exception:  # noqa: BLE001 - an unknown workspace counts as local
            return "local"
        return kind if kind in FORGE_TYPES else "local"

    def _provider(self, model: str) -> str:
        try:
            p = self._inner.model(model).provider
        except Exception:  # noqa: BLE001 - an unknown model counts as replay
            return "replay"
        return p if p in MODEL_PROVIDERS else "replay"

    def _wrap(self, fn: Callable[..., Awaitable[Any]], family: LabelsOf,
              timed: bool = False) -> Callable[..., Awaitable[Any]]:
        import functools
        import time

        @functools.wraps(fn)
        async def call(*a: Any, **kw: Any) -> Any:
            t0, exc = time.perf_counter(), None
            try:
                return await fn(*a, **kw)
            except BaseException as e:
                exc = e
                raise
            finally:
                o = outcome_of(exc)
                try:
                    family(a, kw, o).inc()
                    if timed:
                        self._m.model_seconds.labels(
                            provider=self._provider(kw.get("model") or (a[0] if a else ""))
                        ).observe(time.perf_counter() - t0)
                except UnboundedLabel:  # a metric must never break a call
                    pass
        return call
