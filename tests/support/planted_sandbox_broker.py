"""A real sandbox broker process with one defence taken out, for `afe doctor`'s
positive controls (tests/sandbox/test_doctor.py): the doctor drives its broker
over gRPC in a process of its own, so a weakness is planted in that process.

`python -m tests.support.planted_sandbox_broker WEAKNESS ARGS...` plants
WEAKNESS, then runs the broker's own main (services/sandbox/main.py) on ARGS;
`command(WEAKNESS)` is what `doctor(broker_command=...)` takes."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from services.sandbox import main, sandboxes
from services.sandbox.containers import hardening


def fresh_claims() -> None:
    """A claim that makes a second sandbox instead of finding the one made ahead (its own id)."""
    original = sandboxes.SandboxManager.create
    made: set[str] = set()

    async def fresh_each_time(self: sandboxes.SandboxManager, settings: Any, **kw: Any) -> Any:
        if settings.ticket_id in made:
            await self.destroy(settings.ticket_id)
        made.add(settings.ticket_id)
        return await original(self, settings, **kw)
    sandboxes.SandboxManager.create = fresh_each_time  # type: ignore[method-assign]


def caps_and_root() -> None:
    """A sandbox that keeps its capabilities and runs as root."""
    original = hardening.sandbox_create_kwargs

    def weakened(*a: Any, **kw: Any) -> Any:
        out = original(*a, **kw)
        out.pop("cap_drop")
        out["user"] = "0:0"
        return out
    hardening.sandbox_create_kwargs = weakened


def bridge_with_host_address() -> None:
    """A ticket network made as before R31 (its bridge holds the host's gateway address), with the
    broker's own check switched off."""
    original = hardening.ticket_network_kwargs

    def weakened(**kw: Any) -> Any:
        out = original(**kw)
        out["options"] = {"com.docker.network.bridge.enable_icc": "true"}
        return out
    hardening.ticket_network_kwargs = weakened
    sandboxes.check_bridge_has_no_address = lambda name: None


def gvisor_on_runc() -> None:
    """A sandbox that asks for gVisor but is created without the engine's runtime (so on runc)."""
    original = hardening.sandbox_create_kwargs

    def on_runc(*a: Any, **kw: Any) -> Any:
        out = original(*a, **kw)
        out.pop("runtime", None)
        return out
    hardening.sandbox_create_kwargs = on_runc


WEAKNESSES = {f.__name__: f for f in (fresh_claims, caps_and_root, bridge_with_host_address, gvisor_on_runc)}


def command(weakness: str) -> list[str]:
    """The broker command with `weakness` planted (a name of WEAKNESSES)."""
    assert weakness in WEAKNESSES, weakness
    return [sys.executable, "-m", "tests.support.planted_sandbox_broker", weakness]


if __name__ == "__main__":
    WEAKNESSES[sys.argv[1]]()
    sys.exit(asyncio.run(main.amain(sys.argv[2:])))
