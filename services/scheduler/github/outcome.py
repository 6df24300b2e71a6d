"""What the GitHub intake did with an event (`Outcome`, counted by reason in
metrics.github_deliveries), shared by the intake's parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    outcome: str                 # accepted | ignored | duplicate | refused (metrics.GITHUB_OUTCOMES)
    # duplicate: a delivery seen before (`duplicate`) or work that has a live ticket already (`joined`)
    reason: str                  # metrics.GITHUB_REASONS
    ticket_ids: list[str] = field(default_factory=list)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
