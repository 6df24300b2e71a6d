"""Reading secrets from the environment once (R28, R30).

A secret is read, registered with the redactor, kept in a `SecretValue`
holder whose repr never shows it, and then removed from `os.environ`. The
bytes of the original environment block are overwritten as well, so the
value is gone from `/proc/<pid>/environ` too.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

from services.common.secrecy.redact import Redactor


class SecretValue:
    """Holds a secret; `repr`/`str` never show it."""

    __slots__ = ("_value", "name")

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"SecretValue({self.name}=[secure])"

    __str__ = __repr__


def _scrub_environ_block(name: str) -> None:
    """Overwrite the value of NAME in the C environment block with NULs."""
    try:
        libc = ctypes.CDLL(None)
        environ = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")
    except (OSError, ValueError, AttributeError):
        return
    prefix = name.encode() + b"="
    i = 0
    while True:
        entry = environ[i]
        if entry is None:
            break
        if entry.startswith(prefix):
            addr = ctypes.cast(environ, ctypes.POINTER(ctypes.c_void_p))[i]
            if addr:
                ctypes.memset(addr + len(prefix), 0, len(entry) - len(prefix))
        i += 1


def take_secret_env(names: Iterable[str], redactor: Redactor, *, required: bool = False) -> dict[str, SecretValue]:
    """Read each named variable, register it, delete it from the environment."""
    out: dict[str, SecretValue] = {}
    missing: list[str] = []
    for name in sorted(set(names)):
        value = os.environ.get(name)
        if value is None:
            missing.append(name)
            continue
        redactor.register(value)
        out[name] = SecretValue(name, value)
        _scrub_environ_block(name)
        os.environ.pop(name, None)
    if required and missing:
        from services.common.errors import ConfigError

        raise ConfigError(f"environment variable(s) not set: {', '.join(missing)}")
    return out
