"""The environment a sandbox's process gets (R9): declared variable NAMES
whose values come from the broker's own environment, and literal entries
that may name none of those. Mixed into `SandboxManager` (sandboxes.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.secrecy.env_secrets import SecretValue
from services.sandbox.containers.info import SandboxInfo

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class SandboxEnv:
    env_values: dict[str, SecretValue | str]     # a plain str in tests

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
            if not sep or not ENV_NAME_RE.match(name):
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
