"""The relay's per-ticket state (R32): capability, declared models, budget
and usage, kept as one file per ticket in the broker's private folder so a
restarted broker serves the same capability and budget."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from services.common.layout import check_ticket_id

from .relaylimits import TicketLoad
from .relayusage import Usage

log = logging.getLogger(__name__)


@dataclass
class TicketRelay:
    ticket_id: str
    capability: str
    models: tuple[str, ...]
    budget: int
    usage: dict[str, Usage] = field(default_factory=dict)
    closed: bool = False
    runner: web.AppRunner | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    load: TicketLoad = field(default_factory=TicketLoad)   # connections and body bytes held now

    @property
    def used(self) -> int:
        return sum(u.total for u in self.usage.values())

    def state(self) -> dict:
        return {"capability": self.capability, "models": list(self.models), "budget": self.budget,
                "usage": {k: [u.input_tokens, u.output_tokens, u.requests, u.refused]
                          for k, u in self.usage.items()}}


class RelayStates:
    """The state files, `<state_dir>/<ticket>.json` (0600, written atomically)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def path(self, ticket_id: str) -> Path:
        return self.state_dir / f"{check_ticket_id(ticket_id)}.json"

    def save(self, t: TicketRelay) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.path(t.ticket_id)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(t.state(), f)
        os.replace(tmp, path)

    def load(self, ticket_id: str) -> TicketRelay | None:
        try:
            doc = json.loads(self.path(ticket_id).read_text())
            usage = {k: Usage(*[int(x) for x in v]) for k, v in doc.get("usage", {}).items()}
            return TicketRelay(ticket_id, str(doc["capability"]), tuple(doc["models"]), int(doc["budget"]), usage)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("relay state of ticket %s is unreadable; a new capability is made", ticket_id)
            return None
