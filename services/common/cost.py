"""The one place a model call's cost is estimated: tokens times the Model
manifest's `price` (USD per million tokens, by direction). The estimate goes
into `model.usage` events (the scheduler), and from there to the UI, `afe
ticket show` and the `afe_model_cost_usd_total` metric."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from services.common.config.model import Model

PER = 1_000_000


def estimate(model: Model | None, input_tokens: int, output_tokens: int) -> float | None:
    """USD for these tokens at `model`'s price; None when the model has no price (unknown, not free)."""
    price = model.price if model is not None else None
    if not price:
        return None
    return (max(0, input_tokens) * price[0] + max(0, output_tokens) * price[1]) / PER


def usage_payload(node: str, model: Model | None, model_name: str, input_tokens: int,
                  output_tokens: int) -> dict[str, Any]:
    """The common fields of a `model.usage` event; `cost_usd` only when the Model is priced."""
    payload: dict[str, Any] = {"node": node, "model": model_name, "input_tokens": input_tokens,
                               "output_tokens": output_tokens}
    cost = estimate(model, input_tokens, output_tokens)
    if cost is not None:
        payload["cost_usd"] = round(cost, 6)
    return payload


def totals(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum the `model.usage` events of a ticket: per node and for the ticket
    ({"input_tokens", "output_tokens", "cost_usd" (None if nothing was priced), "unpriced": bool})."""
    nodes: dict[str, dict[str, Any]] = {}
    ticket: dict[str, Any] = {"input_tokens": 0, "output_tokens": 0, "cost_usd": None, "unpriced": False}
    for e in events:
        if e.get("type") != "model.usage":
            continue
        p = e.get("payload") or {}
        n = nodes.setdefault(str(p.get("node") or ""), {"input_tokens": 0, "output_tokens": 0,
                                                       "cost_usd": None, "unpriced": False})
        for acc in (n, ticket):
            acc["input_tokens"] += int(p.get("input_tokens") or 0)
            acc["output_tokens"] += int(p.get("output_tokens") or 0)
            if isinstance(p.get("cost_usd"), (int, float)):
                acc["cost_usd"] = (acc["cost_usd"] or 0.0) + float(p["cost_usd"])
            else:
                acc["unpriced"] = True
    return {"nodes": nodes, "ticket": ticket}


def fmt_usd(value: float | None) -> str:
    """`$0.0123`; `—` when unknown."""
    if value is None:
        return "—"
    return f"${value:.4f}" if value < 1 else f"${value:.2f}"
